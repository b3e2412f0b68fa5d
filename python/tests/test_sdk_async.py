"""The async SDK mirrors the sync one (same requests, same parsing)."""

from __future__ import annotations

import inspect
import io

import httpx
import pytest

import branchbox
from branchbox import (
    AsyncCommandHandle,
    AsyncImages,
    AsyncSandbox,
    CommandResult,
    ConflictError,
    DaemonUnavailableError,
    Execution,
    Images,
    NotFoundError,
    PathEscapeError,
    Sandbox,
    ShellResult,
)
from branchbox import sandbox_async, sandbox_sync
from conftest import BASE, ENTRY, IMAGE, RESULT, SANDBOX, SID, Chunks, FakeDaemon, ndjson


@pytest.fixture
async def sbx(fake: FakeDaemon) -> AsyncSandbox:
    s = await AsyncSandbox.create(transport=fake.transport())
    yield s
    await s.close()


async def test_create_connect_list(fake: FakeDaemon) -> None:
    s = await AsyncSandbox.create("img", memory_mb=64, env={"A": "1"}, token="t", transport=fake.transport())
    assert s.id == SID and repr(s) == "AsyncSandbox(id=%r)" % SID
    assert fake.body() == {"image": "img", "memory_mb": 64, "env": {"A": "1"}, "timeout": 300, "network": "none"}
    assert fake.last.headers["authorization"] == "Bearer t"
    c = await AsyncSandbox.connect(SID, transport=fake.transport())
    assert c.id == SID
    with pytest.raises(NotFoundError):
        await AsyncSandbox.connect("sb-nope", transport=fake.transport())
    fake.on("GET", "/v1/sandboxes", {"sandboxes": [SANDBOX]})
    infos = await AsyncSandbox.list(metadata={"k": "v"}, transport=fake.transport())
    assert [i.id for i in infos] == [SID] and dict(fake.last.url.params) == {"metadata.k": "v"}


async def test_lifecycle(sbx: AsyncSandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/timeout", SANDBOX)
    assert (await sbx.info()).memory_mb == 512
    await sbx.set_timeout(5)
    assert fake.body() == {"timeout": 5}
    assert await sbx.is_running() is True
    assert await sbx.kill() is True
    fake.on("DELETE", BASE, {"error": {"code": "not_found", "message": "x"}}, 404)
    fake.on("GET", BASE, {"error": {"code": "not_found", "message": "x"}}, 404)
    assert await sbx.kill() is False
    assert await sbx.is_running() is False


async def test_async_context_manager(fake: FakeDaemon) -> None:
    async with await AsyncSandbox.create(transport=fake.transport()) as s:
        assert s.id == SID
    assert (fake.last.method, fake.last.url.path) == ("DELETE", BASE)


async def test_commands(sbx: AsyncSandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands", RESULT)
    res = await sbx.commands.run(["echo", "hi"], stdin=b"x", env={"A": "1"})
    assert fake.body() == {"args": ["echo", "hi"], "env": {"A": "1"}, "timeout": 60, "stdin_b64": "eA=="}
    assert isinstance(res, CommandResult) and res.stdout == "hi\n"

    fake.on("POST", BASE + "/commands", {"pid": 8}, 201)
    fake.on("POST", BASE + "/commands/8/wait", dict(RESULT, pid=8))
    fake.on("POST", BASE + "/commands/8/kill", {"killed": True})
    fake.on("GET", BASE + "/commands", {"processes": [{"pid": 8, "cmd": "sleep", "running": True}]})
    h = await sbx.commands.run("sleep 1", background=True)
    assert isinstance(h, AsyncCommandHandle) and h.pid == 8
    assert (await h.wait(timeout=2)).pid == 8 and fake.body() == {"timeout": 2}
    assert await h.kill(signal=2) is True and fake.body() == {"signal": 2}
    assert [p.pid for p in await sbx.commands.list()] == [8]
    assert (await sbx.commands.wait(8)).pid == 8 and fake.body() == {}
    assert await sbx.commands.kill(8) is True


async def test_stream_with_sync_and_async_callbacks(sbx: AsyncSandbox, fake: FakeDaemon) -> None:
    events = [
        {"type": "start", "pid": 7},
        {"type": "stdout", "data": "one\n"},
        {"type": "stderr", "data": "e\n"},
        {"type": "stdout", "data": "two\n"},
        {"type": "exit", "exit_code": 4, "signal": None, "timed_out": False},
    ]
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events, split=3)))
    out, err = [], []

    async def on_out(chunk: str) -> None:
        out.append(chunk)

    res = await sbx.commands.run("x", on_stdout=on_out, on_stderr=err.append)
    assert out == ["one\n", "two\n"] and err == ["e\n"]
    assert res.exit_code == 4 and res.pid == 7 and res.stdout == "one\ntwo\n"


async def test_stream_error_event(sbx: AsyncSandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson({"type": "error", "error": {"code": "conflict", "message": "dead"}})))
    with pytest.raises(ConflictError):
        await sbx.commands.run("x", on_stdout=print)


async def test_code_and_sessions(sbx: AsyncSandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/code", {"stdout": "", "stderr": "", "result": "2", "error": None})
    ex = await sbx.run_code("1+1")
    assert isinstance(ex, Execution) and ex.text == "2"
    assert fake.body() == {"code": "1+1", "language": "python", "timeout": 60}

    fake.on("POST", BASE + "/sessions", {"id": "ss-2", "kind": "shell", "pid": 3}, 201)
    fake.on("POST", BASE + "/sessions/ss-2/run", {"stdout": "", "stderr": "", "exit_code": 1, "timed_out": False})
    fake.on("DELETE", BASE + "/sessions/ss-2", {"killed": True})
    fake.on("GET", BASE + "/sessions", {"sessions": [{"id": "ss-2", "kind": "shell"}]})
    async with await sbx.sessions.create("shell", env={"X": "y"}) as sess:
        assert fake.body() == {"kind": "shell", "cwd": None, "env": {"X": "y"}}
        r = await sess.run("false", timeout=3)
        assert isinstance(r, ShellResult) and r.exit_code == 1
        assert fake.body() == {"code": "false", "timeout": 3}
        assert [s.id for s in await sbx.sessions.list()] == ["ss-2"]
    assert (fake.last.method, fake.last.url.path) == ("DELETE", BASE + "/sessions/ss-2")


async def test_files(sbx: AsyncSandbox, fake: FakeDaemon, tmp_path) -> None:
    fake.on("GET", BASE + "/files", httpx.Response(200, stream=Chunks([b"ab", b"cd"])))
    fake.on("PUT", BASE + "/files", ENTRY)
    fake.on("GET", BASE + "/files/list", {"entries": [ENTRY]})
    fake.on("GET", BASE + "/files/stat", ENTRY)
    fake.on("POST", BASE + "/files/mkdir", ENTRY)
    fake.on("POST", BASE + "/files/rename", ENTRY)
    fake.on("DELETE", BASE + "/files", {"removed": True})

    assert await sbx.files.read("/x") == "abcd"
    assert await sbx.files.read("/x", format="bytes") == b"abcd"
    stream = await sbx.files.read("/x", format="stream")
    async with stream:
        assert [c async for c in stream] == [b"ab", b"cd"]

    await sbx.files.write("/x", "text", mode=0o600)
    assert fake.last.content == b"text" and fake.last.url.params["mode"] == "0600"
    await sbx.files.write("/x", io.BytesIO(b"z" * 100))
    assert fake.last.content == b"z" * 100

    async def agen():
        yield b"a"
        yield "b"

    await sbx.files.write("/x", agen())
    assert fake.last.content == b"ab"

    src = tmp_path / "up"
    src.write_bytes(b"upload-me")
    await sbx.files.upload(src, "/up")
    assert fake.last.content == b"upload-me" and fake.last.headers["content-length"] == "9"
    dst = tmp_path / "down"
    assert await sbx.files.download("/x", dst) == str(dst)
    assert dst.read_bytes() == b"abcd"

    assert [e.name for e in await sbx.files.list("/a", depth=3)] == ["b"]
    assert fake.last.url.params["depth"] == "3"
    assert (await sbx.files.stat("/a/b")).type == "file"
    assert await sbx.files.exists("/a/b") is True
    await sbx.files.make_dir("/d", parents=False)
    assert fake.body() == {"path": "/d", "parents": False}
    await sbx.files.rename("/a", "/b")
    assert fake.body() == {"from": "/a", "to": "/b"}
    assert await sbx.files.remove("/b", recursive=True) is True
    assert fake.last.url.params["recursive"] == "true"

    fake.on("GET", BASE + "/files/stat", {"error": {"code": "not_found", "message": "x"}}, 404)
    assert await sbx.files.exists("/nope") is False
    fake.on("GET", BASE + "/files", {"error": {"code": "path_escape", "message": "x"}}, 400)
    with pytest.raises(PathEscapeError):
        await sbx.files.read("/../x")


async def test_user_only_when_given(sbx: AsyncSandbox, fake: FakeDaemon, tmp_path) -> None:
    fake.on("POST", BASE + "/commands", RESULT)
    await sbx.commands.run("id", user="user")
    assert fake.body() == {"cmd": "id", "timeout": 60, "user": "user"}
    await sbx.commands.run("id")
    assert "user" not in fake.body()

    fake.on("POST", BASE + "/commands", {"pid": 8}, 201)
    h = await sbx.commands.run("sleep 1", background=True, user="user")
    assert h.pid == 8 and fake.body() == {"cmd": "sleep 1", "timeout": 60, "user": "user", "background": True}

    events = [{"type": "exit", "exit_code": 0, "signal": None, "timed_out": False}]
    fake.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events)))
    await sbx.commands.run("id", on_stdout=print, user="user")
    assert fake.last.url.path == BASE + "/commands/stream"
    assert fake.body() == {"cmd": "id", "timeout": 60, "user": "user"}

    fake.on("PUT", BASE + "/files", dict(ENTRY, uid=1000, gid=1000))
    fake.on("POST", BASE + "/files/mkdir", dict(ENTRY, type="dir", uid=1000, gid=1000))
    info = await sbx.files.write("/home/user/x", b"x", user="user")
    assert dict(fake.last.url.params) == {"path": "/home/user/x", "user": "user"}
    assert (info.uid, info.gid) == (1000, 1000)
    await sbx.files.write("/x", b"x")
    assert dict(fake.last.url.params) == {"path": "/x"}
    src = tmp_path / "up"
    src.write_bytes(b"u")
    await sbx.files.upload(src, "/home/user/up", mode=0o644, user="user")
    assert dict(fake.last.url.params) == {"path": "/home/user/up", "mode": "0644", "user": "user"}
    d = await sbx.files.make_dir("/home/user/d", user="user")
    assert fake.body() == {"path": "/home/user/d", "parents": True, "user": "user"} and d.uid == 1000
    await sbx.files.make_dir("/d")
    assert fake.body() == {"path": "/d", "parents": True}

    fake.on("GET", BASE + "/files/list", {"entries": [dict(ENTRY, uid=1000, gid=100), ENTRY]})
    owned, old = await sbx.files.list("/a")
    assert (owned.uid, owned.gid, old.uid, old.gid) == (1000, 100, 0, 0)

    with pytest.raises(branchbox.InvalidArgumentError, match="user"):
        await sbx.commands.run("x", user="")


async def test_images(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/images", {"images": [IMAGE]})
    events = [{"type": "progress", "stage": "s", "done": 1, "total": 2}, {"type": "done", "image": IMAGE}]
    fake.on("POST", "/v1/images/build", httpx.Response(200, stream=ndjson(*events, split=4)))
    fake.on("POST", "/v1/images/import", httpx.Response(200, stream=ndjson(*events)))
    fake.on("DELETE", "/v1/images/base", {"removed": True})
    seen = []

    async def on_progress(p):
        seen.append(p.stage)

    async with AsyncImages(transport=fake.transport()) as images:
        assert [i.name for i in await images.list()] == ["base"]
        assert (await images.build("base", packages=["vim"], on_progress=on_progress)).name == "base"
        assert fake.body() == {"name": "base", "packages": ["vim"]}
        assert (await images.import_("a", "/a.tar", on_progress=seen.append)).name == "base"
        assert await images.remove("base") is True
    assert seen[0] == "s" and len(seen) == 2


async def test_unreachable(tmp_path) -> None:
    with pytest.raises(DaemonUnavailableError, match="branchbox daemon start"):
        await AsyncSandbox.list(daemon="unix://%s/nope.sock" % tmp_path)


async def test_timeout_mapping(fake: FakeDaemon) -> None:
    fake.error = httpx.ConnectTimeout("slow")
    with pytest.raises(branchbox.TimeoutError):
        await AsyncSandbox.list(transport=fake.transport())


# ----------------------------------------------------------------------------- surface parity

PAIRS = [
    (Sandbox, AsyncSandbox),
    (sandbox_sync.Commands, sandbox_async.AsyncCommands),
    (sandbox_sync.CommandHandle, sandbox_async.AsyncCommandHandle),
    (sandbox_sync.Files, sandbox_async.AsyncFiles),
    (sandbox_sync.Sessions, sandbox_async.AsyncSessions),
    (sandbox_sync.Session, sandbox_async.AsyncSession),
    (Images, AsyncImages),
    (sandbox_sync.Snapshots, sandbox_async.AsyncSnapshots),
]


def _public(cls):
    return {
        n: getattr(cls, n)
        for n in dir(cls)
        if not n.startswith("_") and callable(getattr(cls, n)) and n not in ("close", "aclose")
    }


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_sync_async_surfaces_match(sync_cls, async_cls) -> None:
    s, a = _public(sync_cls), _public(async_cls)
    assert set(s) == set(a)
    for name in s:
        sp = list(inspect.signature(s[name]).parameters)
        ap = list(inspect.signature(a[name]).parameters)
        assert sp == ap, name
        assert inspect.iscoroutinefunction(a[name]), name
