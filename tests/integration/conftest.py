"""Live-daemon fixtures: one branchboxd per test session, on its own socket, state dir and cgroup.

The state dir persists between runs (BRANCHBOX_TEST_STATE, default /var/lib/branchbox-test) so the
debootstrap base image is built once per machine. These tests need root; with MUST_WORK=1 (CI)
a missing prerequisite fails instead of skipping.

Overrides, to run beside another test run: BRANCHBOX_DAEMON_BIN (default: branchboxd on PATH),
BRANCHBOX_INIT_BIN (default: branchbox-init next to the daemon binary), BRANCHBOX_TEST_STATE,
BRANCHBOX_TEST_RUN (socket dir, default /run/branchbox-test), BRANCHBOX_TEST_CGROUP (cgroup parent),
BRANCHBOX_TEST_MAX_CHAIN (the daemon's --max-chain, default 6: chains are compacted often),
BRANCHBOX_TEST_BRIDGE and BRANCHBOX_TEST_NET (--net-bridge, default bbt0; --net-range, default
10.231.0.0/24).
"""
import json
import os
import signal
import socket
import subprocess
import time
import uuid

import httpx
import pytest

from branchbox import Sandbox, Snapshots
from branchbox.images import Images

from branchbox_bench import networld
from helpers import CGROUP_PARENT, MAX_CHAIN, NET_BRIDGE, NET_RANGE, RUN, SOCKET, STATE, URL, daemon_bin, state_mounts  # noqa: F401 (re-exported)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PROXY_CREDENTIALS = os.path.join(DATA, "proxy-credentials.json")
PROXY_CA = os.path.join(DATA, "test-ca.pem")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self) -> None:
        self.proc = None
        self.log = os.path.join(STATE, "test-daemon.log")
        # Its TCP listener (the Host-header form of ports, test_ports.py), the same port across
        # restarts.
        self.tcp_port = _free_port()
        self.tcp_token = "e2b_" + uuid.uuid4().hex  # E2B SDKs of some versions accept no other form
        # The E2B-compatible endpoint (test_e2b.py), its API key the token.
        self.e2b_port = _free_port()

    def start(self, extra=()) -> None:
        os.makedirs(RUN, exist_ok=True)
        os.makedirs(STATE, exist_ok=True)
        # No warm pool unless a test sets one (PUT /v1/pool/...): pooled sandboxes would show in
        # the suite's counts of processes, cgroups and mounts.
        argv = [daemon_bin(), "--state-dir", STATE, "--socket", SOCKET, "--cgroup-parent", CGROUP_PARENT, "--pool-size", "0",
                "--max-chain", str(MAX_CHAIN),
                # Sandboxes with egress: a bridge and range of the suite's own, DNS forwarded to
                # the network tests' own "outside world" (networld.py).
                "--net-bridge", NET_BRIDGE, "--net-range", NET_RANGE, "--net-dns", networld.DNS,
                # The proxy's credentials for the world's hosts, and the CA of the world's HTTPS
                # servers (test_proxy.py).
                "--proxy-credentials", PROXY_CREDENTIALS, "--proxy-ca", PROXY_CA,
                "--listen", "127.0.0.1:%d" % self.tcp_port, "--token", self.tcp_token,
                "--e2b-listen", "127.0.0.1:%d" % self.e2b_port]
        if os.environ.get("BRANCHBOX_INIT_BIN"):  # default: branchbox-init next to the daemon binary
            argv += ["--init-bin", os.environ["BRANCHBOX_INIT_BIN"]]
        argv += extra
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail("branchboxd exited at start: " + open(self.log).read()[-2000:])
            try:
                import httpx

                with httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://d") as c:
                    if c.get("/v1/health").status_code == 200:
                        return
            except Exception:
                pass
            time.sleep(0.05)
        pytest.fail("branchboxd did not become healthy: " + open(self.log).read()[-2000:])

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            rc = self.proc.wait(timeout=30)
            # A stop is graceful: a panic on the way out (exit 101) is a bug (see its log).
            assert sig != signal.SIGTERM or rc == 0, "branchboxd exited with status %r at SIGTERM: see %s" % (rc, self.log)
        self.proc = None

    @property
    def pid(self) -> int:
        assert self.proc is not None and self.proc.poll() is None, "branchboxd is not running"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> None:
        """Restart the daemon if a test left it stopped (or it died)."""
        if not self.running():
            if self.proc is not None:
                # Say how it died (a negative status is the signal that killed it) in its log.
                with open(self.log, "a") as f:
                    f.write("test harness: branchboxd (pid %d) was found dead, exit status %r; restarting\n"
                            % (self.proc.pid, self.proc.returncode))
            self.proc = None
            self.start()


def _base_is_current() -> bool:
    """Whether the kept base image has what images built now have: the `user` account (E2B's
    default user, test_e2b.py), C.UTF-8 in a locale archive (test_smoke.py) and a hostname that
    resolves (myhostname, test_escape.py's sudo test)."""
    s = Sandbox.create(daemon=URL, timeout=60)
    try:
        check = "id -u user && test -f /usr/lib/locale/locale-archive && getent hosts $(hostname)"
        return s.commands.run(check).exit_code == 0
    finally:
        s.kill()


@pytest.fixture(scope="session")
def daemon():
    if os.geteuid() != 0:
        if os.environ.get("MUST_WORK"):
            pytest.fail("integration tests need root (MUST_WORK is set)")
        pytest.skip("integration tests need root")
    d = Daemon()
    d.start()
    os.environ["BRANCHBOX_URL"] = URL
    # Snapshots a run left (killed mid-way) would pile up in the kept state dir, layers and
    # process images with them: every snapshot there is a test's.
    Snapshots(daemon=URL).gc(keep=[])
    imgs = Images(daemon=URL)
    # A base image kept in the state dir from before images had what they have now is built
    # again, once.
    if not any(i.name == "base" for i in imgs.list()) or not _base_is_current():
        imgs.build("base")
    yield d
    # Kill whatever the tests left, then stop.
    d.ensure_running()
    for info in Sandbox.list(daemon=URL):
        Sandbox.connect(info.id, daemon=URL, resume=False).kill()
    Snapshots(daemon=URL).gc(keep=[])
    d.stop()
    # The sandboxes' bridge and nftables table (made with the first sandbox with egress).
    subprocess.run(["nft", "delete", "table", "inet", "branchbox_" + NET_BRIDGE], capture_output=True)
    subprocess.run(["ip", "link", "del", NET_BRIDGE], capture_output=True)
    # Killed sandboxes must not leave their root filesystems mounted on the host.
    left = state_mounts(os.path.join(STATE, "sandboxes"))
    assert not left, "mounts of killed sandboxes remain after the suite:\n" + "\n".join(left)


@pytest.fixture
def sbx(daemon):
    s = Sandbox.create(daemon=URL, timeout=600)
    yield s
    s.kill()


@pytest.fixture
def make_sandbox(daemon):
    """Factory: ``make_sandbox(**create_kwargs)``; every sandbox made is killed at teardown."""
    made = []

    def make(**kw):
        kw.setdefault("timeout", 600)
        s = Sandbox.create(daemon=URL, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        try:
            s.kill()
        except Exception:
            pass
        s.close()


@pytest.fixture
def raw(daemon):
    """A bare httpx client on the daemon's socket, for requests the SDK would not send."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://d", timeout=60) as c:
        yield c
