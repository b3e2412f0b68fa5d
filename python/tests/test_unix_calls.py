"""The sync SDK's unix-socket fast path (``sandbox_sync._UnixCalls``): plain calls to a daemon on
a unix socket go through keep-alive ``http.client`` connections instead of httpx. Tested
against a real HTTP/1.1 server on a unix socket in a thread."""

import http.server
import json
import os
import socketserver
import threading
import time

import pytest

from branchbox import exceptions as exc
from branchbox import sandbox_sync


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        # One handler per connection: number them (object ids can be reused once freed).
        with self.server.lock:
            self.server.conns += 1
            self.conn_no = self.server.conns

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self._answer()

    def do_PUT(self):
        if self.path.startswith("/refuse"):
            # Answer without reading the body, then close (as the daemon does for a refused path).
            self.server.seen.append({"method": "PUT", "path": self.path, "conn": self.conn_no})
            data = json.dumps({"error": {"code": "path_escape", "message": "refused " + self.path}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
            return
        self._answer()

    def _answer(self):
        srv = self.server
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        srv.seen.append(
            {
                "method": self.command,
                "path": self.path,
                "body": body,
                "auth": self.headers.get("Authorization"),
                "agent": self.headers.get("User-Agent"),
                "type": self.headers.get("Content-Type"),
                "conn": self.conn_no,
            }
        )
        if self.path.startswith("/slow"):
            time.sleep(1.0)
        if self.path.startswith("/v1/sandboxes/missing"):
            status, out = 404, {"error": {"code": "not_found", "message": "no sandbox missing"}}
        else:
            status, out = 200, {"ok": True, "path": self.path}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.path.startswith("/close"):
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server(tmp_path):
    path = str(tmp_path / "d.sock")
    srv = _Server(path, _Handler)
    srv.seen = []
    srv.conns = 0
    srv.lock = threading.Lock()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, path
    srv.shutdown()
    srv.server_close()


def _http(path, token="tok", timeout=10.0):
    return sandbox_sync._HTTP(sandbox_sync.ConnectionConfig("unix://" + path, token, timeout, None))


def _call(method, path, **kw):
    return sandbox_sync._core.Call(method, path, **kw)


def test_calls_go_through_one_kept_connection_with_body_query_and_headers(server):
    srv, path = server
    h = _http(path)
    assert h.unix is not None
    assert h.call(_call("POST", "/v1/sandboxes/a%2Fb/checkpoint", json={"label": "x y"})) == {
        "ok": True,
        "path": "/v1/sandboxes/a%2Fb/checkpoint",
    }
    got = h.call(_call("GET", "/v1/sandboxes", params={"metadata.k": "a b&c"}))
    assert got["path"] == "/v1/sandboxes?metadata.k=a%20b%26c"
    first, second = srv.seen
    assert json.loads(first["body"]) == {"label": "x y"} and first["type"] == "application/json"
    assert first["auth"] == "Bearer tok" and first["agent"].startswith("branchbox-python/")
    assert second["body"] == b"" and second["method"] == "GET"
    assert first["conn"] == second["conn"], "the connection was not kept"


def test_a_connection_the_daemon_closed_is_not_reused(server):
    srv, path = server
    h = _http(path)
    h.call(_call("GET", "/close"))
    time.sleep(0.05)
    # The next call must not be written to the closed connection.
    assert h.call(_call("GET", "/after"))["path"] == "/after"
    assert srv.seen[0]["conn"] != srv.seen[1]["conn"]


def test_an_answer_sent_before_the_body_was_read_is_not_lost_to_the_broken_pipe(server):
    srv, path = server
    h = _http(path)
    # Larger than the socket's buffers: the server closes while the body is still being sent.
    big = b"x" * (8 << 20)
    for _ in range(3):
        with pytest.raises(exc.PathEscapeError) as e:
            h.call(_call("PUT", "/refuse", content=big))
        assert "refused /refuse" in str(e.value)
    assert h.call(_call("GET", "/after"))["path"] == "/after"


def test_error_answers_raise_the_sdk_exceptions(server):
    _, path = server
    with pytest.raises(exc.NotFoundError):
        _http(path).call(_call("GET", "/v1/sandboxes/missing"))


def test_a_missing_daemon_and_a_timeout_say_what_to_do(server, tmp_path):
    _, path = server
    with pytest.raises(exc.DaemonUnavailableError) as e:
        _http(str(tmp_path / "nothing.sock")).call(_call("GET", "/v1/health"))
    assert e.value.code == "connect" and "branchbox daemon start" in str(e.value)
    with pytest.raises(exc.TimeoutError) as e:
        _http(path, timeout=0.2).call(_call("GET", "/slow"))
    assert "request_timeout" in str(e.value)
    # The timed-out connection was dropped; the next call works.
    assert _http(path).call(_call("GET", "/ok"))["path"] == "/ok"


def test_file_objects_and_custom_transports_keep_httpx(server):
    _, path = server
    h = _http(path)
    parts = sandbox_sync._unix_call_parts(_call("PUT", "/f", content=iter([b"x"])), 10.0)
    assert parts is None
    assert sandbox_sync._unix_call_parts(_call("PUT", "/f", content=b"x"), 10.0)[1] == b"x"
    import httpx

    cfg = sandbox_sync.ConnectionConfig("unix://" + path, None, 10.0, httpx.MockTransport(lambda r: httpx.Response(200)))
    assert sandbox_sync._HTTP(cfg).unix is None
    assert h.unix is sandbox_sync._HTTP(sandbox_sync.ConnectionConfig("unix://" + path, "tok", 10.0, None)).unix


def test_a_forked_child_opens_its_own_connections(server):
    srv, path = server
    h = _http(path)
    h.call(_call("GET", "/parent"))
    pid = os.fork()
    if pid == 0:
        try:
            ok = h.call(_call("GET", "/child"))["path"] == "/child"
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    by_path = {s["path"]: s["conn"] for s in srv.seen}
    assert by_path["/child"] != by_path["/parent"]
    # The parent's connection still works.
    assert h.call(_call("GET", "/parent2"))["path"] == "/parent2"
