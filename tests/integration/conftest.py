"""Live-daemon fixtures: one branchboxd per test session, on its own socket, state dir and cgroup.

The state dir persists between runs (BRANCHBOX_TEST_STATE, default /var/lib/branchbox-test) so the
debootstrap base image is built once per machine. These tests need root; with MUST_WORK=1 (CI)
a missing prerequisite fails instead of skipping.
"""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from branchbox import Sandbox
from branchbox.images import Images

STATE = os.environ.get("BRANCHBOX_TEST_STATE", "/var/lib/branchbox-test")
RUN = "/run/branchbox-test"
SOCKET = os.path.join(RUN, "d.sock")
URL = "unix://" + SOCKET
CGROUP_PARENT = "branchbox-test"


def daemon_bin() -> str:
    b = os.environ.get("BRANCHBOX_DAEMON_BIN") or shutil.which("branchboxd")
    if not b:
        pytest.fail("branchboxd not found: run `make install` or set BRANCHBOX_DAEMON_BIN")
    return b


class Daemon:
    def __init__(self) -> None:
        self.proc = None
        self.log = os.path.join(STATE, "test-daemon.log")

    def start(self, extra=()) -> None:
        os.makedirs(RUN, exist_ok=True)
        os.makedirs(STATE, exist_ok=True)
        argv = [daemon_bin(), "--state-dir", STATE, "--socket", SOCKET, "--cgroup-parent", CGROUP_PARENT, *extra]
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
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="session")
def daemon():
    if os.geteuid() != 0:
        if os.environ.get("MUST_WORK"):
            pytest.fail("integration tests need root (MUST_WORK is set)")
        pytest.skip("integration tests need root")
    d = Daemon()
    d.start()
    os.environ["BRANCHBOX_URL"] = URL
    imgs = Images(daemon=URL)
    if not any(i.name == "base" for i in imgs.list()):
        imgs.build("base")
    yield d
    # Kill whatever the tests left, then stop.
    for info in Sandbox.list(daemon=URL):
        Sandbox.connect(info.id, daemon=URL).kill()
    d.stop()


@pytest.fixture
def sbx(daemon):
    s = Sandbox.create(daemon=URL, timeout=600)
    yield s
    s.kill()
