"""The optional TCP listener requires a bearer token; the unix socket does not."""
import os
import socket
import subprocess
import tempfile
import time

import httpx
import pytest

from conftest import daemon_bin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tcp_daemon(daemon):
    """A second daemon on its own state dir, cgroup parent and socket, also serving TCP."""
    state = tempfile.mkdtemp(prefix="bb-tcp-state-")
    sock = os.path.join(tempfile.mkdtemp(prefix="bb-tcp-run-"), "d.sock")
    port = free_port()
    proc = subprocess.Popen(
        [daemon_bin(), "--state-dir", state, "--socket", sock, "--cgroup-parent", "branchbox-test-tcp",
         "--listen", "127.0.0.1:%d" % port, "--token", "s3cret"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    url = "http://127.0.0.1:%d" % port
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            httpx.get(url + "/v1/health", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    yield url, sock
    proc.terminate()
    proc.wait(timeout=20)


def test_tcp_requires_the_bearer_token(tcp_daemon):
    url, sock = tcp_daemon
    r = httpx.get(url + "/v1/health")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
    r = httpx.get(url + "/v1/health", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(url + "/v1/health", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["ok"] is True
    # The SDK sends BRANCHBOX_TOKEN / token= as the bearer token.
    from branchbox.images import Images
    assert Images(daemon=url, token="s3cret").list() == []
    # The unix socket stays token-free (protected by file permissions: 0660 root).
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://d") as c:
        assert c.get("/v1/health").status_code == 200
    assert oct(os.stat(sock).st_mode & 0o777) == "0o660"


def test_tcp_without_a_token_is_refused_at_start(daemon, tmp_path):
    r = subprocess.run(
        [daemon_bin(), "--state-dir", str(tmp_path / "s"), "--socket", str(tmp_path / "d.sock"),
         "--cgroup-parent", "branchbox-test-tcp", "--listen", "127.0.0.1:%d" % free_port()],
        capture_output=True, text=True, timeout=20, env={k: v for k, v in os.environ.items() if k != "BRANCHBOX_TOKEN"},
    )
    assert r.returncode != 0 and "--token" in r.stderr, (r.returncode, r.stderr)
