# The two commands of the README: `make run` and `make test`. Everything installs into .venv
# from requirements.lock (pinned, hash-checked); the project itself is installed editable.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

CONSOLE := control_plane/console
CONSOLE_BUILD := $(CONSOLE)/dist/index.html
CONSOLE_SOURCES := $(wildcard $(CONSOLE)/src/*) $(CONSOLE)/index.html $(CONSOLE)/package-lock.json \
	$(CONSOLE)/vite.config.ts $(CONSOLE)/tsconfig.json

.PHONY: install run test check lint e2e console browser

## Tests run in parallel (pytest-xdist): each test file on one worker, files that share a machine-wide
## resource together (tests/conftest.py). The tests mostly wait on processes, so more workers than
## cores pays; PYTEST_WORKERS=1 runs them one after another.
PYTEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

## The model server's native gRPC front (Rust, native/grpc_front): built offline with Debian's
## toolchain from Debian's packaged crates (installed if missing), pinned by its Cargo.lock.
GRPC_FRONT := runtime_worker/serving/bin/modelforge-grpc-front
GRPC_FRONT_SOURCES := $(wildcard native/grpc_front/src/*.rs) native/grpc_front/Cargo.toml \
	native/grpc_front/Cargo.lock native/grpc_front/.cargo/config.toml

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

$(GRPC_FRONT): $(GRPC_FRONT_SOURCES)
	./scripts/ensure-rust
	cd native/grpc_front && RUSTC=/usr/bin/rustc /usr/bin/cargo build -q --release --locked \
		--target-dir ../../build/grpc_front
	install -D -m 755 build/grpc_front/release/modelforge-grpc-front $@

## The agent's end of the gateway's tunnel (Rust, native/tunnel_relay), built the same way.
TUNNEL_RELAY := node_agent/bin/modelforge-tunnel-relay
TUNNEL_RELAY_SOURCES := $(wildcard native/tunnel_relay/src/*.rs) native/tunnel_relay/Cargo.toml \
	native/tunnel_relay/Cargo.lock native/tunnel_relay/.cargo/config.toml

$(TUNNEL_RELAY): $(TUNNEL_RELAY_SOURCES)
	./scripts/ensure-rust
	cd native/tunnel_relay && RUSTC=/usr/bin/rustc /usr/bin/cargo build -q --release --locked \
		--target-dir ../../build/tunnel_relay
	install -D -m 755 build/tunnel_relay/release/modelforge-tunnel-relay $@

## The control plane's native gateway front (Rust, native/gateway_front; it compiles the relay's
## frames.rs and ws.rs too), built the same way.
GATEWAY_FRONT := control_plane/bin/modelforge-gateway-front
GATEWAY_FRONT_SOURCES := $(wildcard native/gateway_front/src/*.rs) native/gateway_front/Cargo.toml \
	native/gateway_front/Cargo.lock native/gateway_front/.cargo/config.toml \
	native/tunnel_relay/src/frames.rs native/tunnel_relay/src/ws.rs

$(GATEWAY_FRONT): $(GATEWAY_FRONT_SOURCES)
	./scripts/ensure-rust
	cd native/gateway_front && RUSTC=/usr/bin/rustc /usr/bin/cargo build -q --release --locked \
		--target-dir ../../build/gateway_front
	install -D -m 755 build/gateway_front/release/modelforge-gateway-front $@

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

## The whole suite: lint, types, then every test on SQLite and PostgreSQL (started if needed).
test: lint
	./scripts/ensure-postgres
	./scripts/ensure-chromium
	./scripts/ensure-haproxy
	./scripts/ensure-wrk
	./scripts/ensure-slurm
	cd native/tunnel_relay && RUSTC=/usr/bin/rustc /usr/bin/cargo test -q --locked \
		--target-dir ../../build/tunnel_relay
	cd native/gateway_front && RUSTC=/usr/bin/rustc /usr/bin/cargo test -q --locked \
		--target-dir ../../build/gateway_front
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
