# The two commands of the README: `make run` and `make test`. Everything installs into .venv
# from requirements.lock (pinned, hash-checked); the project itself is installed editable.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint e2e

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --require-hashes -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

## Run the control plane on its embedded SQLite default (data in ./modelforge-data).
run: install
	$(VENV)/bin/modelforge-control-plane

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## The whole suite: lint, types, then every test on SQLite and PostgreSQL (started if needed).
test: lint
	./scripts/ensure-postgres
	$(VENV)/bin/pytest --ignore=tests/e2e_docker

## The heavier end-to-end suite against a real Docker engine (installed and started if needed):
## build the images, bundle, sign, verify, load, and `up` the stack.
e2e: install
	./scripts/ensure-postgres
	./scripts/ensure-docker
	$(VENV)/bin/pytest tests/e2e_docker
