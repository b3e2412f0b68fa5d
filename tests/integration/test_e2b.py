"""The official `e2b` Python SDK, unchanged, against branchboxd's E2B-compatible endpoint
(`--e2b-listen`, API key = the daemon's token): control plane (create, info, list, timeout, kill,
pause/resume, snapshots, fork), commands, users, files, the code interpreter
(`e2b_code_interpreter`: run_code, contexts, rich results, fork/snapshot of code state),
branchbox's checkpoint/rollback on E2B ids, what is not served yet, and bad input.

The SDK is pointed at the endpoint with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY (set for this
module only). Sandbox ids it shows are branchbox's without the dash. Every sandbox made here
carries the metadata ``suite=<TAG>`` and is killed at the end of the module (a fork's children
are found by listing: they are killed too)."""
import asyncio
import base64
import gzip as gzip_mod
import hashlib
import io
import json
import os
import re
import struct
import threading
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest

from e2b import (
    ALL_TRAFFIC,
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    ConnectionConfig,
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
    AsyncVolume,
    Volume,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)
from e2b_code_interpreter import AsyncSandbox as CIAsyncSandbox, Sandbox as CISandbox

from branchbox import Sandbox as BBSandbox, Volume as BBVolume
from helpers import URL, e2b_sdk_env, wait_until

TAG = "e2bt-" + uuid.uuid4().hex[:10]
MB = 1 << 20


# ----------------------------------------------------------------------------- helpers


def bb_id(e2b_id):
    """branchbox's id of a sandbox the endpoint shows as ``e2b_id`` (``sb0123...`` -> ``sb-0123...``)."""
    assert e2b_id.startswith("sb") and "-" not in e2b_id, e2b_id
    return "sb-" + e2b_id[2:]


def all_listed(query=None, limit=None):
    """Every SandboxInfo of a list, page by page; also the pages (lists of ids)."""
    p = Sandbox.list(query=query, limit=limit)
    items, pages = [], []
    while p.has_next:
        page = p.next_items()
        items += page
        pages.append([i.sandbox_id for i in page])
    return items, pages


def ids_now():
    return {i.sandbox_id for i in all_listed()[0]}


def kill_quietly(sandbox_id):
    try:
        Sandbox.kill(sandbox_id)
    except Exception:
        pass


def delete_snapshots_of(sandbox_id):
    try:
        p = Sandbox.list_snapshots(sandbox_id=sandbox_id)
        while p.has_next:
            for snap in p.next_items():
                Sandbox.delete_snapshot(snap.snapshot_id)
    except Exception:
        pass


def envd_headers(sbx, token=True, **extra):
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token:
        h["X-Access-Token"] = sbx._envd_access_token
    h.update(extra)
    return h


def envelope(payload: bytes, flags=0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def envelopes(body: bytes):
    """[(flags, parsed JSON)] of a Connect streaming body."""
    out, i = [], 0
    while i < len(body):
        assert len(body) - i >= 5, "truncated envelope header in %r" % body
        flags, n = struct.unpack(">BI", body[i:i + 5])
        out.append((flags, json.loads(body[i + 5:i + 5 + n])))
        i += 5 + n
    return out


PAT = "".join(chr(97 + i % 26) for i in range(MB))
PRINT_PAT = "python3 -c \"import sys; sys.stdout.write(''.join(chr(97 + i % 26) for i in range(1 << 20)))\""

# A background process that counts in /tmp/<name>.n and leaves its pid in /tmp/<name>.pid.
COUNTER = ("nohup python3 -c 'import os, time\nopen(\"/tmp/{n}.pid\", \"w\").write(str(os.getpid()))\nc = 0\n"
           "while True:\n    c += 1\n    open(\"/tmp/{n}.tmp\", \"w\").write(str(c))\n"
           "    os.rename(\"/tmp/{n}.tmp\", \"/tmp/{n}.n\")\n    time.sleep(0.02)' >/dev/null 2>&1 &")


def counter_value(sbx, name):
    try:
        return int(sbx.files.read("/tmp/%s.n" % name))
    except FileNotFoundException:
        return None


def counter_advances(sbx, name):
    first = wait_until(lambda: counter_value(sbx, name), timeout=15, what="the counter %s to start" % name)
    wait_until(lambda: (counter_value(sbx, name) or 0) > first, timeout=15, what="the counter %s to advance" % name)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def e2b(daemon):
    """The SDK's environment pointed at the daemon's E2B endpoint, for this module."""
    with e2b_sdk_env(daemon) as url:
        try:
            yield SimpleNamespace(url=url, key=daemon.tcp_token, daemon=daemon)
        finally:
            daemon.ensure_running()
            for info in all_listed(SandboxQuery(metadata={"suite": TAG}))[0]:
                kill_quietly(info.sandbox_id)


@pytest.fixture(scope="module")
def box(e2b):
    """One sandbox shared by the tests that do not conflict (each uses paths of its own)."""
    s = Sandbox.create(envs={"FOO": "created"}, metadata={"suite": TAG, "role": "box"}, timeout=600)
    yield s
    kill_quietly(s.sandbox_id)


@pytest.fixture(scope="module")
def me(box):
    """Who the box's commands run as by default: user, home (from /etc/passwd), default cwd."""
    user, home, cwd = box.commands.run('id -un; getent passwd "$(id -un)" | cut -d: -f6; pwd').stdout.split("\n")[:3]
    return SimpleNamespace(user=user, home=home, cwd=cwd)


@pytest.fixture
def make(e2b):
    """Factory ``make(**create_kwargs)`` (sync Sandbox); each is killed at teardown, and so is
    any sandbox that appeared during the test (a fork's children, even if the SDK lost them)."""
    before = ids_now()
    made = []

    def create(**kw):
        kw.setdefault("timeout", 300)
        kw["metadata"] = dict({"suite": TAG}, **kw.get("metadata", {}) or {})
        s = Sandbox.create(**kw)
        made.append(s.sandbox_id)
        return s

    create.adopt = made.append  # a sandbox made otherwise, to kill at teardown
    yield create
    e2b.daemon.ensure_running()
    gone = set(made) | (ids_now() - before)
    for sid in gone:
        kill_quietly(sid)
    # Snapshots outlive their sandboxes, the ones a fork takes too.
    for sid in gone:
        delete_snapshots_of(sid)


@pytest.fixture
def snapshots(e2b):
    """``snapshots(SnapshotInfo)`` registers a snapshot to delete at teardown (snapshots outlive
    their sandboxes); returns it."""
    made = []

    def keep(info):
        made.append(info.snapshot_id)
        return info

    yield keep
    for sid in made:
        try:
            Sandbox.delete_snapshot(sid)
        except Exception:
            pass


@pytest.fixture
def raw(e2b):
    with httpx.Client(base_url=e2b.url, timeout=30) as c:
        yield c


# ----------------------------------------------------------------------------- control plane


def test_create_info_and_ids(e2b, make):
    s = make(metadata={"who": "info"}, envs={"A": "1"}, timeout=123)
    info = s.get_info()
    assert info.sandbox_id == s.sandbox_id and "-" not in s.sandbox_id
    assert info.template_id == "base"
    assert info.metadata == {"suite": TAG, "who": "info"}
    assert info.state == SandboxState.RUNNING
    assert info.envd_version and info.cpu_count >= 1 and info.memory_mb > 0
    assert abs((info.end_at - info.started_at).total_seconds() - 123) < 5, (info.started_at, info.end_at)
    assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
    # Class form, and the same sandbox as branchbox's own SDK sees it (dashed id).
    assert Sandbox.get_info(s.sandbox_id).sandbox_id == s.sandbox_id
    bb = BBSandbox.connect(bb_id(s.sandbox_id), daemon=URL, resume=False)
    assert bb.info().metadata.get("who") == "info"
    s.files.write("/tmp/from-e2b", "x")
    assert bb.files.read("/tmp/from-e2b") == "x"
    assert s.is_running()
    (m,) = s.get_metrics()
    assert m.cpu_count >= 1 and m.mem_total > 0


def test_allow_internet_access_is_kept(make):
    """The SDK sends `allow_internet_access` (snake case: api/client/models/new_sandbox_v2.py)."""
    s = make(allow_internet_access=True)
    assert s.get_info().allow_internet_access is True


def test_network_allow_and_deny_map_onto_branchbox_network(make):
    """E2B's `network` (create) and `update_network`: "deny all but" becomes branchbox's
    allowlist; what cannot be mapped is refused with a 400, never dropped."""
    s = make(network={"deny_out": [ALL_TRAFFIC], "allow_out": ["10.1.2.3", "*.example.com"]})
    bb = BBSandbox.connect(bb_id(s.sandbox_id), daemon=URL, resume=False)
    n = bb.network.get()
    assert (n.network, n.allow) == ("allowlist", ["10.1.2.3", "*.example.com"])
    eth0 = "test -e /sys/class/net/eth0 && echo eth0 || echo no-eth0"
    assert s.commands.run(eth0).stdout == "eth0\n", "allowlist: the sandbox has eth0"
    s.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": ["10.9.9.9"]})
    assert (bb.network.get().network, bb.network.get().allow) == ("allowlist", ["10.9.9.9"])
    s.update_network({"allow_internet_access": True})
    assert bb.network.get().network == "open" and s.get_info().allow_internet_access is True
    s.update_network({})  # E2B clears what is left out: here, no network
    assert (bb.network.get().network, bb.network.get().allow) == ("none", [])
    assert s.commands.run(eth0).stdout == "no-eth0\n"
    for bad, field in (({"deny_out": ["10.0.0.0/8"]}, "denyOut"), ({"mask_request_host": "x"}, "maskRequestHost")):
        with pytest.raises((InvalidArgumentException, SandboxException)) as ei:
            make(network=bad)
        assert field in str(ei.value), str(ei.value)
    # (update_network sends the egress fields alone: no maskRequestHost.)
    with pytest.raises((InvalidArgumentException, SandboxException)) as ei:
        s.update_network({"deny_out": ["10.0.0.0/8"]})
    assert "denyOut" in str(ei.value), str(ei.value)
    assert bb.network.get().network == "none", "a refused update changes nothing"


def test_volume_mounts_are_branchbox_volumes_by_name(make):
    """`volume_mounts={path: name}` mounts the branchbox volume of that name (one made with
    branchbox's SDK here): what one sandbox writes there, the next one reads after it is gone.
    Unknown volumes, `mcp` and `iam` are refused, not dropped."""
    name = "e2bvol-" + uuid.uuid4().hex[:8]
    vol = BBVolume.create(name, daemon=URL)
    try:
        a = make(volume_mounts={"/mnt/data": name})
        a.files.write("/mnt/data/kept.txt", "from a")
        assert a.commands.run("cat /mnt/data/kept.txt").stdout == "from a"
        a.kill()
        b = make(volume_mounts={"/mnt/data": name})
        assert b.files.read("/mnt/data/kept.txt") == "from a"
        b.kill()
        # An rox volume (read-only for many) is mounted read-only: E2B's API has no flag for it.
        ro_name = "e2bro-" + uuid.uuid4().hex[:8]
        ro = BBVolume.create(ro_name, "rox", daemon=URL)
        try:
            ro.files.write("/seed.txt", "seed")
            c = make(volume_mounts={"/mnt/ro": ro_name})
            assert c.files.read("/mnt/ro/seed.txt") == "seed"
            out = c.commands.run("touch /mnt/ro/new 2>&1 || echo refused").stdout
            assert "Read-only file system" in out and out.endswith("refused\n"), out
            c.kill()
        finally:
            ro.delete()
        for bad, says in (({"volume_mounts": {"/mnt/x": "no-such-volume-e2b"}}, "no-such-volume-e2b"),
                          ({"mcp": {"exa": {"apiKey": "k"}}}, "mcp")):
            with pytest.raises((InvalidArgumentException, NotFoundException, SandboxException)) as ei:
                make(**bad)
            assert says in str(ei.value), str(ei.value)
    finally:
        vol.delete()


@pytest.fixture
def volumes(e2b):
    """``volumes(name)``: an E2B ``Volume.create(name)``, destroyed at teardown."""
    made = []

    def create(name=None):
        v = Volume.create(name or "e2bv-" + uuid.uuid4().hex[:8])
        made.append(v.volume_id)
        return v

    yield create
    for vid in made:
        try:
            Volume.destroy(vid)
        except Exception:
            pass


def test_volume_api_maps_onto_branchbox_volumes(e2b, make, raw, volumes):
    """E2B's `Volume` (control plane `/volumes`, content API `/volumecontent/...` with the
    volume's bearer token) on branchbox volumes: E2B's defaults (0666 files, 0777 directories,
    owner 9090), new-only writes unless `force`, a root the sandbox's `user` writes into."""
    v = volumes()
    assert v.volume_id.startswith("vol-") and v.token
    assert BBVolume.connect(v.name, daemon=URL).id == v.volume_id, "a branchbox volume by that name"
    assert (v.volume_id, v.name) in [(i.volume_id, i.name) for i in Volume.list()]
    info = Volume.get_info(v.volume_id)
    assert (info.name, info.token) == (v.name, v.token)
    with pytest.raises(VolumeException, match="already exists"):
        Volume.create(v.name)

    f = v.write_file("/notes/a.txt", "hello", force=True)
    assert (f.type.value, f.path, f.size, f.mode, f.uid, f.gid) == ("file", "/notes/a.txt", 5, 0o666, 9090, 9090)
    assert v.get_info("/notes").mode == 0o777, "parents made by force: 0777"
    assert v.read_file("/notes/a.txt") == "hello" and v.read_file("/notes/a.txt", format="bytes") == b"hello"
    with pytest.raises(VolumeException, match="409"):
        v.write_file("/notes/a.txt", "again")
    assert v.read_file("/notes/a.txt") == "hello", "a refused write changes nothing"
    with pytest.raises(VolumePathNotFoundException):
        v.write_file("/missing/b.txt", "x")
    assert v.write_file("/notes/a.txt", b"\x00bin", force=True, mode=0o600, uid=1000, gid=1000).mode == 0o600
    d = v.make_dir("/notes/sub", mode=0o750)
    assert (d.type.value, d.mode) == ("directory", 0o750)
    with pytest.raises(VolumeException, match="409"):
        v.make_dir("/notes/sub")
    assert v.make_dir("/notes/sub", force=True).mode == 0o750, "force takes an existing directory as it is"
    with pytest.raises(VolumePathNotFoundException):
        v.make_dir("/x/y/z")
    assert [(e.path, e.type.value) for e in v.list("/", depth=2)] == [
        ("/notes", "directory"), ("/notes/a.txt", "file"), ("/notes/sub", "directory")]
    with pytest.raises(VolumeException, match="depth"):
        v.list("/", depth=11)
    u = v.update_metadata("/notes/a.txt", mode=0o644, uid=0)
    assert (u.mode, u.uid, u.gid) == (0o644, 0, 1000)
    assert v.exists("/notes/a.txt") and not v.exists("/nope")
    with pytest.raises(VolumePathNotFoundException):
        v.read_file("/nope")

    # In a sandbox: the root is writable by `user`; what it writes, the content API reads.
    s = make(volume_mounts={"/mnt/data": v})
    assert s.files.read("/mnt/data/notes/a.txt", format="bytes") == b"\x00bin"
    s.commands.run("echo from-sandbox > /mnt/data/made-by-user.txt")
    made = v.get_info("/made-by-user.txt")
    assert (made.uid, v.read_file("/made-by-user.txt")) == (1000, "from-sandbox\n")
    # Shared as E2B's are (branchbox's `rwx`): a second sandbox mounts it while the first
    # does, and both see one copy.
    assert BBVolume.connect(v.volume_id, daemon=URL).info().access == "rwx"
    s2 = make(volume_mounts={"/data": v.name})
    assert s2.files.read("/data/made-by-user.txt") == "from-sandbox\n"
    s2.files.write("/data/from-s2.txt", "two")
    assert s.commands.run("cat /mnt/data/from-s2.txt").stdout == "two"
    with pytest.raises(VolumeException):
        Volume.destroy(v.volume_id)  # mounted: refused
    s.kill()
    s2.kill()
    v.remove("/from-s2.txt")

    # Bad input: no or a wrong token, another volume's token, a path climbing out, the root.
    url = "/volumecontent/%s/file" % v.volume_id
    assert raw.get(url, params={"path": "/notes/a.txt"}).status_code == 401
    other = volumes()
    r = raw.get(url, params={"path": "/notes/a.txt"}, headers={"Authorization": "Bearer " + other.token})
    assert r.status_code == 401 and r.json()["code"] == 401, r.text
    auth = {"Authorization": "Bearer " + v.token}
    r = raw.get(url, params={"path": "/../../etc/passwd"}, headers=auth)
    assert r.status_code == 400 and "climbs above" in r.json()["message"], r.text
    r = raw.put(url, params={"path": "/big", "mode": "99999"}, content=b"x", headers=auth)
    assert r.status_code == 400, r.text
    r = raw.delete("/volumecontent/%s/path" % v.volume_id, params={"path": "/"}, headers=auth)
    assert r.status_code == 400, r.text
    assert raw.get("/volumecontent/vol-nosuch/path", params={"path": "/"}, headers=auth).status_code == 404
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info("vol-nosuch")

    v.remove("/notes")
    assert [e.path for e in v.list("/")] == ["/made-by-user.txt"]
    assert Volume.destroy(v.volume_id) is True
    assert Volume.destroy(v.volume_id) is False


def test_async_volume(e2b, volumes):
    """`AsyncVolume`: the same API, awaited."""

    async def go():
        v = await AsyncVolume.create("e2bva-" + uuid.uuid4().hex[:8])
        try:
            await v.write_file("/a/b.txt", "async", force=True)
            assert await v.read_file("/a/b.txt") == "async"
            assert [e.name for e in await v.list("/a")] == ["b.txt"]
            assert (await v.get_info("/a/b.txt")).size == 5
            await v.remove("/a/b.txt")
            assert not await v.exists("/a/b.txt")
        finally:
            assert await AsyncVolume.destroy(v.volume_id)

    asyncio.run(go())


def test_insecure_sandbox_needs_no_access_token(e2b, make, raw):
    """``secure: false`` at create (older SDKs send it; 2.63 ignores its ``secure`` argument)."""
    r = raw.post("/sandboxes", json={"templateID": "base", "secure": False, "timeout": 120,
                                     "metadata": {"suite": TAG}}, headers={"X-API-KEY": e2b.key})
    assert r.status_code == 201 and "envdAccessToken" not in r.json(), r.text
    sid = r.json()["sandboxID"]
    make.adopt(sid)
    s = Sandbox.connect(sid)
    assert s._envd_access_token is None
    assert s.commands.run("echo open").stdout == "open\n"
    s.files.write("/tmp/insecure.txt", "x")
    assert raw.get("/files", params={"path": "/tmp/insecure.txt"}, headers=envd_headers(s, token=False)).text == "x"
    assert "branchbox.e2b.insecure" not in (s.get_info().metadata or {})
    # A secure one still refuses requests without its token.
    t = make()
    r = raw.get("/files", params={"path": "/etc/hostname"}, headers=envd_headers(t, token=False))
    assert r.status_code == 401


def test_set_timeout_moves_end_and_zero_kills(make):
    s = make(timeout=100)
    i0 = s.get_info()
    s.set_timeout(900)
    i1 = s.get_info()
    assert i1.end_at > i0.end_at
    assert abs((i1.end_at - i0.end_at).total_seconds() - 800) < 30
    Sandbox.set_timeout(s.sandbox_id, 50)  # class form, shorter: end moves back
    assert s.get_info().end_at < i1.end_at
    s.set_timeout(0)
    assert not s.is_running()
    with pytest.raises(SandboxNotFoundException):
        s.get_info()
    assert s.kill() is False


def test_set_timeout_zero_pauses_with_lifecycle_pause(make):
    s = make(lifecycle={"on_timeout": "pause"})
    assert s.get_info().lifecycle["on_timeout"] == "pause"
    s.files.write("/tmp/kept", "yes")
    # What runs is kept, as by pause() (test_pause_keeps_commands_started_here).
    h = s.commands.run("sleep 1000", background=True)
    s.set_timeout(0)
    assert s.get_info().state == SandboxState.PAUSED
    assert not s.is_running()
    again = Sandbox.connect(s.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    assert again.files.read("/tmp/kept") == "yes"
    assert h.pid in {p.pid for p in again.commands.list()}
    assert h.kill() is True


def test_kill_forms_and_unknown_ids(make):
    a, b = make(), make()
    assert a.kill() is True
    assert a.kill() is False
    assert Sandbox.kill(b.sandbox_id) is True
    assert Sandbox.kill(b.sandbox_id) is False
    assert Sandbox.kill("sb000000000000") is False
    listed = ids_now()
    assert a.sandbox_id not in listed and b.sandbox_id not in listed
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(a.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect(a.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect("sb000000000000")


def test_connect_by_id(box):
    s = Sandbox.connect(box.sandbox_id)
    assert s.sandbox_id == box.sandbox_id
    assert s.commands.run("echo $FOO").stdout == "created\n"
    # branchbox's dashed form is accepted too.
    assert Sandbox.connect(bb_id(box.sandbox_id)).commands.run("true").exit_code == 0


def test_list_filters_paging_newest_first(make):
    t = uuid.uuid4().hex[:8]
    made = [make(metadata={"lt": t, "n": str(n)}) for n in range(3)]
    items, pages = all_listed(SandboxQuery(metadata={"lt": t}), limit=2)
    ids = [s.sandbox_id for s in made]
    assert pages == [[ids[2], ids[1]], [ids[0]]]
    assert [i.metadata["n"] for i in items] == ["2", "1", "0"]
    assert all(i.state == SandboxState.RUNNING and i.template_id == "base" for i in items)
    # By state: one paused; the default lists both states.
    assert made[1].pause() is True
    paused, _ = all_listed(SandboxQuery(metadata={"lt": t}, state=[SandboxState.PAUSED]))
    running, _ = all_listed(SandboxQuery(metadata={"lt": t}, state=[SandboxState.RUNNING]))
    both, _ = all_listed(SandboxQuery(metadata={"lt": t}))
    assert [i.sandbox_id for i in paused] == [ids[1]]
    assert [i.sandbox_id for i in running] == [ids[2], ids[0]]
    assert [(i.sandbox_id, i.state) for i in both] == [
        (ids[2], SandboxState.RUNNING), (ids[1], SandboxState.PAUSED), (ids[0], SandboxState.RUNNING)]
    # Several metadata pairs are ANDed.
    one, _ = all_listed(SandboxQuery(metadata={"lt": t, "n": "0"}))
    assert [i.sandbox_id for i in one] == [ids[0]]


def test_list_metadata_filter_with_characters_to_escape(make):
    """The SDK quotes each key and value, then urlencodes the pairs (sandbox_sync/paginator.py
    next_items): the endpoint must undo both (plus the URL's own encoding)."""
    t = uuid.uuid4().hex[:8]
    s = make(metadata={"lt": t, "a key": "x&y=z/ü"})
    found, _ = all_listed(SandboxQuery(metadata={"lt": t, "a key": "x&y=z/ü"}))
    assert [i.sandbox_id for i in found] == [s.sandbox_id]


def test_pause_connect_keeps_processes_and_tmp(make):
    s = make()
    s.commands.run(COUNTER.format(n="pc"))
    counter_advances(s, "pc")
    s.files.write("/tmp/pc.file", "still here")
    pid = s.files.read("/tmp/pc.pid")
    assert s.pause() is True
    assert s.get_info().state == SandboxState.PAUSED
    assert s.is_running() is False
    assert s.pause() is False  # already paused (409)
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("true")
    s.connect()
    assert s.get_info().state == SandboxState.RUNNING
    assert s.is_running()
    assert s.files.read("/tmp/pc.file") == "still here"
    assert s.commands.run("kill -0 %s && cat /tmp/pc.pid" % pid).stdout == pid
    counter_advances(s, "pc")
    # Again: the counter (an orphan: the command that started it ended) came back in a session
    # of the sandbox's own, which the next dump needs.
    assert s.pause() is True
    s.connect()
    assert s.commands.run("kill -0 %s && cat /tmp/pc.pid" % pid).stdout == pid
    counter_advances(s, "pc")


def test_pause_keeps_commands_started_here(make):
    """A full pause keeps the commands started through the endpoint, as E2B's (a VM snapshot)
    does: a server goes on serving after the resume, a handle streaming a command's output goes
    on receiving it (the daemon holds the stream, the resume gives the command new pipes), stdin
    still reaches it, and it is listed and killable under its pid."""
    s = make()

    def follow(handle):
        """The handle's output as it comes (its wait() in a thread), and its end."""
        out, err, end = [], [], []

        def wait():
            try:
                end.append(handle.wait(on_stdout=out.append, on_stderr=err.append))
            except Exception as e:  # noqa: BLE001 (kept for the test to look at)
                end.append(e)
        threading.Thread(target=wait, daemon=True).start()
        return out, err, end

    ticker = s.commands.run("for i in $(seq 1 100000); do echo tick $i; sleep 0.05; done", background=True)
    cat = s.commands.run("cat", background=True, stdin=True)
    server = s.commands.run("python3 -m http.server 8000 --bind 127.0.0.1", background=True)
    (ticks, _, ticker_end), (echoed, _, cat_end), (_, logged, _) = follow(ticker), follow(cat), follow(server)
    wait_until(lambda: s.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/ || true").stdout
               == "200", timeout=20, what="the server to answer")
    s.commands.send_stdin(cat.pid, "before\n")
    wait_until(lambda: "before" in "".join(echoed), what="cat to echo its input")
    wait_until(lambda: len(ticks) >= 3, what="the ticker's output")
    assert s.pause() is True
    assert s.get_info().state == SandboxState.PAUSED
    during = len(ticks)
    time.sleep(0.5)
    assert len(ticks) - during <= 1  # paused: at most the line read as the freeze came
    s.connect()
    # The server answers (the access log line goes to its stderr pipe, read by the daemon).
    seen_log = len(logged)
    assert s.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/").stdout == "200"
    wait_until(lambda: "GET / HTTP" in "".join(logged[seen_log:]), what="the server's log after the resume")
    # The ticker counts on from where it was, into the same handle.
    seen = len(ticks)
    wait_until(lambda: len(ticks) >= seen + 3, what="the ticker's output after the resume")
    numbers = [int(line.split()[1]) for line in "".join(ticks).splitlines() if line.startswith("tick ")]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    s.commands.send_stdin(cat.pid, "after\n")
    wait_until(lambda: "after" in "".join(echoed), what="cat to echo input sent after the resume")
    assert {ticker.pid, cat.pid, server.pid} <= {p.pid for p in s.commands.list()}
    # Paused and resumed again: the new pipes are kept too.
    assert s.pause() is True
    s.connect()
    s.commands.send_stdin(cat.pid, "again\n")
    wait_until(lambda: "again" in "".join(echoed), what="cat to echo input after a second resume")
    s.commands.close_stdin(cat.pid)
    wait_until(lambda: cat_end, what="cat to end at the end of its input")
    assert cat_end[0].exit_code == 0 and cat_end[0].stdout.split() == ["before", "after", "again"], cat_end
    assert ticker.kill() is True
    wait_until(lambda: ticker_end, what="the killed ticker's end")
    assert isinstance(ticker_end[0], CommandExitException), ticker_end
    assert server.kill() is True


def test_pause_keeps_a_terminal(make):
    """A full pause keeps a PTY too: the shell, its terminal's size and what it was doing come
    back, input typed after the resume reaches it and its output the same handle (the resume gave
    it a new terminal of the sandbox's devpts in place of the old, whose master the daemon holds)."""
    s = make()
    t = s.pty.create(PtySize(rows=24, cols=80), timeout=60)
    out, end, _ = pty_reader(t)
    s.pty.send_stdin(t.pid, b"x=41; sleep 1000 & echo started-$((x+1))\n")
    wait_until(lambda: b"started-42" in out, timeout=20, what="the shell's answer: %r" % out)
    assert s.pause() is True
    s.connect()
    s.pty.send_stdin(t.pid, b"echo back-$((x+2)) $(stty size) $(kill -0 $! && echo alive)\n")
    wait_until(lambda: b"back-43 24 80 alive" in out, timeout=20, what="the shell after the resume: %r" % out)
    s.pty.resize(t.pid, PtySize(rows=30, cols=100))
    s.pty.send_stdin(t.pid, b"stty size\n")
    wait_until(lambda: b"30 100" in out, timeout=20, what="the new size: %r" % out)
    assert s.pty.kill(t.pid) is True
    wait_until(lambda: t.pid not in {p.pid for p in s.commands.list()}, what="the killed terminal to leave the list")
    assert s.commands.run("echo ok").stdout == "ok\n"


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id(sbx):
    # /proc is the sandbox's own, not in its files (the files API reads its root).
    return sbx.commands.run("cat " + BOOT_ID).stdout.strip()


def test_each_sandbox_has_its_own_boot_id(make):
    a, b = make(), make()
    ids = {boot_id(a), boot_id(b), open(BOOT_ID).read().strip()}
    assert len(ids) == 3 and all(re.fullmatch(r"[0-9a-f-]{36}", i) for i in ids), ids
    # Nothing in the sandbox changes it, not even its root.
    with pytest.raises(CommandExitException):
        a.commands.run("echo x > %s" % BOOT_ID, user="root")
    assert boot_id(a) in ids


def test_pause_filesystem_mode_cold_boots(make):
    """``mode="filesystem"`` (``keep_memory=False``): files kept, every process ends (a command
    the client streams too: nothing of it could be kept), the resume is a cold boot with a new
    boot id."""
    s = make()
    s.files.write("/tmp/fs.file", "kept")
    s.commands.run(COUNTER.format(n="fs"))
    counter_advances(s, "fs")
    h = s.commands.run("sleep 1000", background=True)
    before = boot_id(s)
    assert s.pause(mode="filesystem") is True
    assert s.get_info().state == SandboxState.PAUSED
    with pytest.raises(CommandExitException):
        h.wait()
    s.connect()
    assert s.get_info().state == SandboxState.RUNNING
    assert s.files.read("/tmp/fs.file") == "kept"
    after = boot_id(s)
    assert after != before
    # (pgrep -f would find the shell running it: its command line holds the pattern.)
    assert s.commands.run("pgrep -x 'sleep|python3' || true").stdout == ""
    assert [p.pid for p in s.commands.list()] == []
    # The deprecated spelling does the same.
    s.commands.run("echo again > /tmp/fs.2")
    assert s.pause(keep_memory=False) is True
    s.connect()
    assert boot_id(s) not in (before, after)
    assert s.files.read("/tmp/fs.2") == "again\n"


def test_connect_with_reboot_cold_boots_a_full_pause(make):
    s = make()
    s.commands.run(COUNTER.format(n="rb"))
    counter_advances(s, "rb")
    before = boot_id(s)
    assert s.pause() is True
    Sandbox.connect(s.sandbox_id, on_resume="reboot")
    assert boot_id(s) != before
    assert s.commands.run("pgrep -x python3 || true").stdout == ""
    # A full pause resumed as usual keeps the processes and the boot id.
    s.commands.run(COUNTER.format(n="rb2"))
    now = boot_id(s)
    assert s.pause() is True
    s.connect()
    assert boot_id(s) == now
    counter_advances(s, "rb2")


def test_lifecycle_filesystem_pause_at_the_timeout(e2b, make, raw):
    s = make(lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    s.files.write("/tmp/lt", "kept")
    before = boot_id(s)
    s.set_timeout(0)
    assert s.get_info().state == SandboxState.PAUSED
    again = Sandbox.connect(s.sandbox_id)
    assert again.files.read("/tmp/lt") == "kept"
    assert boot_id(again) != before
    # A cold boot cannot be woken by traffic: the SDK refuses the pair, and so does the endpoint.
    with pytest.raises(InvalidArgumentException):
        make(lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}, "auto_resume": True})
    key = {"X-API-KEY": e2b.key}
    r = raw.post("/sandboxes", json={"templateID": "base", "autoPause": True, "autoPauseMemory": False,
                                     "autoResume": {"enabled": True}}, headers=key)
    assert r.status_code == 400 and "autoResume" in r.json()["message"], r.text
    r = raw.post("/sandboxes", json={"templateID": "base", "autoPauseMemory": False}, headers=key)
    assert r.status_code == 400 and "autoPause" in r.json()["message"], r.text


def test_snapshot_then_create_from_it(make, snapshots):
    s = make()
    s.files.write("/tmp/snap.txt", "in the snapshot")
    snap = snapshots(s.create_snapshot(name="e2b-" + TAG))
    assert snap.snapshot_id and snap.names == ["e2b-" + TAG]
    assert s.get_info().state == SandboxState.RUNNING  # the source keeps running
    s.files.write("/tmp/snap.txt", "after the snapshot")
    c = make(template=snap.snapshot_id)
    assert c.files.read("/tmp/snap.txt") == "in the snapshot"
    assert c.commands.run("cat /tmp/snap.txt").stdout == "in the snapshot"
    assert s.files.read("/tmp/snap.txt") == "after the snapshot"


def test_snapshot_and_fork_carry_a_detached_server(make, snapshots):
    """E2B's snapshots hold the whole VM; here a snapshot (and a fork) keeps the processes CRIU
    can keep: a server started detached (`nohup ... &`) serves in a sandbox made from the
    snapshot and in a fork child, under its pid."""
    s = make()
    s.files.write("www/index.html", "served")
    s.commands.run("cd www && nohup python3 -m http.server 8123 --bind 127.0.0.1 > /dev/null 2>&1 &")
    fetch = "curl -sS http://127.0.0.1:8123/index.html"
    wait_until(lambda: s.commands.run(fetch + " || true").stdout == "served", timeout=20, what="the server")
    server = s.commands.run("pgrep -f '^python3 -m http.server 8123'").stdout.strip()
    snap = snapshots(s.create_snapshot())
    (kid,) = s.fork(count=1)
    for c in (make(template=snap.snapshot_id), kid):
        assert c.commands.run(fetch).stdout == "served", c.sandbox_id
        assert c.commands.run("pgrep -f '^python3 -m http.server 8123'").stdout.strip() == server
        c.files.write("www/index.html", "child")
        assert c.commands.run(fetch).stdout == "child"
    assert s.commands.run(fetch).stdout == "served"


def test_snapshot_fork_and_rollback_carry_background_commands_and_terminals(make, snapshots, raw):
    """Commands started through the SDK (`background=True`, with stdin) and PTYs are kept by a
    snapshot and a fork as E2B's VM snapshots keep them: in a fork child, a sandbox made from the
    snapshot and after a rollback each is listed under its pid, carries on from where it was,
    takes input and streams output to a new handle (`connect`); the copies are independent."""
    s = make()
    ticker = s.commands.run("i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.05; done", background=True)
    cat = s.commands.run("cat", background=True, stdin=True)
    t = s.pty.create(PtySize(rows=24, cols=80), timeout=60)
    out, _, _ = pty_reader(t)
    s.pty.send_stdin(t.pid, b"x=41; echo set-$((x+1))\n")
    wait_until(lambda: b"set-42" in out, timeout=20, what="the shell's answer: %r" % out)
    pids = {ticker.pid, cat.pid, t.pid}

    def check(c, word):
        assert pids <= {p.pid for p in c.commands.list()}, (c.sandbox_id, c.commands.list())
        ticks, echoed, term = [], [], bytearray()
        for pid, sink in ((ticker.pid, ticks), (cat.pid, echoed)):
            h = c.commands.connect(pid, timeout=60)
            threading.Thread(target=lambda h=h, sink=sink: _follow(h, sink), daemon=True).start()
        h = c.pty.connect(t.pid, timeout=60)
        threading.Thread(target=lambda: _follow(h, term, pty=True), daemon=True).start()
        wait_until(lambda: "".join(ticks).count("\n") >= 4, what="the ticker in %s" % c.sandbox_id)
        # (Whole lines only: the first may have begun before the stream.)
        numbers = [int(x.split()[1]) for x in "".join(ticks).split("\n")[1:-1]]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
        c.commands.send_stdin(cat.pid, word + "\n")
        wait_until(lambda: word in "".join(echoed), what="cat in %s to echo its input" % c.sandbox_id)
        c.pty.send_stdin(t.pid, ("echo %s-$((x+2)) $(stty size)\n" % word).encode())
        wait_until(lambda: ("%s-43 24 80" % word).encode() in term, timeout=20, what="the shell: %r" % term)

    snap = snapshots(s.create_snapshot())
    kids = s.fork(count=2)
    made = make(template=snap.snapshot_id)
    for i, c in enumerate(kids + [made]):
        check(c, "child%d" % i)
    # Independent: killing the ticker in one child leaves the other's and the parent's.
    assert kids[0].commands.kill(ticker.pid) is True
    wait_until(lambda: ticker.pid not in {p.pid for p in kids[0].commands.list()}, what="the killed ticker to go")
    assert ticker.pid in {p.pid for p in kids[1].commands.list()}
    assert pids <= {p.pid for p in s.commands.list()}
    # A rollback of the parent puts them back as the snapshot had them, after they were killed.
    for pid in pids:
        s.commands.kill(pid)
    wait_until(lambda: not pids & {p.pid for p in s.commands.list()}, what="the parent's processes to end")
    key = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    r = raw.post("/sandboxes/%s/rollback" % s.sandbox_id, headers=key, json={"snapshotID": snap.snapshot_id})
    assert r.status_code == 200, r.text
    check(s, "rolledback")


def _follow(handle, sink, pty=False):
    """Read a command handle's output into `sink` (a list of stdout chunks, or a bytearray of
    terminal output) until it ends; errors end it quietly (the test looks at `sink`)."""
    try:
        if pty:
            handle.wait(on_pty=sink.extend)
        else:
            handle.wait(on_stdout=sink.append)
    except Exception:  # noqa: BLE001 (a killed command raises; the test looks at the sink)
        pass


def test_list_and_delete_snapshots(make, snapshots):
    a, b = make(), make()
    sa = snapshots(a.create_snapshot())
    sb = snapshots(Sandbox.create_snapshot(b.sandbox_id))
    every = [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
    assert sa.snapshot_id in every and sb.snapshot_id in every
    # The SDK sends ?sandboxID= for a sandbox's own snapshots (sandbox_sync/paginator.py SnapshotPaginator).
    assert [x.snapshot_id for x in a.list_snapshots().next_items()] == [sa.snapshot_id]
    assert [x.snapshot_id for x in Sandbox.list_snapshots(sandbox_id=b.sandbox_id).next_items()] == [sb.snapshot_id]
    assert Sandbox.delete_snapshot(sb.snapshot_id) is True
    assert Sandbox.delete_snapshot(sb.snapshot_id) is False
    assert sb.snapshot_id not in [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]


def test_snapshot_names_paging_and_filesystem_mode(make, snapshots):
    """A snapshot's name is a template id (its newest snapshot, as E2B's newest build of the
    template), `list_snapshots(name=)` filters by name or id, newest first and paged; and
    `create_snapshot(mode="filesystem")` keeps the files alone: what starts from it cold-boots,
    without the source's processes."""
    s = make()
    name = "named-" + TAG
    s.files.write("/tmp/n.txt", "first")
    s.commands.run("sleep 1000", background=True)
    first = snapshots(s.create_snapshot(name=name))
    s.files.write("/tmp/n.txt", "second")
    second = snapshots(s.create_snapshot(name=name))
    assert first.names == second.names == [name] and first.snapshot_id != second.snapshot_id
    listed = [x.snapshot_id for x in Sandbox.list_snapshots(name=name).next_items()]
    assert listed == [second.snapshot_id, first.snapshot_id]
    assert [x.snapshot_id for x in Sandbox.list_snapshots(name=first.snapshot_id).next_items()] == [first.snapshot_id]
    pages = Sandbox.list_snapshots(name=name, limit=1)
    seen = []
    while pages.has_next:
        seen += [x.snapshot_id for x in pages.next_items()]
    assert seen == listed
    for template in (name, name + ":latest"):
        c = make(template=template)
        assert c.files.read("/tmp/n.txt") == "second"
        assert [p.args for p in c.commands.list()] == [["-l", "-c", "sleep 1000"]]
    with pytest.raises(SandboxException, match="not usable as a template name"):
        s.create_snapshot(name="../up")
    with pytest.raises(SandboxException, match="is the name of a template"):
        s.create_snapshot(name="base")
    s.files.write("/tmp/n.txt", "files only")
    files = snapshots(s.create_snapshot(mode="filesystem"))
    c = make(template=files.snapshot_id)
    assert c.files.read("/tmp/n.txt") == "files only"
    assert c.commands.list() == []
    assert boot_id(c) != boot_id(s)
    assert [p.args for p in s.commands.list()] == [["-l", "-c", "sleep 1000"]]  # the source keeps running


def test_fork_children_are_independent(make):
    s = make(metadata={"role": "fork-parent"})
    s.files.write("/tmp/fork.txt", "parent")
    kids = s.fork(count=2)
    assert len(kids) == 2 and all(isinstance(k, Sandbox) for k in kids), kids
    ids = {k.sandbox_id for k in kids}
    assert len(ids) == 2 and s.sandbox_id not in ids
    for k in kids:
        assert k.files.read("/tmp/fork.txt") == "parent"
    kids[0].files.write("/tmp/fork.txt", "child0")
    assert kids[1].files.read("/tmp/fork.txt") == "parent"
    assert s.files.read("/tmp/fork.txt") == "parent"
    kids[1].kill()
    assert kids[0].is_running() and s.is_running()
    (k,) = Sandbox.fork(s.sandbox_id, count=1)  # class form
    assert k.commands.run("cat /tmp/fork.txt").stdout == "parent"


# ----------------------------------------------------------------------------- commands


def test_envs_at_create_and_per_command(box):
    assert box.commands.run("echo $FOO").stdout == "created\n"
    r = box.commands.run('echo "$FOO $BAR"', envs={"FOO": "override", "BAR": "bar"})
    assert r.stdout == "override bar\n"
    assert box.commands.run('echo "$FOO ${BAR-unset}"').stdout == "created unset\n"


def test_foreground_output_and_exit_codes(box):
    r = box.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as ei:
        box.commands.run("echo partial; echo bad >&2; exit 7")
    assert (ei.value.exit_code, ei.value.stdout, ei.value.stderr) == (7, "partial\n", "bad\n")


def test_cwd(box, me):
    assert box.commands.run("pwd").stdout == me.home + "\n"
    assert box.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    box.files.make_dir("cwd-rel")
    assert box.commands.run("pwd", cwd="cwd-rel").stdout == me.home + "/cwd-rel\n"


def test_streaming_callbacks(box):
    """Output reaches the callback while the command runs: it waits for stdin that the
    on_stdout callback only sends once it saw the first line."""
    h = box.commands.run('echo first; read x; echo "second $x"; echo e1 >&2', background=True, stdin=True)
    outs, errs = [], []

    def on_out(chunk):
        outs.append(chunk)
        if "first" in chunk and len(outs) == 1:
            box.commands.send_stdin(h.pid, "go\n")

    r = h.wait(on_stdout=on_out, on_stderr=errs.append)
    assert r.stdout == "first\nsecond go\n" == "".join(outs)
    assert r.stderr == "e1\n" == "".join(errs)
    outs2, errs2 = [], []
    r = box.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; done", on_stdout=outs2.append, on_stderr=errs2.append)
    assert "".join(outs2) == r.stdout == "o1\no2\no3\n"
    assert "".join(errs2) == r.stderr == "e1\ne2\ne3\n"


def test_background_list_and_kill(box):
    h = box.commands.run("sleep 1000", background=True)
    procs = {p.pid: p for p in box.commands.list()}
    assert h.pid in procs
    assert procs[h.pid].cmd == "/bin/bash" and procs[h.pid].args[-1] == "sleep 1000"
    assert h.kill() is True
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1
    h2 = box.commands.run("sleep 1000", background=True)
    assert box.commands.kill(h2.pid) is True
    wait_until(lambda: h2.pid not in {p.pid for p in box.commands.list()}, what="the killed command to leave the list")
    assert box.commands.kill(h2.pid) is False
    assert box.commands.kill(987654) is False


def test_stdin(box):
    h = box.commands.run("cat", background=True, stdin=True)
    h.send_stdin("hello\n")
    box.commands.send_stdin(h.pid, b"world\n")
    h.close_stdin()
    assert h.wait().stdout == "hello\nworld\n"
    h = box.commands.run("head -n1", background=True, stdin=True)
    h.send_stdin("line one\nline two\n")
    assert h.wait().stdout == "line one\n"


def test_connect_to_running_command(box):
    h = box.commands.run('echo ready; read x; echo "got $x"', background=True, stdin=True)
    for out, _, _ in h:
        if out and "ready" in out:
            break
    h.disconnect()
    c = box.commands.connect(h.pid)
    assert c.pid == h.pid
    box.commands.send_stdin(h.pid, "hi\n")
    assert "got hi\n" in c.wait().stdout
    with pytest.raises(NotFoundException):
        box.commands.connect(987654)


def test_long_output_arrives_complete(box):
    r = box.commands.run(PRINT_PAT)
    assert len(r.stdout) == MB
    assert hashlib.sha256(r.stdout.encode()).hexdigest() == hashlib.sha256(PAT.encode()).hexdigest()


def test_default_user_is_user(box, me):
    """E2B's default user: commands run as `user` in /home/user, and files written with a
    relative path land in its home, owned by it."""
    assert (me.user, me.home, me.cwd) == ("user", "/home/user", "/home/user")
    assert box.commands.run("whoami").stdout == "user\n"
    assert box.commands.run("pwd").stdout == "/home/user\n"
    home, uid = box.commands.run("echo $HOME; id -u").stdout.split()
    assert home == "/home/user" and uid != "0"
    info = box.files.write("users-rel.txt", "mine")
    assert info.path == "/home/user/users-rel.txt"
    assert box.commands.run("stat -c %U:%G /home/user/users-rel.txt").stdout == "user:user\n"
    assert box.files.get_info("users-rel.txt").owner == "user"
    box.commands.run("echo made > by-cmd.txt")
    assert box.commands.run("stat -c %U:%G /home/user/by-cmd.txt").stdout == "user:user\n"


def test_user_root(box):
    assert box.commands.run("whoami", user="root").stdout == "root\n"
    assert box.commands.run("pwd", user="root").stdout == "/root\n"
    assert box.files.write("/tmp/by-root", "r", user="root").path == "/tmp/by-root"
    assert box.commands.run("stat -c %U:%G /tmp/by-root").stdout == "root:root\n"
    assert box.files.get_info("/tmp/by-root").owner == "root"
    box.commands.run("echo r > /tmp/by-root-cmd", user="root")
    assert box.commands.run("stat -c %U:%G /tmp/by-root-cmd").stdout == "root:root\n"
    # Explicit user="user" is the default's twin.
    assert box.files.write("/tmp/by-user", "u", user="user").path == "/tmp/by-user"
    assert box.commands.run("stat -c %U:%G /tmp/by-user", user="root").stdout == "user:user\n"
    # What root wrote, the user cannot overwrite.
    box.commands.run("chmod 644 /tmp/by-root", user="root")
    with pytest.raises(CommandExitException):
        box.commands.run("echo x > /tmp/by-root")


def test_unknown_user_is_refused_cleanly(box):
    """(An upload as an unknown user is refused too, but before its body is read, which breaks
    the SDK's pooled connection for whatever request comes next: see
    test_keepalive_survives_refused_uploads.)"""
    for call in (lambda: box.commands.run("true", user="no-such-user"),
                 lambda: box.files.read("/etc/hostname", user="no-such-user"),
                 lambda: box.files.list("/tmp", user="no-such-user")):
        with pytest.raises((InvalidArgumentException, SandboxException)) as ei:
            call()
        assert "no-such-user" in str(ei.value), str(ei.value)
    assert box.commands.run("whoami").stdout == "user\n"


def test_sudo_works_for_user(box):
    """As in E2B's sandboxes: `user` has passwordless sudo (root of the sandbox's user namespace;
    test_escape.py checks what that root can and cannot do), quietly: the hostname resolves."""
    r = box.commands.run("sudo -n whoami")
    assert (r.stdout, r.stderr) == ("root\n", ""), r
    box.commands.run("echo by-sudo | sudo tee /root/by-sudo > /dev/null")
    assert box.commands.run("sudo cat /root/by-sudo").stdout == "by-sudo\n"
    assert box.commands.run("stat -c %U /root/by-sudo", user="root").stdout == "root\n"


# ----------------------------------------------------------------------------- files


def test_files_write_and_read_forms(box):
    f = box.files
    info = f.write("/tmp/fw/a.txt", "text ü")
    assert (info.name, info.path, info.type) == ("a.txt", "/tmp/fw/a.txt", FileType.FILE)
    assert f.read("/tmp/fw/a.txt") == "text ü"
    data = bytes(range(256)) * 64
    f.write("/tmp/fw/multipart.bin", data)  # multipart (default for bytes)
    f.write("/tmp/fw/octet.bin", data, use_octet_stream=True)
    f.write("/tmp/fw/fileobj.bin", io.BytesIO(data))  # file-like: octet-stream, streamed
    for p in ("multipart", "octet", "fileobj"):
        assert f.read("/tmp/fw/%s.bin" % p, format="bytes") == data, p
    big = os.urandom(3 * MB)
    f.write("/tmp/fw/big.bin", big, gzip=True)
    # Stored decompressed: the sandbox sees the bytes that were sent.
    assert box.commands.run("sha256sum /tmp/fw/big.bin").stdout.split()[0] == hashlib.sha256(big).hexdigest()
    assert f.read("/tmp/fw/big.bin", format="bytes", gzip=True) == big
    assert f.read("/tmp/fw/big.bin", format="bytes") == big
    with f.read("/tmp/fw/big.bin", format="stream") as st:
        assert b"".join(st) == big
    # Overwrite.
    f.write("/tmp/fw/a.txt", "second")
    assert f.read("/tmp/fw/a.txt") == "second"


def test_files_gzip_download_is_gzip_encoded(box, raw):
    box.files.write("/tmp/fz.txt", "z" * 10000)
    r = raw.get("/files", params={"path": "/tmp/fz.txt"}, headers=envd_headers(box, **{"Accept-Encoding": "gzip"}))
    assert r.status_code == 200
    assert r.headers.get("content-encoding") == "gzip"
    assert r.content == b"z" * 10000  # httpx decodes
    up = raw.post("/files", params={"path": "/tmp/fz2.txt"}, content=gzip_mod.compress(b"up" * 500),
                  headers=envd_headers(box, **{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}))
    assert up.status_code == 200, up.text
    assert box.files.read("/tmp/fz2.txt") == "up" * 500


def test_files_write_files_and_relative_paths(box, me):
    f = box.files
    out = f.write_files([{"path": "/tmp/wf/one", "data": "1"}, {"path": "/tmp/wf/two", "data": b"2"}])
    assert [w.path for w in out] == ["/tmp/wf/one", "/tmp/wf/two"]
    out = f.write_files([{"path": "/tmp/wf/three", "data": "3"}, {"path": "wf-rel/four", "data": b"4"}], use_octet_stream=True)
    assert [w.path for w in out] == ["/tmp/wf/three", me.home + "/wf-rel/four"]
    assert [e.name for e in f.list("/tmp/wf")] == ["one", "three", "two"]
    assert f.read("wf-rel/four") == "4" == f.read(me.home + "/wf-rel/four")
    f.write("~/wf-tilde", "t")
    assert box.commands.run("cat %s/wf-tilde" % me.home).stdout == "t"
    assert f.exists("wf-rel/four")
    assert f.get_info("wf-rel").path == me.home + "/wf-rel"


def test_files_list_stat_mkdir_rename_remove(box, me):
    f = box.files
    assert f.make_dir("/tmp/fl/d1/d2") is True
    assert f.make_dir("/tmp/fl/d1/d2") is False
    f.write("/tmp/fl/d1/d2/x", "xx")
    f.write("/tmp/fl/d1/y", "y")
    assert [(e.path, e.type) for e in f.list("/tmp/fl/d1")] == [("/tmp/fl/d1/d2", FileType.DIR), ("/tmp/fl/d1/y", FileType.FILE)]
    assert [e.path for e in f.list("/tmp/fl/d1", depth=2)] == ["/tmp/fl/d1/d2", "/tmp/fl/d1/d2/x", "/tmp/fl/d1/y"]
    assert f.exists("/tmp/fl/d1/d2/x") and not f.exists("/tmp/fl/nope")
    i = f.get_info("/tmp/fl/d1/d2/x")
    assert (i.name, i.type, i.path, i.size) == ("x", FileType.FILE, "/tmp/fl/d1/d2/x", 2)
    assert i.permissions.startswith("-")
    assert box.commands.run("stat -c %U /tmp/fl/d1/d2/x").stdout == me.user + "\n"
    assert i.owner == me.user, "EntryInfo.owner %r, the file's owner is %r" % (i.owner, me.user)
    assert f.get_info("/tmp/fl/d1").type == FileType.DIR
    with pytest.raises(FileNotFoundException):
        f.get_info("/tmp/fl/nope")
    moved = f.rename("/tmp/fl/d1/d2/x", "/tmp/fl/moved")
    assert (moved.path, moved.name) == ("/tmp/fl/moved", "moved")
    assert not f.exists("/tmp/fl/d1/d2/x") and f.read("/tmp/fl/moved") == "xx"
    f.remove("/tmp/fl/d1")
    assert not f.exists("/tmp/fl/d1")
    for call in (lambda: f.read("/tmp/fl/nope"), lambda: f.list("/tmp/fl/nope"),
                 lambda: f.rename("/tmp/fl/nope", "/tmp/fl/nope2"), lambda: f.remove("/tmp/fl/nope")):
        with pytest.raises(FileNotFoundException):
            call()


def test_files_metadata_is_kept_as_xattrs(box, raw):
    f = box.files
    w = f.write("/tmp/md/a.txt", "m", metadata={"Owner": "alice", "note": "two words"})
    assert w.metadata == {"owner": "alice", "note": "two words"}  # keys lowercased, as envd does
    assert f.get_info("/tmp/md/a.txt").metadata == {"owner": "alice", "note": "two words"}
    assert [(e.name, e.metadata) for e in f.list("/tmp/md")] == [("a.txt", {"owner": "alice", "note": "two words"})]
    # Kept where E2B keeps them: user.e2b.* extended attributes, visible in the sandbox.
    got = box.commands.run("python3 -c \"import os; print(os.getxattr('/tmp/md/a.txt', 'user.e2b.owner').decode())\"")
    assert got.stdout == "alice\n"
    # Set in the sandbox, read through the endpoint; a move keeps them.
    box.commands.run("python3 -c \"import os; os.setxattr('/tmp/md/a.txt', 'user.e2b.extra', b'x')\"")
    assert f.rename("/tmp/md/a.txt", "/tmp/md/b.txt").metadata == {"owner": "alice", "note": "two words", "extra": "x"}
    assert f.write("/tmp/md/plain.txt", "p").metadata is None and f.get_info("/tmp/md/plain.txt").metadata is None
    # Uploads of several files carry the same map; an overwrite without metadata has none.
    out = f.write_files([{"path": "/tmp/md/m1", "data": "1"}, {"path": "/tmp/md/m2", "data": "2"}], metadata={"k": "v"})
    assert [w.metadata for w in out] == [{"k": "v"}, {"k": "v"}]
    assert f.write("/tmp/md/m1", "again").metadata is None and f.get_info("/tmp/md/m1").metadata is None
    # Bad values are refused before anything is written (the SDK checks too: sent raw here).
    r = raw.post("/files", params={"path": "/tmp/md/bad"}, content=b"x",
                 headers=envd_headers(box, **{"Content-Type": "application/octet-stream", "X-Metadata-k": "v" * 9000}))
    assert r.status_code == 400 and "metadata" in r.json()["message"], r.text
    assert not f.exists("/tmp/md/bad")


def test_signed_urls(box, raw):
    box.files.write("/tmp/su/a.txt", "signed")
    url = box.download_url("/tmp/su/a.txt")
    assert "signature=v1_" in url
    # No sandbox header and no access token: the signature names the sandbox.
    r = httpx.get(url)
    assert (r.status_code, r.text) == (200, "signed")
    assert httpx.get(box.download_url("/tmp/su/a.txt", use_signature_expiration=60)).text == "signed"
    expired = httpx.get(box.download_url("/tmp/su/a.txt", use_signature_expiration=-5))
    assert expired.status_code == 401 and "expired" in expired.json()["message"]
    # A signature is for one path and one operation.
    r = httpx.get(url.replace("a.txt", "b.txt"))
    assert r.status_code == 401 and "signature" in r.json()["message"]
    assert httpx.post(url, files={"file": ("x", b"x")}).status_code == 401
    r = httpx.get(url, headers={"E2b-Sandbox-Id": box.sandbox_id, "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 200  # through the sandbox's header too
    up = box.upload_url("/tmp/su/up.txt")
    r = httpx.post(up, files={"file": ("up.txt", b"uploaded")})
    assert r.status_code == 200, r.text
    assert box.files.read("/tmp/su/up.txt") == "uploaded"
    assert box.files.get_info("/tmp/su/up.txt").owner == box.files.get_info("/tmp/su/a.txt").owner
    # The daemon answers the rest unharmed.
    assert raw.get("/files", params={"path": "/tmp/su/a.txt", "signature": "v1_nope"}).status_code == 401


def collect_events(handle, want, timeout=20):
    """Poll a watch handle until every (name, type) of ``want`` was seen; returns all events."""
    seen = []

    def done():
        seen.extend(handle.get_new_events())
        got = {(e.name, e.type.name) for e in seen}
        return want <= got

    wait_until(done, timeout=timeout, what="events %s (seen %s)" % (sorted(want), [(e.name, e.type.name) for e in seen]))
    return seen


def test_watch_dir_polled(box):
    f = box.files
    f.make_dir("/tmp/wd")
    h = f.watch_dir("/tmp/wd", request_timeout=20)
    f.write("/tmp/wd/a.txt", "1")
    box.commands.run("echo x >> /tmp/wd/b.txt && mkdir /tmp/wd/sub && chmod 600 /tmp/wd/b.txt && "
                     "mv /tmp/wd/b.txt /tmp/wd/c.txt && rm /tmp/wd/a.txt && echo y > /tmp/wd/sub/not-watched")
    want = {("a.txt", "CREATE"), ("a.txt", "WRITE"), ("b.txt", "CREATE"), ("b.txt", "WRITE"), ("sub", "CREATE"),
            ("b.txt", "CHMOD"), ("b.txt", "RENAME"), ("c.txt", "CREATE"), ("a.txt", "REMOVE")}
    seen = collect_events(h, want)
    names = {e.name for e in seen}
    assert not any(n.startswith(".branchbox") for n in names), names  # the upload's temporary file
    assert "sub/not-watched" not in names  # not recursive
    assert all(e.entry is None for e in seen)
    h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()


def test_watch_dir_recursive_with_entries(box):
    f = box.files
    f.make_dir("/tmp/wr/old")
    h = f.watch_dir("/tmp/wr", recursive=True, include_entry=True, request_timeout=20)
    f.write("/tmp/wr/old/x", "x")
    box.commands.run("mkdir /tmp/wr/new")
    collect_events(h, {("old/x", "WRITE"), ("new", "CREATE")})
    # A directory made after the watch started is watched once its creation was seen.
    box.commands.run("echo hello > /tmp/wr/new/y")
    seen = collect_events(h, {("new/y", "CREATE"), ("new/y", "WRITE")})
    y = [e for e in seen if e.name == "new/y" and e.entry is not None]
    assert y and y[-1].entry.path == "/tmp/wr/new/y" and y[-1].entry.type == FileType.FILE
    h.stop()


def test_watch_dir_errors(box):
    with pytest.raises(NotFoundException):
        box.files.watch_dir("/tmp/no-such-dir", request_timeout=20)
    box.files.write("/tmp/wfile", "f")
    with pytest.raises(InvalidArgumentException):
        box.files.watch_dir("/tmp/wfile", request_timeout=20)
    # A removed watched directory fails the watcher with a clear error.
    box.files.make_dir("/tmp/wgone")
    h = box.files.watch_dir("/tmp/wgone", request_timeout=20)
    box.commands.run("rmdir /tmp/wgone")

    def failed():
        try:
            h.get_new_events()
            return False
        except SandboxException as e:
            return "removed" in str(e)

    wait_until(failed, timeout=20, what="the watcher of a removed directory to fail")


def test_watch_survives_a_checkpoint(box, snapshots):
    """A checkpoint mounts the sandbox's root anew: the watch re-arms on it."""
    box.files.make_dir("/tmp/wc")
    h = box.files.watch_dir("/tmp/wc", request_timeout=20)
    bb = BBSandbox.connect(bb_id(box.sandbox_id), daemon=URL, resume=False)
    snapshots(SimpleNamespace(snapshot_id=bb.checkpoint(label="e2b-watch")))
    # Changes made right after the swap may be missed (the watch notices it within half a
    # second): keep writing until one is seen.
    n = [0]

    def seen():
        n[0] += 1
        box.files.write("/tmp/wc/after-%d" % n[0], "x")
        return any(e.name.startswith("after-") for e in h.get_new_events())

    wait_until(seen, timeout=20, what="an event after the checkpoint")
    h.stop()


# ----------------------------------------------------------------------------- PTY


def pty_reader(h):
    """Read a PTY handle's output on a thread: (output so far, {"result" or "error"}, thread)."""
    out, end = bytearray(), {}

    def run():
        try:
            end["result"] = h.wait(on_pty=out.extend)
        except Exception as e:  # an exit code other than 0 raises; kept for the test to look at
            end["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return out, end, t


def test_pty_input_resize_and_exit(make, me):
    s = make()
    h = s.pty.create(PtySize(rows=24, cols=80), timeout=60)
    out, end, t = pty_reader(h)
    s.pty.send_stdin(h.pid, b"tty; stty size; echo T=$TERM; id -un\n")
    wait_until(lambda: b"24 80" in out and b"T=xterm-256color" in out, timeout=20, what="the terminal's answers: %r" % out)
    assert b"/dev/pts/" in out  # a terminal of the sandbox's own devpts
    assert ("\n%s\r\n" % me.user).encode() in out.replace(b"\r\r", b"\r")  # as the default user
    s.pty.resize(h.pid, PtySize(rows=40, cols=100))
    s.pty.send_stdin(h.pid, b"stty size\n")
    wait_until(lambda: b"40 100" in out, timeout=20, what="the new size: %r" % out)
    s.pty.send_stdin(h.pid, b"exit 3\n")
    t.join(20)
    assert isinstance(end.get("error"), CommandExitException) and end["error"].exit_code == 3, end


def test_pty_reconnect_kill_and_bad_input(make):
    s = make()
    h = s.pty.create(PtySize(rows=24, cols=80), timeout=60)
    pid = h.pid
    h.disconnect()
    s.pty.send_stdin(pid, b"echo before-$((20+1))\n")  # while nobody listens: the shell keeps running
    h2 = s.pty.connect(pid, timeout=60)
    out, end, t = pty_reader(h2)
    s.pty.send_stdin(pid, b"echo again-$((40+2))\n")
    wait_until(lambda: b"again-42" in out, timeout=20, what="output after reconnecting: %r" % out)
    assert pid in [p.pid for p in s.commands.list()]
    # Terminal input to a process without one, and a resize of it, are refused clearly.
    c = s.commands.run("sleep 600", background=True)
    with pytest.raises(SandboxException) as ei:
        s.pty.send_stdin(c.pid, b"x")
    assert "no terminal" in str(ei.value)
    with pytest.raises(SandboxException) as ei:
        s.pty.resize(c.pid, PtySize(rows=10, cols=10))
    assert "no terminal" in str(ei.value)
    with pytest.raises(SandboxException):
        s.pty.create(PtySize(rows=0, cols=80), timeout=20)
    c.kill()
    assert s.pty.kill(pid) is True
    t.join(20)
    assert not t.is_alive() and "error" in end, end  # killed: no clean exit
    wait_until(lambda: pid not in [p.pid for p in s.commands.list()], timeout=10, what="the killed PTY to leave the list")
    assert s.commands.run("echo ok").stdout == "ok\n"


# ----------------------------------------------------------------------------- code interpreter

# A value with rich representations, as IPython's formatter finds them.
RICH = (
    "class Rich:\n"
    "    def _repr_html_(self): return '<b>rich</b>'\n"
    "    def _repr_png_(self): return b'\\x89PNG not really'\n"
    "    def __repr__(self): return 'Rich()'\n"
)


@pytest.fixture(scope="module")
def ci(e2b):
    """One code-interpreter sandbox shared by the tests that do not conflict (each uses names of
    its own in the default context)."""
    s = CISandbox.create(timeout=600, metadata={"suite": TAG, "role": "ci"})
    yield s
    kill_quietly(s.sandbox_id)


def ci_make(**kw):
    kw.setdefault("timeout", 300)
    kw["metadata"] = dict({"suite": TAG}, **kw.get("metadata", {}) or {})
    return CISandbox.create(**kw)


def context_ids(sbx):
    return {c.id for c in sbx.list_code_contexts()}


def test_ci_run_code_results_and_counter(ci):
    # The SDK's default template, code-interpreter-v1, is served by the base image.
    assert ci.get_info().template_id == "code-interpreter-v1"
    assert ci.commands.run("whoami").stdout == "user\n"
    e = ci.run_code("x = 1+1\nprint('hi')\nx")
    assert e.logs.stdout == ["hi\n"] and e.logs.stderr == [] and e.error is None
    (r,) = e.results
    assert r.text == "2" and r.is_main_result and e.text == "2"
    # State persists across calls; the counter moves by one per run.
    e2 = ci.run_code("y = x * 21\ny")
    assert e2.text == "42" and e2.execution_count == e.execution_count + 1
    e3 = ci.run_code("y = None")  # no last expression: no result
    assert e3.results == [] and e3.logs.stdout == [] and e3.execution_count == e2.execution_count + 1


def test_ci_exception(ci):
    e = ci.run_code("z0 = 'before'\n1/0")
    assert e.error is not None and e.results == []
    assert e.error.name == "ZeroDivisionError"
    assert "division by zero" in e.error.value
    assert "ZeroDivisionError" in e.error.traceback
    # What ran before the error stays; the context keeps working.
    assert ci.run_code("z0").text == "'before'"
    errs = []
    e = ci.run_code("raise ValueError('bad value')", on_error=errs.append)
    assert (e.error.name, e.error.value) == ("ValueError", "bad value")
    assert [x.name for x in errs] == ["ValueError"]


def test_ci_callbacks(ci):
    outs, errs, results = [], [], []
    e = ci.run_code("import sys\nprint('o1')\nprint('e1', file=sys.stderr)\n6 * 7",
                    on_stdout=outs.append, on_stderr=errs.append, on_result=results.append)
    assert "".join(m.line for m in outs) == "o1\n" == "".join(e.logs.stdout)
    assert not any(m.error for m in outs)
    assert "".join(m.line for m in errs) == "e1\n" == "".join(e.logs.stderr)
    assert all(m.error for m in errs)
    assert [r.text for r in results] == ["42"] and results[0].is_main_result


def test_ci_output_streams_while_the_code_runs(ci):
    """The code waits for a file the test writes when the first line reaches ``on_stdout``: the
    run says "streamed" only if that line came while it ran (it gives up after 30 s)."""
    flag = "/tmp/streamed-" + uuid.uuid4().hex[:8]

    def on_stdout(m):
        if m.line.startswith("first"):
            ci.files.write(flag, "seen")

    code = ("import os, sys, time\nprint('first')\nprint('to stderr', file=sys.stderr)\n"
            "for _ in range(600):\n    if os.path.exists(%r): break\n    time.sleep(0.05)\n"
            "print('streamed' if os.path.exists(%r) else 'not streamed')\n'done'" % (flag, flag))
    e = ci.run_code(code, on_stdout=on_stdout)
    assert "".join(e.logs.stdout) == "first\nstreamed\n", e.logs
    assert "".join(e.logs.stderr) == "to stderr\n" and e.text == "'done'", e
    # The same in a bash context (its output is its processes').
    flag2 = flag + "-sh"

    def on_sh(m):
        if m.line.startswith("first"):
            ci.files.write(flag2, "seen")

    sh = ("echo first; for i in $(seq 600); do [ -e %s ] && break; sleep 0.05; done; "
          "[ -e %s ] && echo streamed || echo not streamed" % (flag2, flag2))
    e = ci.run_code(sh, language="bash", on_stdout=on_sh)
    assert "".join(e.logs.stdout) == "first\nstreamed\n", e.logs


def test_ci_bash(ci):
    e = ci.run_code("echo $((6*7))", language="bash")
    assert e.logs.stdout == ["42\n"] and e.error is None
    # The bash context keeps its shell state too, apart from python's.
    ci.run_code("CI_BASH=kept; cd /tmp", language="bash")
    assert ci.run_code('echo "$CI_BASH $PWD"', language="bash").logs.stdout == ["kept /tmp\n"]
    assert ci.run_code("CI_BASH").error.name == "NameError"


def test_ci_contexts(ci):
    ci.run_code("ctx_var = 'default'")
    ctx = ci.create_code_context()
    assert ctx.language == "python" and ctx.cwd == "/home/user"
    assert ctx.id in context_ids(ci)
    # Isolated from the default context, both ways.
    assert ci.run_code("ctx_var", context=ctx).error.name == "NameError"
    assert ci.run_code("ctx_var = 'ctx'", context=ctx).error is None
    assert ci.run_code("ctx_var").text == "'default'"
    assert ci.run_code("ctx_var", context=ctx).text == "'ctx'"
    assert ci.run_code("import os\nos.getcwd()", context=ctx).text == "'/home/user'"
    # Restart: same context, fresh state.
    ci.restart_code_context(ctx)
    assert ci.run_code("ctx_var", context=ctx).error.name == "NameError"
    assert ctx.id in context_ids(ci)
    ci.remove_code_context(ctx)
    assert ctx.id not in context_ids(ci)
    with pytest.raises(NotFoundException):
        ci.run_code("1", context=ctx)
    assert ci.run_code("ctx_var").text == "'default'"
    # A bash context with its own cwd; removed by id.
    b = ci.create_code_context(cwd="/tmp", language="bash")
    assert b.language == "bash" and b.cwd == "/tmp"
    assert ci.run_code("pwd", context=b).logs.stdout == ["/tmp\n"]
    ci.remove_code_context(b.id)
    assert b.id not in context_ids(ci)
    with pytest.raises(InvalidArgumentException):  # the SDK refuses both at once
        ci.run_code("1", language="python", context=ctx)


def test_ci_rich_results_and_display(ci):
    e = ci.run_code(RICH + "Rich()")
    (r,) = e.results
    assert r.is_main_result
    assert r.html == "<b>rich</b>"
    assert base64.b64decode(r.png) == b"\x89PNG not really"
    assert r.text == "Rich()"
    assert {"html", "png"} <= set(r.formats())
    # display() adds results that are not the main one.
    seen = []
    e = ci.run_code("display(Rich())\nprint('between')\n'last'", on_result=seen.append)
    assert [(x.is_main_result, x.html, x.text) for x in e.results] == [(False, "<b>rich</b>", "Rich()"), (True, None, "'last'")]
    assert base64.b64decode(e.results[0].png) == b"\x89PNG not really"
    assert e.logs.stdout == ["between\n"] and len(seen) == 2
    assert e.text == "'last'"  # Execution.text is the main result's


def test_ci_envs_hold_for_one_run(ci):
    code = "import os, subprocess\n(os.environ.get('CI_ENV'), subprocess.check_output('echo $CI_ENV', shell=True, text=True))"
    assert ci.run_code(code, envs={"CI_ENV": "x"}).text == "('x', 'x\\n')"
    assert ci.run_code(code).text == "(None, '\\n')"
    assert ci.run_code("echo \"[$CI_SH]\"", language="bash", envs={"CI_SH": "it's"}).logs.stdout == ["[it's]\n"]
    assert ci.run_code("echo \"[$CI_SH]\"", language="bash").logs.stdout == ["[]\n"]
    with pytest.raises(SandboxException) as ei:
        ci.run_code("1", envs={"NOT-A-NAME": "x"})
    assert "400" in str(ei.value) and "NOT-A-NAME" in str(ei.value), str(ei.value)


def test_ci_unsupported_is_refused_cleanly(ci):
    # javascript and typescript need node, which the base image (serving code-interpreter-v1
    # until it is built) does not have: said up front, nothing started.
    for language in ("javascript", "ts"):
        with pytest.raises(SandboxException) as ei:
            ci.run_code("1 + 1", language=language)
        assert "400" in str(ei.value) and "has no node" in str(ei.value), str(ei.value)
    assert not [c for c in ci.list_code_contexts() if c.language in ("javascript", "typescript")]
    with pytest.raises(SandboxException) as ei:
        ci.create_code_context(language="r")
    assert "400" in str(ei.value) and '"typescript"' in str(ei.value), str(ei.value)
    assert ci.run_code("'still fine'").text == "'still fine'"


def test_ci_client_timeout_interrupts_the_run(ci):
    ci.run_code("timeout_state = 'kept'")
    with pytest.raises(TimeoutException):
        ci.run_code("import time\ntime.sleep(30)", timeout=2)

    def usable():
        try:
            return ci.run_code("1", timeout=5).text == "1"
        except TimeoutException:
            return False

    # The server interrupts the run (SIGINT) when the client goes away: the context is free well
    # before the 30 s sleep would have ended, and keeps its state.
    wait_until(usable, timeout=10, interval=0.2, what="the context to be usable after a client-side timeout")
    assert ci.run_code("timeout_state").text == "'kept'"


def extra_contexts(sbx, n=2):
    """``n`` more python contexts, made after the default one (each holding a variable of its
    own): a fork or a snapshot must keep telling the default context from them."""
    # The last one starts in /tmp: a fork's children list it there too.
    ctxs = [sbx.create_code_context(cwd="/tmp" if i == n - 1 else None) for i in range(n)]
    for i, c in enumerate(ctxs):
        assert sbx.run_code("cv = 'ctx%d'" % i, context=c).error is None
    return ctxs


def default_context_is_kept(sbx, expect):
    """The default context still is the one that ran first (the others' counters are lower)."""
    e = sbx.run_code("v")
    assert e.error is None, "the default context is another one: %s: %s" % (e.error.name, e.error.value)
    assert e.text == expect


def test_ci_fork_children_carry_code_state(e2b, make):
    s = ci_make(metadata={"role": "ci-fork"})
    make.adopt(s.sandbox_id)
    s.run_code("v = 'parent'\nn = 41")
    ctxs = extra_contexts(s)
    kids = s.fork(count=3)
    assert len(kids) == 3 and all(isinstance(k, CISandbox) for k in kids), kids
    for k in kids:
        make.adopt(k.sandbox_id)
    cwds = {c.id: c.cwd for c in s.list_code_contexts()}
    assert cwds[ctxs[-1].id] == "/tmp"
    for k in kids:
        assert context_ids(k) == context_ids(s)
        assert {c.id: c.cwd for c in k.list_code_contexts()} == cwds
        for i, c in enumerate(ctxs):
            assert k.run_code("cv", context=c).text == "'ctx%d'" % i
        default_context_is_kept(k, "'parent'")
    kids[0].run_code("v = 'child'\nn += 1")
    assert kids[0].run_code("(v, n)").text == "('child', 42)"
    assert kids[1].run_code("(v, n)").text == "('parent', 41)"
    assert s.run_code("(v, n)").text == "('parent', 41)"
    kids[1].run_code("cv = 'changed'", context=ctxs[0])
    assert s.run_code("cv", context=ctxs[0]).text == "'ctx0'"


def test_ci_snapshot_carries_code_state(e2b, make, snapshots):
    s = ci_make()
    make.adopt(s.sandbox_id)
    s.run_code("v = [1, 2, 3]")
    ctxs = extra_contexts(s)
    snap = snapshots(s.create_snapshot())
    s.run_code("v.append(4)")
    for _ in range(3):
        c = ci_make(template=snap.snapshot_id)
        make.adopt(c.sandbox_id)
        assert c.run_code("cv", context=ctxs[1]).text == "'ctx1'"
        default_context_is_kept(c, "[1, 2, 3]")
    assert s.run_code("v").text == "[1, 2, 3, 4]"


async def test_ci_async(e2b):
    s = await CIAsyncSandbox.create(timeout=300, metadata={"suite": TAG, "role": "ci-async"})
    try:
        outs, results = [], []

        async def on_result(r):
            results.append(r)

        e = await s.run_code("x = 1+1\nprint('hi')\nx", on_stdout=outs.append, on_result=on_result)
        assert e.logs.stdout == ["hi\n"] and e.text == "2" and e.results[0].is_main_result
        assert [m.line for m in outs] == ["hi\n"] and [r.text for r in results] == ["2"]
        e2 = await s.run_code("x + 40")
        assert e2.text == "42" and e2.execution_count == e.execution_count + 1
        err = (await s.run_code("1/0")).error
        assert err.name == "ZeroDivisionError" and "ZeroDivisionError" in err.traceback
        assert (await s.run_code("echo $((6*7))", language="bash")).logs.stdout == ["42\n"]
        ctx = await s.create_code_context()
        assert (await s.run_code("x", context=ctx)).error.name == "NameError"
        assert ctx.id in {c.id for c in await s.list_code_contexts()}
        await s.remove_code_context(ctx)
        assert ctx.id not in {c.id for c in await s.list_code_contexts()}
        assert (await s.run_code("import os\nos.environ['A']", envs={"A": "b"})).text == "'b'"
    finally:
        await CIAsyncSandbox.kill(s.sandbox_id)


# ----------------------------------------------------------------------------- branchbox extras on E2B ids


def test_branchbox_checkpoint_rollback_on_e2b_sandbox(make, snapshots):
    s = make()
    s.files.write("/tmp/rb.txt", "v1")
    bb = BBSandbox.connect(s.sandbox_id, daemon=URL)  # the dashless id is accepted
    try:
        assert bb.info().id == bb_id(s.sandbox_id)
        snap = snapshots(SimpleNamespace(snapshot_id=bb.checkpoint(label="e2b-rb"))).snapshot_id
        s.files.write("/tmp/rb.txt", "v2")
        s.files.write("/tmp/rb-new.txt", "new")
        bb.rollback(snap)
        assert s.files.read("/tmp/rb.txt") == "v1"
        assert not s.files.exists("/tmp/rb-new.txt")
        assert s.commands.run("cat /tmp/rb.txt").stdout == "v1"
        assert s.get_info().state == SandboxState.RUNNING
    finally:
        bb.close()


def test_branchbox_fork_with_processes_gives_children_the_e2b_commands(make):
    """branchbox's own fork (`processes="keepable"`) of an E2B sandbox copies the commands the
    E2B SDK started into each child, where the E2B SDK lists and reaches them by the child's id."""
    s = make()
    cat = s.commands.run("cat", background=True, stdin=True)
    bb = BBSandbox.connect(s.sandbox_id, daemon=URL)
    try:
        children, res = bb.fork_info(2, processes="keepable")
    finally:
        bb.close()
    for c in children:
        make.adopt(c.id.replace("-", ""))
        c.close()
    kids = [Sandbox.connect(c.id.replace("-", ""), timeout=120) for c in children]
    assert not res.processes_not_restored, res.processes_not_restored
    for k in kids:
        assert cat.pid in {p.pid for p in k.commands.list()}, k.sandbox_id
        echoed = []
        h = k.commands.connect(cat.pid, timeout=60)
        threading.Thread(target=_follow, args=(h, echoed), daemon=True).start()
        k.commands.send_stdin(cat.pid, "to %s\n" % k.sandbox_id)
        wait_until(lambda: "to %s" % k.sandbox_id in "".join(echoed), what="cat in %s" % k.sandbox_id)
    s.commands.send_stdin(cat.pid, "still here\n")
    assert cat.pid in {p.pid for p in s.commands.list()}


def test_branchbox_rollback_of_code_state(e2b, make, snapshots):
    s = ci_make()
    make.adopt(s.sandbox_id)
    s.run_code("v = 'at checkpoint'")
    extra_contexts(s, 6)  # the more contexts, the likelier a mix-up shows
    bb = BBSandbox.connect(s.sandbox_id, daemon=URL)
    try:
        snap = snapshots(SimpleNamespace(snapshot_id=bb.checkpoint())).snapshot_id
        s.run_code("v = 'later'")
        bb.rollback(snap)
    finally:
        bb.close()  # not `with`: its exit kills the sandbox
    default_context_is_kept(s, "'at checkpoint'")


def test_raw_rollback_endpoint(make, raw):
    s = make()
    key = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    s.files.write("/tmp/rr.txt", "before")
    r = raw.post("/sandboxes/%s/snapshots" % s.sandbox_id, headers=key, json={})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    try:
        s.files.write("/tmp/rr.txt", "after")
        r = raw.post("/sandboxes/%s/rollback" % s.sandbox_id, headers=key, json={"snapshotID": snap})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["sandboxID"] == s.sandbox_id, body
        assert s.files.read("/tmp/rr.txt") == "before"
        # Bad input: no snapshot, an unknown one, an unknown sandbox.
        r = raw.post("/sandboxes/%s/rollback" % s.sandbox_id, headers=key, json={})
        assert r.status_code == 400, r.text
        r = raw.post("/sandboxes/%s/rollback" % s.sandbox_id, headers=key, json={"snapshotID": "no-such-snap"})
        assert r.status_code == 404, r.text
        r = raw.post("/sandboxes/sb000000000000/rollback", headers=key, json={"snapshotID": snap})
        assert r.status_code == 404, r.text
        r = raw.post("/sandboxes/%s/rollback" % s.sandbox_id, json={"snapshotID": snap})
        assert r.status_code == 401, r.text
    finally:
        Sandbox.delete_snapshot(snap)


# ----------------------------------------------------------------------------- bad input


def test_wrong_api_key(e2b):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-the-token", timeout=30)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="not-the-token").next_items()


def test_unknown_template(e2b):
    with pytest.raises(SandboxException) as ei:
        Sandbox.create(template="no-such-template-" + TAG, timeout=30)
    assert "404" in str(ei.value)


def test_data_plane_of_a_killed_sandbox(make, raw):
    s = make()
    s.kill()
    assert s.is_running() is False
    for call in (lambda: s.commands.run("true"), lambda: s.files.read("/etc/hostname"),
                 lambda: s.files.write("/tmp/x", "x"), lambda: s.files.list("/tmp"), lambda: s.commands.list()):
        with pytest.raises(SandboxNotRunningException):
            call()
    r = raw.get("/health", headers=envd_headers(s))
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_raw_connect_protocol_errors(box, raw):
    h = envd_headers(box, **{"Content-Type": "application/connect+json"})
    # A streaming RPC with a malformed envelope: HTTP 200, one end-stream envelope with the error.
    for body in (b"\x00\x00\x00", b"\x00\x00\x00\x00\x09not json!", envelope(b"{}") + b"\x00"):
        r = raw.post("/process.Process/Start", headers=h, content=body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/connect+json")
        ((flags, msg),) = envelopes(r.content)
        assert flags & 0x02 and msg["error"]["code"] == "invalid_argument", (flags, msg)
    # Unary RPCs with bad JSON: 400 {"code": "invalid_argument"}.
    hu = envd_headers(box, **{"Content-Type": "application/json"})
    for rpc in ("filesystem.Filesystem/Stat", "filesystem.Filesystem/ListDir", "filesystem.Filesystem/MakeDir",
                "process.Process/SendInput", "process.Process/CloseStdin", "process.Process/SendSignal"):
        r = raw.post("/" + rpc, headers=hu, content=b"{not json")
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (rpc, r.status_code, r.text)
    # No / a wrong access token.
    for hdrs in (envd_headers(box, token=False), envd_headers(box, **{"X-Access-Token": "wrong"})):
        r = raw.post("/filesystem.Filesystem/Stat", headers=dict(hdrs, **{"Content-Type": "application/json"}),
                     content=b'{"path": "/tmp"}')
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
        r = raw.post("/process.Process/Start", headers=dict(hdrs, **{"Content-Type": "application/connect+json"}),
                     content=envelope(json.dumps({"process": {"cmd": "/bin/true"}}).encode()))
        ((flags, msg),) = envelopes(r.content)
        assert flags & 0x02 and msg["error"]["code"] == "unauthenticated", msg
        r = raw.get("/files", params={"path": "/etc/hostname"}, headers=hdrs)
        assert r.status_code == 401, r.text
    # The SDK with a wrong token gets AuthenticationException.
    cfg = ConnectionConfig(extra_sandbox_headers={"E2b-Sandbox-Id": box.sandbox_id, "E2b-Sandbox-Port": "49983",
                                                  "X-Access-Token": "wrong"})
    bad = Sandbox(sandbox_id=box.sandbox_id, sandbox_domain=None, envd_version=box._envd_version,
                  envd_access_token="wrong", connection_config=cfg)
    with pytest.raises(AuthenticationException):
        bad.files.list("/tmp")
    with pytest.raises(AuthenticationException):
        bad.commands.run("true")


def test_list_rpc_with_bad_json(box, raw):
    """Every unary RPC parses its request: `{not json` is invalid_argument, List's too."""
    r = raw.post("/process.Process/List", headers=envd_headers(box, **{"Content-Type": "application/json"}),
                 content=b"{not json")
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (r.status_code, r.text)


def test_path_traversal_is_refused(box, make, raw):
    other = make()
    with open("/etc/passwd", "rb") as fh:
        host_before = hashlib.sha256(fh.read()).hexdigest()
    inside_before = box.commands.run("sha256sum /etc/passwd").stdout
    h = envd_headers(box)
    # (Refused uploads on connections of their own: the refusal leaves the body unread, and the
    # connection dies under the next request: test_keepalive_survives_refused_uploads.)
    hc = dict(h, Connection="close")
    r = raw.post("/files?path=/../../etc/passwd", headers=dict(hc, **{"Content-Type": "application/octet-stream"}),
                 content=b"pwned\n")
    assert r.status_code == 400, r.text
    r = raw.post("/files", params={"path": "/../../etc/passwd"}, headers=hc, files={"file": ("passwd", b"pwned\n")})
    assert r.status_code == 400, r.text
    r = raw.get("/files", params={"path": "/../../../etc/shadow"}, headers=h)
    assert r.status_code == 400, r.text
    with open("/etc/passwd", "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == host_before
    assert box.commands.run("sha256sum /etc/passwd").stdout == inside_before
    # The daemon keeps serving: another sandbox's health, and a fresh sandbox.
    assert raw.get("/health", headers=envd_headers(other)).status_code in (200, 204)
    assert other.is_running()
    assert make().commands.run("echo alive").stdout == "alive\n"


def test_daemon_still_works_after_bad_input(make):
    s = make(envs={"AFTER": "bad-input"})
    assert s.commands.run("echo $AFTER").stdout == "bad-input\n"


def test_keepalive_connections_survive_early_answers(make, raw):
    """A keep-alive client must be able to send its next request on the connection an answer
    came on. Answers given before the request body was read (a paused sandbox's 502 to a
    streamed Start body, `pause` ignoring its JSON body) must not leave a connection the server
    closes without saying so: the SDK's pool (pyqwest) reuses it and the next call fails with
    "connection closed before message completed"."""
    s = make()
    key = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    closing = []
    for _ in range(10):
        r = raw.post("/sandboxes/%s/pause" % s.sandbox_id, headers=key, json={})
        assert r.status_code == 204, r.text
        closing += [r.headers.get("connection")] if r.headers.get("connection") == "close" else []
        assert raw.post("/v2/sandboxes/%s/connect" % s.sandbox_id, headers=key, json={}).status_code == 201
    assert raw.post("/sandboxes/%s/pause" % s.sandbox_id, headers=key, json={}).status_code == 204
    h = envd_headers(s, **{"Content-Type": "application/connect+json"})
    body = envelope(json.dumps({"process": {"cmd": "/bin/true"}}).encode())
    errors = []
    for i in range(30):
        for content in (lambda: iter([body]), lambda: body):  # chunked, then sized
            try:
                r = raw.post("/process.Process/Start", headers=h, content=content())
                assert r.status_code == 502, r.text
            except httpx.TransportError as e:
                errors.append("%d: %s: %s" % (i, type(e).__name__, e))
    assert not errors, "requests after early answers failed on a closed keep-alive connection:\n" + "\n".join(errors)
    assert not closing, "pause answered Connection: close %d times out of 10" % len(closing)


def pipelined(port, first, second):
    """Send two HTTP/1.1 requests back to back on one connection (the second asks to close it),
    read until the server closes it, and return the status codes it answered: a server that
    answers the first without reading its body closes the connection and never answers the
    second (what a keep-alive client sees, at random, as a reused connection closed under it)."""
    import socket

    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as c:
        c.sendall(first + second)
        try:
            while True:
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def http_request(method, target, headers, body=b"", close=False):
    h = dict(headers, Host="127.0.0.1", **{"Content-Length": str(len(body))})
    if close:
        h["Connection"] = "close"
    head = "%s %s HTTP/1.1\r\n" % (method, target) + "".join("%s: %s\r\n" % kv for kv in h.items()) + "\r\n"
    return head.encode() + body


@pytest.mark.parametrize("case", ["unknown-user", "path-climbs-out", "no-path", "wrong-token", "gone-sandbox"])
def test_keepalive_survives_refused_uploads(e2b, box, make, case):
    """Every early answer to an upload reads the body first, so the connection serves the next
    request. (Through the SDK, the unknown-user case is `files.write(..., user="no-such-user")`
    then `files.exists()` failing now and then with SandboxUnreachableException "connection
    closed before message completed": test_unknown_user_is_refused_cleanly.)"""
    target = box
    if case == "gone-sandbox":
        target = make()
        target.kill()
    h = envd_headers(target, **{"Content-Type": "application/octet-stream"})
    query = {"unknown-user": "?path=/tmp/ka&username=no-such-user", "path-climbs-out": "?path=/../../etc/ka",
             "no-path": "", "wrong-token": "?path=/tmp/ka", "gone-sandbox": "?path=/tmp/ka"}[case]
    if case == "wrong-token":
        h["X-Access-Token"] = "wrong"
    first = http_request("POST", "/files" + query, h, b"x" * (64 << 10))
    second = http_request("GET", "/health", envd_headers(box), close=True)
    codes = pipelined(e2b.daemon.e2b_port, first, second)
    assert len(codes) == 2 and codes[0] >= 400 and codes[1] in (200, 204), \
        "%s: answers %r: the connection was closed after the refusal, its body unread" % (case, codes)
    assert not box.files.exists("/tmp/ka")


# ----------------------------------------------------------------------------- async


async def _acleanup(*boxes):
    await asyncio.gather(*(AsyncSandbox.kill(b.sandbox_id) for b in boxes), return_exceptions=True)


async def test_async_main_surface(e2b):
    s = await AsyncSandbox.create(envs={"X": "async"}, metadata={"suite": TAG, "role": "async"}, timeout=300)
    try:
        assert (await s.commands.run("echo $X")).stdout == "async\n"
        with pytest.raises(CommandExitException) as ei:
            await s.commands.run("exit 5")
        assert ei.value.exit_code == 5
        # Streaming: the callback sees the first line before the command (waiting on stdin) ends.
        outs = []
        h = await s.commands.run("echo first; read x; echo got $x", background=True, stdin=True, on_stdout=outs.append)
        deadline = time.monotonic() + 15
        while not any("first" in o for o in outs):
            assert time.monotonic() < deadline, "no output streamed before the command ended"
            await asyncio.sleep(0.02)
        await h.send_stdin("yes\n")
        assert (await h.wait()).stdout == "first\ngot yes\n"
        h = await s.commands.run("sleep 1000", background=True)
        assert h.pid in [p.pid for p in await s.commands.list()]
        assert await s.commands.kill(h.pid) is True
        await s.files.write("/tmp/a.txt", "async file")
        assert await s.files.read("/tmp/a.txt") == "async file"
        assert await s.files.read("/tmp/a.txt", format="bytes", gzip=True) == bytearray(b"async file")
        assert [e.name for e in await s.files.list("/tmp")] == ["a.txt"]
        assert await s.files.exists("/tmp/a.txt")
        info = await s.get_info()
        assert info.state == SandboxState.RUNNING and info.metadata["role"] == "async"
        p = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": TAG, "role": "async"}))
        assert [i.sandbox_id for i in await p.next_items()] == [s.sandbox_id]
        assert await s.pause() is True
        assert await s.is_running() is False
        await s.connect()
        assert await s.is_running()
        assert await s.files.read("/tmp/a.txt") == "async file"
        assert await s.kill() is True
        assert await AsyncSandbox.kill(s.sandbox_id) is False
        with pytest.raises(SandboxNotRunningException):
            await s.commands.run("true")
    finally:
        await _acleanup(s)


TICKER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/t.new; mv /tmp/t.new /tmp/tick; sleep 0.05; done"


async def _ticking(sbx):
    """The ticker of ``sbx`` counts on: two counts seen within 20 s (a copy made before its first
    count writes the file once it runs)."""
    seen = set()
    deadline = time.monotonic() + 20
    while len(seen) < 2:
        assert time.monotonic() < deadline, "the ticker of %s stopped at %s" % (sbx.sandbox_id, seen)
        if await sbx.files.exists("/tmp/tick"):
            seen.add((await sbx.files.read("/tmp/tick")).strip())
        await asyncio.sleep(0.05)


async def test_async_concurrent_snapshot_fork_rollback_pause_rounds(e2b):
    """Clients doing snapshot, fork, rollback, create-by-name, pause and delete at once: every
    copy keeps its background command. (Collecting unused process images, run by each delete,
    once deleted an image whose snapshot or pause was being recorded meanwhile; a rollback once
    restored the ticker while a killed member of its process group still held its pid.)"""
    made, errors = [], []

    async def rounds(w):
        for r in range(3):
            s = await AsyncSandbox.create(metadata={"suite": TAG}, timeout=300)
            made.append(s)
            name = "conc-%s-%d" % (TAG, w)
            await s.files.write("f", "round %d" % r)
            await s.commands.run(TICKER, background=True)
            snap = await s.create_snapshot(name=name)
            try:
                await s.files.write("f", "changed")
                kids = await s.fork(count=2)
                made.extend(kids)
                for k in kids:
                    assert await k.files.read("f") == "changed"
                    assert len(await k.commands.list()) == 1
                    await _ticking(k)
                back = await asyncio.to_thread(
                    httpx.post, e2b.url + "/sandboxes/%s/rollback" % s.sandbox_id,
                    json={"snapshotID": snap.snapshot_id}, headers={"X-API-KEY": e2b.key}, timeout=60,
                )
                assert back.status_code == 200, back.text
                assert await s.files.read("f") == "round %d" % r
                c = await AsyncSandbox.create(name, metadata={"suite": TAG}, timeout=300)
                made.append(c)
                assert await c.files.read("f") == "round %d" % r
                assert await c.pause() is True
                await c.connect()
                assert len(await c.commands.list()) == 1
                await _ticking(c)
                await _ticking(s)
            finally:
                await AsyncSandbox.delete_snapshot(snap.snapshot_id)

    async def guarded(w):
        try:
            await rounds(w)
        except Exception as e:  # all workers finish; the first failure is reported
            errors.append(e)

    try:
        await asyncio.gather(*(guarded(w) for w in range(4)))
        if errors:
            raise errors[0]
    finally:
        await _acleanup(*made)
        for b in made:
            await asyncio.to_thread(delete_snapshots_of, b.sandbox_id)  # the forks'


async def test_async_fork(e2b):
    before = ids_now()
    s = await AsyncSandbox.create(metadata={"suite": TAG}, timeout=300)
    try:
        await s.files.write("/tmp/f", "parent")
        (k,) = await s.fork(count=1)
        assert isinstance(k, AsyncSandbox)
        assert await k.files.read("/tmp/f") == "parent"
        await k.files.write("/tmp/f", "child")
        assert await s.files.read("/tmp/f") == "parent"
    finally:
        await _acleanup(s)
        for sid in ids_now() - before:
            kill_quietly(sid)
        delete_snapshots_of(s.sandbox_id)  # the fork's


async def test_async_snapshot_and_errors(e2b):
    s = await AsyncSandbox.create(metadata={"suite": TAG}, timeout=300)
    c = None
    try:
        with pytest.raises(AuthenticationException):
            await AsyncSandbox.create(api_key="wrong", timeout=30)
        with pytest.raises(NotFoundException):
            await AsyncSandbox.connect("sb000000000000")
        await s.files.write("/tmp/s.txt", "snap")
        snap = await s.create_snapshot()
        try:
            c = await AsyncSandbox.create(snap.snapshot_id, metadata={"suite": TAG}, timeout=300)
            assert await c.files.read("/tmp/s.txt") == "snap"
        finally:
            await AsyncSandbox.delete_snapshot(snap.snapshot_id)
    finally:
        await _acleanup(*(x for x in (s, c) if x is not None))






async def test_async_pty(e2b):
    s = await AsyncSandbox.create(metadata={"suite": TAG, "role": "async-pty"}, timeout=300)
    try:
        out = bytearray()
        h = await s.pty.create(PtySize(rows=30, cols=90), on_data=out.extend, timeout=60)
        await s.pty.send_stdin(h.pid, b"stty size; exit\n")
        r = await h.wait()
        assert r.exit_code == 0 and b"30 90" in out, out
    finally:
        await _acleanup(s)


async def test_async_watch_dir_streams_events(e2b):
    s = await AsyncSandbox.create(metadata={"suite": TAG, "role": "async-watch"}, timeout=300)
    try:
        got, exits = [], []
        await s.files.make_dir("/tmp/aw")
        h = await s.files.watch_dir("/tmp/aw", on_event=got.append, on_exit=exits.append, timeout=0)
        await s.files.write("/tmp/aw/x.txt", "x")
        await s.commands.run("mkdir /tmp/aw/d && rm /tmp/aw/x.txt")
        want = {("x.txt", "CREATE"), ("x.txt", "WRITE"), ("d", "CREATE"), ("x.txt", "REMOVE")}
        deadline = time.monotonic() + 20
        while not want <= {(e.name, e.type.name) for e in got}:
            assert time.monotonic() < deadline, "events %s, seen %s" % (want, [(e.name, e.type.name) for e in got])
            await asyncio.sleep(0.05)
        await h.stop()
        # Killing the sandbox under a second watch ends it with an error, not silently.
        h2 = await s.files.watch_dir("/tmp", on_event=lambda e: None, on_exit=exits.append, timeout=0)
        await s.kill()
        deadline = time.monotonic() + 20
        while not any(x is not None for x in exits):
            assert time.monotonic() < deadline, "the watch of a killed sandbox did not end: %r" % exits
            await asyncio.sleep(0.05)
        await h2.stop()
    finally:
        await _acleanup(s)
