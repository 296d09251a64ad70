# Every target bootstraps what it needs on a fresh machine (Debian/Ubuntu, Python >= 3.11, root or sudo).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrapped
TORCH_PIN := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: bootstrap demo test check bench results clean constraints

$(STAMP): pyproject.toml testing/pyproject.toml testing/constraints.txt
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  VER=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq "python$$VER-venv" >/dev/null; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU wheel first, from PyTorch's CPU index: PyPI's torch is the multi-GB CUDA build. A wheel
	# pip already finds on this machine (its find-links) is taken without the network; its dependencies
	# come with the package's below, from the usual index.
	$(PY) -m pip install -q --no-index --no-deps $(TORCH_PIN) 2>/dev/null \
	  || $(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple $(TORCH_PIN)
	# The package with its extras, and the test harness (resilientjob.testing: its own distribution, never shipped),
	# at the versions the suite last passed with (testing/constraints.txt: a new mypy or redis release once
	# failed a clean clone's CI on code that had not changed; `make constraints` refreshes them).
	$(PY) -m pip install -q -c testing/constraints.txt -e '.[dev,local]' -e ./testing
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

## Pin the test environment to what is installed now (run it once the suite passes on newer versions).
constraints: $(STAMP)
	{ echo '# The versions `make bootstrap` installs: the suite passed with them. Refresh: `make constraints`.'; \
	  $(PY) -m pip freeze --exclude-editable; } > testing/constraints.txt

clean:
	rm -rf $(VENV) build .mypy_cache .pytest_cache .ruff_cache

## The operator on a kind cluster: image, chart, real-cluster tests (needs docker and kind; not run in CI).
.PHONY: e2e-kind
e2e-kind: $(STAMP)
	deploy/kind/e2e.sh
