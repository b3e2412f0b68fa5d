#!/usr/bin/env bash
# Install CRIU >= 4.1 as /usr/local/lib/branchbox/criu (idempotent).
#
# Debian bookworm's criu 3.17 fails on recent kernels ("vdso: Unexpected rt vDSO area bounds").
# Debian trixie ships 4.1.1; its upstream tarball builds against bookworm's libraries. It is
# fetched with a private apt configuration that sees only trixie's *source* index, so the
# system's apt never sees trixie and cannot pull trixie's libc. The tarball is checked against
# the signed Sources index by apt, and against the sha256 below.
set -euo pipefail
DEST=${CRIU_DEST:-/usr/local/lib/branchbox/criu}
VERSION=4.1.1
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
BUILD=${CRIU_BUILD_DIR:-/var/cache/branchbox/criu}
# Fixes applied to the tarball: upstream commits released after 4.1.1 that this kernel needs (the
# file names the commit) and our own fixes for bugs branchbox hits (the file says why). A build
# records which patches it has; a different set rebuilds.
PATCHES=$(cd "$(dirname "$0")/criu-patches" && pwd)
# Where CRIU caches what it probed of the kernel (criu.kdat; ~20 ms a run without it). CRIU keeps
# it only on a tmpfs: branchboxd mounts one there when /run is not (bb_criu::KDAT_DIR).
RUNDIR=/run/branchbox-criu
STAMP=$( (cat "$PATCHES"/*.patch; echo "RUNDIR=$RUNDIR") | sha256sum | cut -c1-16)

have() {
  [ -x "$DEST" ] && "$DEST" --version 2>/dev/null | grep -q "Version: $VERSION" &&
    [ "$(cat "$DEST.patches" 2>/dev/null)" = "$STAMP" ]
}
if have; then
  exit 0
fi

DEPS="build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler
      libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev python3-protobuf"
missing=""
for p in $DEPS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "criu: installing build dependencies:$missing"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

mkdir -p "$BUILD"
cd "$BUILD"
TARBALL=criu_$VERSION.orig.tar.xz
if ! echo "$SHA256  $TARBALL" | sha256sum -c --quiet >/dev/null 2>&1; then
  rm -f "$TARBALL"
  APT=$BUILD/apt
  mkdir -p "$APT/sources.list.d" "$APT/lists/partial" "$APT/cache/archives/partial"
  cat > "$APT/sources.list.d/trixie-src.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  cat > "$APT/apt.conf" <<CONF
Dir::Etc::SourceList "/dev/null";
Dir::Etc::SourceParts "$APT/sources.list.d";
Dir::State::Lists "$APT/lists";
Dir::Cache "$APT/cache";
Dir::State::status "/dev/null";
CONF
  echo "criu: fetching the $VERSION source tarball (Debian trixie)"
  APT_CONFIG=$APT/apt.conf apt-get update -qq
  APT_CONFIG=$APT/apt.conf apt-get source -qq --download-only --tar-only "criu/trixie" >/dev/null 2>&1 ||
    APT_CONFIG=$APT/apt.conf apt-get source -qq --download-only "criu/trixie" >/dev/null 2>&1 || true
  [ -f "$TARBALL" ] || { echo "criu: could not download $TARBALL" >&2; exit 1; }
  echo "$SHA256  $TARBALL" | sha256sum -c --quiet || { echo "criu: $TARBALL has the wrong sha256" >&2; exit 1; }
fi
rm -rf "criu-$VERSION"
tar xf "$TARBALL"
for p in "$PATCHES"/*.patch; do
  patch -s -p1 -d "criu-$VERSION" <"$p" || { echo "criu: patch $(basename "$p") does not apply" >&2; exit 1; }
done
echo "criu: building $VERSION"
make -s -C "criu-$VERSION" -j"$(nproc)" RUNDIR="$RUNDIR" criu >build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
install -D -m 0755 "criu-$VERSION/criu/criu" "$DEST"
echo "$STAMP" >"$DEST.patches"
"$DEST" check >/dev/null 2>&1 || echo "criu: 'criu check' reports problems on this kernel; branchboxd runs without durable process images" >&2
echo "criu: installed $("$DEST" --version | head -1) at $DEST"
