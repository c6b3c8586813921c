# Two commands for a newcomer: `make demo` and `make test`. Both build .venv from
# pyproject.toml when it is missing or older than pyproject.toml, and reuse it otherwise.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch/torchvision pinned to the releases this workplace keeps on disk (no multi-GB download).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

# The oldest lightning pyproject.toml allows, for the Lightning-facing tests (make test-oldest).
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
LIGHTNING_FLOOR := $(shell grep -oE '"lightning>=[0-9.]+' pyproject.toml | cut -d'=' -f2)
LIGHTNING_TESTS := tests/test_lightning_door.py tests/test_profiler.py tests/test_callbacks.py \
	tests/test_datamodule.py tests/test_cli.py

.PHONY: demo test test-oldest lint bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# One pip call with the torch pins: the resolver keeps those torch/torchvision releases.
$(OLDEST_STAMP): pyproject.toml
	test -n "$(LIGHTNING_FLOOR)" || { echo "no lightning floor found in pyproject.toml"; exit 1; }
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q $(TORCH_PINS) "lightning==$(LIGHTNING_FLOOR)" -e '.[dev]'
	touch $(OLDEST_STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m lightning_fastdata.demo

test: $(STAMP)
	$(PY) -m ruff check lightning_fastdata tests examples benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider

# The Lightning-facing tests on the oldest lightning the floor allows (same torch pins).
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c 'import lightning; assert lightning.__version__ == "$(LIGHTNING_FLOOR)", lightning.__version__'
	OMP_NUM_THREADS=1 $(OLDEST_PY) -m pytest -q -p no:cacheprovider $(LIGHTNING_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/loader_throughput.py

clean-venv:
	rm -rf $(VENV) $(OLDEST_VENV)
