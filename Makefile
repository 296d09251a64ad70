# Every target bootstraps what it needs on a fresh machine (Debian/Ubuntu, Python >= 3.11, root or sudo).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrapped
TORCH_PIN := torch==2.13.0

.PHONY: bootstrap demo test check bench results clean

$(STAMP): pyproject.toml testing/pyproject.toml
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_PIN)
	# The package with its extras, and the test harness (resilientjob.testing: its own distribution, never shipped).
	$(PY) -m pip install -q -e '.[dev,local]' -e ./testing
	@touch $(STAMP)

bootstrap: $(STAMP)

## The main job: the whole system on this machine (real Redis, real operator, real worker processes).
demo: $(STAMP)
	$(VENV)/bin/rjob demo

## The test suite (CI runs exactly this).
test: $(STAMP)
	scripts/check

bench: $(STAMP)
	$(PY) bench/run_all.py

results: $(STAMP)
	$(VENV)/bin/rjob simulate --suite paper

clean:
	rm -rf $(VENV) build .mypy_cache .pytest_cache .ruff_cache

## The operator on a kind cluster: image, chart, real-cluster tests (needs docker and kind; not run in CI).
.PHONY: e2e-kind
e2e-kind: $(STAMP)
	deploy/kind/e2e.sh
