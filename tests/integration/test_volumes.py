"""Persistent volumes against a live daemon (crates/bb-runtime/src/volumes, /v1/volumes): API
objects, mounts in sandboxes, POSIX behaviour on a mounted volume, survival across sandbox kills
and daemon restarts, snapshots / restore / fork, branching with sandbox checkpoints, real tools
(git, a venv with pip) and sync to the object store.

Every test deletes the volumes and kills the sandboxes it makes, even when it fails (the
``make_volume`` factory, conftest's ``make_sandbox`` and the autouse ``_leave_nothing``, which
also takes what the daemon made for a test: the volumes of fork children, and the sandbox
snapshots of its checkpoints). Deleted volumes must leave no host traces (their dir under
<state>/volumes and their host-side mount).

Volumes across daemons (opening on another node, writer leases, the store down) are in
test_volumes_remote.py.
"""
import base64
import concurrent.futures
import glob
import hashlib
import io
import json
import os
import re
import signal
import sqlite3
import threading
import uuid
import zipfile

import httpx
import pytest

from branchbox import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    Sandbox,
    Volume,
    VolumeMount,
)
from helpers import (
    FSYNC_WRITE_PY,
    SOCKET,
    STATE,
    URL,
    api_error,
    cgroup_children,
    make_tree,
    mutate,
    proc_stat,
    py_in,
    sandbox_entries,
    sh_in,
    state_mounts,
    tree_digest,
    tree_digests,
    wait_until,
)

INFO_KEYS = {"id", "name", "access", "quota_mb", "created_at", "size_bytes", "layers", "snapshots", "mounts",
             "version", "durability", "backlog_bytes", "source", "encrypted_at_rest", "cached"}


# ----------------------------------------------------------------------------- fixtures and helpers


def client():
    return httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://d", timeout=120)


def volume_traces(vid):
    """What the host still holds for a volume: its state dir and its host-side mount."""
    return {"dir": os.path.exists(os.path.join(STATE, "volumes", vid)), "mounts": state_mounts("/volumes/%s/" % vid)}


def remove_volume(c, vid):
    """Kill the sandboxes that mount ``vid``, delete it, check it left nothing on the host."""
    r = c.get("/v1/volumes/%s" % vid)
    if r.status_code == 404:
        return
    assert r.status_code == 200, r.text
    for m in r.json()["mounts"]:
        c.delete("/v1/sandboxes/%s" % m["sandbox"])
    r = c.delete("/v1/volumes/%s" % vid)
    assert r.status_code in (200, 404), "deleting volume %s at teardown: %s" % (vid, r.text)
    assert volume_traces(vid) == {"dir": False, "mounts": []}, "deleted volume %s left %r" % (vid, volume_traces(vid))


@pytest.fixture(autouse=True)
def _leave_nothing(daemon):
    """Whatever a test leaves (sandboxes, volumes: also those the daemon made for it, such as
    the volumes of fork children) is killed and deleted after it, even if it failed."""
    with client() as c:
        sandboxes = {s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]}
        volumes = {v["id"] for v in c.get("/v1/volumes").json()["volumes"]}
        snapshots = {s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]}
    yield
    daemon.ensure_running()  # a restart test that failed half-way
    with client() as c:
        for s in c.get("/v1/sandboxes").json()["sandboxes"]:
            if s["id"] not in sandboxes:
                c.delete("/v1/sandboxes/%s" % s["id"])
        for v in c.get("/v1/volumes").json()["volumes"]:
            if v["id"] not in volumes:
                remove_volume(c, v["id"])
        # The sandbox snapshots its checkpoints, forks and evaluations made (with their templates).
        for s in c.get("/v1/snapshots").json()["snapshots"]:
            if s["id"] not in snapshots:
                c.delete("/v1/snapshots/%s" % s["id"])


@pytest.fixture
def make_volume(daemon):
    """Factory: ``make_volume(name=None, access="rwo", quota_mb=None)`` -> Volume; every volume
    made (or adopted with ``make_volume.adopt(id)``) is deleted at teardown, after the
    sandboxes that mount it are killed."""
    made = []

    def make(name=None, access="rwo", quota_mb=None):
        v = Volume.create(name, access, quota_mb, daemon=URL)
        made.append(v)
        return v

    def adopt(vid):
        v = Volume.connect(vid, daemon=URL)
        made.append(v)
        return v

    make.adopt = adopt
    yield make
    with client() as c:
        for v in reversed(made):
            remove_volume(c, v.id)
            v.close()


def sandbox_ids(c):
    return sorted(s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"])


def volume_ids(c):
    return sorted(v["id"] for v in c.get("/v1/volumes").json()["volumes"])


def mounts_of(v):
    return [(m.sandbox, m.path, m.read_only, m.branch) for m in v.info().mounts]


def alive(pid):
    st = proc_stat(pid)
    return st is not None and st[0] != "Z"


def create_body(*mounts):
    return {"image": "base", "timeout": 120, "volumes": list(mounts)}


# Appends numbered lines to the file argv[1], through one fd, until killed.
APPEND_PY = r'''
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
i = 0
while True:
    os.write(fd, b"tick %d\n" % i)
    i += 1
    time.sleep(0.002)
'''


def whole_lines(text):
    return text.split("\n")[:-1]  # a read may meet the line being written: leave it out


def consecutive(lines):
    return lines == ["tick %d" % i for i in range(len(lines))]


def log_lines(v):
    try:
        return len(whole_lines(v.files.read("/log")))
    except NotFoundError:  # not created yet
        return 0


def start_appender(v, s, cwd=None):
    """Start APPEND_PY on /workspace/log in sandbox ``s`` (volume ``v`` at /workspace), with
    working directory ``cwd``; returns once it wrote a few lines."""
    writer = s.commands.run(["python3", "-c", APPEND_PY, "/workspace/log"], background=True, cwd=cwd)
    wait_until(lambda: log_lines(v) > 20, what="the writer to start")
    return writer


def grown(v, n):
    wait_until(lambda: log_lines(v) > n + 50, what="the live file to grow past %d lines" % n)


# ----------------------------------------------------------------------------- 1. API objects


def test_create_list_info_delete(raw, make_volume):
    tag = uuid.uuid4().hex[:8]
    r = raw.post("/v1/volumes", json={})
    assert r.status_code == 200, r.text
    anon = r.json()
    make_volume.adopt(anon["id"])
    assert set(anon) == INFO_KEYS, anon
    assert re.fullmatch(r"vol-[0-9a-f]{16}", anon["id"]), anon
    assert isinstance(anon["created_at"], float) and anon["created_at"] > 0
    fresh = {"name": None, "access": "rwo", "quota_mb": None, "size_bytes": 0, "layers": 0, "snapshots": 0,
             "mounts": [], "version": 0, "durability": "node-local", "backlog_bytes": 0, "source": None}
    assert {k: anon[k] for k in fresh} == fresh

    name = "ws-" + tag
    r = raw.post("/v1/volumes", json={"name": name, "access": "rox", "quota_mb": 64})
    assert r.status_code == 200, r.text
    named = r.json()
    make_volume.adopt(named["id"])
    assert (named["name"], named["access"], named["quota_mb"]) == (name, "rox", 64)
    assert named["id"] != anon["id"]
    # The name stands for the id everywhere.
    r = raw.get("/v1/volumes/%s" % name)
    assert r.status_code == 200 and r.json()["id"] == named["id"], r.text
    assert Volume.connect(name, daemon=URL).id == named["id"]

    # Names are unique (creates and forks alike) and checked.
    before = volume_ids(raw)
    err = api_error(raw.post("/v1/volumes", json={"name": name}), 409, "conflict")
    assert name in err["message"]
    api_error(raw.post("/v1/volumes/%s/fork" % anon["id"], json={"name": name}), 409, "conflict")
    for bad in ["", "-x", ".x", "a/b", "a b", "x" * 64, "vol-" + tag, "é", "a\nb"]:
        api_error(raw.post("/v1/volumes", json={"name": bad}), 400, "bad_request")
        api_error(raw.post("/v1/volumes/%s/fork" % anon["id"], json={"name": bad}), 400, "bad_request")
    for body in [{"access": "rw"}, {"quota_mb": 0}, {"quota_mb": -1}, {"name": 5}, {"unknown": 1}]:
        api_error(raw.post("/v1/volumes", json=body), 400, "bad_request")
    assert volume_ids(raw) == before, "a refused create or fork left a volume"
    with pytest.raises(ConflictError):
        Volume.create(name, daemon=URL)

    # List: each entry is the volume's info.
    listed = {v["id"]: v for v in raw.get("/v1/volumes").json()["volumes"]}
    for v in (anon, named):
        assert listed[v["id"]] == raw.get("/v1/volumes/%s" % v["id"]).json()
    assert {v.id for v in Volume.list(daemon=URL)} == set(listed)

    # Info follows what happens to the volume.
    vol = Volume.connect(anon["id"], daemon=URL)
    vol.files.write("/a.bin", os.urandom(100_000))
    i = vol.info()
    assert i.size_bytes >= 100_000 and i.backlog_bytes >= 100_000 and i.layers == 0 and i.durability == "node-local", i
    s1 = vol.snapshot("first")
    assert (s1.volume, s1.label, s1.layers) == (vol.id, "first", 1) and re.fullmatch(r"vs-[0-9a-f]{16}", s1.id), s1
    i = vol.info()
    assert (i.layers, i.snapshots) == (1, 1) and i.backlog_bytes >= 100_000, i
    s2 = vol.snapshot()  # nothing written since: the same chain
    assert s2.layers == 1 and s2.label is None and s2.id != s1.id
    assert [s.id for s in vol.snapshots()] == [s1.id, s2.id]
    assert vol.delete_snapshot(s2) is True
    api_error(raw.delete("/v1/volumes/%s/snapshots/%s" % (vol.id, s2.id)), 404, "not_found")
    api_error(raw.delete("/v1/volumes/%s/snapshots/%s" % (named["id"], s1.id)), 404, "not_found")  # not its own
    assert [s.id for s in vol.snapshots()] == [s1.id] and vol.info().snapshots == 1

    # Delete: gone from everything, with its snapshots; the name is free again.
    r = raw.delete("/v1/volumes/%s" % name)
    assert r.status_code == 200 and r.json() == {"removed": True}, r.text
    assert volume_traces(named["id"]) == {"dir": False, "mounts": []}
    r = raw.delete("/v1/volumes/%s" % vol.id)
    assert r.status_code == 200 and r.json() == {"removed": True}, r.text
    assert volume_traces(vol.id) == {"dir": False, "mounts": []}
    for vid in (vol.id, named["id"], name):
        api_error(raw.get("/v1/volumes/%s" % vid), 404, "not_found")
        api_error(raw.delete("/v1/volumes/%s" % vid), 404, "not_found")
        api_error(raw.get("/v1/volumes/%s/files" % vid, params={"path": "/a.bin"}), 404, "not_found")
        api_error(raw.post("/v1/volumes/%s/snapshots" % vid, json={}), 404, "not_found")
    api_error(raw.post("/v1/volumes/%s/restore" % vol.id, json={"snapshot": s1.id}), 404, "not_found")
    assert not {vol.id, named["id"]} & set(volume_ids(raw))
    with pytest.raises(NotFoundError):
        vol.info()
    again = make_volume(name)
    assert again.id != named["id"] and again.info().name == name


def test_quota_refuses_file_api_writes_beyond_it(make_volume):
    """``quota_mb`` bounds what the volume's file API writes: an upload that would take the
    volume past its quota is refused with 507 ``quota_exceeded`` (``QuotaExceededError``) and
    leaves the file as it was; what fits is written, and deleting files makes room again.
    Only the file API is checked: writes from inside a sandbox are not held to the quota yet."""
    v = make_volume(quota_mb=1)
    with client() as c:
        r = c.put("/v1/volumes/%s/files" % v.id, params={"path": "/big"}, content=b"x" * (3 << 20))
        err = api_error(r, 507, "quota_exceeded")
    assert "quota_mb" in err["message"], err
    assert not v.files.exists("/big")
    small = os.urandom(200_000)
    v.files.write("/small", small)
    with pytest.raises(QuotaExceededError):
        v.files.write("/small", os.urandom(2 << 20))
    assert v.files.read("/small", format="bytes") == small
    with pytest.raises(QuotaExceededError):
        v.files.write("/more", os.urandom(900_000))
    assert not v.files.exists("/more")
    v.files.remove("/small")
    v.files.write("/more", os.urandom(900_000))
    assert v.files.stat("/more").size == 900_000


# ----------------------------------------------------------------------------- 2. mounts


def test_mounted_volume_and_file_api_see_each_other(make_volume, make_sandbox):
    v = make_volume()
    v.files.make_dir("/pre", parents=True)
    v.files.write("/pre/seed.txt", "seeded before the mount")
    s = make_sandbox(volumes={"/workspace": v})
    m = s.info().volumes
    assert [(x.volume, x.path, x.read_only, x.branch) for x in m] == [(v.id, "/workspace", False, True)], m
    assert mounts_of(v) == [(s.id, "/workspace", False, True)]
    assert sh_in(s, "cat /workspace/pre/seed.txt; stat -c %u:%g:%a /workspace/pre/seed.txt") == \
        "seeded before the mount0:0:644\n"

    # Direct writes show in the sandbox as soon as the write returned, and the other way round.
    v.files.write("/live.txt", "from the api", mode=0o600)
    assert sh_in(s, "cat /workspace/live.txt; echo; stat -c %u:%g:%a /workspace/live.txt") == "from the api\n0:0:600\n"
    sh_in(s, "mkdir -p /workspace/out && printf 'from the sandbox' > /workspace/out/o.txt && ln -s out/o.txt /workspace/l")
    assert v.files.read("/out/o.txt") == "from the sandbox"
    st = v.files.stat("/out/o.txt")
    assert (st.type, st.size, st.mode & 0o777) == ("file", 16, 0o644), st
    st = v.files.stat("/l")
    assert (st.type, st.symlink_target) == ("symlink", "out/o.txt"), st

    # mkdir / rename / list / stat / delete through the volume's file API.
    v.files.make_dir("/a/b/c", parents=True)
    with pytest.raises(NotFoundError):
        v.files.make_dir("/x/y", parents=False)
    v.files.rename("/live.txt", "/a/b/moved.txt")
    assert sh_in(s, "test -d /workspace/a/b/c && test ! -e /workspace/live.txt && cat /workspace/a/b/moved.txt") == "from the api"
    assert sorted(e.name for e in v.files.list("/")) == ["a", "l", "out", "pre"]
    deep = {e.path: e.type for e in v.files.list("/a", depth=3)}
    assert deep == {"/a/b": "dir", "/a/b/c": "dir", "/a/b/moved.txt": "file"}, deep
    assert v.files.stat("/a/b").is_dir
    assert v.files.remove("/a", recursive=True) is True
    assert sh_in(s, "test ! -e /workspace/a && echo gone") == "gone\n"
    sh_in(s, "rm /workspace/out/o.txt")
    assert not v.files.exists("/out/o.txt")
    with pytest.raises(NotFoundError):
        v.files.read("/out/o.txt")
    # Large content both ways.
    blob = os.urandom(3 << 20)
    v.files.write("/blob", blob)
    assert sh_in(s, "sha256sum < /workspace/blob").split()[0] == hashlib.sha256(blob).hexdigest()
    sh_in(s, "head -c 2500000 /dev/urandom > /workspace/blob2")
    got = v.files.read("/blob2", format="bytes")
    assert len(got) == 2_500_000 and hashlib.sha256(got).hexdigest() == sh_in(s, "sha256sum < /workspace/blob2").split()[0]

    # The file API stays inside the volume: symlinks the sandbox makes lead nowhere outside.
    host_probe = "/tmp/bb-vol-escape-%s" % uuid.uuid4().hex[:8]
    sh_in(s, "ln -s /etc/hostname /workspace/esc1 && ln -s ../../../../../../../etc/hostname /workspace/esc2 "
             "&& ln -s %s /workspace/esc3 && ln -s /etc /workspace/escdir" % host_probe)
    for p in ["/esc1", "/esc2", "/escdir/hostname"]:
        with pytest.raises((NotFoundError, InvalidArgumentError)):
            v.files.read(p)
    for p in ["/esc3", "/escdir/bbvol-probe"]:
        try:
            v.files.write(p, "owned")
        except (NotFoundError, InvalidArgumentError):
            pass
    assert not os.path.exists(host_probe) and not os.path.exists("/etc/bbvol-probe"), "a volume write escaped to the host"

    # Deleting a mounted volume is refused and names the sandbox.
    with pytest.raises(ConflictError) as e:
        v.delete()
    assert s.id in str(e.value) and "/workspace" in str(e.value)
    assert s.kill() is True
    assert mounts_of(v) == []
    assert v.files.read("/pre/seed.txt") == "seeded before the mount"


WRITES_REFUSED_PY = r'''
import errno, os, sys
top = sys.argv[1]
assert open(os.path.join(top, "seed.txt")).read() == "seed"
attempts = {
    "create": lambda: open(os.path.join(top, "new"), "w"),
    "write": lambda: open(os.path.join(top, "seed.txt"), "a"),
    "mkdir": lambda: os.mkdir(os.path.join(top, "d")),
    "unlink": lambda: os.unlink(os.path.join(top, "seed.txt")),
    "rename": lambda: os.rename(os.path.join(top, "seed.txt"), os.path.join(top, "s2")),
    "chmod": lambda: os.chmod(os.path.join(top, "seed.txt"), 0o600),
    "utime": lambda: os.utime(os.path.join(top, "seed.txt"), (1, 1)),
    "setxattr": lambda: os.setxattr(os.path.join(top, "seed.txt"), "user.x", b"1"),
}
for what, f in attempts.items():
    try:
        f()
    except OSError as e:
        assert e.errno == errno.EROFS, (what, e)
    else:
        raise AssertionError("%s succeeded on a read-only mount" % what)
print("refused")
'''


def test_read_only_mount_refuses_writes_inside(make_volume, make_sandbox):
    v = make_volume()
    v.files.write("/seed.txt", "seed")
    s = make_sandbox(volumes={"/data": VolumeMount(volume=v.id, read_only=True)})
    assert [(m.path, m.read_only) for m in s.info().volumes] == [("/data", True)]
    assert mounts_of(v) == [(s.id, "/data", True, True)]
    assert py_in(s, WRITES_REFUSED_PY, "/data") == "refused\n"
    # The rest of the sandbox is writable; a read-only mount still holds an rwo volume.
    sh_in(s, "touch /root/fine")
    with pytest.raises(ConflictError):
        make_sandbox(volumes={"/data": VolumeMount(volume=v.id, read_only=True)})


def test_rwo_volume_is_mounted_by_one_sandbox_at_a_time(raw, make_volume, make_sandbox):
    v = make_volume("rwo-" + uuid.uuid4().hex[:8])
    s1 = make_sandbox(volumes={"/workspace": v})
    sh_in(s1, "echo one > /workspace/f")
    before = (sandbox_ids(raw), sandbox_entries(), cgroup_children())
    for ref in (v.id, v.info().name):
        err = api_error(raw.post("/v1/sandboxes", json=create_body({"volume": ref, "path": "/w"})), 409, "conflict")
        assert "rwo" in err["message"] and s1.id in err["message"], err
        err = api_error(raw.post("/v1/sandboxes", json=create_body({"volume": ref, "path": "/w", "read_only": True})),
                        409, "conflict")
    with pytest.raises(ConflictError) as e:
        Sandbox.create(daemon=URL, volumes={"/other": v}, timeout=60)
    assert s1.id in str(e.value)
    assert (sandbox_ids(raw), sandbox_entries(), cgroup_children()) == before, "a refused create left a sandbox"
    assert mounts_of(v) == [(s1.id, "/workspace", False, True)]
    # Free again once the holder is gone.
    s1.kill()
    s2 = make_sandbox(volumes={"/w": v})
    assert sh_in(s2, "cat /w/f") == "one\n"
    assert mounts_of(v) == [(s2.id, "/w", False, True)]


def test_concurrent_creates_claim_an_rwo_volume_once(raw, make_volume):
    v = make_volume()
    before = (sandbox_ids(raw), sandbox_entries())
    barrier = threading.Barrier(4)

    def create(_):
        with client() as c:
            barrier.wait()
            return c.post("/v1/sandboxes", json=create_body({"volume": v.id, "path": "/w"}))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(create, range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201, 409, 409, 409], [(r.status_code, r.text[:200]) for r in answers]
    (won,) = [r.json()["id"] for r in answers if r.status_code == 201]
    assert mounts_of(v) == [(won, "/w", False, True)]
    assert raw.delete("/v1/sandboxes/%s" % won).status_code in (200, 204)
    assert (sandbox_ids(raw), sandbox_entries()) == before
    assert mounts_of(v) == []


def test_rox_volume_is_shared_read_only(raw, make_volume, make_sandbox):
    v = make_volume(access="rox")
    v.files.write("/seed.txt", "seed")
    v.files.make_dir("/dir")
    err = api_error(raw.post("/v1/sandboxes", json=create_body({"volume": v.id, "path": "/ro"})), 400, "bad_request")
    assert "read_only" in err["message"], err
    s1 = make_sandbox(volumes={"/ro": VolumeMount(volume=v.id, read_only=True)})
    s2 = make_sandbox(volumes={"/shared": VolumeMount(volume=v.id, read_only=True)})
    assert sorted(mounts_of(v)) == sorted([(s1.id, "/ro", True, False), (s2.id, "/shared", True, False)])
    assert py_in(s1, WRITES_REFUSED_PY, "/ro") == "refused\n"
    assert py_in(s2, WRITES_REFUSED_PY, "/shared") == "refused\n"
    # The file API reads, but refuses every change while a sandbox mounts it.
    assert v.files.read("/seed.txt") == "seed" and [e.name for e in v.files.list("/")] == ["dir", "seed.txt"]
    for change in (lambda: v.files.write("/new", "x"), lambda: v.files.make_dir("/d2"),
                   lambda: v.files.rename("/seed.txt", "/s2"), lambda: v.files.remove("/seed.txt"),
                   lambda: v.files.remove("/dir", recursive=True)):
        with pytest.raises(ConflictError) as e:
            change()
        assert "rox" in str(e.value), e.value
    assert v.files.read("/seed.txt") == "seed"
    s1.kill()
    with pytest.raises(ConflictError):
        v.files.write("/new", "x")  # s2 still mounts it
    s2.kill()
    v.files.write("/new", "written once none mounts it")
    s3 = make_sandbox(volumes={"/ro": VolumeMount(volume=v.id, read_only=True)})
    assert sh_in(s3, "cat /ro/new") == "written once none mounts it"


def test_rwx_volume_is_shared_read_write_and_freezes_in_every_holder(make_volume, make_sandbox):
    """An rwx volume: any number of sandboxes mount it at once, read-write (or read-only), and
    see one copy. A snapshot of it freezes every sandbox that mounts it and gives each the new
    instance: a writer in one goes on in its open file without a gap, the others see its lines,
    the snapshot stays as taken. It never branches: a fork child mounts the same volume, a
    rollback leaves it; restore waits until no sandbox mounts it."""
    v = make_volume(access="rwx")
    a = make_sandbox(volumes={"/workspace": v})
    b = make_sandbox(volumes={"/data": v})
    ro = make_sandbox(volumes={"/ro": VolumeMount(volume=v.id, read_only=True)})
    assert v.info().access == "rwx"
    assert sorted(mounts_of(v)) == sorted(
        [(a.id, "/workspace", False, False), (b.id, "/data", False, False), (ro.id, "/ro", True, False)])
    sh_in(a, "echo from-a > /workspace/a.txt")
    sh_in(b, "echo from-b > /data/b.txt")
    assert sh_in(b, "cat /data/a.txt") == "from-a\n" and sh_in(a, "cat /workspace/b.txt") == "from-b\n"
    assert sh_in(ro, "cat /ro/a.txt /ro/b.txt") == "from-a\nfrom-b\n"
    v.files.write("/seed.txt", "seed")  # the file API writes it while mounted, as rwo's
    assert py_in(ro, WRITES_REFUSED_PY, "/ro") == "refused\n"

    writer = start_appender(v, a)
    cp = a.checkpoint()
    snap = v.snapshot()
    at_snapshot = len(whole_lines(v.files.read("/log")))
    frozen = make_volume.adopt(v.fork(snapshot=snap).id).files.read("/log")
    assert frozen.endswith("\n") and consecutive(whole_lines(frozen)), "a torn snapshot: %r" % frozen[-40:]
    assert 20 < len(whole_lines(frozen)) <= at_snapshot
    grown(v, at_snapshot)
    for sbx, path in ((a, "/workspace/log"), (b, "/data/log"), (ro, "/ro/log")):
        live = sh_in(sbx, "cat " + path)
        assert live.startswith(frozen) and consecutive(whole_lines(live)), "%s lost or repeated lines" % sbx.id
        assert len(whole_lines(live)) > len(whole_lines(frozen))
    sh_in(b, "echo after > /data/after.txt")
    assert sh_in(a, "cat /workspace/after.txt") == "after\n" and v.files.read("/after.txt") == "after\n"
    assert a.commands.kill(writer.pid) is True

    # A fork child mounts the same volume, read-write as its parent did; a rollback leaves it.
    child = make_sandbox(snapshot=cp)
    assert [(m.volume, m.path, m.read_only) for m in child.info().volumes] == [(v.id, "/workspace", False)]
    sh_in(child, "echo from-child > /workspace/child.txt")
    assert sh_in(b, "cat /data/child.txt") == "from-child\n"
    a.rollback(cp)
    assert sh_in(a, "cat /workspace/child.txt /workspace/after.txt") == "from-child\nafter\n"

    with pytest.raises(ConflictError):
        v.restore(snap)
    for sbx in (a, b, ro, child):
        sbx.kill()
    v.restore(snap)
    assert v.files.read("/log") == frozen and not v.files.exists("/after.txt")


def test_rwx_freezes_racing_new_mounts_leave_every_sandbox_on_the_live_instance(make_volume, make_sandbox):
    """Sandboxes mount an rwx volume while another thread freezes it over and over (a write
    through the file API, then a snapshot): every sandbox ends on the volume's live instance,
    none on a replaced one, so what each writes afterwards is in the volume."""
    v = make_volume(access="rwx")
    first = make_sandbox(volumes={"/w": v})
    stop = threading.Event()
    frozen = []

    def freeze_on():
        with Volume.connect(v.id, daemon=URL) as same:
            while not stop.is_set():
                same.files.write("/freeze-%d" % len(frozen), "x")
                frozen.append(same.snapshot().id)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        freezer = pool.submit(freeze_on)
        try:
            wait_until(lambda: len(frozen) >= 2, what="the first freezes")
            sandboxes = [first] + [make_sandbox(volumes={"/w": v}) for _ in range(6)]
            wait_until(lambda: len(frozen) >= 10, what="more freezes")
        finally:
            stop.set()
        freezer.result()
    for i, sbx in enumerate(sandboxes):
        sh_in(sbx, "echo %d > /w/from-%d" % (i, i))
    assert [v.files.read("/from-%d" % i) for i in range(len(sandboxes))] == ["%d\n" % i for i in range(len(sandboxes))]
    for sbx in sandboxes:
        assert sh_in(sbx, "ls /w | grep -c from-") == "%d\n" % len(sandboxes), sbx.id


def test_bad_mounts_are_refused_and_leave_nothing(raw, make_volume, make_sandbox):
    v = make_volume("bm-" + uuid.uuid4().hex[:8])
    w = make_volume()
    rox = make_volume(access="rox")
    before = (sandbox_ids(raw), sandbox_entries(), cgroup_children(), state_mounts("/sandboxes/"), volume_ids(raw))
    bad = [
        [{"volume": v.id, "path": p}] for p in
        ["workspace", "", "/", "/.", "/..", "/a/../..", "/proc/x", "/proc", "/dev", "/dev/shm/x", "/sys", "/sys/fs"]
    ] + [
        [{"volume": v.id, "path": "/a"}, {"volume": w.id, "path": "/a/b"}],  # nested
        [{"volume": v.id, "path": "/a/b"}, {"volume": w.id, "path": "/a"}],
        [{"volume": v.id, "path": "/a"}, {"volume": w.id, "path": "/a/"}],  # the same path
        [{"volume": v.id, "path": "/a"}, {"volume": v.id, "path": "/b"}],  # the same volume twice
        [{"volume": v.id, "path": "/a"}, {"volume": v.info().name, "path": "/b"}],  # by id and by name
        [{"volume": rox.id, "path": "/r"}],  # rox needs read_only
        [{"volume": v.id, "path": "/etc/hostname/x"}],  # under a file: fails while mounting
    ]
    for mounts in bad:
        err = api_error(raw.post("/v1/sandboxes", json=create_body(*mounts)), 400)
        assert err["code"] in ("bad_request", "path_escape"), (mounts, err)
    for mounts in ([{"volume": "vol-0000000000000000", "path": "/w"}], [{"volume": "no-such-volume", "path": "/w"}],
                   [{"volume": w.id, "path": "/ok"}, {"volume": "vol-0000000000000000", "path": "/w"}]):
        api_error(raw.post("/v1/sandboxes", json=create_body(*mounts)), 404, "not_found")
    many = [make_volume() for _ in range(17)]
    err = api_error(raw.post("/v1/sandboxes", json=create_body(
        *[{"volume": x.id, "path": "/m%d" % i} for i, x in enumerate(many)])), 400, "bad_request")
    assert "16" in err["message"]
    api_error(raw.post("/v1/sandboxes", json=create_body({"volume": v.id})), 400)  # no path
    # Nothing was left: no sandbox, cgroup, mount or claim (every volume can be mounted now).
    after = (sandbox_ids(raw), sandbox_entries(), cgroup_children(), state_mounts("/sandboxes/"), volume_ids(raw))
    assert after[:4] == before[:4], "a refused create left a sandbox: %r -> %r" % (before, after)
    assert set(after[4]) - set(before[4]) == {x.id for x in many}
    for x in (v, w, rox):
        assert mounts_of(x) == []
    s = make_sandbox(volumes={"/a": v, "/b": w, "/c": VolumeMount(volume=rox.id, read_only=True)})
    assert sorted(m.path for m in s.info().volumes) == ["/a", "/b", "/c"]
    # 16 is fine.
    s.kill()
    s16 = make_sandbox(volumes={"/m%d" % i: x for i, x in enumerate(many[:16])})
    assert len(s16.info().volumes) == 16
    assert sh_in(s16, "for i in $(seq 0 15); do echo $i > /m$i/n; done; cat /m15/n") == "15\n"
    assert many[15].files.read("/n") == "15\n"


# ----------------------------------------------------------------------------- 3. POSIX


# Phase 1 (everything in the volume's writable layer), phase 2 (the same operations on files a
# snapshot froze into a lower layer: copy-up, whiteouts, opaque and renamed directories).
POSIX_PY = r'''
import errno, fcntl, mmap, os, stat, sys
top, phase = sys.argv[1], sys.argv[2]
os.chdir(top)

def read(p):
    with open(p, "rb") as f:
        return f.read()

def write(p, data, mode="wb"):
    with open(p, mode) as f:
        f.write(data)

WEIRD = b"\xff\xfe name\n"

if phase == "1":
    # create, write, read, O_EXCL, O_APPEND
    write("f", b"hello")
    assert read("f") == b"hello"
    try:
        os.open("f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        raise AssertionError("O_EXCL on an existing file")
    except FileExistsError:
        pass
    write("f", b" world", "ab")
    assert read("f") == b"hello world"
    # pwrite past the end: a hole reads as zeros
    fd = os.open("sparse", os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"end", 1 << 20)
    os.fsync(fd)
    os.fdatasync(fd)
    os.close(fd)
    assert os.path.getsize("sparse") == (1 << 20) + 3 and read("sparse")[:4096] == bytes(4096)
    # truncate (shrink, grow, ftruncate)
    write("t", b"0123456789")
    os.truncate("t", 4)
    assert read("t") == b"0123"
    fd = os.open("t", os.O_RDWR)
    os.ftruncate(fd, 8)
    os.close(fd)
    assert read("t") == b"0123" + bytes(4)
    # rename over an existing file (atomic replace) and of directories
    write("old", b"old")
    write("new", b"new")
    os.rename("new", "old")
    assert read("old") == b"new" and not os.path.exists("new")
    os.makedirs("da/inner")
    write("da/inner/x", b"x")
    os.mkdir("db")
    os.rename("da", "db")  # over an empty directory
    assert read("db/inner/x") == b"x" and not os.path.exists("da")
    # unlink, mkdir, rmdir (ENOTEMPTY first)
    write("gone", b"g")
    os.unlink("gone")
    assert not os.path.exists("gone")
    os.mkdir("empty")
    os.mkdir("full")
    write("full/x", b"")
    try:
        os.rmdir("full")
        raise AssertionError("rmdir of a non-empty dir")
    except OSError as e:
        assert e.errno == errno.ENOTEMPTY, e
    os.rmdir("empty")
    assert not os.path.exists("empty")
    # symlink, readlink, a dangling one
    os.symlink("f", "sym")
    os.symlink("/nowhere/at/all", "dangling")
    assert os.readlink("sym") == "f" and read("sym") == b"hello world"
    assert os.readlink("dangling") == "/nowhere/at/all" and not os.path.exists("dangling")
    # hard link (in one layer)
    os.link("f", "hard")
    assert os.stat("f").st_ino == os.stat("hard").st_ino and os.stat("f").st_nlink == 2
    write("hard", b"!", "ab")
    assert read("f") == b"hello world!"
    # chmod, chown, utime (nanoseconds)
    os.chmod("f", 0o4751)
    assert stat.S_IMODE(os.stat("f").st_mode) == 0o4751
    os.chown("t", 1000, 2000)
    assert (os.stat("t").st_uid, os.stat("t").st_gid) == (1000, 2000)
    os.utime("old", ns=(1_000_000_000_123_456_789, 1_500_000_000_987_654_321))
    assert os.stat("old").st_mtime_ns == 1_500_000_000_987_654_321
    # fsync of a file and of a directory
    fd = os.open("synced", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"durable")
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    # statvfs
    sv = os.statvfs(".")
    assert sv.f_bsize > 0 and sv.f_blocks > 0 and sv.f_bavail > 0 and sv.f_namemax >= 255, sv
    # user.* xattrs
    os.setxattr("f", "user.kept", b"value-1")
    os.setxattr("f", "user.dropped", b"x")
    assert os.getxattr("f", "user.kept") == b"value-1"
    assert {"user.kept", "user.dropped"} <= set(os.listxattr("f"))
    os.removexattr("f", "user.dropped")
    assert "user.dropped" not in os.listxattr("f")
    try:
        os.getxattr("f", "user.dropped")
        raise AssertionError("a removed xattr is still there")
    except OSError as e:
        assert e.errno == errno.ENODATA, e
    # mmap write + msync
    fd = os.open("m.bin", os.O_CREAT | os.O_RDWR, 0o644)
    os.ftruncate(fd, 8192)
    mm = mmap.mmap(fd, 8192)
    mm[0:5] = b"hello"
    mm[4096:4101] = b"world"
    mm.flush()
    mm.close()
    os.close(fd)
    data = read("m.bin")
    assert data[:5] == b"hello" and data[4096:4101] == b"world" and len(data) == 8192
    # locks
    with open("lock", "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(lf, fcntl.LOCK_UN)
    # file names are bytes
    write(os.fsencode(top) + b"/" + WEIRD, b"weird")
    assert WEIRD in os.listdir(b".")
    os.rename(WEIRD, b"caf\xe9")
    assert read(b"caf\xe9") == b"weird" and WEIRD not in os.listdir(b".")
    write(WEIRD, b"weird again")
    os.mkdir(b"dir\x01\x7f")
    write(b"dir\x01\x7f/\xc3\x28", b"inside")
    # things phase 2 changes in a lower layer
    os.makedirs("lower/dir/sub")
    for n in ("a", "b", "c", "d", "e", "f"):
        write("lower/" + n, n.encode() * 10)
    write("lower/dir/sub/deep", b"deep")
    write("lower/dir/keep", b"keep")
    os.makedirs("lower/opaque")
    write("lower/opaque/old1", b"1")
    write("lower/opaque/old2", b"2")
    write("lower/m.bin", bytes(8192))
    os.setxattr("lower/a", "user.lower", b"L")
    print("phase 1 ok")
else:
    assert read("f") == b"hello world!" and os.getxattr("f", "user.kept") == b"value-1"
    assert stat.S_IMODE(os.stat("f").st_mode) == 0o4751
    assert os.stat("old").st_mtime_ns == 1_500_000_000_987_654_321
    # write in place, append, truncate a lower file (copy-up keeps the rest)
    with open("lower/a", "r+b") as f:
        f.seek(2)
        f.write(b"XY")
    assert read("lower/a") == b"aaXYaaaaaa" and os.getxattr("lower/a", "user.lower") == b"L"
    write("lower/b", b"+", "ab")
    assert read("lower/b") == b"b" * 10 + b"+"
    os.truncate("lower/c", 3)
    assert read("lower/c") == b"ccc"
    # rename over a lower file, unlink a lower file: whiteouts do not show
    os.rename("lower/d", "lower/e")
    assert read("lower/e") == b"d" * 10 and not os.path.exists("lower/d")
    os.unlink("lower/f")
    assert sorted(os.listdir("lower")) == ["a", "b", "c", "dir", "e", "m.bin", "opaque"], os.listdir("lower")
    # metadata-only changes of lower files
    os.chmod("lower/b", 0o640)
    os.chown("lower/c", 33, 33)
    os.utime("lower/e", ns=(5, 7_000_000_000))
    assert stat.S_IMODE(os.stat("lower/b").st_mode) == 0o640 and os.stat("lower/c").st_uid == 33
    assert os.stat("lower/e").st_mtime_ns == 7_000_000_000
    # rename a lower directory (its files follow), rmdir below it
    os.rename("lower/dir", "lower/moved")
    assert read("lower/moved/sub/deep") == b"deep" and not os.path.exists("lower/dir")
    os.unlink("lower/moved/sub/deep")
    os.rmdir("lower/moved/sub")
    assert os.listdir("lower/moved") == ["keep"]
    # remove a lower directory and make one of the same name: the old entries stay gone
    for n in os.listdir("lower/opaque"):
        os.unlink("lower/opaque/" + n)
    os.rmdir("lower/opaque")
    os.mkdir("lower/opaque")
    write("lower/opaque/new", b"n")
    assert os.listdir("lower/opaque") == ["new"]
    # mmap a lower file
    fd = os.open("lower/m.bin", os.O_RDWR)
    mm = mmap.mmap(fd, 8192)
    mm[100:103] = b"MAP"
    mm.flush()
    mm.close()
    os.close(fd)
    assert read("lower/m.bin")[100:103] == b"MAP"
    # xattrs on lower files
    os.setxattr("lower/b", "user.added", b"later")
    os.removexattr("lower/a", "user.lower")
    assert os.getxattr("lower/b", "user.added") == b"later" and "user.lower" not in os.listxattr("lower/a")
    # byte names in a lower layer
    assert read(WEIRD) == b"weird again" and read(b"caf\xe9") == b"weird"
    os.rename(WEIRD, b"\xfe renamed")
    assert read(b"dir\x01\x7f/\xc3\x28") == b"inside"
    fd = os.open("synced", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"+more")
    os.fsync(fd)
    os.close(fd)
    print("phase 2 ok")
'''


def test_posix_semantics_in_a_mounted_volume(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    assert py_in(s, POSIX_PY, "/workspace", "1") == "phase 1 ok\n"
    # What the sandbox wrote (msync'd) is what the file API reads once the command returned.
    m = v.files.read("/m.bin", format="bytes")
    assert m[:5] == b"hello" and m[4096:4101] == b"world"
    assert v.files.read("/synced") == "durable"
    assert v.files.stat("/sym").symlink_target == "f" and v.files.stat("/f").mode & 0o7777 == 0o4751
    v.snapshot("posix phase 1")  # phase 1's files go to a lower layer
    assert py_in(s, POSIX_PY, "/workspace", "2") == "phase 2 ok\n"
    assert v.files.read("/lower/m.bin", format="bytes")[100:103] == b"MAP"
    # The file API lists what the sandbox lists (no whiteouts, nothing missing).
    listed = py_in(s, "import os, json; print(json.dumps(sorted(n for n in os.listdir('/workspace/lower'))))")
    assert sorted(e.name for e in v.files.list("/lower")) == eval(listed)
    before = tree_digest(s, "/workspace")
    # Everything is there in the next sandbox, byte for byte (names, modes, owners, times, xattrs).
    s.kill()
    s2 = make_sandbox(volumes={"/elsewhere": v})
    assert tree_digest(s2, "/elsewhere") == before
    assert sh_in(s2, "cat /elsewhere/synced") == "durable+more"


HARDLINK_PY = r'''
import os, sys
os.chdir(sys.argv[1])
if sys.argv[2] == "1":
    with open("a", "w") as f:
        f.write("one")
    os.link("a", "b")
    with open("b", "r+") as f:  # linked in the writable layer: one file
        f.write("ONE")
    assert open("a").read() == "ONE"
else:
    # The rule of docs/ARCHITECTURE.md ("Hard links across checkpoints"), for volumes as for
    # the root: after a freeze, the first change through one name gives it its own copy, the
    # other name keeps the frozen content; a link made now joins the copy.
    with open("a", "r+") as f:
        f.write("TWO")
    assert open("a").read() == "TWO" and open("b").read() == "ONE", (open("a").read(), open("b").read())
    os.link("a", "c")
    with open("c", "r+") as f:
        f.write("333")
    assert open("a").read() == "333" and os.stat("a").st_ino == os.stat("c").st_ino
'''


def test_hard_links_follow_the_documented_freeze_rule(make_volume, make_sandbox):
    """Hard links in a volume behave as in a sandbox root (overlayfs without an index): one
    file until a freeze (snapshot, checkpoint, fork, sync); after it, a change through one name
    copies that name alone. Documented in docs/ARCHITECTURE.md."""
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    py_in(s, HARDLINK_PY, "/workspace", "1")
    v.snapshot()
    py_in(s, HARDLINK_PY, "/workspace", "2")


def test_file_api_lists_and_removes_non_utf8_names(make_volume, make_sandbox):
    """A name that is not UTF-8, made in the sandbox: the volume's file API lists it beside
    the others, and removes the directory that holds it."""
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    py_in(s, "import os; os.mkdir('/workspace/d'); open(b'/workspace/d/\\xff\\xfe name\\n', 'wb').write(b'x'); "
             "open('/workspace/d/plain', 'w').write('y')")
    assert len(v.files.list("/d")) == 2, "list shows %r of 2 entries" % [e.name for e in v.files.list("/d")]
    v.files.remove("/d", recursive=True)
    assert sh_in(s, "test ! -e /workspace/d && echo gone") == "gone\n"


# ----------------------------------------------------------------------------- 4. survival


def test_volume_survives_sandbox_kill_and_daemon_restart(daemon, make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    make_tree(s, "/workspace/t", 1)
    d1 = tree_digest(s, "/workspace")
    bg = s.commands.run("sleep 4262", background=True, cwd="/workspace")
    old = daemon.pid
    try:
        daemon.stop(signal.SIGTERM)
    finally:
        daemon.ensure_running()
    assert daemon.pid != old
    # The sandbox was re-attached with its mount; the volume knows who mounts it.
    s = Sandbox.connect(s.id, daemon=URL)
    v = Volume.connect(v.id, daemon=URL)
    assert [(m.volume, m.path) for m in s.info().volumes] == [(v.id, "/workspace")]
    assert mounts_of(v) == [(s.id, "/workspace", False, True)]
    assert tree_digest(s, "/workspace") == d1
    with pytest.raises(ConflictError):
        v.delete()
    with pytest.raises(ConflictError):
        Sandbox.create(daemon=URL, volumes={"/w": v}, timeout=60)
    # Writes both ways still meet, and the volume still freezes under the re-attached sandbox.
    v.files.write("/after-restart", "api")
    sh_in(s, "cat /workspace/after-restart > /workspace/copied")
    assert v.files.read("/copied") == "api"
    snap = v.snapshot()
    sh_in(s, "echo later >> /workspace/copied")
    assert v.files.read("/copied") == "apilater\n"
    d2 = tree_digest(s, "/workspace")
    assert s.commands.kill(bg.pid) is True
    s.kill()
    s2 = make_sandbox(volumes={"/workspace": v})
    assert tree_digest(s2, "/workspace") == d2
    s2.kill()
    v.restore(snap)
    s3 = make_sandbox(volumes={"/workspace": v})
    assert sh_in(s3, "cat /workspace/copied") == "api"


def test_fsynced_writes_survive_kill_9_of_the_daemon(daemon, make_volume):
    """Three rounds: a sandbox writes and fsyncs a file in the volume, the daemon is killed
    with SIGKILL and started again; the file API and a new sandbox see every round's file."""
    v = make_volume()
    expected = {}
    writer = Sandbox.create(daemon=URL, volumes={"/workspace": v}, timeout=600)
    for i in range(3):
        data = "round %d %s" % (i, uuid.uuid4().hex)
        py_in(writer, FSYNC_WRITE_PY, "/workspace/r%d" % i, data)
        expected["r%d" % i] = data
        old = daemon.pid
        try:
            daemon.stop(signal.SIGKILL)
        finally:
            daemon.ensure_running()
        assert daemon.pid != old
        v = Volume.connect(v.id, daemon=URL)
        for name, content in expected.items():
            assert v.files.read("/" + name) == content, (i, name)
        assert mounts_of(v) == [(writer.id, "/workspace", False, True)], i
        # The sandbox that wrote lives on; kill it: a new one takes the volume.
        writer = Sandbox.connect(writer.id, daemon=URL)
        assert sh_in(writer, "cat /workspace/r%d" % i) == data
        assert writer.kill() is True
        assert mounts_of(v) == []
        writer = Sandbox.create(daemon=URL, volumes={"/workspace": v}, timeout=600)
        got = py_in(writer, "import json, os; print(json.dumps({n: open('/workspace/' + n).read() "
                            "for n in os.listdir('/workspace')}))")
        assert eval(got) == expected, i
    writer.kill()


def test_volume_of_a_sandbox_that_died_while_the_daemon_was_down_is_released(daemon, make_volume):
    v = make_volume()
    s = Sandbox.create(daemon=URL, volumes={"/workspace": v}, timeout=600)
    sh_in(s, "echo kept > /workspace/f")
    init = s.info().init_pid
    try:
        daemon.stop(signal.SIGKILL)
        os.kill(init, signal.SIGKILL)
        wait_until(lambda: not alive(init), what="the sandbox's init to die")
    finally:
        daemon.ensure_running()
    v = Volume.connect(v.id, daemon=URL)
    assert mounts_of(v) == []
    with Sandbox.create(daemon=URL, volumes={"/w": v}, timeout=600) as s2:
        assert sh_in(s2, "cat /w/f") == "kept\n"


def test_expired_sandbox_releases_its_volume(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v}, timeout=2)
    sh_in(s, "echo before-expiry > /workspace/f")
    wait_until(lambda: mounts_of(v) == [], timeout=30, what="the expired sandbox to be reaped and its volume released")
    assert not s.is_running()
    s2 = make_sandbox(volumes={"/workspace": v})
    assert sh_in(s2, "cat /workspace/f") == "before-expiry\n"


def need_criu():
    with client() as c:
        pi = c.get("/v1/health").json().get("process_images") or {}
    if not pi.get("criu"):
        if os.environ.get("MUST_WORK"):
            pytest.fail("CRIU is not available to the daemon: %r" % pi)
        pytest.skip("CRIU is not available: %r" % pi)


def test_pause_and_resume_keep_the_volume_and_its_open_files(make_volume, make_sandbox):
    need_criu()
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v}, timeout=0)
    start_appender(v, s, cwd="/workspace")
    s.pause()
    # Paused, the sandbox still holds its volume.
    assert mounts_of(v) == [(s.id, "/workspace", False, True)]
    with pytest.raises(ConflictError):
        Sandbox.create(daemon=URL, volumes={"/w": v}, timeout=60)
    with pytest.raises(ConflictError):
        v.delete()
    at_pause = log_lines(v)
    v.files.write("/while-paused", "api")
    s.resume()
    assert [m.volume for m in s.info().volumes] == [v.id]
    assert sh_in(s, "cat /workspace/while-paused") == "api"
    # The restored writer goes on in the same file, without a gap.
    grown(v, at_pause)
    assert consecutive(whole_lines(v.files.read("/log")))


# ----------------------------------------------------------------------------- 5. snapshots, restore, fork


def test_snapshots_restore_and_forks_follow_content_exactly(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/v": v})
    make_tree(s, "/v", 11)
    d_a = tree_digest(s, "/v")
    snap_a = v.snapshot("a")
    mutate(s, "/v", "b")
    d_b = tree_digest(s, "/v")
    assert d_b != d_a
    snap_b = v.snapshot("b")
    assert (snap_a.layers, snap_b.layers) == (1, 2)
    # Restore is refused while mounted (nothing changes); fork works and takes the live state.
    with pytest.raises(ConflictError) as e:
        v.restore(snap_a)
    assert s.id in str(e.value)
    assert tree_digest(s, "/v") == d_b
    mutate(s, "/v", "c")
    d_c = tree_digest(s, "/v")
    live_fork = make_volume.adopt(v.fork().id)
    assert live_fork.info().source == v.id and live_fork.id != v.id
    fork_a = make_volume.adopt(v.fork(snapshot=snap_a).id)
    named = "fork-" + uuid.uuid4().hex[:8]
    fork_b = make_volume.adopt(v.fork(name=named, snapshot=snap_b.id).id)
    assert fork_b.info().name == named and fork_b.info().layers == 2
    s.kill()
    v.restore(snap_a)
    s = make_sandbox(volumes={"/v": v, "/live": live_fork, "/fa": fork_a, "/fb": fork_b})
    assert tree_digests(s, "/v", "/live", "/fa", "/fb") == [d_a, d_c, d_a, d_b]
    # Forks and their source change independently.
    mutate(s, "/live", "x")
    sh_in(s, "echo only-v > /v/only-v && rm -r /fa/d0")
    got = tree_digests(s, "/v", "/live", "/fa", "/fb")
    assert got[3] == d_b and len(set(got)) == 4
    assert not fork_b.files.exists("/only-v") and not live_fork.files.exists("/only-v")
    assert v.files.exists("/d0") and not fork_a.files.exists("/d0")
    # Restore back and forth (nothing mounts the volume): the file API sees each state.
    s.kill()
    assert v.restore(snap_b).layers == 2
    assert v.files.read("/seed") == "b" and not v.files.exists("/only-v")
    v.restore(snap_a)
    assert v.files.read("/seed") == "11"
    # A snapshot of another volume, or a deleted one, cannot be restored.
    with pytest.raises(NotFoundError):
        fork_b.restore(snap_a)
    v.delete_snapshot(snap_b)
    with pytest.raises(NotFoundError):
        v.restore(snap_b)
    with pytest.raises(NotFoundError):
        v.fork(snapshot=snap_b)
    # Forks stand on their own layers: deleting the source takes nothing from them.
    snap_fa = fork_a.snapshot()
    with client() as c:
        remove_volume(c, v.id)
    s = make_sandbox(volumes={"/fa": fork_a, "/fb": fork_b, "/live": live_fork})
    assert tree_digests(s, "/fb", "/fa", "/live") == [d_b, got[2], got[1]]
    s.kill()
    fork_a.restore(snap_fa)
    s = make_sandbox(volumes={"/fa": fork_a})
    assert tree_digest(s, "/fa") == got[2]


def snaplayers():
    """The layer dirs on this node: sandboxes' and (on the volumes' own filesystem) volumes'."""
    volume_layers = os.path.join(STATE, "volume-fs", "v", "layers")
    return set(os.listdir(os.path.join(STATE, "snaplayers"))) | set(os.listdir(volume_layers))


def image_contains(path, needles):
    """Which of ``needles`` (bytes) occur in the allocated extents of the (sparse) file."""
    found = set()
    fd = os.open(path, os.O_RDONLY)
    try:
        end, pos, tail = os.fstat(fd).st_size, 0, b""
        while pos < end:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
            while pos < hole:
                chunk = os.pread(fd, min(8 << 20, hole - pos), pos)
                buf = tail + chunk
                found.update(n for n in needles if n in buf)
                tail, pos = buf[-256:], pos + len(chunk)
    finally:
        os.close(fd)
    return found


def test_volume_files_are_encrypted_at_rest(make_volume, make_sandbox):
    """What a sandbox writes (and fsyncs) in a volume and what the file API writes reach the
    node's disk encrypted, names and contents: the image of the daemon's volume filesystem holds
    neither, while a file written beside the encrypted dir on that filesystem is found in it
    (the scan works). The key file is the daemon's alone."""
    tag = uuid.uuid4().hex
    name, content, api_content = "name-%s" % tag, "content-%s" % tag, "api-%s" % tag
    v = make_volume()
    assert v.info().encrypted_at_rest is True
    s = make_sandbox(volumes={"/workspace": v})
    py_in(s, FSYNC_WRITE_PY, "/workspace/" + name, content * 512)
    v.files.write("/api-file", api_content * 512)
    control = os.path.join(STATE, "volume-fs", "control-%s" % tag)
    with open(control, "w") as f:
        f.write("control-%s" % tag)
    try:
        os.sync()
        image = os.path.join(STATE, "volume-fs.img")
        needles = [x.encode() for x in (name, content, api_content, "control-%s" % tag)]
        assert image_contains(image, needles) == {("control-%s" % tag).encode()}
    finally:
        os.unlink(control)
    assert sh_in(s, "cat /workspace/" + name) == content * 512
    key = os.stat(os.path.join(STATE, "volume.key"))
    assert (key.st_mode & 0o777, key.st_uid, key.st_size) == (0o600, 0, 64)


def test_deleted_volumes_and_forks_leave_no_layers(make_volume):
    """Create, write, snapshot, fork and delete through the file API only: every layer the
    volumes made is gone from <state>/snaplayers once both are deleted (the shared ones go
    with the last)."""
    layers_before = snaplayers()
    v = make_volume()
    v.files.write("/a", "1")
    v.snapshot()
    v.files.write("/b", "2")
    f = make_volume.adopt(v.fork().id)
    f.files.write("/c", "3")
    v.files.write("/d", "4")
    v.snapshot()
    assert [e.name for e in v.files.list("/")] == ["a", "b", "d"]
    assert [e.name for e in f.files.list("/")] == ["a", "b", "c"]
    assert len(snaplayers() - layers_before) >= 4, "volumes make layers"
    with client() as c:
        remove_volume(c, v.id)
        assert f.files.read("/a") == "1" and f.files.read("/b") == "2" and not f.files.exists("/d")
        remove_volume(c, f.id)
    left = snaplayers() - layers_before
    assert not left, "deleted volumes left layers: %r" % sorted(left)


def test_deleting_a_volume_removes_layers_only_its_snapshots_held(make_volume):
    """A layer that only one of the volume's snapshots holds (frozen by a snapshot, then left
    by a restore to an earlier one) goes from <state>/snaplayers with the volume, like the
    layers of its current chain."""
    layers_before = snaplayers()
    v = make_volume()
    v.files.write("/a", "1")
    s1 = v.snapshot()
    v.files.write("/b", "2")
    v.snapshot()
    v.restore(s1)
    assert [e.name for e in v.files.list("/")] == ["a"]
    with client() as c:
        remove_volume(c, v.id)
    left = snaplayers() - layers_before
    assert not left, "the deleted volume left layers: %r" % sorted(left)


def test_snapshot_of_a_file_being_appended_stays_frozen(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    writer = start_appender(v, s)
    snap = v.snapshot()
    at_snapshot = len(whole_lines(v.files.read("/log")))
    fork = make_volume.adopt(v.fork(snapshot=snap).id)
    frozen = fork.files.read("/log")
    assert frozen.endswith("\n"), "a torn line in the snapshot: %r" % frozen[-40:]
    n = len(whole_lines(frozen))
    assert consecutive(whole_lines(frozen)) and 20 < n <= at_snapshot, (n, at_snapshot)
    # The writer goes on in the same open file (now in the new writable layer) without a gap,
    # and the snapshot stays as it was.
    grown(v, at_snapshot)
    live = sh_in(s, "cat /workspace/log")
    assert live.startswith(frozen) and consecutive(whole_lines(live)), "the live file lost or repeated lines"
    assert fork.files.read("/log") == frozen
    assert s.commands.kill(writer.pid) is True
    live = v.files.read("/log")
    assert live.startswith(frozen) and consecutive(whole_lines(live)) and live.endswith("\n")
    assert len(whole_lines(live)) > n + 50 and fork.files.read("/log") == frozen


@pytest.mark.parametrize("how", ["volume-snapshot", "checkpoint"])
def test_second_snapshot_of_a_file_kept_open_stays_frozen(make_volume, make_sandbox, how):
    """A process appends to a file in the volume, through one fd, across two snapshots (of the
    volume, or checkpoints of the sandbox). At the second freeze its fd is still on the mount
    instance it was opened in, an older one than the volume's: each snapshot, and the fork
    made of it, keeps the file as it was when taken while the writer goes on."""
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    writer = start_appender(v, s)

    def snapshot_and_fork():
        if how == "volume-snapshot":
            return make_volume.adopt(v.fork(snapshot=v.snapshot()).id)
        child = make_sandbox(snapshot=s.checkpoint())
        return make_volume.adopt(child.info().volumes[0].volume)

    f1 = snapshot_and_fork()
    frozen1 = f1.files.read("/log")
    grown(v, len(whole_lines(frozen1)))
    f2 = snapshot_and_fork()
    frozen2 = f2.files.read("/log")
    assert frozen2.startswith(frozen1) and consecutive(whole_lines(frozen2))
    grown(v, len(whole_lines(frozen2)))
    assert s.commands.kill(writer.pid) is True
    assert f1.files.read("/log") == frozen1, "the first snapshot changed"
    now = f2.files.read("/log")
    assert now == frozen2, "the second snapshot grew from %d to %d lines after it was taken" % (
        len(whole_lines(frozen2)), len(whole_lines(now)))


# ----------------------------------------------------------------------------- 6. branching with the sandbox


def test_checkpoint_and_rollback_take_the_volume_along(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    make_tree(s, "/workspace", 21)
    s.run_code("x = 1")
    snap1 = s.checkpoint()
    d1 = tree_digest(s, "/workspace")
    assert v.info().snapshots == 1  # the checkpoint recorded the volume's state
    mutate(s, "/workspace", "two")
    v.files.write("/api-file", "written through the api")
    d2 = tree_digest(s, "/workspace")
    snap2 = s.checkpoint()
    sh_in(s, "rm -r /workspace/d0 && echo 3 > /workspace/three")
    s.rollback(snap1)
    assert tree_digest(s, "/workspace") == d1
    assert not v.files.exists("/api-file") and v.files.read("/seed") == "21"
    assert s.run_code("x").result == "1"
    s.rollback(snap2)
    assert tree_digest(s, "/workspace") == d2 and v.files.read("/api-file") == "written through the api"
    # Work goes on after a rollback, and an unchanged volume rolls back to itself.
    sh_in(s, "echo after > /workspace/after")
    s.rollback(snap2)
    assert tree_digest(s, "/workspace") == d2
    s.rollback(snap1)
    s.rollback(snap1)
    assert tree_digest(s, "/workspace") == d1
    # Restoring the volume itself is refused while it is mounted.
    snaps = v.snapshots()
    with pytest.raises(ConflictError):
        v.restore(snaps[0])


def test_a_checkpoint_is_lightweight_only_if_the_volume_did_not_change(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    s.run_code("a = 1")
    s1 = s.checkpoint_info()
    s2 = s.checkpoint_info()
    assert s2.lightweight is True and s2.parent == s1.id, s2
    # A change in the volume alone (here through the file API) makes the next one a full one.
    v.files.write("/via-api", "x")
    s3 = s.checkpoint_info()
    assert s3.lightweight is False, s3
    v.files.remove("/via-api")
    s.rollback(s3.id)
    assert v.files.read("/via-api") == "x" and sh_in(s, "cat /workspace/via-api") == "x"
    s.rollback(s2.id)
    assert not v.files.exists("/via-api") and sh_in(s, "ls -A /workspace | wc -l") == "0\n"
    assert s.run_code("a").result == "1"


def test_rollback_restores_a_background_writer_of_a_volume_file(make_volume, make_sandbox):
    """A checkpoint with processes="all" keeps a process appending to a file in the volume; a
    rollback brings back the file as it was and the process, which appends on from there."""
    need_criu()
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    start_appender(v, s, cwd="/workspace")
    snap = s.checkpoint(processes="all")
    at = log_lines(v)
    grown(v, at)
    r = s.rollback(snap)
    assert len(r.restored_processes) == 1 and not r.processes_not_restored, r
    grown(v, at)
    # The file went back to the checkpoint and the writer (back to its count then) goes on from
    # there: had either not gone back, the lines would not follow on.
    assert consecutive(whole_lines(v.files.read("/log"))), "the restored writer did not go on where the file was"


def test_session_restored_by_a_rollback_writes_on_in_its_open_volume_file(make_volume, make_sandbox):
    """A python session holds a file in the volume open for writing across a checkpoint. After
    a rollback the restored session works on in the restored volume: from its working
    directory there, and in the file it holds open, which is reopened in the restored writable
    layer (as files in the sandbox's root are, see test_checkpoint.py::
    test_open_file_cannot_change_the_snapshot)."""
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    s.run_code("import os\nos.chdir('/workspace')\nf = open('/workspace/sess.txt', 'w')\nf.write('before')\nf.flush()")
    snap = s.checkpoint()
    s.run_code("f.write(' after'); f.flush()")
    assert sh_in(s, "cat /workspace/sess.txt") == "before after"
    s.rollback(snap)
    assert sh_in(s, "cat /workspace/sess.txt") == "before"
    # The restored session works on in the restored volume, from its working directory in it...
    s.run_code("open('rel.txt', 'w').write('cwd')")
    assert sh_in(s, "cat /workspace/rel.txt") == "cwd" and v.files.read("/rel.txt") == "cwd"
    assert s.run_code("sorted(os.listdir('.'))").result == "['rel.txt', 'sess.txt']"
    # ...and in the file it holds open.
    r = s.run_code("f.write('+again'); f.flush()\nos.fstat(f.fileno()).st_nlink")
    assert sh_in(s, "cat /workspace/sess.txt") == "before+again", "the session's file has %s links" % r.result
    assert v.files.read("/sess.txt") == "before+again"


def test_fork_gives_each_child_its_own_copy_of_the_volume(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    make_tree(s, "/workspace", 31)
    snap = s.checkpoint()
    d_snap = tree_digest(s, "/workspace")
    sh_in(s, "echo parent-later > /workspace/later")
    d_parent = tree_digest(s, "/workspace")
    kids = s.fork(3, snapshot=snap)
    try:
        vids = []
        for k in kids:
            mounts = k.info().volumes
            assert len(mounts) == 1 and mounts[0].path == "/workspace" and mounts[0].read_only is False, mounts
            vid = mounts[0].volume
            make_volume.adopt(vid)
            vids.append(vid)
            info = Volume.connect(vid, daemon=URL).info()
            assert info.source == v.id and [m.sandbox for m in info.mounts] == [k.id], info
        assert len(set(vids)) == 3 and v.id not in vids
        assert mounts_of(v) == [(s.id, "/workspace", False, True)]
        for k in kids:
            assert tree_digest(k, "/workspace") == d_snap
        for i, k in enumerate(kids):
            sh_in(k, "echo child%d > /workspace/mine && rm /workspace/seed" % i)
        for i, k in enumerate(kids):
            assert sh_in(k, "cat /workspace/mine; test ! -e /workspace/later && test ! -e /workspace/seed && echo clean") == \
                "child%d\nclean\n" % i
            assert Volume.connect(vids[i], daemon=URL).files.read("/mine") == "child%d\n" % i
        assert tree_digest(s, "/workspace") == d_parent
        assert not v.files.exists("/mine")
        # A fork without a snapshot takes a checkpoint now: the child has the parent's current files.
        sh_in(s, "echo parent-now > /workspace/now")
        d_now = tree_digest(s, "/workspace")
        (kid,) = s.fork(1)
        kids.append(kid)
        make_volume.adopt(kid.info().volumes[0].volume)
        assert tree_digest(kid, "/workspace") == d_now
        sh_in(s, "echo parent-after-fork > /workspace/now")
        assert sh_in(kid, "cat /workspace/now") == "parent-now\n"
    finally:
        for k in kids:
            k.kill()
            k.close()


@pytest.mark.parametrize("access", ["rwo", "rox"])
def test_forks_of_a_read_only_mount_stay_read_only(make_volume, make_sandbox, access):
    """Children of a sandbox that mounts a volume read-only mount it read-only too: an rwo
    volume as a copy of their own, an rox volume as the one shared volume (nothing is forked)."""
    v = make_volume(access=access)
    v.files.write("/seed.txt", "seed")
    s = make_sandbox(volumes={"/data": VolumeMount(volume=v.id, read_only=True)})
    snap = s.checkpoint()
    with client() as c:
        vols_before = volume_ids(c)
        r = c.post("/v1/sandboxes/%s/fork" % s.id, json={"count": 2, "snapshot": snap})
        if r.status_code != 201:
            left = sorted(set(volume_ids(c)) - set(vols_before))
            pytest.fail("fork failed (%d %s); volumes it left behind: %r" % (r.status_code, r.text, left))
        kids = [Sandbox.connect(k["id"], daemon=URL) for k in r.json()["sandboxes"]]
        for k in kids:
            (m,) = k.info().volumes
            if access == "rox":
                # Shared read-only data: each child mounts the volume itself, nothing is forked.
                assert m.volume == v.id and m.branch is False, m
            else:
                make_volume.adopt(m.volume)
            assert m.read_only is True, "the child's mount of a read-only mount is read-write: %r" % m
            assert py_in(k, WRITES_REFUSED_PY, "/data") == "refused\n"
        assert len(volume_ids(c)) == len(vols_before) + (0 if access == "rox" else 2)


def test_non_branching_mount_is_not_rolled_back_nor_forked(make_volume, make_sandbox):
    ws = make_volume()
    cache = make_volume()
    s = make_sandbox(volumes=[VolumeMount(volume=ws.id, path="/workspace"),
                              VolumeMount(volume=cache.id, path="/cache", branch=False)])
    assert sorted((m.path, m.branch) for m in s.info().volumes) == [("/cache", False), ("/workspace", True)]
    sh_in(s, "echo 1 > /workspace/f && echo 1 > /cache/f")
    snap = s.checkpoint()
    assert (ws.info().snapshots, cache.info().snapshots) == (1, 0)
    sh_in(s, "echo 2 > /workspace/f && echo 2 > /cache/f && echo new > /cache/g")
    s.rollback(snap)
    assert sh_in(s, "cat /workspace/f /cache/f /cache/g") == "1\n2\nnew\n"
    assert cache.files.read("/g") == "new\n"
    # Children get the branching volume only; the cache stays with the parent.
    (kid,) = s.fork(1, snapshot=snap)
    try:
        assert [m.path for m in kid.info().volumes] == ["/workspace"]
        make_volume.adopt(kid.info().volumes[0].volume)
        assert sh_in(kid, "cat /workspace/f; ls -A /cache 2>/dev/null | wc -l") == "1\n0\n"
        assert mounts_of(cache) == [(s.id, "/cache", False, False)]
    finally:
        kid.kill()


def test_sandbox_created_from_a_snapshot_gets_forks_of_its_volumes(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    make_tree(s, "/workspace", 41)
    snap = s.checkpoint()
    d_snap = tree_digest(s, "/workspace")
    sh_in(s, "rm -r /workspace/d1")
    c1 = make_sandbox(snapshot=snap)
    c2 = make_sandbox(snapshot=snap)
    vids = []
    for c in (c1, c2):
        (m,) = c.info().volumes
        make_volume.adopt(m.volume)
        vids.append(m.volume)
        assert m.path == "/workspace" and m.volume != v.id
        assert Volume.connect(m.volume, daemon=URL).info().source == v.id
        assert tree_digest(c, "/workspace") == d_snap
    assert len(set(vids)) == 2
    sh_in(c1, "echo c1 > /workspace/c1")
    assert not Volume.connect(vids[1], daemon=URL).files.exists("/c1") and not v.files.exists("/c1")
    # The parent's sandbox may be gone: the snapshot still makes a sandbox with its volume.
    s.kill()
    c3 = make_sandbox(snapshot=snap)
    make_volume.adopt(c3.info().volumes[0].volume)
    assert tree_digest(c3, "/workspace") == d_snap


def test_evaluate_sees_the_volumes_and_leaves_nothing_behind(make_volume, make_sandbox):
    """``evaluate`` runs its command on a copy of the sandbox made from a checkpoint: the
    command sees the files of the sandbox's volume, what it changes does not reach the volume,
    and no volume or volume snapshot is left after it."""
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    sh_in(s, "echo orig > /workspace/f")
    with client() as c:
        volumes_before = volume_ids(c)
        snaps_before = [x.id for x in v.snapshots()]
        r = s.evaluate("cat /workspace/f; echo changed > /workspace/f; touch /workspace/new")
        assert r.stdout == "orig\n", "the evaluated command did not see the volume: %r" % (r,)
        assert sh_in(s, "cat /workspace/f; ls /workspace") == "orig\nf\n", "evaluate changed the volume"
        assert volume_ids(c) == volumes_before, "evaluate left volumes: %r" % sorted(set(volume_ids(c)) - set(volumes_before))
        snaps_after = [(x.id, x.label) for x in v.snapshots()]
        assert [x[0] for x in snaps_after] == snaps_before, "evaluate left volume snapshots: %r" % [
            x for x in snaps_after if x[0] not in snaps_before]


# ----------------------------------------------------------------------------- 7. real tools


GIT_PY = r'''
import os, subprocess
src = "/workspace/src"
for i in range(3000):
    d = os.path.join(src, "pkg%02d" % (i % 30), "mod%d" % (i % 7))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "file%04d.txt" % i), "w") as f:
        f.write("line %d\n" % i * (1 + i % 5))
def git(*args, cwd=src):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@e", "-c", "init.defaultBranch=main", *args],
                   cwd=cwd, check=True, stdout=subprocess.DEVNULL)
git("init", "-q")
git("add", "-A")
git("commit", "-q", "-m", "3000 files")
print("ok")
'''


def build_template(c, body):
    """Build a template through the API; its final event."""
    r = c.post("/v1/templates", json=body, timeout=600)
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]["template"]


def test_template_volumes_are_forked_into_each_of_its_sandboxes(raw, make_volume):
    """A template's recipe fills a volume it mounts; each sandbox created from the template
    gets its own copy-on-write fork of it at the same path, a volume given at that path
    replaces it, one overlapping it is refused; the template holds the volume until removed."""
    v = make_volume()
    name = "vt-%s" % uuid.uuid4().hex[:8]
    with client() as c:
        try:
            t = build_template(c, {
                "name": name,
                "run": ["echo prepared > /workspace/state", "seq 1 1000 > /workspace/data"],
                "code": "x = 1",
                "shells": 1,
                "volumes": [{"volume": v.id, "path": "/workspace"}],
            })
            assert [(m["volume"], m["path"], m["read_only"], m["branch"]) for m in t["volumes"]] == [
                (v.id, "/workspace", False, True)]
            assert [m.sandbox for m in v.info().mounts] == [t["sandbox_id"]]
            assert api_error(c.delete("/v1/volumes/%s" % v.id), 409, "conflict")
            a = Sandbox.create(template=name, daemon=URL, timeout=600)
            b = Sandbox.create(template=name, daemon=URL, timeout=600)
            forks = []
            for s in (a, b):
                [m] = s.info().volumes
                assert m.path == "/workspace" and m.volume != v.id
                assert Volume.connect(m.volume, daemon=URL).info().source == v.id
                forks.append(m.volume)
                assert sh_in(s, "cat /workspace/state; wc -l < /workspace/data") == "prepared\n1000\n"
            assert forks[0] != forks[1]
            sh_in(a, "echo a > /workspace/state")
            assert sh_in(b, "cat /workspace/state") == "prepared\n"
            assert v.files.read("/state") == "prepared\n"
            # A volume of the request's own at the same path replaces the template's.
            w = make_volume()
            w.files.write("/state", "mine")
            s = Sandbox.create(template=name, volumes={"/workspace": w}, daemon=URL, timeout=600)
            assert [m.volume for m in s.info().volumes] == [w.id]
            assert sh_in(s, "cat /workspace/state") == "mine"  # written without a newline
            s.kill()
            # One that overlaps it is refused, and the refused sandbox leaves nothing.
            before = {i.id for i in Sandbox.list(daemon=URL)}
            with pytest.raises(InvalidArgumentError, match="overlaps"):
                Sandbox.create(template=name, volumes={"/workspace/sub": w}, daemon=URL, timeout=600)
            assert {i.id for i in Sandbox.list(daemon=URL)} == before
            assert w.info().mounts == []
            for s in (a, b):
                s.kill()
        finally:
            c.delete("/v1/templates/%s" % name)
    wait_until(lambda: v.info().mounts == [], what="the removed template to release its volume")
    assert v.files.read("/state") == "prepared\n"


def test_git_repository_on_a_volume(make_volume, make_sandbox):
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    assert py_in(s, GIT_PY, timeout=300) == "ok\n"
    v.snapshot()  # the repository goes to a lower layer: the clone and the next commit work on it
    sh_in(s, "git clone -q /workspace/src /workspace/clone", timeout=300)
    sh_in(s, "git -C /workspace/clone fsck --full --strict", timeout=300)
    count = "git -C /workspace/clone ls-files | wc -l; find /workspace/clone -type f -not -path '*/.git/*' | wc -l"
    assert sh_in(s, count) == "3000\n3000\n"
    sh_in(s, "cd /workspace/src && echo change >> pkg01/mod1/file0001.txt && git rm -q pkg02/mod2/file0002.txt "
             "&& echo new > pkg03/new.txt && git add -A && git -c user.name=t -c user.email=t@e commit -qm second "
             "&& git -C /workspace/clone pull -q && git -C /workspace/clone fsck --full", timeout=300)
    assert sh_in(s, "cat /workspace/clone/pkg03/new.txt; test ! -e /workspace/clone/pkg02/mod2/file0002.txt && echo rm") == "new\nrm\n"
    head = sh_in(s, "git -C /workspace/src rev-parse HEAD")
    assert sh_in(s, "git -C /workspace/clone rev-parse HEAD") == head
    # A new sandbox finds the repositories intact.
    s.kill()
    s2 = make_sandbox(volumes={"/workspace": v})
    sh_in(s2, "git -C /workspace/src fsck --full && git -C /workspace/clone fsck --full", timeout=300)
    assert sh_in(s2, "git -C /workspace/src status --porcelain | wc -l") == "0\n"
    assert sh_in(s2, "git -C /workspace/clone rev-parse HEAD") == head


def tiny_wheel(dist, version, module_code):
    """A minimal pure-python wheel (bytes) of one package ``dist`` with ``__init__.py``."""
    files = {
        "%s/__init__.py" % dist: module_code.encode(),
        "%s-%s.dist-info/METADATA" % (dist, version): ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (dist, version)).encode(),
        "%s-%s.dist-info/WHEEL" % (dist, version): b"Wheel-Version: 1.0\nGenerator: test_volumes\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "%s-%s.dist-info/top_level.txt" % (dist, version): (dist + "\n").encode(),
    }
    record = "%s-%s.dist-info/RECORD" % (dist, version)
    rows = []
    for name, data in files.items():
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append("%s,sha256=%s,%d" % (name, h, len(data)))
    rows.append(record + ",,")
    files[record] = ("\n".join(rows) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


PKG_CODE = '''
def add(a, b):
    return a + b

def shout(s):
    return s.upper() + "!"
'''

UNITTEST_CODE = '''
import unittest
import pkg


class PkgTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(pkg.add(2, 3), 5)

    def test_shout(self):
        self.assertEqual(pkg.shout("hi"), "HI!")

    def test_installed_in_the_volume(self):
        self.assertTrue(pkg.__file__.startswith("/workspace/venv/"), pkg.__file__)


if __name__ == "__main__":
    unittest.main()
'''


def test_python_venv_and_pip_install_on_a_volume(make_volume, make_sandbox):
    pip_wheels = sorted(glob.glob("/usr/share/python-wheels/pip-*.whl"))
    if not pip_wheels:
        if os.environ.get("MUST_WORK"):
            pytest.fail("no pip wheel in /usr/share/python-wheels (apt-get install python3-pip-whl)")
        pytest.skip("no pip wheel in /usr/share/python-wheels")
    v = make_volume()
    s = make_sandbox(volumes={"/workspace": v})
    sh_in(s, "python3 -m venv --without-pip /workspace/venv", timeout=120)
    s.files.upload(pip_wheels[-1], "/tmp/pip.whl")
    v.files.write("/pkg-1.0-py3-none-any.whl", tiny_wheel("pkg", "1.0", PKG_CODE))
    v.files.write("/test_pkg.py", UNITTEST_CODE)
    out = sh_in(s, "/workspace/venv/bin/python /tmp/pip.whl/pip install --no-index --no-cache-dir "
                   "--disable-pip-version-check /workspace/pkg-*.whl 2>&1", timeout=300)
    assert "Successfully installed pkg-1.0" in out, out
    assert sh_in(s, "cd / && /workspace/venv/bin/python -c 'import pkg; print(pkg.add(40, 2), pkg.__file__)'") == \
        "42 /workspace/venv/lib/python3.11/site-packages/pkg/__init__.py\n"
    r = s.commands.run("cd /workspace && /workspace/venv/bin/python -m unittest -v test_pkg 2>&1", timeout=120)
    assert r.exit_code == 0 and "Ran 3 tests" in r.stdout and r.stdout.rstrip().endswith("OK"), r.stdout
    # The venv is in the volume: a new sandbox runs it (after a snapshot froze it to a lower layer).
    s.kill()
    v.snapshot()
    s2 = make_sandbox(volumes={"/workspace": v})
    r = s2.commands.run("cd /workspace && /workspace/venv/bin/python -m unittest test_pkg 2>&1", timeout=120)
    assert r.exit_code == 0 and "Ran 3 tests" in r.stdout, r.stdout
    assert {"pkg", "pkg-1.0.dist-info"} <= set(sh_in(s2, "ls /workspace/venv/lib/python3.11/site-packages").split())


# ----------------------------------------------------------------------------- 8. sync


def head_in_metadata_store(vid):
    """(version, number of layers) of the volume's head in the daemon's metadata store (the
    default: the state dir's SQLite database), or None."""
    db = sqlite3.connect("file:%s?mode=ro" % os.path.join(STATE, "branchbox.db"), uri=True, timeout=30)
    try:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'heads'").fetchone():
            return None  # the metadata store is set up on first use
        row = db.execute("SELECT version, value FROM heads WHERE name = ?", ("volume/" + vid,)).fetchone()
    finally:
        db.close()
    if row is None:
        return None
    return row[0], len(json.loads(row[1])["layers"])


def test_sync_makes_the_volume_durable(make_volume, make_sandbox):
    v = make_volume()
    i = v.info()
    assert (i.version, i.durability, i.backlog_bytes) == (0, "node-local", 0)
    assert head_in_metadata_store(v.id) is None
    v.files.write("/a", os.urandom(50_000))
    i = v.info()
    assert i.durability == "node-local" and i.backlog_bytes >= 50_000 and i.version == 0, i
    i = v.sync()
    assert (i.durability, i.backlog_bytes, i.version) == ("durable", 0, 1), i
    assert v.info() == i
    assert head_in_metadata_store(v.id) == (1, i.layers)
    # Nothing changed: the version stays.
    i = v.sync()
    assert (i.durability, i.backlog_bytes, i.version) == ("durable", 0, 1), i
    # A snapshot of its own is committed with it: no bytes to push (its layers are), a version.
    snap = v.snapshot()
    assert not snap.durable
    i = v.info()
    assert (i.durability, i.backlog_bytes, i.version) == ("node-local", 0, 1), i
    i = v.sync()
    assert (i.durability, i.version) == ("durable", 2) and [s.durable for s in v.snapshots()] == [True], i
    # Writes from a sandbox that mounts it; sync while it is mounted, and it keeps working.
    s = make_sandbox(volumes={"/workspace": v})
    assert v.info().durability == "durable"
    sh_in(s, "head -c 30000 /dev/urandom > /workspace/b")
    i = v.info()
    assert i.durability == "node-local" and i.backlog_bytes >= 30_000 and i.version == 2, i
    i = v.sync()
    assert (i.durability, i.backlog_bytes, i.version) == ("durable", 0, 3), i
    assert head_in_metadata_store(v.id) == (3, i.layers)
    sh_in(s, "echo more >> /workspace/b && sync")
    assert v.info().durability == "node-local"
    assert v.sync().version == 4
    assert v.sync().version == 4
    # A fork is a volume of its own: never synced.
    f = make_volume.adopt(v.fork().id)
    fi = f.info()
    assert (fi.version, fi.durability) == (0, "node-local") and fi.backlog_bytes > 0, fi
    assert f.sync().version == 1
