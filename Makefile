# The two commands a new user needs: `make demo` trains, `make test` runs the tests.
# Both create .venv and install gpuaccel into it on first use: the demo only what training
# needs, the tests also the test extras (ONNX, OpenVINO, a browser driver, ...).
# TORCH picks the PyTorch requirement: plain `torch` on a fresh machine (with CUDA
# wheels), e.g. `make test TORCH=torch==2.13.0` where a CPU build is already at hand.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test venv clean

demo: $(STAMP)
	$(BIN)/gpuaccel train --recipe digits

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(TEST_STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
