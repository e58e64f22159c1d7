# Two commands do everything on a fresh machine (see README.md):
#   make demo   set up .venv, then run the main job: a small real GPT pretraining run with
#               ring x Ulysses (U2 x R2) on 4 CPU ranks through DeepSpeed
#   make test   set up .venv, then run the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
# torch is installed FIRST and alone: any later package that asks for "torch" then finds it
# and pip fetches no other build (a CPU machine would otherwise download GBs of CUDA wheels).
TORCH_SPEC ?= torch==2.13.0
# The exact framework versions CI installs (reproducible runs; the lowest ends of the ranges
# users may install, integrations/versions.py and README "Supported versions"). Their sdists
# build against the installed torch, hence --no-build-isolation.
DEEPSPEED_SPEC ?= deepspeed==0.19.8
MEGATRON_SPEC ?= megatron-core==0.16.1 einops
TRANSFORMERS_SPEC ?= transformers==5.18.0 accelerate==1.15.0
TRL_SPEC ?= trl==1.16.0 peft==0.21.2
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.ring_sp_installed

.PHONY: demo quickstart test setup clean

setup: $(STAMP)

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet --no-build-isolation "$(DEEPSPEED_SPEC)" $(MEGATRON_SPEC) $(TRANSFORMERS_SPEC) $(TRL_SPEC)
	$(PIP) install --quiet --no-build-isolation -e ".[test]"
	touch $@

demo: $(STAMP)
	PYTHON=$(VENV)/bin/python examples/deepspeed/pretrain_gpt.sh --cpu

quickstart: $(STAMP)
	$(VENV)/bin/python examples/quickstart.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
