# ember: `make serve` (the OpenAI-compatible server), `make test` (ruff, then pytest), `make demo`; each sets up
# first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ember-setup

.PHONY: setup serve test demo clean

SERVE_ARGS ?=

setup: $(STAMP)
	@$(PY) -m ember.loader.default_model >/dev/null

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,structured]'
	# the real sglang frontend for tests/server/test_sglang_frontend.py: its wheel lists CUDA torch, which it does
	# not import, so it comes without dependencies (these five are all it needs)
	$(PY) -m pip install -q --no-deps sglang==0.5.23 pybase64==1.5.1 msgspec==0.23.0 ipython==9.19.1 traitlets==5.16.1
	touch $(STAMP)

serve: setup
	$(VENV)/bin/ember serve $(SERVE_ARGS)

test: setup
	$(VENV)/bin/ruff check ember tests benchmarks
	$(PY) -m pytest -q -n 2

demo: setup
	$(VENV)/bin/ember chat -m "What is the capital of France?"

clean:
	rm -rf $(VENV) build *.egg-info
