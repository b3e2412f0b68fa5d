"""Request shapes and parsing of the synchronous SDK, against httpx.MockTransport."""

from __future__ import annotations

import base64
import builtins
import io
import json

import httpx
import pytest

import branchbox
from branchbox import (
    CommandExitError,
    CommandHandle,
    CommandResult,
    ConflictError,
    DaemonUnavailableError,
    EntryInfo,
    Execution,
    ImageInfo,
    ImageProgress,
    Images,
    InvalidArgumentError,
    NotFoundError,
    PathEscapeError,
    ProcessInfo,
    Sandbox,
    SandboxInfo,
    SessionInfo,
    ShellResult,
)
from conftest import BASE, ENTRY, IMAGE, RESULT, SANDBOX, SID, Chunks, FakeDaemon, ndjson


@pytest.fixture
def sbx(fake: FakeDaemon) -> Sandbox:
    s = Sandbox.create(transport=fake.transport())
    yield s
    s.close()


# ----------------------------------------------------------------------------- sandboxes


def test_create_defaults(fake: FakeDaemon) -> None:
    sbx = Sandbox.create(transport=fake.transport())
    req = fake.last
    assert (req.method, req.url.path) == ("POST", "/v1/sandboxes")
    assert fake.body() == {"image": "base", "timeout": 300, "network": "none"}
    assert req.headers["content-type"] == "application/json"
    assert "authorization" not in req.headers
    assert req.headers["user-agent"].startswith("branchbox-python/")
    assert sbx.id == SID == sbx.sandbox_id
    assert repr(sbx) == "Sandbox(id=%r)" % SID


def test_create_all_fields_and_token(fake: FakeDaemon) -> None:
    Sandbox.create(
        "alpine",
        cpu=2.0,
        memory_mb=256,
        pids=64,
        env={"A": "1", "N": 2},
        cwd="/work",
        timeout=0,
        network="none",
        metadata={"owner": "me"},
        token="s3cret",
        transport=fake.transport(),
    )
    assert fake.body() == {
        "image": "alpine",
        "cpu": 2.0,
        "memory_mb": 256,
        "pids": 64,
        "env": {"A": "1", "N": "2"},
        "cwd": "/work",
        "timeout": 0,
        "network": "none",
        "metadata": {"owner": "me"},
    }
    assert fake.last.headers["authorization"] == "Bearer s3cret"


def test_token_from_env(fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRANCHBOX_TOKEN", "envtok")
    Sandbox.create(transport=fake.transport())
    assert fake.last.headers["authorization"] == "Bearer envtok"


def test_info_fields(sbx: Sandbox, fake: FakeDaemon) -> None:
    info = sbx.info()
    assert (fake.last.method, fake.last.url.path) == ("GET", BASE)
    assert isinstance(info, SandboxInfo)
    assert info.id == SID and info.state == "running" and info.is_running
    assert info.memory_mb == 512 and info.env == {"K": "V"} and info.init_pid == 12345
    assert info.raw == SANDBOX
    assert "raw" not in repr(info)


def test_connect_and_not_found(fake: FakeDaemon) -> None:
    sbx = Sandbox.connect(SID, transport=fake.transport())
    assert sbx.id == SID and fake.last.url.path == BASE
    with pytest.raises(NotFoundError) as ei:
        Sandbox.connect("sb-missing", transport=fake.transport())
    assert ei.value.status_code == 404 and ei.value.code == "not_found"


def test_list_with_metadata_filter(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/sandboxes", {"sandboxes": [SANDBOX, dict(SANDBOX, id="sb-2", state="dead")]})
    infos = Sandbox.list(metadata={"owner": "me", "team": "x"}, transport=fake.transport())
    assert [i.id for i in infos] == [SID, "sb-2"]
    assert infos[1].state == "dead"
    assert dict(fake.last.url.params) == {"metadata.owner": "me", "metadata.team": "x"}
    Sandbox.list(transport=fake.transport())
    assert fake.last.url.query == b""


def test_set_timeout(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/timeout", dict(SANDBOX, expires_at=5.0))
    info = sbx.set_timeout(60)
    assert fake.body() == {"timeout": 60}
    assert info.expires_at == 5.0


def test_pause_modes_and_reboot(sbx: Sandbox, fake: FakeDaemon) -> None:
    paused = {"sandbox": dict(SANDBOX, state="paused"), "processes": 0, "sessions": 1, "image_bytes": 0, "took_ms": 3.0}
    fake.on("POST", BASE + "/pause", dict(paused, mode="filesystem"))
    r = sbx.pause(mode="filesystem")
    assert fake.body() == {"mode": "filesystem"} and r.mode == "filesystem"
    fake.on("POST", BASE + "/pause", paused)
    assert sbx.pause().mode == "full" and fake.last.content == b""
    with pytest.raises(InvalidArgumentError, match="mode must be one of full, filesystem"):
        sbx.pause(mode="memory")
    fake.on("POST", BASE + "/resume", {"sandbox": SANDBOX, "processes": 0, "sessions": 0, "took_ms": 2.0, "rebooted": True})
    assert sbx.resume(reboot=True).rebooted is True
    assert fake.body() == {"reboot": True}
    sbx.resume(timeout=5)
    assert fake.body() == {"timeout": 5}


def test_kill_and_is_running(sbx: Sandbox, fake: FakeDaemon) -> None:
    assert sbx.is_running() is True
    assert sbx.kill() is True
    assert (fake.last.method, fake.last.url.path) == ("DELETE", BASE)
    fake.on("DELETE", BASE, {"error": {"code": "not_found", "message": "gone"}}, 404)
    fake.on("GET", BASE, {"error": {"code": "not_found", "message": "gone"}}, 404)
    assert sbx.kill() is False
    assert sbx.is_running() is False


def test_dead_sandbox_is_not_running(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", BASE, dict(SANDBOX, state="dead", oom_killed=True))
    assert sbx.is_running() is False


def test_context_manager_kills(fake: FakeDaemon) -> None:
    with Sandbox.create(transport=fake.transport()) as sbx:
        assert sbx.id == SID
    assert (fake.last.method, fake.last.url.path) == ("DELETE", BASE)


def test_context_manager_does_not_mask_errors(fake: FakeDaemon) -> None:
    fake.on("DELETE", BASE, {"error": {"code": "internal", "message": "boom"}}, 500)
    with pytest.raises(ZeroDivisionError):
        with Sandbox.create(transport=fake.transport()):
            1 / 0


# ----------------------------------------------------------------------------- commands


def test_run_string_command(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", RESULT)
    res = sbx.commands.run("echo hi")
    assert fake.last.url.path == BASE + "/commands"
    assert fake.body() == {"cmd": "echo hi", "timeout": 60}
    assert isinstance(res, CommandResult)
    assert res.stdout == "hi\n" and res.exit_code == 0 and res.ok
    assert res.check() is res


def test_run_argv_with_everything(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", RESULT)
    sbx.commands.run(["ls", "-la", "/"], cwd="/tmp", env={"A": "b"}, timeout=5, stdin="input")
    assert fake.body() == {
        "args": ["ls", "-la", "/"],
        "cwd": "/tmp",
        "env": {"A": "b"},
        "timeout": 5,
        "stdin": "input",
    }
    sbx.commands.run("cat", stdin=b"\x00\xffbin", timeout=None)
    body = fake.body()
    assert body == {"cmd": "cat", "stdin_b64": base64.b64encode(b"\x00\xffbin").decode()}


def test_run_rejects_bad_input(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("")
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run([])
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("x", stdin=123)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("x", background=True, on_stdout=print)


def test_nonzero_exit_check(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", dict(RESULT, exit_code=3, stderr="bad thing\n"))
    res = sbx.commands.run("false")
    assert not res.ok
    with pytest.raises(CommandExitError) as ei:
        res.check()
    assert ei.value.result is res
    assert ei.value.exit_code == 3 and "exited with code 3" in str(ei.value) and "bad thing" in str(ei.value)
    assert isinstance(ei.value, branchbox.SandboxError)


def test_timed_out_is_not_an_error(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", dict(RESULT, exit_code=None, signal=9, timed_out=True))
    res = sbx.commands.run("sleep 100", timeout=1)
    assert res.timed_out and res.exit_code is None and res.signal == 9
    with pytest.raises(CommandExitError, match="timed out"):
        res.check()


def test_background_handle(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", {"pid": 8}, 201)
    fake.on("POST", BASE + "/commands/8/wait", dict(RESULT, pid=8))
    fake.on("POST", BASE + "/commands/8/kill", {"killed": True})
    handle = sbx.commands.run("sleep 10", background=True)
    assert fake.body() == {"cmd": "sleep 10", "timeout": 60, "background": True}
    assert isinstance(handle, CommandHandle) and handle.pid == 8
    res = handle.wait(timeout=30)
    assert fake.last.url.path == BASE + "/commands/8/wait" and fake.body() == {"timeout": 30}
    assert res.pid == 8
    handle.wait()
    assert fake.body() == {}
    assert handle.kill() is True
    assert fake.body() == {"signal": 9}
    sbx.commands.kill(8, signal=15)
    assert fake.last.url.path == BASE + "/commands/8/kill" and fake.body() == {"signal": 15}


def test_commands_list_and_wait(sbx: Sandbox, fake: FakeDaemon) -> None:
    proc = {"pid": 8, "cmd": "sleep 10", "running": True, "exit_code": None, "signal": None, "started_at": 1.5}
    fake.on("GET", BASE + "/commands", {"processes": [proc]})
    procs = sbx.commands.list()
    assert procs == [ProcessInfo(pid=8, cmd="sleep 10", running=True, started_at=1.5)]
    fake.on("POST", BASE + "/commands/9/wait", dict(RESULT, pid=9, timed_out=True, exit_code=None))
    res = sbx.commands.wait(9, timeout=0.5)
    assert res.timed_out and fake.body() == {"timeout": 0.5}


def test_stream_callbacks(sbx: Sandbox, fake: FakeDaemon) -> None:
    events = [
        {"type": "start", "pid": 7},
        {"type": "stdout", "data": "a\n"},
        {"type": "stderr", "data": "warn\n"},
        {"type": "stdout", "data": "b\u00e9\n"},
        {"type": "exit", "pid": 7, "exit_code": 0, "signal": None, "timed_out": False, "duration": 0.01},
    ]
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events, split=7)))
    out, err = [], []
    res = sbx.commands.run("x", on_stdout=out.append, on_stderr=err.append, background=False)
    assert fake.last.url.path == BASE + "/commands/stream"
    assert fake.body() == {"cmd": "x", "timeout": 60}
    assert out == ["a\n", "b\u00e9\n"] and err == ["warn\n"]
    assert res.stdout == "a\nb\u00e9\n" and res.stderr == "warn\n"
    assert res.exit_code == 0 and res.pid == 7 and res.duration == 0.01


def test_stream_only_stderr_callback_and_missing_exit(sbx: Sandbox, fake: FakeDaemon) -> None:
    events = [{"type": "start", "pid": 3}, {"type": "stdout", "data": "x"}]
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events)))
    with pytest.raises(branchbox.SandboxError, match="without an exit event"):
        sbx.commands.run("x", on_stderr=lambda s: None)


def test_stream_error_event(sbx: Sandbox, fake: FakeDaemon) -> None:
    events = [{"type": "error", "error": {"code": "conflict", "message": "sandbox is dead"}}]
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events)))
    with pytest.raises(ConflictError, match="sandbox is dead"):
        sbx.commands.run("x", on_stdout=print)


def test_stream_http_error(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands/stream", {"error": {"code": "not_found", "message": "no sandbox"}}, 404)
    with pytest.raises(NotFoundError, match="no sandbox"):
        sbx.commands.run("x", on_stdout=print)


def test_stream_malformed_line(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=Chunks([b'{"type":"start"}\n{oops\n'])))
    with pytest.raises(branchbox.SandboxError, match="malformed"):
        sbx.commands.run("x", on_stdout=print)


# ----------------------------------------------------------------------------- code & sessions


def test_run_code(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/code", {"stdout": "p\n", "stderr": "", "result": "2", "error": None, "timed_out": False})
    ex = sbx.run_code("x = 1\nx + 1", timeout=10)
    assert fake.body() == {"code": "x = 1\nx + 1", "language": "python", "timeout": 10}
    assert isinstance(ex, Execution)
    assert ex.result == ex.text == "2" and ex.stdout == "p\n" and ex.error is None


def test_run_code_env(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/code", {"stdout": "", "stderr": "", "result": "'x'"})
    sbx.run_code("import os\nos.environ['A']", env={"A": "x"})
    assert fake.body()["env"] == {"A": "x"}
    sbx.run_code("1")
    assert "env" not in fake.body()
    with pytest.raises(InvalidArgumentError, match="env must map str names to str values"):
        sbx.run_code("1", env={"A": 1})


def test_run_code_error(sbx: Sandbox, fake: FakeDaemon) -> None:
    err = {"name": "ZeroDivisionError", "value": "division by zero", "traceback": "Traceback...\n"}
    fake.on("POST", BASE + "/code", {"stdout": "", "stderr": "", "result": None, "error": err, "timed_out": False})
    ex = sbx.run_code("1/0")
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert ex.error.traceback == "Traceback...\n"
    assert str(ex.error) == "ZeroDivisionError: division by zero"
    assert ex.text is None


def test_sessions(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/sessions", {"id": "ss-01234567", "kind": "shell", "pid": 9, "created_at": 1.0}, 201)
    fake.on("GET", BASE + "/sessions", {"sessions": [{"id": "ss-01234567", "kind": "shell", "pid": 9}]})
    fake.on(
        "POST",
        BASE + "/sessions/ss-01234567/run",
        {"stdout": "/tmp\n", "stderr": "", "exit_code": 0, "timed_out": False},
    )
    fake.on("DELETE", BASE + "/sessions/ss-01234567", {"killed": True})
    sess = sbx.sessions.create("shell", cwd="/tmp", env={"A": "1"})
    assert fake.body() == {"kind": "shell", "cwd": "/tmp", "env": {"A": "1"}}
    assert sess.id == "ss-01234567" and sess.kind == "shell" and sess.pid == 9
    res = sess.run("pwd", timeout=5)
    assert fake.body() == {"code": "pwd", "timeout": 5}
    assert isinstance(res, ShellResult) and res.stdout == "/tmp\n" and res.exit_code == 0
    assert sbx.sessions.list() == [SessionInfo(id="ss-01234567", kind="shell", pid=9)]
    # a timed-out shell run has no exit_code: the session's kind still decides the type
    fake.on("POST", BASE + "/sessions/ss-01234567/run", {"stdout": "", "stderr": "", "timed_out": True})
    res = sess.run("sleep 100", timeout=1)
    assert isinstance(res, ShellResult) and res.timed_out and res.exit_code is None
    assert sess.kill() is True
    assert (fake.last.method, fake.last.url.path) == ("DELETE", BASE + "/sessions/ss-01234567")


def test_python_session_run_and_context(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/sessions", {"id": "ss-1", "kind": "python", "pid": 9}, 201)
    fake.on("POST", BASE + "/sessions/ss-1/run", {"stdout": "", "stderr": "", "result": "3", "timed_out": False})
    fake.on("DELETE", BASE + "/sessions/ss-1", {"killed": True})
    with sbx.sessions.create() as sess:
        assert fake.body() == {"kind": "python", "cwd": None, "env": {}}
        ex = sess.run("1+2")
        assert isinstance(ex, Execution) and ex.text == "3"
    assert fake.last.method == "DELETE"
    with pytest.raises(InvalidArgumentError):
        sbx.sessions.create("ruby")


# ----------------------------------------------------------------------------- files


def test_read_formats(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", BASE + "/files", httpx.Response(200, stream=Chunks([b"he", b"llo \xc3", b"\xa9"])))
    assert sbx.files.read("/a/b") == "hello \u00e9"
    assert dict(fake.last.url.params) == {"path": "/a/b"}
    assert sbx.files.read("/a/b", format="bytes") == b"hello \xc3\xa9"
    with sbx.files.read("/a/b", format="stream") as stream:
        assert list(stream) == [b"he", b"llo \xc3", b"\xa9"]
    with pytest.raises(InvalidArgumentError):
        sbx.files.read("/a/b", format="json")


def test_read_path_escape(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", BASE + "/files", {"error": {"code": "path_escape", "message": "../ leaves the root"}}, 400)
    with pytest.raises(PathEscapeError) as ei:
        sbx.files.read("../../etc/shadow")
    assert isinstance(ei.value, InvalidArgumentError) and ei.value.code == "path_escape"


def test_write_variants(sbx: Sandbox, fake: FakeDaemon, tmp_path) -> None:
    fake.on("PUT", BASE + "/files", ENTRY)
    info = sbx.files.write("/a/b", "h\u00e9")
    assert isinstance(info, EntryInfo) and info.path == "/a/b" and info.is_file
    req = fake.last
    assert req.content == "h\u00e9".encode() and req.headers["content-length"] == "3"
    assert req.headers["content-type"] == "application/octet-stream"
    assert dict(req.url.params) == {"path": "/a/b"}

    sbx.files.write("/a/b", b"\x00\x01", mode=0o755)
    assert fake.last.content == b"\x00\x01" and dict(fake.last.url.params) == {"path": "/a/b", "mode": "0755"}
    sbx.files.write("/a/b", b"", mode="644")
    assert fake.last.url.params["mode"] == "0644" and fake.last.content == b""

    sbx.files.write("/a/b", io.BytesIO(b"x" * 3_000_000))  # not a real file: chunked
    assert len(fake.last.content) == 3_000_000
    assert fake.last.headers.get("transfer-encoding") == "chunked"

    p = tmp_path / "f.bin"
    p.write_bytes(b"0123456789")
    with open(p, "rb") as f:
        f.read(4)
        sbx.files.write("/a/b", f)
    assert fake.last.content == b"456789" and fake.last.headers["content-length"] == "6"

    sbx.files.write("/a/b", iter([b"ab", "cd", b""]))
    assert fake.last.content == b"abcd"

    with pytest.raises(InvalidArgumentError):
        sbx.files.write("/a/b", 42)
    with pytest.raises(InvalidArgumentError):
        sbx.files.write("/a/b", "x", mode="rwx")
    with pytest.raises(InvalidArgumentError):
        sbx.files.write("/a/b", "x", mode=0o17777)


def test_upload_download_stream_in_chunks(sbx: Sandbox, fake: FakeDaemon, tmp_path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 20000)  # ~5 MiB
    seen = {}

    def put(request: httpx.Request) -> httpx.Response:
        seen["len"] = request.headers.get("content-length")
        seen["data"] = request.content
        return httpx.Response(200, json=ENTRY)

    fake.on("PUT", BASE + "/files", put)
    sbx.files.upload(src, "/remote/src.bin", mode=0o600)
    assert seen["data"] == src.read_bytes() and seen["len"] == str(src.stat().st_size)
    assert fake.last.url.params["mode"] == "0600"

    chunks = [b"a" * 1000, b"b" * 1000, b"c"]
    fake.on("GET", BASE + "/files", httpx.Response(200, stream=Chunks(chunks)))
    dst = tmp_path / "dst.bin"
    assert sbx.files.download("/remote/x", dst) == str(dst)
    assert dst.read_bytes() == b"".join(chunks)


def test_file_metadata_ops(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", BASE + "/files/list", {"entries": [ENTRY, dict(ENTRY, name="d", type="dir")]})
    fake.on("GET", BASE + "/files/stat", ENTRY)
    fake.on("POST", BASE + "/files/mkdir", dict(ENTRY, type="dir"))
    fake.on("POST", BASE + "/files/rename", dict(ENTRY, path="/a/d"))
    fake.on("DELETE", BASE + "/files", {"removed": True})

    entries = sbx.files.list("/a", depth=2)
    assert dict(fake.last.url.params) == {"path": "/a", "depth": "2"}
    assert [e.name for e in entries] == ["b", "d"] and entries[1].is_dir
    assert sbx.files.stat("/a/b").size == 3
    assert dict(fake.last.url.params) == {"path": "/a/b"}
    assert sbx.files.exists("/a/b") is True
    assert sbx.files.make_dir("/a/c").is_dir
    assert fake.body() == {"path": "/a/c", "parents": True}
    sbx.files.make_dir("/a/c", parents=False)
    assert fake.body() == {"path": "/a/c", "parents": False}
    assert sbx.files.rename("/a/b", "/a/d").path == "/a/d"
    assert fake.body() == {"from": "/a/b", "to": "/a/d"}
    assert sbx.files.remove("/a/d") is True
    assert (fake.last.method, dict(fake.last.url.params)) == ("DELETE", {"path": "/a/d", "recursive": "false"})
    sbx.files.remove("/a", recursive=True)
    assert fake.last.url.params["recursive"] == "true"

    fake.on("GET", BASE + "/files/stat", {"error": {"code": "not_found", "message": "no such file"}}, 404)
    assert sbx.files.exists("/nope") is False


def test_run_as_user_only_when_given(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", RESULT)
    sbx.commands.run("id -u", user="user")
    assert fake.body() == {"cmd": "id -u", "timeout": 60, "user": "user"}
    sbx.commands.run("id -u", user=None)
    assert "user" not in fake.body()

    fake.on("POST", BASE + "/commands", {"pid": 8}, 201)
    sbx.commands.run("sleep 10", background=True, user="user")
    assert fake.body() == {"cmd": "sleep 10", "timeout": 60, "user": "user", "background": True}
    sbx.commands.run("sleep 10", background=True)
    assert "user" not in fake.body()

    events = [{"type": "start", "pid": 7}, {"type": "exit", "exit_code": 0, "signal": None, "timed_out": False}]
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events)))
    sbx.commands.run(["whoami"], on_stdout=print, user="user")
    assert fake.last.url.path == BASE + "/commands/stream"
    assert fake.body() == {"args": ["whoami"], "timeout": 60, "user": "user"}
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events)))
    sbx.commands.run(["whoami"], on_stdout=print)
    assert "user" not in fake.body()

    n = len(fake.requests)
    for bad in ("", "  ", 1000):
        with pytest.raises(InvalidArgumentError, match="user"):
            sbx.commands.run("x", user=bad)  # type: ignore[arg-type]
    assert len(fake.requests) == n


def test_unknown_user_is_the_daemons_400(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", {"error": {"code": "bad_request", "message": "no user nobody2 in the sandbox"}}, 400)
    with pytest.raises(InvalidArgumentError, match="nobody2"):
        sbx.commands.run("x", user="nobody2")


def test_files_as_user_only_when_given(sbx: Sandbox, fake: FakeDaemon, tmp_path) -> None:
    fake.on("PUT", BASE + "/files", dict(ENTRY, uid=1000, gid=1000))
    fake.on("POST", BASE + "/files/mkdir", dict(ENTRY, type="dir", uid=1000, gid=1000))
    info = sbx.files.write("/home/user/a", "x", mode=0o600, user="user")
    assert dict(fake.last.url.params) == {"path": "/home/user/a", "mode": "0600", "user": "user"}
    assert (info.uid, info.gid) == (1000, 1000)
    sbx.files.write("/a/b", "x")
    assert dict(fake.last.url.params) == {"path": "/a/b"}

    src = tmp_path / "f"
    src.write_bytes(b"data")
    sbx.files.upload(src, "/home/user/f", user="user")
    assert dict(fake.last.url.params) == {"path": "/home/user/f", "user": "user"} and fake.last.content == b"data"
    sbx.files.upload(src, "/f")
    assert "user" not in fake.last.url.params

    d = sbx.files.make_dir("/home/user/d", user="user")
    assert fake.body() == {"path": "/home/user/d", "parents": True, "user": "user"}
    assert d.is_dir and (d.uid, d.gid) == (1000, 1000)
    sbx.files.make_dir("/d", parents=False)
    assert fake.body() == {"path": "/d", "parents": False}

    with pytest.raises(InvalidArgumentError, match="user"):
        sbx.files.write("/a", "x", user="")
    with pytest.raises(InvalidArgumentError, match="user"):
        sbx.files.make_dir("/a", user=0)  # type: ignore[arg-type]


def test_entries_parse_uid_gid_and_default_to_root(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", BASE + "/files/list", {"entries": [dict(ENTRY, uid=1000, gid=100), ENTRY]})
    fake.on("GET", BASE + "/files/stat", dict(ENTRY, uid=65534, gid=65534))
    owned, old = sbx.files.list("/a")
    assert (owned.uid, owned.gid) == (1000, 100)
    assert (old.uid, old.gid) == (0, 0)  # an older daemon sends neither
    assert (sbx.files.stat("/a/b").uid, sbx.files.stat("/a/b").gid) == (65534, 65534)
    assert EntryInfo.from_dict(ENTRY) == EntryInfo.from_dict(dict(ENTRY, uid=0, gid=0))


# ----------------------------------------------------------------------------- images


def test_images(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/images", {"images": [IMAGE]})
    events = [
        {"type": "progress", "stage": "download", "done": 1, "total": 10, "message": "pkg a"},
        {"type": "progress", "stage": "download", "done": 10, "total": 10, "message": "pkg z"},
        {"type": "progress", "stage": "pack", "done": 0, "total": None, "message": ""},
        {"type": "done", "image": IMAGE},
    ]
    fake.on("POST", "/v1/images/build", httpx.Response(200, stream=ndjson(*events, split=5)))
    fake.on("POST", "/v1/images/import", httpx.Response(200, stream=ndjson(*events[2:])))
    fake.on("DELETE", "/v1/images/base", {"removed": True})
    with Images(transport=fake.transport()) as images:
        assert images.list() == [ImageInfo.from_dict(IMAGE)]
        progress = []
        info = images.build("base", suite="bookworm", packages=["curl"], on_progress=progress.append)
        assert fake.body() == {"name": "base", "suite": "bookworm", "packages": ["curl"]}
        assert info.name == "base" and info.layers == ["sha256:l1"]
        assert [(p.stage, p.done, p.total) for p in progress] == [("download", 1, 10), ("download", 10, 10), ("pack", 0, None)]
        assert all(isinstance(p, ImageProgress) for p in progress)
        images.build()
        assert fake.body() == {"name": "base"}
        assert images.import_("alpine", "/tmp/alpine.tar").name == "base"
        assert fake.body() == {"name": "alpine", "path": "/tmp/alpine.tar"}
        assert images.remove("base") is True
        assert (fake.last.method, fake.last.url.path) == ("DELETE", "/v1/images/base")


def test_image_errors(fake: FakeDaemon) -> None:
    events = [{"type": "progress", "stage": "x", "done": 0, "total": 1}, {"type": "error", "error": {"code": "bad_request", "message": "no such suite"}}]
    fake.on("POST", "/v1/images/build", httpx.Response(200, stream=ndjson(*events)))
    fake.on("DELETE", "/v1/images/base", {"error": {"code": "conflict", "message": "in use by sb-1"}}, 409)
    fake.on("POST", "/v1/images/import", httpx.Response(200, stream=ndjson(events[0])))
    with Images(transport=fake.transport()) as images:
        with pytest.raises(InvalidArgumentError, match="no such suite"):
            images.build()
        with pytest.raises(ConflictError, match="in use"):
            images.remove("base")
        with pytest.raises(branchbox.SandboxError, match="without a done event"):
            images.import_("a", "/x.tar")


def test_images_module_functions(daemon: FakeDaemon) -> None:
    import branchbox.images as images_mod

    daemon.on("GET", "/v1/images", {"images": [IMAGE]})
    assert [i.name for i in branchbox.images.list()] == ["base"]
    assert images_mod.__all__ == ["list", "build", "import_", "remove"]


# ----------------------------------------------------------------------------- transport errors


def test_daemon_unreachable_message(tmp_path) -> None:
    sock = tmp_path / "missing.sock"
    with pytest.raises(DaemonUnavailableError) as ei:
        Sandbox.list(daemon="unix://%s" % sock)
    msg = str(ei.value)
    assert "branchbox daemon start" in msg and "BRANCHBOX_URL" in msg and str(sock) in msg
    assert ei.value.code == "connect"


def test_env_url_is_used(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRANCHBOX_URL", "unix://%s/env.sock" % tmp_path)
    with pytest.raises(DaemonUnavailableError, match="env.sock"):
        Sandbox.list()


def test_client_timeout_maps_to_branchbox_timeout(fake: FakeDaemon) -> None:
    fake.error = httpx.ReadTimeout("slow")
    with pytest.raises(branchbox.TimeoutError) as ei:
        Sandbox.list(transport=fake.transport())
    assert not isinstance(ei.value, builtins.TimeoutError)
    assert ei.value.code == "timeout"


def test_connection_lost(fake: FakeDaemon) -> None:
    fake.error = httpx.RemoteProtocolError("peer closed")
    with pytest.raises(DaemonUnavailableError, match="peer closed"):
        Sandbox.list(transport=fake.transport())


def test_non_json_error_body(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/sandboxes", httpx.Response(502, text="Bad Gateway"))
    with pytest.raises(branchbox.SandboxError) as ei:
        Sandbox.list(transport=fake.transport())
    assert ei.value.status_code == 502 and "Bad Gateway" in str(ei.value)


def test_invalid_json_answer(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/sandboxes", httpx.Response(200, text="<html>"))
    with pytest.raises(branchbox.SandboxError, match="invalid JSON"):
        Sandbox.list(transport=fake.transport())


def test_ids_are_url_quoted(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/sandboxes/a%2Fb", SANDBOX)
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(200, json=SANDBOX)

    Sandbox.connect("a/b", transport=httpx.MockTransport(handler))
    assert seen == [b"/v1/sandboxes/a%2Fb"]


def test_json_bodies_are_json(fake: FakeDaemon) -> None:
    sbx = Sandbox.create(transport=fake.transport())
    fake.on("POST", BASE + "/commands", RESULT)
    sbx.commands.run("echo")
    assert json.loads(fake.last.content) == {"cmd": "echo", "timeout": 60}


def test_sandboxes_share_one_http_client_per_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    from branchbox import sandbox_sync
    from branchbox._transport import ConnectionConfig

    shared = sandbox_sync._SharedClients()
    monkeypatch.setattr(sandbox_sync, "_SHARED", shared)
    a = sandbox_sync._HTTP(ConnectionConfig("unix:///tmp/bb-test-a.sock", None, 30))
    b = sandbox_sync._HTTP(ConnectionConfig("unix:///tmp/bb-test-a.sock", None, 30))
    other = sandbox_sync._HTTP(ConnectionConfig("unix:///tmp/bb-test-b.sock", None, 30))
    assert a.client is b.client, "same daemon, token and timeout: one client"
    assert other.client is not a.client
    a.close()
    assert not b.client.is_closed, "closing one sandbox leaves the shared client to the others"
    shared.close_all()
    assert b.client.is_closed and other.client.is_closed, "closed at exit"
    d = sandbox_sync._HTTP(ConnectionConfig("unix:///tmp/bb-test-a.sock", None, 30))
    assert not d.client.is_closed, "a new one after that"
    # A forked child never uses its parent's connections.
    monkeypatch.setattr(sandbox_sync.os, "getpid", lambda: shared.pid + 1)
    c = sandbox_sync._HTTP(ConnectionConfig("unix:///tmp/bb-test-a.sock", None, 30))
    assert c.client is not d.client


def test_a_custom_transport_gets_its_own_client(fake: FakeDaemon) -> None:
    s1 = Sandbox.create(transport=fake.transport())
    s2 = Sandbox.create(transport=fake.transport())
    assert s1._http.client is not s2._http.client
    s1.close()
    assert s1._http.client.is_closed and not s2._http.client.is_closed
    s2.close()
