"""Volumes in the sync and async SDKs (``Volume`` / ``AsyncVolume``, ``vol.files``,
``Sandbox.create(volumes=...)``) against the contract of the volumes HTTP API."""

from __future__ import annotations

import inspect

import httpx
import pytest

from branchbox import (
    AsyncSandbox,
    AsyncVolume,
    ConflictError,
    EntryInfo,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    Sandbox,
    SandboxError,
    SandboxInfo,
    Volume,
    VolumeInfo,
    VolumeMount,
    VolumeSnapshotInfo,
    _core,
    sandbox_async,
    sandbox_sync,
)
from conftest import ENTRY, SANDBOX, SID, Chunks, FakeDaemon

VID = "vol-0123456789abcdef"
VID2 = "vol-fedcba9876543210"
VS1 = "vs-0123456789ab"
VS2 = "vs-0123456789cd"
VBASE = "/v1/volumes/" + VID
VOLUME = {
    "id": VID,
    "name": "ws",
    "access": "rwo",
    "quota_mb": 1024,
    "created_at": 1732250000.5,
    "size_bytes": 8192,
    "layers": 2,
    "snapshots": 1,
    "mounts": [{"sandbox": SID, "path": "/workspace", "read_only": False, "branch": True}],
    "version": 3,
    "durability": "node-local",
    "backlog_bytes": 4096,
    "source": None,
}
FORKED = dict(VOLUME, id=VID2, name="ws2", mounts=[], snapshots=0, source=VID)
SYNCED = dict(VOLUME, version=4, durability="durable", backlog_bytes=0)
VSNAP = {"id": VS1, "volume": VID, "created_at": 1732250001.0, "layers": 2, "label": "clean", "durable": True}
VSNAP2 = dict(VSNAP, id=VS2, label=None, layers=3, durable=False)
MOUNTED = dict(SANDBOX, volumes=[{"volume": VID, "path": "/workspace", "read_only": False, "branch": True}])


def routes(fake: FakeDaemon) -> FakeDaemon:
    fake.on("POST", "/v1/volumes", VOLUME)
    fake.on("GET", "/v1/volumes", {"volumes": [VOLUME, FORKED]})
    fake.on("GET", VBASE, VOLUME)
    fake.on("GET", "/v1/volumes/ws", VOLUME)
    fake.on("DELETE", VBASE, {"removed": True})
    fake.on("POST", VBASE + "/snapshots", VSNAP)
    fake.on("GET", VBASE + "/snapshots", {"snapshots": [VSNAP, VSNAP2]})
    fake.on("DELETE", VBASE + "/snapshots/" + VS1, {"removed": True})
    fake.on("POST", VBASE + "/restore", VOLUME)
    fake.on("POST", VBASE + "/fork", FORKED)
    fake.on("POST", VBASE + "/sync", SYNCED)
    fake.on("GET", "/v1/volumes/" + VID2, FORKED)
    return fake


@pytest.fixture
def vol(fake: FakeDaemon) -> Volume:
    routes(fake)
    v = Volume.create(transport=fake.transport())
    yield v
    v.close()


@pytest.fixture
async def avol(fake: FakeDaemon) -> AsyncVolume:
    routes(fake)
    v = await AsyncVolume.create(transport=fake.transport())
    yield v
    await v.close()



# ----------------------------------------------------------------------------- models


def test_volume_info_parsing() -> None:
    info = VolumeInfo.from_dict(VOLUME)
    assert (info.id, info.name, info.access, info.quota_mb) == (VID, "ws", "rwo", 1024)
    assert (info.size_bytes, info.layers, info.snapshots, info.version) == (8192, 2, 1, 3)
    assert (info.durability, info.backlog_bytes, info.source, info.created_at) == ("node-local", 4096, None, 1732250000.5)
    # A mount of VolumeInfo names the sandbox; its volume is this one.
    assert info.mounts == [VolumeMount(volume=VID, path="/workspace", read_only=False, branch=True, sandbox=SID)]
    assert info.mounts[0].raw == VOLUME["mounts"][0]
    assert info.raw == VOLUME and "raw" not in repr(info)
    assert VolumeInfo.from_dict(FORKED).source == VID


def test_models_tolerate_missing_and_unknown_fields() -> None:
    info = VolumeInfo.from_dict({"id": VID, "mounts": None, "future": 1})
    assert info.mounts == [] and info.name is None and info.quota_mb is None and info.access == "rwo"
    assert info.durability == "node-local" and info.version == 0 and info.backlog_bytes == 0
    assert VolumeInfo.from_dict(None).id == ""
    snap = VolumeSnapshotInfo.from_dict(VSNAP)
    assert (snap.id, snap.volume, snap.layers, snap.label, snap.created_at) == (VS1, VID, 2, "clean", 1732250001.0)
    assert snap.durable is True
    assert VolumeSnapshotInfo.from_dict({"id": VS2}).label is None
    assert VolumeSnapshotInfo.from_dict({"id": VS2}).durable is False
    assert VolumeMount.from_dict({"volume": VID, "path": "/w"}) == VolumeMount(VID, "/w", False, True)


def test_sandbox_info_has_its_volumes() -> None:
    info = SandboxInfo.from_dict(MOUNTED)
    assert info.volumes == [VolumeMount(volume=VID, path="/workspace")]
    assert info.volumes[0].sandbox is None and info.volumes[0].branch is True
    assert SandboxInfo.from_dict(SANDBOX).volumes == []
    assert SandboxInfo.from_dict(dict(SANDBOX, volumes=None)).volumes == []


# ----------------------------------------------------------------------------- _core calls


def test_core_call_shapes() -> None:
    info = VolumeInfo.from_dict(VOLUME)
    snap = VolumeSnapshotInfo.from_dict(VSNAP)
    cases = [
        (_core.create_volume(), "POST", "/v1/volumes", {"access": "rwo"}),
        (_core.create_volume("ws", "rox", 10), "POST", "/v1/volumes", {"name": "ws", "access": "rox", "quota_mb": 10}),
        (_core.create_volume("shared", "rwx"), "POST", "/v1/volumes", {"name": "shared", "access": "rwx"}),
        (_core.list_volumes(), "GET", "/v1/volumes", None),
        (_core.get_volume(VID), "GET", VBASE, None),
        (_core.get_volume("ws"), "GET", "/v1/volumes/ws", None),
        (_core.get_volume(info), "GET", VBASE, None),
        (_core.delete_volume(VID), "DELETE", VBASE, None),
        (_core.volume_snapshot(VID), "POST", VBASE + "/snapshots", {}),
        (_core.volume_snapshot(VID, "x"), "POST", VBASE + "/snapshots", {"label": "x"}),
        (_core.list_volume_snapshots(VID), "GET", VBASE + "/snapshots", None),
        (_core.delete_volume_snapshot(VID, VS1), "DELETE", VBASE + "/snapshots/" + VS1, None),
        (_core.delete_volume_snapshot(VID, snap), "DELETE", VBASE + "/snapshots/" + VS1, None),
        (_core.restore_volume(VID, VS1), "POST", VBASE + "/restore", {"snapshot": VS1}),
        (_core.restore_volume(VID, snap), "POST", VBASE + "/restore", {"snapshot": VS1}),
        (_core.fork_volume(VID), "POST", VBASE + "/fork", {}),
        (_core.fork_volume(VID, "b", snap), "POST", VBASE + "/fork", {"name": "b", "snapshot": VS1}),
        (_core.sync_volume(VID), "POST", VBASE + "/sync", None),
        (_core.create_sandbox(volumes={"/w": VID}), "POST", "/v1/sandboxes",
         {"image": "base", "timeout": 300, "network": "none",
          "volumes": [{"volume": VID, "path": "/w", "read_only": False, "branch": True}]}),
    ]
    for call, method, path, body in cases:
        assert (call.method, call.path, call.json) == (method, path, body)
    assert _core.get_volume("a/b").path == "/v1/volumes/a%2Fb"
    # A sync uploads: no read timeout. The rest are the daemon's usual quick calls.
    assert _core.sync_volume(VID).unbounded and _core.sync_volume(VID).http_timeout(120) is None
    assert not _core.fork_volume(VID).unbounded and not _core.volume_snapshot(VID).unbounded
    assert "volumes" not in _core.create_sandbox().json


def test_file_calls_share_one_builder_for_sandboxes_and_volumes() -> None:
    for prefix, base in ((_core.sandbox_files(SID), "/v1/sandboxes/" + SID), (_core.volume_files(VID), VBASE)):
        assert prefix == base + "/files"
        assert _core.read_file(prefix, "/a").path == base + "/files"
        assert _core.list_dir(prefix, "/a", 2).path == base + "/files/list"
        assert _core.stat(prefix, "/a").path == base + "/files/stat"
        assert _core.make_dir(prefix, "/a").path == base + "/files/mkdir"
        assert _core.rename(prefix, "/a", "/b").path == base + "/files/rename"
        assert _core.remove(prefix, "/a").path == base + "/files"
        assert _core.write_file(prefix, "/a", b"x", 0o600).params == {"path": "/a", "mode": "0600"}


@pytest.mark.parametrize(
    "build",
    [
        lambda: _core.create_volume(access="rw"),
        lambda: _core.create_volume(access=None),
        lambda: _core.create_volume(name=""),
        lambda: _core.create_volume(name=" "),
        lambda: _core.create_volume(name=3),
        lambda: _core.create_volume(quota_mb=0),
        lambda: _core.create_volume(quota_mb=-1),
        lambda: _core.create_volume(quota_mb=1.5),
        lambda: _core.create_volume(quota_mb=True),
        lambda: _core.create_volume(quota_mb="10"),
        lambda: _core.get_volume(""),
        lambda: _core.get_volume(None),
        lambda: _core.get_volume(7),
        lambda: _core.volume_snapshot(VID, 5),
        lambda: _core.delete_volume_snapshot(VID, ""),
        lambda: _core.delete_volume_snapshot(VID, None),
        lambda: _core.restore_volume(VID, ""),
        lambda: _core.restore_volume(VID, 3),
        lambda: _core.fork_volume(VID, name=""),
        lambda: _core.fork_volume(VID, snapshot=""),
        lambda: _core.sync_volume("  "),
    ],
)
def test_core_bad_input(build) -> None:
    with pytest.raises(InvalidArgumentError):
        build()


def test_create_volume_names_the_access_modes() -> None:
    with pytest.raises(InvalidArgumentError, match='"rwo".*"rox".*"rwx"'):
        _core.create_volume("ws", "rw")


# ----------------------------------------------------------------------------- volumes=


def mount(volume: str, path: str, read_only: bool = False, branch: bool = True) -> dict:
    return {"volume": volume, "path": path, "read_only": read_only, "branch": branch}


def test_volume_mounts_from_a_dict(vol: Volume) -> None:
    info = VolumeInfo.from_dict(FORKED)
    mounts = _core.volume_mounts(
        {
            "/workspace": vol,
            "/cache": "cache",
            "/data": info,
            "/ro": VolumeMount(volume="ws", read_only=True),
            "/same": VolumeMount(volume="ws", path="/same", branch=False),
        }
    )
    assert mounts == [
        mount(VID, "/workspace"),
        mount("cache", "/cache"),
        mount(VID2, "/data"),
        mount("ws", "/ro", read_only=True),
        mount("ws", "/same", branch=False),
    ]


def test_volume_mounts_from_a_list(vol: Volume) -> None:
    mounts = _core.volume_mounts(
        [
            VolumeMount(volume=VID, path="/a"),
            {"volume": vol, "path": "/b"},
            {"volume": "ws", "path": "/c", "read_only": True, "branch": False},
        ]
    )
    assert mounts == [mount(VID, "/a"), mount(VID, "/b"), mount("ws", "/c", True, False)]
    assert _core.volume_mounts(()) == [] and _core.volume_mounts({}) == []


@pytest.mark.parametrize(
    "volumes, match",
    [
        ({"workspace": VID}, "absolute"),
        ({"": VID}, "absolute"),
        ({3: VID}, "absolute"),
        ({"/w": ""}, "empty"),
        ({"/w": 5}, "volume"),
        ({"/w": VolumeMount(volume=VID, path="/elsewhere")}, "one path"),
        ({"/w": VolumeMount(volume=VID, read_only="yes")}, "read_only"),
        ([VolumeMount(volume=VID)], "absolute"),
        ([{"volume": VID, "path": "/a", "readonly": True}], "keys"),
        ([{"volume": VID}], "keys"),
        ([{"path": "/a"}], "keys"),
        ([{"volume": VID, "path": "/a", "branch": 1}], "branch"),
        ([("/a", VID)], "VolumeMount or a dict"),
        ([VolumeMount(volume=VID, path="/a"), {"volume": "x", "path": "/a"}], "more than one volume mounted at /a"),
        ("/w=vol", "not str"),
        (VID, "not str"),
        (3, "not int"),
    ],
)
def test_volume_mounts_bad_input(volumes, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        _core.volume_mounts(volumes)


def test_sandbox_create_with_volumes(fake: FakeDaemon, vol: Volume) -> None:
    fake.on("POST", "/v1/sandboxes", MOUNTED, 201)
    sbx = Sandbox.create(volumes={"/workspace": vol}, transport=fake.transport())
    assert fake.body()["volumes"] == [mount(VID, "/workspace")]
    assert sbx._info.volumes == [VolumeMount(volume=VID, path="/workspace")]
    sbx.close()
    Sandbox.create(volumes=[VolumeMount("ws", "/w", read_only=True, branch=False)], transport=fake.transport()).close()
    assert fake.body()["volumes"] == [mount("ws", "/w", True, False)]
    Sandbox.create(transport=fake.transport()).close()
    assert "volumes" not in fake.body()


def test_sandbox_create_bad_volumes_sends_nothing(fake: FakeDaemon) -> None:
    with pytest.raises(InvalidArgumentError):
        Sandbox.create(volumes={"relative": VID}, transport=fake.transport())
    assert fake.requests == []


# ----------------------------------------------------------------------------- sync Volume


def test_create_connect_list(fake: FakeDaemon) -> None:
    routes(fake)
    with Volume.create("ws", "rox", 64, token="tok", transport=fake.transport()) as v:
        assert fake.shape() == ("POST", "/v1/volumes", {"name": "ws", "access": "rox", "quota_mb": 64})
        assert fake.last.headers["authorization"] == "Bearer tok"
        assert v.id == VID and v._info == VolumeInfo.from_dict(VOLUME) and repr(v) == "Volume(id=%r)" % VID
    with Volume.connect("ws", transport=fake.transport()) as v:
        assert fake.shape() == ("GET", "/v1/volumes/ws", None)
        assert v.id == VID  # the id from now on, not the name
        v.info()
        assert fake.last.url.path == VBASE
    infos = Volume.list(transport=fake.transport())
    assert fake.shape() == ("GET", "/v1/volumes", None)
    assert [i.id for i in infos] == [VID, VID2] and all(isinstance(i, VolumeInfo) for i in infos)


def test_volume_operations(vol: Volume, fake: FakeDaemon) -> None:
    info = vol.info()
    assert fake.shape() == ("GET", VBASE, None) and info.mounts[0].sandbox == SID
    snap = vol.snapshot("clean")
    assert fake.shape() == ("POST", VBASE + "/snapshots", {"label": "clean"}) and snap == VolumeSnapshotInfo.from_dict(VSNAP)
    vol.snapshot()
    assert fake.body() == {}
    assert [s.id for s in vol.snapshots()] == [VS1, VS2]
    assert fake.shape() == ("GET", VBASE + "/snapshots", None)
    assert vol.delete_snapshot(snap) is True
    assert fake.shape() == ("DELETE", VBASE + "/snapshots/" + VS1, None)
    restored = vol.restore(VS1)
    assert fake.shape() == ("POST", VBASE + "/restore", {"snapshot": VS1}) and restored.id == VID
    synced = vol.sync()
    assert fake.shape() == ("POST", VBASE + "/sync", None)
    assert (synced.durability, synced.version, synced.backlog_bytes) == ("durable", 4, 0)
    assert vol._info is synced
    assert vol.delete() is True
    assert fake.shape() == ("DELETE", VBASE, None)


def test_fork_is_a_volume_with_its_own_connection(fake: FakeDaemon) -> None:
    routes(fake)
    vol = Volume.create(token="tok", transport=fake.transport())
    child = vol.fork("ws2", snapshot=VSNAP["id"])
    assert fake.shape() == ("POST", VBASE + "/fork", {"name": "ws2", "snapshot": VS1})
    assert isinstance(child, Volume) and child.id == VID2 and child._info.source == VID
    assert child._http is not vol._http and child._http.config is vol._http.config
    vol.fork().close()
    assert fake.body() == {}
    vol.close()  # closing the parent does not close the child
    assert child.info().id == VID2 and fake.last.headers["authorization"] == "Bearer tok"
    child.close()


def test_volume_files_are_the_sandbox_files_class_on_the_volume(vol: Volume, fake: FakeDaemon, tmp_path) -> None:
    sbx = Sandbox.create(transport=fake.transport())
    assert type(vol.files) is type(sbx.files) is sandbox_sync.Files
    sbx.close()
    fake.on("GET", VBASE + "/files", httpx.Response(200, stream=Chunks([b"he", b"llo"])))
    fake.on("PUT", VBASE + "/files", ENTRY)
    fake.on("GET", VBASE + "/files/list", {"entries": [ENTRY, dict(ENTRY, name="d", type="dir")]})
    fake.on("GET", VBASE + "/files/stat", ENTRY)
    fake.on("POST", VBASE + "/files/mkdir", dict(ENTRY, type="dir"))
    fake.on("POST", VBASE + "/files/rename", dict(ENTRY, path="/a/d"))
    fake.on("DELETE", VBASE + "/files", {"removed": True})

    assert vol.files.read("/a/b") == "hello" and dict(fake.last.url.params) == {"path": "/a/b"}
    info = vol.files.write("/a/b", b"abc", mode=0o600)
    assert isinstance(info, EntryInfo) and fake.last.content == b"abc"
    assert (fake.last.url.path, dict(fake.last.url.params)) == (VBASE + "/files", {"path": "/a/b", "mode": "0600"})
    assert [e.name for e in vol.files.list("/a", depth=2)] == ["b", "d"]
    assert (fake.last.url.path, dict(fake.last.url.params)) == (VBASE + "/files/list", {"path": "/a", "depth": "2"})
    assert vol.files.stat("/a/b").size == 3 and vol.files.exists("/a/b") is True
    assert vol.files.make_dir("/a/c").is_dir and fake.shape() == ("POST", VBASE + "/files/mkdir", {"path": "/a/c", "parents": True})
    assert vol.files.rename("/a/b", "/a/d").path == "/a/d"
    assert fake.shape() == ("POST", VBASE + "/files/rename", {"from": "/a/b", "to": "/a/d"})
    assert vol.files.remove("/a", recursive=True) is True
    assert (fake.last.method, dict(fake.last.url.params)) == ("DELETE", {"path": "/a", "recursive": "true"})
    src = tmp_path / "src.bin"
    src.write_bytes(b"0123456789")
    vol.files.upload(src, "/up.bin")
    assert fake.last.content == b"0123456789" and fake.last.url.params["path"] == "/up.bin"
    fake.on("GET", VBASE + "/files", httpx.Response(200, stream=Chunks([b"x" * 10, b"y"])))
    assert vol.files.download("/up.bin", tmp_path / "dst.bin") == str(tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == b"x" * 10 + b"y"
    fake.on("GET", VBASE + "/files/stat", {"error": {"code": "not_found", "message": "no such file"}}, 404)
    assert vol.files.exists("/nope") is False


def test_errors_map(vol: Volume, fake: FakeDaemon) -> None:
    with pytest.raises(NotFoundError, match="no route"):
        Volume.connect("missing", transport=fake.transport())
    fake.on("DELETE", VBASE, {"error": {"code": "conflict", "message": "volume is mounted in sb-x"}}, 409)
    with pytest.raises(ConflictError, match="mounted"):
        vol.delete()
    fake.on("PUT", VBASE + "/files", {"error": {"code": "quota_exceeded", "message": "quota of 1 MiB"}}, 507)
    with pytest.raises(QuotaExceededError) as ei:
        vol.files.write("/big", b"x" * 10)
    assert ei.value.code == "quota_exceeded" and ei.value.status_code == 507 and isinstance(ei.value, SandboxError)
    fake.on("POST", VBASE + "/sync", httpx.Response(507, text="full"))  # the status alone
    with pytest.raises(QuotaExceededError):
        vol.sync()
    fake.on("POST", VBASE + "/restore", {"error": {"code": "bad_request", "message": "unknown snapshot"}}, 400)
    with pytest.raises(InvalidArgumentError, match="unknown snapshot"):
        vol.restore("vs-nope")
    fake.on("POST", VBASE + "/restore", {"error": {"code": "not_found", "message": "no snapshot vs-x"}}, 404)
    with pytest.raises(NotFoundError):
        vol.restore("vs-x")


def test_bad_input_sends_nothing(vol: Volume, fake: FakeDaemon) -> None:
    before = len(fake.requests)
    for bad in (
        lambda: Volume.create(access="rw", transport=fake.transport()),
        lambda: Volume.create(quota_mb=0, transport=fake.transport()),
        lambda: Volume.connect("", transport=fake.transport()),
        lambda: vol.snapshot(label=1),
        lambda: vol.restore(""),
        lambda: vol.fork(name=""),
        lambda: vol.delete_snapshot(None),
    ):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert len(fake.requests) == before


# ----------------------------------------------------------------------------- async


async def test_async_volume(fake: FakeDaemon, avol: AsyncVolume) -> None:
    assert fake.shape() == ("POST", "/v1/volumes", {"access": "rwo"}) and avol.id == VID
    assert (await avol.info()).name == "ws"
    assert (await avol.snapshot("l")).id == VS1 and fake.body() == {"label": "l"}
    assert [s.id for s in await avol.snapshots()] == [VS1, VS2]
    assert await avol.delete_snapshot(VS1) is True and fake.last.url.path == VBASE + "/snapshots/" + VS1
    assert (await avol.restore(VSNAP2["id"])).id == VID and fake.body() == {"snapshot": VS2}
    assert (await avol.sync()).durability == "durable"
    child = await avol.fork(snapshot=VS1)
    assert fake.shape() == ("POST", VBASE + "/fork", {"snapshot": VS1})
    assert isinstance(child, AsyncVolume) and child.id == VID2 and child._http.config is avol._http.config
    assert child._http is not avol._http
    await child.close()
    assert await avol.delete() is True


async def test_async_connect_list_and_files(fake: FakeDaemon) -> None:
    routes(fake)
    async with await AsyncVolume.connect("ws", transport=fake.transport()) as v:
        assert v.id == VID and fake.last.url.path == "/v1/volumes/ws"
        assert type(v.files) is sandbox_async.AsyncFiles
        fake.on("PUT", VBASE + "/files", ENTRY)
        await v.files.write("/a", "x")
        assert fake.last.url.path == VBASE + "/files" and fake.last.content == b"x"
        fake.on("GET", VBASE + "/files", httpx.Response(200, stream=Chunks([b"a", b"b"])))
        assert await v.files.read("/a", format="bytes") == b"ab"
    assert [i.id for i in await AsyncVolume.list(transport=fake.transport())] == [VID, VID2]
    with pytest.raises(NotFoundError):
        await AsyncVolume.connect("vol-missing", transport=fake.transport())


async def test_async_sandbox_create_with_volumes(fake: FakeDaemon, avol: AsyncVolume) -> None:
    fake.on("POST", "/v1/sandboxes", MOUNTED, 201)
    sbx = await AsyncSandbox.create(volumes={"/workspace": avol, "/ro": VolumeMount("ws", read_only=True)},
                                    transport=fake.transport())
    assert fake.body()["volumes"] == [mount(VID, "/workspace"), mount("ws", "/ro", read_only=True)]
    assert sbx._info.volumes[0].volume == VID
    await sbx.close()


# ----------------------------------------------------------------------------- parity


def _public(cls):
    return {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_volume_classes_mirror() -> None:
    s, a = _public(Volume), _public(AsyncVolume)
    assert set(s) == set(a) == {
        "create", "connect", "list", "info", "delete", "snapshot", "snapshots", "delete_snapshot",
        "restore", "fork", "sync", "close",
    }
    for name in s:
        ps, pa = inspect.signature(s[name]).parameters, inspect.signature(a[name]).parameters
        assert list(ps) == list(pa), name
        assert [p.default for p in ps.values()] == [p.default for p in pa.values()], name
        assert inspect.iscoroutinefunction(a[name]) and not inspect.iscoroutinefunction(s[name]), name
    assert list(inspect.signature(Volume.create).parameters)[:3] == ["name", "access", "quota_mb"]
    assert inspect.signature(Volume.create).parameters["access"].default == "rwo"
    assert list(inspect.signature(Volume.fork).parameters) == ["self", "name", "snapshot"]


def test_files_classes_mirror() -> None:
    s, a = _public(sandbox_sync.Files), _public(sandbox_async.AsyncFiles)
    assert set(s) == set(a)
    for name in s:
        assert list(inspect.signature(s[name]).parameters) == list(inspect.signature(a[name]).parameters), name


def test_create_signatures_take_volumes() -> None:
    for cls in (Sandbox, AsyncSandbox):
        param = inspect.signature(cls.create).parameters["volumes"]
        assert param.default is None and param.kind is inspect.Parameter.KEYWORD_ONLY
    assert "Volume" in sandbox_sync.__all__ and "AsyncVolume" in sandbox_async.__all__
