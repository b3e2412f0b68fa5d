"""Exports guard, error mapping, address resolution and shared parsing helpers."""

from __future__ import annotations

import builtins

import httpx
import pytest

import branchbox
from branchbox import _core, exceptions
from branchbox._transport import DEFAULT_URL, ConnectionConfig, resolve_address, resolve_token

EXPECTED_ALL = {
    "Sandbox",
    "AsyncSandbox",
    "CommandHandle",
    "AsyncCommandHandle",
    "Session",
    "AsyncSession",
    "ByteStream",
    "AsyncByteStream",
    "images",
    "Images",
    "AsyncImages",
    "SandboxInfo",
    "CommandResult",
    "ProcessInfo",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "ShellResult",
    "SessionInfo",
    "PortInfo",
    "NetworkInfo",
    "NetLimits",
    "ImageInfo",
    "ImageProgress",
    "Snapshots",
    "AsyncSnapshots",
    "SnapshotInfo",
    "SnapshotSession",
    "RollbackResult",
    "ForkResult",
    "GcResult",
    "PauseResult",
    "ResumeResult",
    "OffloadResult",
    "PullResult",
    "PushResult",
    "RemotePausedInfo",
    "RemoteSnapshotInfo",
    "StoreGcResult",
    "templates",
    "Templates",
    "AsyncTemplates",
    "pool",
    "Pool",
    "AsyncPool",
    "PoolStats",
    "PoolImageStats",
    "TemplateInfo",
    "TemplateProgress",
    "Volume",
    "AsyncVolume",
    "VolumeInfo",
    "VolumeSnapshotInfo",
    "VolumeMount",
    "SandboxError",
    "NotFoundError",
    "InvalidArgumentError",
    "PathEscapeError",
    "AuthenticationError",
    "ConflictError",
    "PayloadTooLargeError",
    "QuotaExceededError",
    "TimeoutError",
    "DaemonUnavailableError",
    "CorruptDataError",
    "CommandExitError",
    "__version__",
}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(branchbox.__all__) == EXPECTED_ALL
    assert len(branchbox.__all__) == len(set(branchbox.__all__))
    for name in branchbox.__all__:
        assert getattr(branchbox, name) is not None, name


def test_star_import() -> None:
    ns: dict = {}
    exec("from branchbox import *", ns)
    assert EXPECTED_ALL <= set(ns)


def test_exception_tree() -> None:
    for name in (
        "NotFoundError",
        "InvalidArgumentError",
        "PathEscapeError",
        "AuthenticationError",
        "ConflictError",
        "PayloadTooLargeError",
        "TimeoutError",
        "DaemonUnavailableError",
        "CorruptDataError",
        "CommandExitError",
    ):
        assert issubclass(getattr(branchbox, name), branchbox.SandboxError), name
    assert issubclass(branchbox.PathEscapeError, branchbox.InvalidArgumentError)
    assert branchbox.TimeoutError is not builtins.TimeoutError
    assert not issubclass(branchbox.TimeoutError, builtins.TimeoutError)
    # the docstring draws the tree
    for name in ("SandboxError", "PathEscapeError", "CommandExitError"):
        assert name in exceptions.__doc__


@pytest.mark.parametrize(
    "status, code, cls",
    [
        (400, "bad_request", branchbox.InvalidArgumentError),
        (400, "path_escape", branchbox.PathEscapeError),
        (401, "unauthorized", branchbox.AuthenticationError),
        (404, "not_found", branchbox.NotFoundError),
        (409, "conflict", branchbox.ConflictError),
        (413, "payload_too_large", branchbox.PayloadTooLargeError),
        (408, "timeout", branchbox.TimeoutError),
        (503, "unavailable", branchbox.DaemonUnavailableError),
        (502, "corrupt", branchbox.CorruptDataError),
        (500, "internal", branchbox.SandboxError),
    ],
)
def test_error_code_mapping(status: int, code: str, cls: type) -> None:
    e = exceptions.error_from_response(status, {"error": {"code": code, "message": "do X instead"}})
    assert type(e) is cls
    assert (e.code, e.status_code, str(e), e.message) == (code, status, "do X instead", "do X instead")


def test_error_fallbacks() -> None:
    e = exceptions.error_from_response(404, None)
    assert type(e) is branchbox.NotFoundError and "404" in str(e)
    e = exceptions.error_from_response(409, {"error": {"code": "brand_new_code", "message": "m"}})
    assert type(e) is branchbox.ConflictError and e.code == "brand_new_code"
    e = exceptions.error_from_response(500, "plain text")
    assert type(e) is branchbox.SandboxError and str(e) == "plain text"
    e = exceptions.error_from_response(413, {"error": "too big"})
    assert type(e) is branchbox.PayloadTooLargeError and str(e) == "too big"


def test_command_exit_error_for_signal() -> None:
    res = branchbox.CommandResult(exit_code=None, signal=15)
    with pytest.raises(branchbox.CommandExitError, match="signal 15"):
        res.check()


# ----------------------------------------------------------------------------- transport


def test_resolve_address(monkeypatch: pytest.MonkeyPatch) -> None:
    a = resolve_address()
    assert a.url == DEFAULT_URL and a.uds == "/run/branchbox/branchboxd.sock" and a.is_unix
    monkeypatch.setenv("BRANCHBOX_URL", "http://127.0.0.1:7070/")
    a = resolve_address()
    assert (a.base_url, a.uds) == ("http://127.0.0.1:7070", None)
    a = resolve_address("unix:///tmp/x.sock")  # the argument wins over the environment
    assert a.uds == "/tmp/x.sock" and a.base_url.startswith("http://")
    assert resolve_address("/tmp/y.sock").uds == "/tmp/y.sock"
    assert resolve_address("https://h:1").base_url == "https://h:1"
    for bad in ("unix://relative.sock", "ftp://x", "localhost:7070"):
        with pytest.raises(branchbox.InvalidArgumentError):
            resolve_address(bad)


def test_resolve_token(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_token() is None
    monkeypatch.setenv("BRANCHBOX_TOKEN", "env")
    assert resolve_token() == "env"
    assert resolve_token("arg") == "arg"
    cfg = ConnectionConfig(token="abc")
    assert cfg.headers()["Authorization"] == "Bearer abc"


def test_uds_transport_is_used() -> None:
    client = ConnectionConfig("unix:///tmp/some.sock").sync_client()
    try:
        assert isinstance(client._transport, httpx.HTTPTransport)
        assert str(client.base_url).startswith("http://")
    finally:
        client.close()


def test_http_timeouts() -> None:
    call = _core.Call("GET", "/x")
    assert call.http_timeout(120) is httpx.USE_CLIENT_DEFAULT
    call = _core.Call("POST", "/x", op_timeout=600)
    t = call.http_timeout(120)
    assert isinstance(t, httpx.Timeout) and t.read == 600 + _core.TIMEOUT_GRACE
    assert _core.Call("POST", "/x", op_timeout=5).http_timeout(120).read == 120
    assert _core.Call("POST", "/x", op_timeout=0).http_timeout(120) is None
    assert _core.Call("POST", "/x", unbounded=True).http_timeout(120) is None
    assert _core.wait_process("sb-1", 3).http_timeout(120) is None


def test_ndjson_decoder() -> None:
    d = _core.NDJSONDecoder()
    assert d.feed(b'{"a": 1}\n{"b"') == [{"a": 1}]
    assert d.feed(b": 2}") == []
    assert d.feed(b"\n\n{}\n") == [{"b": 2}, {}]
    assert d.feed(b'{"tail": true}') == []
    assert d.close() == [{"tail": True}]
    assert d.close() == []
    with pytest.raises(branchbox.SandboxError):
        _core.NDJSONDecoder().feed(b"nope\n")


def test_format_mode() -> None:
    assert _core.format_mode(None) is None
    assert _core.format_mode(0o644) == "0644"
    assert _core.format_mode("755") == "0755"
    assert _core.format_mode("0600") == "0600"
    for bad in ("9", -1, 0o10000, True):
        with pytest.raises(branchbox.InvalidArgumentError):
            _core.format_mode(bad)


def test_models_tolerate_unknown_and_missing_fields() -> None:
    info = branchbox.SandboxInfo.from_dict({"id": "sb-1", "future_field": 1})
    assert info.id == "sb-1" and info.state == "" and info.raw["future_field"] == 1
    ex = branchbox.Execution.from_dict({"error": {"name": "E", "value": "v", "traceback": "t"}, "extra": 1})
    assert isinstance(ex.error, branchbox.ExecutionError) and ex.error.name == "E"
    assert branchbox.Execution.from_dict(None).result is None
    assert isinstance(_core.parse_run_result({"stdout": "", "exit_code": 0}), branchbox.ShellResult)
    assert isinstance(_core.parse_run_result({"stdout": "", "result": None}), branchbox.Execution)


def test_create_sends_sudo_only_when_given() -> None:
    body = lambda **kw: _core.create_sandbox(**kw).json  # noqa: E731
    assert "sudo" not in body()
    assert body(sudo=True)["sudo"] is True
    assert body(image=None, snapshot="sn-000000000001", sudo=False)["sudo"] is False, "False turns a snapshot's off"
    for bad in ("yes", 1, 0):
        with pytest.raises(exceptions.InvalidArgumentError, match="sudo must be True, False or None"):
            _core.create_sandbox(sudo=bad)
    assert branchbox.SandboxInfo.from_dict({"id": "sb-1", "sudo": True}).sudo is True
    assert branchbox.SandboxInfo.from_dict({"id": "sb-1"}).sudo is False
