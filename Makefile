# branchbox — two commands matter: `make demo` and `make test` (both idempotent, run as root).
SHELL := /bin/bash
PREFIX      ?= /usr/local
LIBDIR      ?= $(PREFIX)/lib/branchbox
VENV        ?= /opt/branchbox/venv
STATE_DIR   ?= /var/lib/branchbox
SOCKET      ?= /run/branchbox/branchboxd.sock
PYTHON      ?= python3
CARGO       ?= cargo
# (nodejs, node-typescript: the session server's javascript and typescript kinds are unit-tested
# on the host, python/tests)
APT_PKGS    := debootstrap pkg-config build-essential ca-certificates curl xfsprogs iproute2 nftables nodejs node-typescript

.PHONY: all deps build install python demo test lint test-rust test-python test-integration openapi clean-state

all: install

## deps: Debian packages the build and the runtime need (skipped when present).
deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust (rustup) first"; exit 1; }
	@CRIU_DEST=$(LIBDIR)/criu scripts/install-criu.sh
	@MINIO_DEST=$(LIBDIR)/minio scripts/install-minio.sh
	@scripts/install-postgres.sh
	@if command -v rustup >/dev/null; then \
	  for c in rustfmt clippy; do rustup component list --installed 2>/dev/null | grep -q "^$$c" || rustup component add $$c; done; \
	fi

## build: release binaries.
build: deps
	$(CARGO) build --release --locked --bins

## install: daemon + init under $(LIBDIR), the CLI/SDK in $(VENV); `branchbox` and `branchboxd` on PATH.
install: build python
	install -d $(LIBDIR)
	install -m 0755 target/release/branchboxd target/release/branchbox-init target/release/branchbox-criu-exec target/release/branchbox-store-bench $(LIBDIR)/
	ln -sf $(LIBDIR)/branchboxd $(PREFIX)/bin/branchboxd

python:
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e 'python[cli,test]'
	ln -sf $(VENV)/bin/branchbox $(PREFIX)/bin/branchbox

## demo: start the daemon on the embedded defaults, build the base image once, run the tour.
demo: install
	branchbox daemon status >/dev/null 2>&1 || branchbox daemon start --state-dir $(STATE_DIR) --socket $(SOCKET)
	branchbox image ls --json | grep -q '"name": *"base"' || branchbox image build base
	$(VENV)/bin/python examples/tour.py

## lint: formatting and clippy; warnings are errors, and every unsafe block needs a SAFETY comment
## (clippy::undocumented_unsafe_blocks is denied in the workspace's lints).
lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

## test: unit + root integration tests (Rust and Python), then the live-daemon suite.
test: install test-rust test-python test-integration

test-rust:
	BRANCHBOX_TEST_DEBOOTSTRAP=1 $(CARGO) test --locked --workspace

test-python:
	$(VENV)/bin/pytest -q python/tests

test-integration:
	@scripts/install-e2b-clients.sh
	BRANCHBOX_DAEMON_BIN=$(LIBDIR)/branchboxd $(VENV)/bin/pytest -q tests/integration

## openapi: regenerate the checked-in spec after changing the API.
openapi:
	$(CARGO) run --release --bin branchboxd -- --print-openapi > crates/bb-api/openapi.json
