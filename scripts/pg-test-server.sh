#!/usr/bin/env bash
# A throwaway PostgreSQL for tests (scripts/install-postgres.sh installs the binaries).
#   pg-test-server.sh start DIR PORT   initdb DIR/data if it is not there, listen only on
#                                      127.0.0.1:PORT and a unix socket in DIR, print the URL
#                                      postgres://bbtest:bbtest@127.0.0.1:PORT/bbtest
#   pg-test-server.sh stop DIR         stop it at once (no shutdown checkpoint)
# The server runs as the `postgres` OS user when started by root (postgres refuses root). Not
# durable on purpose (no fsync): a test database.
set -euo pipefail
usage() { echo "usage: $0 start DIR PORT | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
CMD=$1 DIR=$(realpath -m "$2")
BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -x "$BIN/initdb" ] || { echo "pg-test-server: PostgreSQL is not installed (scripts/install-postgres.sh)" >&2; exit 1; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case $CMD in
start)
  [ $# = 3 ] || usage
  PORT=$3
  mkdir -p "$DIR"
  [ "$(id -u)" = 0 ] && chown postgres: "$DIR"
  if [ ! -f "$DIR/data/PG_VERSION" ]; then
    echo bbtest >"$DIR/pwfile"
    [ "$(id -u)" = 0 ] && chown postgres: "$DIR/pwfile"
    as_pg "$BIN/initdb" -D "$DIR/data" --no-sync --no-locale -E UTF8 -U bbtest --pwfile="$DIR/pwfile" \
      --auth-local=trust --auth-host=scram-sha-256 >"$DIR/initdb.log" 2>&1 ||
      { cat "$DIR/initdb.log" >&2; exit 1; }
    rm -f "$DIR/pwfile"
    cat >>"$DIR/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
fsync = off
synchronous_commit = off
full_page_writes = off
CONF
  fi
  as_pg "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -o "-p $PORT" -w -t 60 start >/dev/null ||
    { tail -n 20 "$DIR/server.log" >&2; exit 1; }
  if ! as_pg "$BIN/psql" -h "$DIR" -p "$PORT" -U bbtest -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = 'bbtest'" | grep -q 1; then
    as_pg "$BIN/createdb" -h "$DIR" -p "$PORT" -U bbtest bbtest
  fi
  echo "postgres://bbtest:bbtest@127.0.0.1:$PORT/bbtest"
  ;;
stop)
  if [ -f "$DIR/data/postmaster.pid" ]; then
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -m immediate -w stop >/dev/null
  fi
  ;;
*) usage ;;
esac
