# Two commands do everything on a fresh machine (see README.md):
#   make demo   set up .venv, then run the main job: a small real GPT pretraining run with
#               ring x Ulysses (U2 x R2) on 4 CPU ranks through DeepSpeed
#   make test   set up .venv, then run the whole test suite (what CI runs)
#   make test-newest   the Hugging Face tests on the newest releases of the supported ranges (own environment)
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
# The newest ends (README "Supported versions"): a separate environment with the NEWEST release inside each
# supported range (integrations/versions.py) of the Hugging Face stack, running its tests; torch and DeepSpeed
# as above. `make test-newest` (re-creates it each time: the newest release may have changed).
NEWEST_VENV ?= build/venv-newest
NEWEST_DISTRIBUTIONS ?= transformers accelerate trl peft
NEWEST_TESTS ?= tests/test_transformers.py tests/test_transformers_trainer.py tests/test_trl.py tests/test_fsdp2.py \
	tests/test_versions.py
NEWEST_PIP := $(NEWEST_VENV)/bin/python -m pip

.PHONY: demo quickstart test test-newest setup clean

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

# Test files whose tests launch an example several times each (a launcher and 2-4 ranks per launch,
# every process importing torch and DeepSpeed: 30-45 s of CPU per test). Beside the other worker's
# ranks they got about one core (kill-and-resume 46-57 s against 25 s alone), so `make test` runs
# them after the rest, one at a time, with the machine to themselves (docs/testing.md).
# A plain `pytest` runs every file in its two workers.
SOLO_TESTS := tests/test_resume.py tests/test_multinode.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(addprefix --ignore=,$(SOLO_TESTS))
	$(if $(SOLO_TESTS),$(VENV)/bin/python -m pytest -n 0 $(SOLO_TESTS))

test-newest:
	rm -rf $(NEWEST_VENV)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) install --quiet --upgrade pip setuptools wheel
	$(NEWEST_PIP) install --quiet "$(TORCH_SPEC)"
	$(NEWEST_PIP) install --quiet --no-build-isolation "$(DEEPSPEED_SPEC)" \
		$(shell $(PYTHON) integrations/versions.py $(NEWEST_DISTRIBUTIONS))
	$(NEWEST_PIP) install --quiet --no-build-isolation -e ".[test]"
	$(NEWEST_PIP) list 2>/dev/null | grep -iE '^(torch|deepspeed|transformers|accelerate|trl|peft) '
	$(NEWEST_VENV)/bin/python -m pytest $(NEWEST_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
