# Two commands for a newcomer: `make demo` and `make test`. Both build .venv from
# pyproject.toml when it is missing or older than pyproject.toml, and reuse it otherwise.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch/torchvision pinned to the releases this workplace keeps on disk (no multi-GB download).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: demo test lint bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m lightning_fastdata.demo

test: $(STAMP)
	$(PY) -m ruff check lightning_fastdata tests examples benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) benchmarks/loader_throughput.py

clean-venv:
	rm -rf $(VENV)
