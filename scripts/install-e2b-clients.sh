#!/usr/bin/env bash
# Install the E2B clients the compatibility tests run besides the current Python SDK (which the
# test extra of python/pyproject.toml pins): an older 2.x Python SDK in a venv of its own (it
# still creates on `POST /sandboxes` and connects on `/sandboxes/{id}/connect`, not `/v2/...`;
# older ones cannot be pointed at another endpoint without TLS: no E2B_SANDBOX_URL before e2b
# 2.7 and e2b-code-interpreter 2.10), and the JS SDKs from npm (e2b, @e2b/code-interpreter). Both pinned, both idempotent (a
# stamp file holds what is installed).
set -euo pipefail
OLD_VENV=${E2B_OLD_VENV:-/opt/branchbox/venv-e2b-old}
JS_DIR=${E2B_JS_DIR:-/opt/branchbox/e2b-js}
PY_OLD="e2b==2.44.0 e2b-code-interpreter==2.10.0"
JS_PIN="e2b@2.51.0 @e2b/code-interpreter@2.8.0"

if [ "$(cat "$OLD_VENV/.branchbox-pins" 2>/dev/null)" != "$PY_OLD" ]; then
  echo "e2b clients: $PY_OLD in $OLD_VENV"
  rm -rf "$OLD_VENV"
  python3 -m venv "$OLD_VENV"
  # shellcheck disable=SC2086 # the pins are separate words
  "$OLD_VENV/bin/pip" install -q $PY_OLD
  echo "$PY_OLD" >"$OLD_VENV/.branchbox-pins"
fi

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "e2b clients: installing nodejs and npm"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
fi
if [ "$(cat "$JS_DIR/.branchbox-pins" 2>/dev/null)" != "$JS_PIN" ]; then
  echo "e2b clients: $JS_PIN in $JS_DIR"
  rm -rf "$JS_DIR"
  mkdir -p "$JS_DIR"
  # shellcheck disable=SC2086 # the pins are separate words
  (cd "$JS_DIR" && echo '{"private": true}' >package.json && npm install --silent --no-audit --no-fund $JS_PIN)
  echo "$JS_PIN" >"$JS_DIR/.branchbox-pins"
fi
