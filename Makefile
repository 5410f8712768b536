# The two commands a new user needs: `make demo` trains, `make test` runs the tests.
# Both create .venv and install gpuaccel into it on first use: the demo only what training
# needs, the tests also the test extras (ONNX, OpenVINO, a browser driver, ...).
#
# The test extras are installed at the versions in constraints.txt (what the suite last passed
# with), so that a new release elsewhere cannot turn `make test` red; `make test-latest` tries the
# newest releases instead, in a venv of its own (.venv-latest), to run now and then.
#
# PyTorch: TORCH is the pip requirement (default `torch`, the newest). On a machine without an
# NVIDIA GPU (nvidia-smi lists none), PyTorch's CPU wheel index is added where it can be reached,
# so pip takes the CPU build (a few hundred MB) rather than the default one with several GB of
# CUDA libraries; where it cannot be reached, the newest CPU build pip's own sources hold
# (a find-links folder: tools/cpu_torch_wheel.py) is taken, and where they hold none, one line says
# so and what to type before pip installs the default build. TORCH_INDEX names another index, or
# none (`make demo TORCH_INDEX=`). A changed TORCH or TORCH_INDEX reinstalls PyTorch.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
CPU_INDEX := https://download.pytorch.org/whl/cpu
# (deferred: probed only when a PyTorch install is being decided)
NVIDIA_GPU = $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
CPU_INDEX_REACHABLE = $(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/torch/', timeout=5)" \
                        >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(NVIDIA_GPU),,$(if $(CPU_INDEX_REACHABLE),$(CPU_INDEX)))
# no GPU, no CPU index, and PyTorch not chosen: a CPU build from pip's own sources, if they hold one
CPU_WHEEL = $(shell $(PYTHON) tools/cpu_torch_wheel.py 2>/dev/null)
WANT_CPU_BUILD = $(and $(filter torch,$(TORCH)),$(if $(NVIDIA_GPU),,yes),$(if $(TORCH_INDEX),,yes))
TORCH_REQUIREMENT = $(if $(WANT_CPU_BUILD),$(or $(CPU_WHEEL),$(TORCH)),$(TORCH))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_CHOICE := $(VENV)/.torch-choice
TORCH_PIP_ARGS = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) )$(TORCH_REQUIREMENT)

.PHONY: demo test test-latest venv clean FORCE

demo: $(STAMP)
	$(BIN)/gpuaccel train --recipe digits

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

venv: $(STAMP)

# rewritten only when the choice differs, so that only a new choice reinstalls PyTorch
$(TORCH_CHOICE): FORCE
	@mkdir -p $(VENV)
	@args='$(TORCH_PIP_ARGS)'; \
	if [ "$$args" = "$(TORCH)" ] && [ -n "$(WANT_CPU_BUILD)" ]; then \
	  echo "make: no NVIDIA GPU, PyTorch's CPU index ($(CPU_INDEX)) cannot be reached and pip's own sources hold no CPU build: pip installs its default build, with several GB of CUDA libraries; for a CPU build give one: make demo TORCH=/path/to/torch-VERSION+cpu-...whl (or TORCH_INDEX=URL of an index that has it)" >&2; \
	fi; \
	echo "$$args" | cmp -s - $@ || echo "$$args" > $@

$(STAMP): pyproject.toml $(TORCH_CHOICE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $$(cat $(TORCH_CHOICE))
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) constraints.txt
	$(BIN)/python -m pip install -q -e ".[test]" -c constraints.txt
	touch $(TEST_STAMP)

# the newest releases of every dependency, unpinned, in their own venv
LATEST := .venv-latest
test-latest: FORCE
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade $(TORCH_PIP_ARGS)
	$(LATEST)/bin/python -m pip install -q --upgrade -e ".[test]"
	$(LATEST)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) $(LATEST) runs .pytest_cache
