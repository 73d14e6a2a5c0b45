# The two commands of the README: `make run` and `make test`. Everything installs into .venv
# from requirements.lock (pinned, hash-checked); the project itself is installed editable.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

CONSOLE := control_plane/console
CONSOLE_BUILD := $(CONSOLE)/dist/index.html
CONSOLE_SOURCES := $(wildcard $(CONSOLE)/src/*) $(CONSOLE)/index.html $(CONSOLE)/package-lock.json \
	$(CONSOLE)/vite.config.ts $(CONSOLE)/tsconfig.json

.PHONY: install run test check lint lint-rust e2e console browser

## Tests run in parallel (pytest-xdist): each test file on one worker, files that share a machine-wide
## resource together (tests/conftest.py). The tests mostly wait on processes, so more workers than
## cores pays; PYTEST_WORKERS=1 runs them one after another.
PYTEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --require-hashes -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

## The web console: a TypeScript single-page app built with Vite (Node.js 18+, installed if
## missing; its browser tests need 20+), served by the control plane at /.
$(CONSOLE_BUILD): $(CONSOLE_SOURCES)
	./scripts/ensure-node
	cd $(CONSOLE) && npm ci --no-audit --no-fund && npm run build

console: $(CONSOLE_BUILD)

## The native parts (Rust): the model server's gRPC front, the agent's tunnel relay and the
## control plane's gateway front, one workspace (native/Cargo.toml) of crates.io's crates pinned by
## one native/Cargo.lock, built at once into one target directory (build/native) with rustup's
## toolchain (scripts/ensure-rust checks for it and says how to install it).
export PATH := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin:$(PATH)
unexport RUSTC
NATIVE_BUILT := build/native/release
NATIVE_STAMP := build/native/.built
NATIVE_SOURCES := native/Cargo.lock native/.cargo/config.toml \
	$(shell find native -name '*.rs' -o -name Cargo.toml)
GRPC_FRONT := runtime_worker/serving/bin/modelforge-grpc-front
TUNNEL_RELAY := node_agent/bin/modelforge-tunnel-relay
GATEWAY_FRONT := control_plane/bin/modelforge-gateway-front

$(NATIVE_STAMP): $(NATIVE_SOURCES)
	./scripts/ensure-rust
	cd native && cargo build -q --release --locked --workspace
	touch $@

$(GRPC_FRONT): $(NATIVE_STAMP)
	install -D -m 755 $(NATIVE_BUILT)/modelforge-grpc-front $@

$(TUNNEL_RELAY): $(NATIVE_STAMP)
	install -D -m 755 $(NATIVE_BUILT)/modelforge-tunnel-relay $@

$(GATEWAY_FRONT): $(NATIVE_STAMP)
	install -D -m 755 $(NATIVE_BUILT)/modelforge-gateway-front $@

install: $(STAMP) $(CONSOLE_BUILD) $(GRPC_FRONT) $(TUNNEL_RELAY) $(GATEWAY_FRONT)

## Run the control plane on its embedded SQLite default (data in ./modelforge-data), with a local
## node beside it (a node agent and a runtime worker) unless MODELFORGE_LOCAL_NODE is set: then
## that decides (MODELFORGE_LOCAL_NODE=false make run: the control plane alone).
run: install
	$(VENV)/bin/modelforge-control-plane $(if $(MODELFORGE_LOCAL_NODE),,--local-node)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## The Rust's own checks: rustfmt, clippy (warnings are errors) and the advisory audit of
## native/Cargo.lock (cargo-audit, installed once into build/cargo-tools at a pinned version). The
## audit fetches RustSec's advisory database from GitHub into build/advisory-db; where GitHub cannot
## be reached, CARGO_AUDIT_DB=<a checkout of rustsec/advisory-db> audits against that copy instead.
## Not yet part of `lint` (issue 40 step 5: the sources are being brought to clippy's bar first).
CARGO_AUDIT_VERSION := 0.22.2
CARGO_AUDIT := build/cargo-tools/bin/cargo-audit
CARGO_AUDIT_DB ?=

$(CARGO_AUDIT):
	./scripts/ensure-rust
	cargo install -q --locked cargo-audit --version $(CARGO_AUDIT_VERSION) --root build/cargo-tools

lint-rust: $(CARGO_AUDIT)
	./scripts/ensure-rust
	cd native && cargo fmt --all --check
	cd native && cargo clippy -q --locked --workspace --all-targets -- -D warnings
	$(CARGO_AUDIT) audit --deny warnings --file native/Cargo.lock \
		$(if $(CARGO_AUDIT_DB),--db $(CARGO_AUDIT_DB) --no-fetch,--db build/advisory-db)

## The whole suite: lint, types, then every test on SQLite and PostgreSQL (started if needed).
test: lint
	./scripts/ensure-postgres
	./scripts/ensure-chromium
	./scripts/ensure-haproxy
	./scripts/ensure-wrk
	./scripts/ensure-slurm
	cd native && cargo test -q --locked --workspace
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) --ignore=tests/e2e_docker --durations=30

## The developers' inner loop: lint, types and the tests that start no real process (`-m "not e2e"`).
check: lint
	./scripts/ensure-postgres
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) --ignore=tests/e2e_docker -m "not e2e" --durations=10

## The heavier end-to-end suite against a real Docker engine (installed and started if needed):
## build the images, bundle, sign, verify, load, and `up` the stack.
e2e: install
	./scripts/ensure-postgres
	./scripts/ensure-docker
	$(VENV)/bin/pytest tests/e2e_docker --durations=30
