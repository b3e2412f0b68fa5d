"""Snapshot API (checkpoint / rollback / fork / snapshots / evaluate / gc) in the sync and
async SDKs, against the contract in docs/design/snapshot-api.md."""

from __future__ import annotations

import inspect

import httpx
import pytest

from branchbox import (
    AsyncSandbox,
    AsyncSnapshots,
    CommandResult,
    ConflictError,
    DaemonUnavailableError,
    ForkResult,
    GcResult,
    InvalidArgumentError,
    NotFoundError,
    RollbackResult,
    Sandbox,
    SandboxInfo,
    SnapshotInfo,
    SnapshotSession,
    Snapshots,
    _core,
)
from conftest import BASE, RESULT, SANDBOX, SID, FakeDaemon

SN1 = "sn-0123456789ab"
SN2 = "sn-0123456789cd"
SN3 = "sn-0123456789ef"
SNAP = {
    "id": SN1,
    "sandbox_id": SID,
    "parent": None,
    "children": [SN2],
    "created_at": 1732250000.5,
    "label": "clean",
    "size_bytes": 4096,
    "depth": 1,
    "lightweight": False,
    "sessions": [
        {"id": "ss-01234567", "kind": "python", "default": True, "template": True},
        {"id": "ss-89abcdef", "kind": "shell", "default": False, "template": False},
    ],
}
SNAP2 = dict(SNAP, id=SN2, parent=SN1, children=[], label=None, size_bytes=0, depth=1, lightweight=True, sessions=[])
CHECKPOINT = dict(SNAP, took_ms=12.5)
ROLLBACK = {"snapshot": SN1, "sessions_restarted": True, "killed": [41, 42], "took_ms": 3.25}
CHILD1 = dict(SANDBOX, id="sb-child000001")
CHILD2 = dict(SANDBOX, id="sb-child000002")
FORK = {"snapshot": SN1, "sandboxes": [CHILD1, CHILD2], "sessions_restarted": False, "took_ms": 8.0}
GC = {"deleted": [SN2, SN3], "freed_bytes": 8192}


def routes(fake: FakeDaemon) -> FakeDaemon:
    fake.on("POST", BASE + "/checkpoint", CHECKPOINT, 201)
    fake.on("POST", BASE + "/rollback", ROLLBACK)
    fake.on("POST", BASE + "/fork", FORK, 201)
    fake.on("POST", BASE + "/evaluate", RESULT)
    fake.on("GET", BASE + "/snapshots", {"snapshots": [SNAP, SNAP2]})
    fake.on("GET", "/v1/snapshots", {"snapshots": [SNAP, SNAP2]})
    fake.on("GET", "/v1/snapshots/" + SN1, SNAP)
    fake.on("DELETE", "/v1/snapshots/" + SN1, httpx.Response(204))
    fake.on("POST", "/v1/snapshots/gc", GC)
    return fake


@pytest.fixture
def sbx(fake: FakeDaemon) -> Sandbox:
    routes(fake)
    s = Sandbox.create(transport=fake.transport())
    yield s
    s.close()


@pytest.fixture
async def asbx(fake: FakeDaemon) -> AsyncSandbox:
    routes(fake)
    s = await AsyncSandbox.create(transport=fake.transport())
    yield s
    await s.close()



# ----------------------------------------------------------------------------- models


def test_snapshot_info_parsing() -> None:
    info = SnapshotInfo.from_dict(CHECKPOINT)
    assert info.id == SN1 and info.sandbox_id == SID and info.parent is None and info.children == [SN2]
    assert info.created_at == 1732250000.5 and info.label == "clean"
    assert info.size_bytes == 4096 and info.depth == 1 and info.lightweight is False
    assert info.took_ms == 12.5
    assert info.sessions == [
        SnapshotSession(id="ss-01234567", kind="python", default=True, template=True),
        SnapshotSession(id="ss-89abcdef", kind="shell", default=False, template=False),
    ]
    assert info.sessions[0].raw == SNAP["sessions"][0]
    assert info.raw == CHECKPOINT and "raw" not in repr(info)
    assert SnapshotInfo.from_dict(SNAP).took_ms is None


def test_models_tolerate_missing_and_unknown_fields() -> None:
    info = SnapshotInfo.from_dict({"id": SN1, "future": 1, "children": None, "sessions": None})
    assert info.children == [] and info.sessions == [] and info.size_bytes == 0 and info.label is None
    assert SnapshotInfo.from_dict(None).id == ""
    r = RollbackResult.from_dict({"snapshot": SN1})
    assert r.killed == [] and r.sessions_restarted is False and r.took_ms is None
    assert GcResult.from_dict({}) == GcResult(deleted=[], freed_bytes=0)


def test_fork_result_parsing() -> None:
    r = ForkResult.from_dict(FORK)
    assert r.snapshot == SN1 and r.took_ms == 8.0 and r.sessions_restarted is False
    assert all(isinstance(s, SandboxInfo) for s in r.sandboxes)
    assert [s.id for s in r.sandboxes] == ["sb-child000001", "sb-child000002"]
    assert r.inflight_handed == 0, "inflight_handed defaults to 0 (no replay_inflight, or an older daemon)"
    r = ForkResult.from_dict(dict(FORK, inflight_handed=3))
    assert r.inflight_handed == 3 and r.raw["inflight_handed"] == 3
    assert r.processes_not_restored == [], "none listed: every process came back (or none was kept)"
    why = "sandbox sb-child000001: 42 (python3 -m http.server): restore failed"
    assert ForkResult.from_dict(dict(FORK, processes_not_restored=[why])).processes_not_restored == [why]


# ----------------------------------------------------------------------------- _core calls


def test_core_call_shapes() -> None:
    cases = [
        (_core.checkpoint(SID), "POST", BASE + "/checkpoint", {}),
        (_core.checkpoint(SID, "x"), "POST", BASE + "/checkpoint", {"label": "x"}),
        (_core.rollback(SID, SN1), "POST", BASE + "/rollback", {"snapshot": SN1}),
        (_core.rollback(SID, SN1, False), "POST", BASE + "/rollback", {"snapshot": SN1, "lazy_pages": False}),
        (_core.rollback(SID, SN1, True), "POST", BASE + "/rollback", {"snapshot": SN1, "lazy_pages": True}),
        (_core.fork(SID), "POST", BASE + "/fork", {"count": 1}),
        (_core.fork(SID, 3, SN1, 0), "POST", BASE + "/fork", {"count": 3, "snapshot": SN1, "timeout": 0}),
        (_core.fork(SID, 2, replay_inflight=True), "POST", BASE + "/fork", {"count": 2, "replay_inflight": True}),
        (_core.fork(SID, 3, SN1, replay_inflight=False), "POST", BASE + "/fork", {"count": 3, "snapshot": SN1}),
        (_core.fork(SID, 2, processes="all"), "POST", BASE + "/fork", {"count": 2, "processes": "all"}),
        (_core.fork(SID, 1, processes="keepable"), "POST", BASE + "/fork", {"count": 1, "processes": "keepable"}),
        (_core.fork(SID, 1, SN1, processes="sessions"), "POST", BASE + "/fork", {"count": 1, "snapshot": SN1, "processes": "sessions"}),
        (_core.checkpoint(SID, processes="keepable"), "POST", BASE + "/checkpoint", {"processes": "keepable"}),
        (_core.evaluate(SID, {"cmd": "true"}), "POST", BASE + "/evaluate", {"cmd": "true"}),
        (_core.sandbox_snapshots(SID), "GET", BASE + "/snapshots", None),
        (_core.list_snapshots(), "GET", "/v1/snapshots", None),
        (_core.get_snapshot(SN1), "GET", "/v1/snapshots/" + SN1, None),
        (_core.delete_snapshot(SN1), "DELETE", "/v1/snapshots/" + SN1, None),
        (_core.gc_snapshots([]), "POST", "/v1/snapshots/gc", {"keep": []}),
        (_core.gc_snapshots([SN1], SID), "POST", "/v1/snapshots/gc", {"keep": [SN1], "sandbox": SID}),
    ]
    for call, method, path, body in cases:
        assert (call.method, call.path, call.json) == (method, path, body)
    assert _core.delete_snapshot(SN1).params == {"subtree": "false"}
    assert _core.delete_snapshot(SN1, subtree=True).params == {"subtree": "true"}
    assert _core.get_snapshot("sn-a/b").path == "/v1/snapshots/sn-a%2Fb"
    assert _core.evaluate(SID, {"cmd": "x", "timeout": 5}).op_timeout == 5


def test_core_accepts_snapshot_info_and_sandbox_objects() -> None:
    info = SnapshotInfo.from_dict(SNAP)
    assert _core.rollback(SID, info).json == {"snapshot": SN1}
    assert _core.fork(SID, snapshot=info).json == {"count": 1, "snapshot": SN1}
    assert _core.get_snapshot(info).path == "/v1/snapshots/" + SN1
    assert _core.gc_snapshots(SN1).json == {"keep": [SN1]}  # a single id is a one-item list
    assert _core.gc_snapshots((info, SN2), SandboxInfo.from_dict(SANDBOX)).json == {"keep": [SN1, SN2], "sandbox": SID}


@pytest.mark.parametrize(
    "build",
    [
        lambda: _core.fork(SID, 0),
        lambda: _core.fork(SID, -1),
        lambda: _core.fork(SID, 65),
        lambda: _core.fork(SID, True),
        lambda: _core.fork(SID, 2.0),
        lambda: _core.fork(SID, "2"),
        lambda: _core.fork(SID, 1, timeout=-1),
        lambda: _core.fork(SID, 1, timeout="10"),
        lambda: _core.fork(SID, 1, snapshot=""),
        lambda: _core.fork("", 1),
        lambda: _core.rollback(SID, ""),
        lambda: _core.rollback(SID, None),
        lambda: _core.rollback(SID, SN1, lazy_pages="no"),
        lambda: _core.rollback(SID, SN1, lazy_pages=0),
        lambda: _core.rollback(SID, 12),
        lambda: _core.checkpoint(SID, 5),
        lambda: _core.checkpoint(SID, processes="some"),
        lambda: _core.fork(SID, 1, processes="some"),
        lambda: _core.fork(SID, 1, snapshot=SN1, processes="all"),
        lambda: _core.get_snapshot(""),
        lambda: _core.delete_snapshot("  "),
        lambda: _core.gc_snapshots(None),
        lambda: _core.gc_snapshots(7),
        lambda: _core.gc_snapshots([SN1, 7]),
        lambda: _core.gc_snapshots([], sandbox=""),
        lambda: _core.gc_snapshots([], sandbox=3),
    ],
)
def test_core_bad_input(build) -> None:
    with pytest.raises(InvalidArgumentError):
        build()


# ----------------------------------------------------------------------------- sync


def test_checkpoint(sbx: Sandbox, fake: FakeDaemon) -> None:
    assert sbx.checkpoint() == SN1
    assert fake.shape() == ("POST", BASE + "/checkpoint", {})
    assert sbx.checkpoint(label="before tests") == SN1
    assert fake.body() == {"label": "before tests"}


def test_checkpoint_info_is_the_whole_answer(sbx: Sandbox, fake: FakeDaemon) -> None:
    info = sbx.checkpoint_info("l")
    assert fake.shape() == ("POST", BASE + "/checkpoint", {"label": "l"})
    assert isinstance(info, SnapshotInfo) and info.id == SN1 and info.took_ms == 12.5


def test_rollback(sbx: Sandbox, fake: FakeDaemon) -> None:
    r = sbx.rollback(SN1)
    assert fake.shape() == ("POST", BASE + "/rollback", {"snapshot": SN1})
    assert isinstance(r, RollbackResult)
    assert r == RollbackResult(snapshot=SN1, sessions_restarted=True, killed=[41, 42], took_ms=3.25)
    sbx.rollback(SnapshotInfo.from_dict(SNAP2))
    assert fake.body() == {"snapshot": SN2}


def test_fork_children_share_connection_config(fake: FakeDaemon) -> None:
    routes(fake)
    sbx = Sandbox.create(token="tok", transport=fake.transport())
    children = sbx.fork()
    assert fake.shape() == ("POST", BASE + "/fork", {"count": 1})
    assert [c.id for c in children] == ["sb-child000001", "sb-child000002"]
    assert all(isinstance(c, Sandbox) for c in children)
    assert children[0]._info.id == "sb-child000001"  # the SandboxInfo from the answer, no extra GET
    for c in children:
        assert c._http is not sbx._http and c._http.config is sbx._http.config
    # a child talks to the daemon on its own connection with the parent's token
    fake.on("POST", "/v1/sandboxes/sb-child000001/commands", RESULT)
    sbx.close()  # closing the parent does not close the children
    children[0].commands.run("true")
    assert fake.last.url.path == "/v1/sandboxes/sb-child000001/commands"
    assert fake.last.headers["authorization"] == "Bearer tok"
    for c in children:
        c.close()


def test_fork_info_returns_the_children_and_the_answer(sbx: Sandbox, fake: FakeDaemon) -> None:
    children, result = sbx.fork_info(2, snapshot=SN1, timeout=60, isolated=True)
    assert fake.shape() == ("POST", BASE + "/fork", {"count": 2, "snapshot": SN1, "timeout": 60, "isolated": True})
    assert isinstance(result, ForkResult) and result.took_ms == 8.0 and result.snapshot == SN1
    assert [c.id for c in children] == [s.id for s in result.sandboxes] == ["sb-child000001", "sb-child000002"]
    assert all(isinstance(c, Sandbox) and c._http.config is sbx._http.config for c in children)
    for c in children:
        c.close()


def test_fork_arguments(sbx: Sandbox, fake: FakeDaemon) -> None:
    sbx.fork(4, snapshot=SN1, timeout=30)
    assert fake.body() == {"count": 4, "snapshot": SN1, "timeout": 30}
    sbx.fork(n=2, snapshot=SnapshotInfo.from_dict(SNAP))
    assert fake.body() == {"count": 2, "snapshot": SN1}


@pytest.mark.parametrize("n", [0, -3, 65, True, 1.5, "2"])
def test_fork_bad_n_sends_nothing(sbx: Sandbox, fake: FakeDaemon, n) -> None:
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError, match="n"):
        sbx.fork(n)
    assert len(fake.requests) == before


def test_rollback_and_checkpoint_bad_input_send_nothing(sbx: Sandbox, fake: FakeDaemon) -> None:
    before = len(fake.requests)
    for bad in (lambda: sbx.rollback(""), lambda: sbx.rollback(None), lambda: sbx.checkpoint(label=3),
                lambda: sbx.fork(1, timeout=-5), lambda: sbx.evaluate(""), lambda: sbx.evaluate([])):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert len(fake.requests) == before


def test_snapshots_of_sandbox(sbx: Sandbox, fake: FakeDaemon) -> None:
    snaps = sbx.snapshots()
    assert fake.shape() == ("GET", BASE + "/snapshots", None)
    assert [s.id for s in snaps] == [SN1, SN2]
    assert snaps[1].parent == SN1 and snaps[1].lightweight is True


def test_evaluate_reuses_command_body(sbx: Sandbox, fake: FakeDaemon) -> None:
    res = sbx.evaluate("pytest -q")
    assert fake.shape() == ("POST", BASE + "/evaluate", {"cmd": "pytest -q"})
    assert isinstance(res, CommandResult) and res.stdout == "hi\n" and res.ok
    sbx.evaluate(["python", "-c", "print(1)"], env={"A": 1}, cwd="/src", timeout=30)
    assert fake.body() == {"args": ["python", "-c", "print(1)"], "env": {"A": "1"}, "cwd": "/src", "timeout": 30}
    assert fake.body() == _core.command_body(["python", "-c", "print(1)"], cwd="/src", env={"A": 1}, timeout=30)


def test_errors_map(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/rollback", {"error": {"code": "not_found", "message": "no snapshot sn-x"}}, 404)
    with pytest.raises(NotFoundError, match="no snapshot sn-x"):
        sbx.rollback("sn-x")
    fake.on("POST", BASE + "/checkpoint", {"error": {"code": "conflict", "message": "sandbox is dead"}}, 409)
    with pytest.raises(ConflictError):
        sbx.checkpoint()
    fake.on("POST", BASE + "/fork", {"error": {"code": "unavailable", "message": "no capacity"}}, 503)
    with pytest.raises(DaemonUnavailableError):
        sbx.fork(2)
    fake.on("POST", BASE + "/fork", {"error": {"code": "bad_request", "message": "count"}}, 400)
    with pytest.raises(InvalidArgumentError):
        sbx.fork(2)


def test_snapshots_client(fake: FakeDaemon) -> None:
    routes(fake)
    with Snapshots(transport=fake.transport()) as snaps:
        assert [s.id for s in snaps.list()] == [SN1, SN2]
        assert fake.shape() == ("GET", "/v1/snapshots", None)
        assert [s.id for s in snaps.list(sandbox=SID)] == [SN1, SN2]
        assert fake.last.url.path == BASE + "/snapshots"
        info = snaps.get(SN1)
        assert fake.shape() == ("GET", "/v1/snapshots/" + SN1, None) and info == SnapshotInfo.from_dict(SNAP)
        assert snaps.delete(SN1) is True  # 204, no body
        assert (fake.last.method, fake.last.url.path, dict(fake.last.url.params)) == (
            "DELETE", "/v1/snapshots/" + SN1, {"subtree": "false"})
        fake.on("DELETE", "/v1/snapshots/" + SN1, {"removed": True})  # a body is fine too
        assert snaps.delete(info, subtree=True) is True
        assert fake.last.url.params["subtree"] == "true"
        r = snaps.gc([SN1], sandbox=SID)
        assert fake.shape() == ("POST", "/v1/snapshots/gc", {"keep": [SN1], "sandbox": SID})
        assert r == GcResult(deleted=[SN2, SN3], freed_bytes=8192)
        snaps.gc([])
        assert fake.body() == {"keep": []}
        fake.on("GET", "/v1/snapshots/sn-nope", {"error": {"code": "not_found", "message": "x"}}, 404)
        with pytest.raises(NotFoundError):
            snaps.get("sn-nope")


def test_snapshots_client_accepts_a_sandbox(sbx: Sandbox, fake: FakeDaemon) -> None:
    with Snapshots(transport=fake.transport()) as snaps:
        snaps.list(sandbox=sbx)
        assert fake.last.url.path == BASE + "/snapshots"
        snaps.gc([SN1], sandbox=sbx)
        assert fake.body() == {"keep": [SN1], "sandbox": SID}


# ----------------------------------------------------------------------------- async


async def test_async_checkpoint_rollback_evaluate(asbx: AsyncSandbox, fake: FakeDaemon) -> None:
    assert await asbx.checkpoint(label="l") == SN1
    assert fake.shape() == ("POST", BASE + "/checkpoint", {"label": "l"})
    r = await asbx.rollback(SN1)
    assert fake.shape() == ("POST", BASE + "/rollback", {"snapshot": SN1})
    assert r.killed == [41, 42] and r.sessions_restarted is True
    res = await asbx.evaluate("make test", cwd="/w", timeout=9)
    assert fake.shape() == ("POST", BASE + "/evaluate", {"cmd": "make test", "cwd": "/w", "timeout": 9})
    assert isinstance(res, CommandResult) and res.exit_code == 0
    assert [s.id for s in await asbx.snapshots()] == [SN1, SN2]
    assert fake.last.url.path == BASE + "/snapshots"


async def test_async_fork(asbx: AsyncSandbox, fake: FakeDaemon) -> None:
    children = await asbx.fork(2, snapshot=SN1, timeout=60)
    assert fake.shape() == ("POST", BASE + "/fork", {"count": 2, "snapshot": SN1, "timeout": 60})
    assert [c.id for c in children] == ["sb-child000001", "sb-child000002"]
    assert all(isinstance(c, AsyncSandbox) for c in children)
    assert all(c._http is not asbx._http and c._http.config is asbx._http.config for c in children)
    fake.on("GET", "/v1/sandboxes/sb-child000002", CHILD2)
    await asbx.close()
    assert (await children[1].info()).id == "sb-child000002"
    for c in children:
        await c.close()


async def test_async_checkpoint_info_and_fork_info(asbx: AsyncSandbox, fake: FakeDaemon) -> None:
    info = await asbx.checkpoint_info()
    assert fake.shape() == ("POST", BASE + "/checkpoint", {}) and info.took_ms == 12.5
    children, result = await asbx.fork_info(2, isolated=True)
    assert fake.shape() == ("POST", BASE + "/fork", {"count": 2, "isolated": True})
    assert result.took_ms == 8.0 and [c.id for c in children] == ["sb-child000001", "sb-child000002"]
    assert all(isinstance(c, AsyncSandbox) for c in children)
    for c in children:
        await c.close()


async def test_async_bad_input_sends_nothing(asbx: AsyncSandbox, fake: FakeDaemon) -> None:
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError):
        await asbx.fork(0)
    with pytest.raises(InvalidArgumentError):
        await asbx.fork(65)
    with pytest.raises(InvalidArgumentError):
        await asbx.rollback("")
    assert len(fake.requests) == before


async def test_async_snapshots_client(fake: FakeDaemon) -> None:
    routes(fake)
    async with AsyncSnapshots(transport=fake.transport()) as snaps:
        assert [s.id for s in await snaps.list()] == [SN1, SN2]
        assert fake.last.url.path == "/v1/snapshots"
        assert [s.id for s in await snaps.list(SID)] == [SN1, SN2]
        assert fake.last.url.path == BASE + "/snapshots"
        assert (await snaps.get(SN1)).label == "clean"
        assert await snaps.delete(SN1, subtree=True) is True
        assert fake.last.url.params["subtree"] == "true"
        r = await snaps.gc([SN1, SN2])
        assert fake.shape() == ("POST", "/v1/snapshots/gc", {"keep": [SN1, SN2]})
        assert r.freed_bytes == 8192
        with pytest.raises(InvalidArgumentError):
            await snaps.gc(None)


# ----------------------------------------------------------------------------- parity


def _public(cls):
    return {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)) and n != "close"}


SNAPSHOT_METHODS = ["checkpoint", "checkpoint_info", "rollback", "fork", "fork_info", "snapshots", "evaluate"]


@pytest.mark.parametrize("name", SNAPSHOT_METHODS)
def test_sandbox_snapshot_methods_mirror(name: str) -> None:
    s, a = getattr(Sandbox, name), getattr(AsyncSandbox, name)
    assert inspect.signature(s).parameters.keys() == inspect.signature(a).parameters.keys()
    assert [p.default for p in inspect.signature(s).parameters.values()] == [
        p.default for p in inspect.signature(a).parameters.values()
    ]
    assert inspect.iscoroutinefunction(a) and not inspect.iscoroutinefunction(s)


def test_sandbox_snapshot_signatures() -> None:
    params = inspect.signature(Sandbox.evaluate).parameters
    assert list(params) == ["self", "cmd", "env", "cwd", "timeout"]
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("env", "cwd", "timeout"))
    assert list(inspect.signature(Sandbox.fork).parameters) == [
        "self", "n", "snapshot", "timeout", "isolated", "network", "allow", "replay_inflight", "processes"
    ]
    assert inspect.signature(Sandbox.fork).parameters["n"].default == 1


def test_snapshots_clients_mirror() -> None:
    s, a = _public(Snapshots), _public(AsyncSnapshots)
    assert set(s) == set(a) == {"list", "get", "delete", "gc", "offload", "push", "pull", "list_remote", "delete_remote", "store_gc", "list_paused_remote"}
    for name in s:
        assert list(inspect.signature(s[name]).parameters) == list(inspect.signature(a[name]).parameters), name
        assert inspect.iscoroutinefunction(a[name]), name


# ----------------------------------------------------------------------------- durable snapshots


def test_remote_call_shapes() -> None:
    info = SnapshotInfo.from_dict(SNAP)
    cases = [
        (_core.push_snapshot(SN1), "POST", "/v1/snapshots/" + SN1 + "/push", None),
        (_core.push_snapshot(info), "POST", "/v1/snapshots/" + SN1 + "/push", None),
        (_core.pull_snapshot(SN1), "POST", "/v1/snapshots/" + SN1 + "/pull", None),
        (_core.list_remote_snapshots(), "GET", "/v1/remote/snapshots", None),
        (_core.delete_remote_snapshot(SN1), "DELETE", "/v1/remote/snapshots/" + SN1, None),
        (_core.store_gc(), "POST", "/v1/remote/gc", {}),
        (_core.store_gc(0), "POST", "/v1/remote/gc", {"grace_seconds": 0}),
        (_core.create_sandbox(None, snapshot=SN1), "POST", "/v1/sandboxes", {"snapshot": SN1, "timeout": 300}),
    ]
    for call, method, path, body in cases:
        assert (call.method, call.path, call.json) == (method, path, body)
    # Pushes and pulls move data: no read timeout.
    assert _core.push_snapshot(SN1).unbounded and _core.pull_snapshot(SN1).unbounded
    with pytest.raises(InvalidArgumentError):
        _core.store_gc(-1)
    with pytest.raises(InvalidArgumentError):
        _core.push_snapshot("")


def test_remote_results_parse(fake: FakeDaemon) -> None:
    push = {"snapshot": SN1, "durability": "durable", "already": False, "layers_pushed": 2, "images_pushed": 1,
            "uploaded_bytes": 1000, "read_bytes": 5000, "lost": [], "took_ms": 12.0}
    remote = {"snapshots": [{"id": SN1, "sandbox_id": SID, "parent": None, "label": "x", "created_at": 1.0,
                             "pushed_at": 2.0, "node": "a", "image": "base", "sessions": ["ss-1"], "bytes": 10,
                             "local": False}], "store": "file:///s", "metadata": "sqlite:///m"}
    fake.on("POST", "/v1/snapshots/" + SN1 + "/push", push)
    fake.on("GET", "/v1/remote/snapshots", remote)
    snaps = Snapshots(transport=fake.transport())
    r = snaps.push(SN1)
    assert r.durability == "durable" and r.layers_pushed == 2 and r.uploaded_bytes == 1000 and not r.already
    (one,) = snaps.list_remote()
    assert one.id == SN1 and one.node == "a" and one.sessions == ["ss-1"] and one.local is False
    assert SnapshotInfo.from_dict(SNAP).durability == "node-local"
    assert SnapshotInfo.from_dict(dict(SNAP, durability="durable")).durability == "durable"
