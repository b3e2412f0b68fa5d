#!/usr/bin/env bash
# Install MinIO as /usr/local/lib/branchbox/minio (idempotent): the S3-compatible server the
# object-store tests start on 127.0.0.1 (crates/bb-store/tests/backends.rs). Built from source
# with the Go toolchain (`go install`, about 2 minutes the first time; Go's module and build
# caches make it seconds after that), pinned to one version.
set -euo pipefail
DEST=${MINIO_DEST:-/usr/local/lib/branchbox/minio}
VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
if [ -x "$DEST" ] && [ "$(cat "$DEST.version" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
GO=$(command -v go || true)
[ -n "$GO" ] || GO=/usr/local/go/bin/go
[ -x "$GO" ] || { echo "minio: Go not found (need >= 1.24 on PATH or in /usr/local/go)" >&2; exit 1; }
BIN=$(mktemp -d)
trap 'rm -rf "$BIN"' EXIT
echo "minio: building $VERSION with $("$GO" version | cut -d' ' -f3)"
GOBIN=$BIN GOFLAGS=-mod=mod "$GO" install "github.com/minio/minio@$VERSION" ||
  { echo "minio: go install failed" >&2; exit 1; }
install -D -m 0755 "$BIN/minio" "$DEST"
echo "$VERSION" >"$DEST.version"
echo "minio: installed at $DEST"
