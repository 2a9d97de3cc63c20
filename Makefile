# Every target creates and reuses .venv/ with plain pip.
# Torch first: without a GPU the CPU build (a bare `torch` pulls a multi-GB CUDA build).
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  := 2.13.0
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install demo test test-slow lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -q "torch==$(TORCH)"
else
	$(PIP) install -q "torch==$(TORCH)+cpu" 2>/dev/null || \
	  $(PIP) install -q --index-url https://download.pytorch.org/whl/cpu "torch==$(TORCH)+cpu"
endif
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdcluster demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" --durations=25 $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m "slow or soak" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/pdcluster bench engine --json
	$(VENV)/bin/pdcluster bench transport --json
	$(VENV)/bin/pdcluster bench cluster --json

clean:
	rm -rf $(VENV) build *.egg-info
