"""Shared fixtures: a scriptable fake daemon behind ``httpx.MockTransport``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import httpx
import pytest

if TYPE_CHECKING:
    from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

SANDBOX = {
    "id": "sb-0123456789ab",
    "image": "base",
    "state": "running",
    "created_at": 1732250000.12,
    "expires_at": 1732250300.12,
    "cpu": 1.0,
    "memory_mb": 512,
    "pids": 256,
    "network": "none",
    "env": {"K": "V"},
    "cwd": "/root",
    "metadata": {"k": "v"},
    "init_pid": 12345,
    "oom_killed": False,
    "memory_bytes": 1234567,
    "pids_current": 2,
}
SID = SANDBOX["id"]
BASE = "/v1/sandboxes/" + SID
RESULT = {
    "pid": 7,
    "exit_code": 0,
    "signal": None,
    "stdout": "hi\n",
    "stderr": "",
    "timed_out": False,
    "oom_killed": False,
    "duration": 0.0012,
    "stdout_truncated": False,
    "stderr_truncated": False,
}
ENTRY = {
    "name": "b",
    "path": "/a/b",
    "type": "file",
    "size": 3,
    "mode": 420,
    "mtime": 1732250000.0,
    "symlink_target": None,
}
IMAGE = {
    "name": "base",
    "id": "sha256:abc",
    "layers": ["sha256:l1"],
    "size_bytes": 1,
    "created_at": 1.0,
    "source": "debootstrap",
}


class Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body delivered in the given chunks (sync and async)."""

    def __init__(self, chunks: List[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self):
        yield from self.chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk


def ndjson(*events: Any, split: int = 0) -> Chunks:
    """NDJSON body; with ``split`` the bytes are cut into ``split``-sized chunks."""
    data = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    if split:
        return Chunks([data[i : i + split] for i in range(0, len(data), split)])
    return Chunks([data])


Responder = Union[Dict[str, Any], Callable[[httpx.Request], httpx.Response], httpx.Response]


class FakeDaemon:
    """Routes requests by (method, path regex); records every request."""

    def __init__(self) -> None:
        self.routes: List[Tuple[str, "re.Pattern[str]", Responder, int]] = []
        self.requests: List[httpx.Request] = []
        self.error: Optional[Exception] = None

    def on(self, method: str, path: str, response: Responder = None, status: int = 200) -> "FakeDaemon":
        self.routes.insert(0, (method, re.compile("^" + path + "$"), response if response is not None else {}, status))
        return self

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        for method, pattern, response, status in self.routes:
            if method == request.method and pattern.match(request.url.path):
                if isinstance(response, httpx.Response):  # fresh copy: responses are single-use
                    return httpx.Response(response.status_code, headers=response.headers, stream=response.stream)
                if callable(response):
                    return response(request)
                return httpx.Response(status, json=response)
        return httpx.Response(
            404, json={"error": {"code": "not_found", "message": "no route %s %s" % (request.method, request.url.path)}}
        )

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def body(self, request: Optional[httpx.Request] = None) -> Any:
        request = request or self.last
        return json.loads(request.content) if request.content else None

    def shape(self) -> Tuple[str, str, Any]:
        """Method, path and JSON body of the last request."""
        return self.last.method, self.last.url.path, self.body()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


@pytest.fixture
def fake() -> FakeDaemon:
    f = FakeDaemon()
    f.on("POST", "/v1/sandboxes", SANDBOX, 201)
    f.on("GET", BASE, SANDBOX)
    f.on("DELETE", BASE, {"killed": True})
    return f


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("BRANCHBOX_URL", "BRANCHBOX_TOKEN", "BRANCHBOX_DEBUG", "BRANCHBOX_DAEMON_BIN"):
        monkeypatch.delenv(var, raising=False)


# ----------------------------------------------------------------------------- the CLI


def cli_runner() -> "CliRunner":
    """A CliRunner that keeps stderr apart from stdout, on any click version."""
    from typer.testing import CliRunner

    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


@pytest.fixture
def runner() -> "CliRunner":
    return cli_runner()


@pytest.fixture
def daemon(fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch) -> FakeDaemon:
    """Route every SDK client the CLI builds to the fake daemon."""
    import branchbox.sandbox_sync as sync_mod

    real = sync_mod.ConnectionConfig

    class Patched(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.transport = fake.transport()

    monkeypatch.setattr(sync_mod, "ConnectionConfig", Patched)
    return fake


def invoke(runner: "CliRunner", *args: str, **kw):
    from branchbox_cli import app as cli

    return runner.invoke(cli.app, list(args), **kw)


def one_red_line(r) -> str:
    """The CLI failed (exit 1) with a single ``error: ...`` line on stderr, no traceback."""
    assert r.exit_code == 1, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    return lines[0]
