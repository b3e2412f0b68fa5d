#!/usr/bin/env bash
# Install PostgreSQL (Debian's package, PG 15 on bookworm) for the metadata-store tests
# (crates/bb-meta/tests/backends.rs), idempotent. The tests start their own server with
# scripts/pg-test-server.sh, so the package's default cluster is kept stopped and set to manual
# start: no database listens on 5432 because of this script.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  # policy-rc.d 101 = "do not start services": the package's postinst would otherwise start the
  # default cluster. Only ours is removed afterwards.
  POLICY=/usr/sbin/policy-rc.d
  OURS=
  if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$POLICY" && chmod 0755 "$POLICY" && OURS=1
    trap '[ -n "$OURS" ] && rm -f "$POLICY"' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends postgresql >/dev/null
  echo "postgresql: installed $(ls -d /usr/lib/postgresql/*/bin/initdb)"
fi
# The default cluster (if the package made one): stopped, and not started at boot.
if command -v pg_lsclusters >/dev/null; then
  pg_lsclusters --no-header 2>/dev/null | while read -r ver name _port status _rest; do
    if [ "$status" = online ]; then pg_ctlcluster "$ver" "$name" stop; fi
    conf=/etc/postgresql/$ver/$name/start.conf
    if [ -f "$conf" ] && ! grep -qx manual "$conf"; then
      sed -i 's/^\(auto\|disabled\)$/manual/' "$conf"
    fi
  done
fi
