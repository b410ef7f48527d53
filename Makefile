# The one source of commands: the README and CI call these targets.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TD     := $(VENV)/bin/tensordiff
DEMO   := out/demo

FAMILY ?= llama
FAULT  ?= none
# WikiText-2 (valid.txt, test.txt): never copied into the repository
WIKITEXT2 ?= $(or $(TENSORDIFF_WIKITEXT2),../shared/data/wikitext-2)
STEPS  ?= 300

.PHONY: setup demo compare launchers locate wikitext2 test test-core lint clean

$(VENV)/.done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned: 2.13.0 is the CPU build on this machine's disk (an unpinned torch pulls CUDA)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[megatron,transformers,mindformers,safetensors,plot,wikitext,dask,dev]"
	touch $@

setup: $(VENV)/.done

demo: setup
	@mkdir -p $(DEMO)
	$(TD) capture -o $(DEMO)/a.h5 --steps 2 -- $(PY) examples/gpt/train.py 2>/dev/null
	$(TD) capture -o $(DEMO)/b.h5 --steps 2 -- $(PY) examples/gpt/train.py --fault gelu-tanh 2>/dev/null
	$(TD) diff $(DEMO)/a.h5 $(DEMO)/b.h5 --first-divergence --json $(DEMO)/report.json; \
	  code=$$?; test $$code -eq 1 && echo "(exit code 1: a divergence was found, as intended; JSON in $(DEMO)/report.json)" \
	  && echo "tensordiff is in $(CURDIR)/$(VENV)/bin: 'source $(CURDIR)/$(VENV)/bin/activate' puts it on your PATH"

compare: setup
	$(PY) examples/megatron_vs_mindformers/run.py --family $(FAMILY) --fault $(FAULT); \
	  code=$$?; test $$code -le 1 && echo "(exit code $$code: 0 = the runs agree, 1 = a divergence was found; JSON in out/megatron_vs_mindformers/)"

# Megatron (megatron-core loop, tensordiff capture --megatron) vs the MindFormers Trainer (YAML, --mindformers)
launchers: setup
	$(PY) examples/launchers/run.py --fault $(FAULT); \
	  code=$$?; test $$code -le 1 && echo "(exit code $$code: 0 = the runs agree, 1 = a divergence was found; JSON in out/launchers/)"

wikitext2: setup
	$(PY) examples/wikitext2/run.py --data $(WIKITEXT2) --steps $(STEPS); \
	  code=$$?; test $$code -le 1 && echo "(exit code $$code: 0 = the loss curves agree within 1%, 1 = they do not; plot and report in out/wikitext2/)"

# two pytest workers (the CI machine has 2 cores; most tests use one): each test file runs whole on one worker (its
# module fixtures made once), the slowest files handed out first (tests/conftest.py SLOW_FIRST). TEST_JOBS=0: one
# process, in file order
TEST_JOBS ?= 2
# the readers' fuzzing (tests/core/test_fuzz_readers.py) as a sample here: test-core runs it whole (60 cases a test)
FUZZ_EXAMPLES ?= 20
locate: setup
	$(PY) examples/locate/run.py

test: setup
	TENSORDIFF_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q --durations=15 $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)

# ruff (style, imports, bugs) on everything; mypy on the package (configured in pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check tensordiff tests examples benchmarks hooks
	$(VENV)/bin/mypy

# the framework-free core alone: a venv with numpy, h5py, rich, pyyaml and regex only (no torch, MindSpore, ml_dtypes)
CORE_VENV := .venv-core
$(CORE_VENV)/.done:
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/python -m pip install -q "numpy>=1.24,<2" "h5py>=3.8" "rich>=13" "pyyaml>=6" "regex>=2023.0" "pytest>=8" "hypothesis>=6.100"
	touch $@

test-core: $(CORE_VENV)/.done
	cd /tmp && PYTHONPATH=$(CURDIR) $(CURDIR)/$(CORE_VENV)/bin/python -c "import tensordiff.diff, tensordiff.store; print('tensordiff.diff and tensordiff.store import without torch, MindSpore or ml_dtypes')"
	PYTHONPATH=$(CURDIR) $(CORE_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/core

clean:
	rm -rf $(VENV) $(CORE_VENV) out .pytest_cache
