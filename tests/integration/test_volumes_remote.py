"""Volumes across daemons that share one object store and one metadata store: a volume synced on
one daemon opens on the other (its committed head), the writer lease of an rwo volume, local
durability without a sync, the store down, a tampered object, and the store's collection.

Run twice, like test_remote.py: on a local directory + a SQLite file, and on MinIO + PostgreSQL
started here. Two daemons share the store: A, the suite's daemon restarted on it as node "a" (it
has the base image), and B, a peer with an empty state dir of its own as node "b"; B's sandboxes
start from a snapshot of a plain sandbox that A pushed. Both run with --volume-sync-interval 0:
a volume goes to the store when a test syncs it, never in the background halfway through a test.
"""
import contextlib
import hashlib
import os
import signal
import time
import uuid

import httpx
import pytest

from branchbox import ConflictError, CorruptDataError, Sandbox, Snapshots, Volume, VolumeMount
from helpers import (
    FSYNC_WRITE_PY,
    SOCKET,
    URL,
    api_error,
    make_tree,
    mutate,
    proc_stat,
    py_in,
    sh_in,
    shared_store,
    start_s,
    tree_digest,
    wait_until,
)

NO_BACKGROUND_SYNC = ["--volume-sync-interval", "0"]
# The writer lease of an rwo volume lasts 30 s after its holder last renewed it (every 10 s
# while a sandbox there mounts it): another node can take over within this many seconds.
LEASE_TAKEOVER = 45


def api(sock):
    return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://d", timeout=120)


class World:
    """Daemon A (the suite's, node "a") and daemon B (a peer, node "b") on one store; what a
    test makes through it is removed by ``cleanup``."""

    def __init__(self, store, daemon, b, base):
        self.store, self.daemon, self.b, self.base = store, daemon, b, base
        self.a_sandboxes, self.volumes = [], []

    def volume_on_a(self):
        v = Volume.create(daemon=URL)
        self.volumes.append(v.id)
        return v

    def sandbox_on_a(self, vid, read_only=False):
        """A sandbox of A's base image with volume ``vid`` at /w."""
        s = Sandbox.create(daemon=URL, timeout=600, volumes={"/w": VolumeMount(volume=vid, read_only=read_only)})
        self.a_sandboxes.append(s.id)
        return s

    def sandbox_on_b(self, vid):
        """A sandbox of B (from A's pushed plain sandbox) with volume ``vid`` at /w."""
        return Sandbox.create(daemon=self.b.url, snapshot=self.base, timeout=600, volumes={"/w": vid})

    def kill_a(self):
        """kill -9 of daemon A (its sandboxes live on)."""
        self.daemon.stop(signal.SIGKILL)

    def start_a(self):
        start_s(self.daemon, self.store, "a", NO_BACKGROUND_SYNC)

    @contextlib.contextmanager
    def store_down(self):
        """The object store unreachable (the metadata store still up): MinIO stopped, or the
        local store's directory replaced by a file, so that every object read and write fails."""
        if self.store.kind == "s3":
            self.store.minio.stop()
            try:
                yield
            finally:
                self.store.minio.start()
            return
        objects = os.path.join(self.store.root, "objects")
        os.rename(objects, objects + ".away")
        open(objects, "w").close()
        try:
            yield
        finally:
            os.unlink(objects)
            os.rename(objects + ".away", objects)

    def cleanup(self):
        """Kill the test's sandboxes on both daemons, then delete its volumes on both: first
        where the copy is at the committed head (that deletes the head), then the others, once
        the leases their sandboxes held are let go."""
        if not self.daemon.running():
            self.start_a()
        daemons = {"a": api(SOCKET), "b": api(self.b.sock)}
        try:
            for sid in self.a_sandboxes:
                daemons["a"].delete("/v1/sandboxes/%s" % sid)
            for s in daemons["b"].get("/v1/sandboxes").json()["sandboxes"]:
                daemons["b"].delete("/v1/sandboxes/%s" % s["id"])
            left = {(d, vid): None for d in daemons for vid in self.volumes}
            deadline = time.monotonic() + LEASE_TAKEOVER
            while left:
                for d, vid in list(left):
                    r = daemons[d].delete("/v1/volumes/%s" % vid)
                    if r.status_code in (200, 404):
                        del left[(d, vid)]
                    else:
                        assert r.status_code == 409, "deleting volume %s on %s: %s" % (vid, d, r.text)
                        left[(d, vid)] = r.json()["error"]["message"]
                assert not left or time.monotonic() < deadline, "volumes that cannot be deleted: %r" % left
                time.sleep(0.2 if left else 0)
        finally:
            for c in daemons.values():
                c.close()
        self.a_sandboxes, self.volumes = [], []


@pytest.fixture(scope="module", params=["local", "s3"])
def world(request, daemon):
    with shared_store(daemon, request.param, node="a", extra=NO_BACKGROUND_SYNC) as (store, peer):
        b = peer("b")
        plain = Sandbox.create(daemon=URL, timeout=600)
        base = plain.checkpoint("plain sandbox for B")
        plain.kill()
        try:
            Snapshots(daemon=URL).push(base)
            yield World(store, daemon, b, base)
        finally:
            Snapshots(daemon=URL).delete(base)


@pytest.fixture
def w(world):
    yield world
    world.cleanup()


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def sha256_in(sbx, path):
    return sh_in(sbx, "sha256sum < %s" % path).split()[0]


# ----------------------------------------------------------------------------- tests


def test_volume_synced_on_one_daemon_opens_on_the_other_and_follows_its_head(w):
    va = w.volume_on_a()
    sa = w.sandbox_on_a(va.id)
    make_tree(sa, "/w", 1)
    d1 = tree_digest(sa, "/w")
    sa.kill()  # a sandbox that mounts it would hold its writer lease
    i = va.sync()
    assert (i.version, i.durability, i.backlog_bytes) == (1, "durable", 0), i

    # B opens it from its committed head: the same files, byte for byte.
    vb = Volume.connect(va.id, daemon=w.b.url)
    i = vb.info()
    assert (i.id, i.version, i.durability, i.backlog_bytes) == (va.id, 1, "durable", 0), i
    sb = w.sandbox_on_b(va.id)
    assert tree_digest(sb, "/w") == d1
    # B writes and syncs: the next version.
    mutate(sb, "/w", "on-b")
    d2 = tree_digest(sb, "/w")
    assert d2 != d1
    sb.kill()
    i = vb.sync()
    assert (i.version, i.durability, i.backlog_bytes) == (2, "durable", 0), i

    # A, where nothing mounts it and nothing changed since its sync, comes up to B's head when
    # it next looks.
    i = Volume.connect(va.id, daemon=URL).info()
    assert (i.version, i.durability, i.backlog_bytes) == (2, "durable", 0), i
    ra = w.sandbox_on_a(va.id, read_only=True)
    assert tree_digest(ra, "/w") == d2


def test_volume_snapshots_ride_in_its_head_and_restore_on_the_other_daemon(w):
    """A volume's own snapshots are committed with it: after a sync on A (and a collection of
    the store), B lists them as durable, restores one whose layers only a snapshot reaches
    (pulled then) and forks another; a snapshot deleted on B leaves the head at B's next sync,
    and A, following the head, drops it too."""
    va = w.volume_on_a()
    va.files.write("/f", "one")
    s1 = va.snapshot("one")
    va.files.write("/f", "two")
    va.files.write("/g", "two")
    s2 = va.snapshot("two")
    # Back to s1 and on: the layer holding "two" is reached by s2 only.
    va.restore(s1)
    va.files.write("/f", "three")
    assert [s.durable for s in va.snapshots()] == [False, False]
    assert va.sync().version == 1
    assert [(s.id, s.durable) for s in va.snapshots()] == [(s1.id, True), (s2.id, True)]
    Snapshots(daemon=URL).store_gc(grace_seconds=0)

    vb = Volume.connect(va.id, daemon=w.b.url)
    assert [(s.id, s.label, s.durable) for s in vb.snapshots()] == [(s1.id, "one", True), (s2.id, "two", True)]
    assert vb.files.read("/f") == "three"
    vb.restore(s2.id)
    assert (vb.files.read("/f"), vb.files.read("/g")) == ("two", "two")
    fork = vb.fork(snapshot=s1.id)
    w.volumes.append(fork.id)
    assert fork.files.read("/f") == "one" and not fork.files.exists("/g")
    info = vb.sync()
    assert (info.version, info.durability) == (2, "durable"), info
    # Deleted on B: nothing else changed, yet the next sync commits (the head lists it no more).
    assert vb.delete_snapshot(s1.id) is True
    assert vb.info().durability == "node-local"
    assert vb.sync().version == 3
    a = Volume.connect(va.id, daemon=URL)
    assert a.info().version == 3
    assert [(s.id, s.durable) for s in a.snapshots()] == [(s2.id, True)]
    assert (a.files.read("/f"), a.files.read("/g")) == ("two", "two")


def test_volume_changed_on_both_daemons_is_refused_as_diverged(w):
    va = w.volume_on_a()
    va.files.write("/one", "1")
    assert va.sync().version == 1
    vb = Volume.connect(va.id, daemon=w.b.url)
    # Each side changes its copy of version 1; B commits first.
    va.files.write("/from-a", "a")
    vb.files.write("/from-b", "b")
    assert vb.sync().version == 2
    # A's copy is neither brought up to version 2 (that would lose its change) nor committed.
    with pytest.raises(ConflictError) as e:
        Volume.connect(va.id, daemon=URL)
    assert "diverged" in str(e.value), e.value
    with pytest.raises(ConflictError) as e:
        va.sync()
    assert "diverged" in str(e.value), e.value
    # The committed head (B's copy) has B's change only.
    assert vb.files.exists("/from-b") and not vb.files.exists("/from-a") and vb.files.read("/one") == "1"


def test_writer_lease_keeps_b_out_until_a_is_gone(w):
    """While a sandbox on A mounts a synced rwo volume, A holds its writer lease: B can read the
    volume but neither mount it writable nor commit to it. Once A's daemon is killed (-9) the
    lease is not renewed: B takes over when it expires, from A's last synced state. A, started
    again, cannot commit on top of B's version, and its sandbox from before runs on."""
    va = w.volume_on_a()
    sa = w.sandbox_on_a(va.id)
    make_tree(sa, "/w", 2)
    synced = tree_digest(sa, "/w")
    assert va.sync().version == 1  # from now on A holds the lease, renewed while sa mounts it

    # B may read it, but neither mount it writable nor commit to it: both name A's node.
    with pytest.raises(ConflictError) as e:
        w.sandbox_on_b(va.id)
    assert 'node "a"' in str(e.value), e.value
    vb = Volume.connect(va.id, daemon=w.b.url)
    assert vb.files.read("/seed") == "2"
    vb.files.write("/from-b", "b")
    with pytest.raises(ConflictError) as e:
        vb.sync()
    assert 'node "a"' in str(e.value), e.value
    i = vb.info()
    assert (i.version, i.durability) == (1, "node-local") and i.backlog_bytes > 0, i

    # A writes on without syncing; then its daemon is killed. Its sandbox lives on, but no one
    # renews the lease any more.
    sh_in(sa, "echo unsynced > /w/unsynced")
    init = sa.info().init_pid
    w.kill_a()
    killed = time.monotonic()
    attempts = []

    def take_over():
        attempts.append(time.monotonic() - killed)
        try:
            return w.sandbox_on_b(va.id)
        except ConflictError as e:
            assert 'node "a"' in str(e), e
            return None

    sb = wait_until(take_over, timeout=LEASE_TAKEOVER, interval=1, what="B to take the volume over from the dead A")
    assert len(attempts) > 1 and attempts[-1] > 15, "the lease did not outlive A's daemon: %r" % attempts
    st = proc_stat(init)
    assert st is not None and st[0] != "Z", "A's sandbox died with its daemon"
    # B has A's last synced state (and its own change), not what A wrote after.
    assert sh_in(sb, "cat /w/from-b; test ! -e /w/unsynced && echo no-unsynced") == "bno-unsynced\n"
    sh_in(sb, "rm /w/from-b")
    assert tree_digest(sb, "/w") == synced
    sh_in(sb, "echo b-writes > /w/b")
    sb.kill()
    assert vb.sync().version == 2

    # A again: its sandbox from before runs on with A's node-local state, but A's sync is
    # refused (B committed since A's version).
    w.start_a()
    sa = Sandbox.connect(sa.id, daemon=URL)
    assert sh_in(sa, "cat /w/unsynced; test ! -e /w/b && echo no-b") == "unsynced\nno-b\n"
    with pytest.raises(ConflictError) as e:
        va.sync()
    assert "committed elsewhere" in str(e.value), e.value
    assert sh_in(sa, "echo alive") == "alive\n"


def test_fsynced_writes_are_kept_on_the_node_after_kill_9_without_a_sync(w):
    """What a sandbox fsync'd in a volume is on the node's disk: a kill -9 of the daemon loses
    none of it (node-local durability); only a sync puts it in the store."""
    va = w.volume_on_a()
    sa = w.sandbox_on_a(va.id)
    sh_in(sa, "echo synced > /w/s")
    assert va.sync().version == 1
    data = "fsync'd " + uuid.uuid4().hex
    py_in(sa, FSYNC_WRITE_PY, "/w/f", data)
    w.kill_a()
    w.start_a()
    # On A: the file is there, node-local (never synced).
    va = Volume.connect(va.id, daemon=URL)
    assert va.files.read("/f") == data
    i = va.info()
    assert (i.version, i.durability) == (1, "node-local") and i.backlog_bytes > 0, i
    sa = Sandbox.connect(sa.id, daemon=URL)
    assert sh_in(sa, "cat /w/f /w/s") == data + "synced\n"
    # The store has the synced version only.
    vb = Volume.connect(va.id, daemon=w.b.url)
    assert vb.files.read("/s") == "synced\n" and not vb.files.exists("/f")


def test_store_down_keeps_writes_local_and_sync_resumes_after(w):
    """With the object store unreachable, a sandbox writes on in its volume; a sync fails with
    503 and the volume shows its backlog; once the store is back a sync uploads all of it."""
    va = w.volume_on_a()
    sa = w.sandbox_on_a(va.id)
    sh_in(sa, "head -c 1000000 /dev/urandom > /w/before")
    assert va.sync().version == 1
    with w.store_down(), api(SOCKET) as a:
        sh_in(sa, "head -c 2000000 /dev/urandom > /w/during && sync")
        want = sha256_in(sa, "/w/during")
        err = api_error(a.post("/v1/volumes/%s/sync" % va.id), 503, "unavailable")
        assert "object store" in err["message"], err
        i = va.info()
        assert (i.version, i.durability) == (1, "node-local") and i.backlog_bytes >= 2_000_000, i
        # Work in the sandbox goes on.
        sh_in(sa, "echo still > /w/still && cat /w/before > /dev/null")
    i = va.sync()
    assert (i.version, i.durability, i.backlog_bytes) == (2, "durable", 0), i
    vb = Volume.connect(va.id, daemon=w.b.url)
    assert sha256(vb.files.read("/during", format="bytes")) == want and vb.files.read("/still") == "still\n"


def test_tampered_pack_object_is_refused_by_name_and_nothing_is_taken_in(w):
    """Objects are authenticated as they are read: a pack object changed in the store makes B's
    opening of the volume fail with an error naming it, and B keeps and serves nothing of it."""
    store = w.store
    va = w.volume_on_a()
    # Small files: their chunks go into pack objects.
    want = {"/small/%d" % i: os.urandom(3000) for i in range(40)}
    for path, data in want.items():
        va.files.write(path, data)
    before = set(store.objects())
    va.sync()
    packs = [k for k in set(store.objects()) - before if k.startswith("packs/") and not k.endswith(".idx")]
    assert packs, "the sync wrote no pack object"
    victim = max(packs, key=lambda k: len(store.read(k)))
    good = store.read(victim)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    layers_b = set(os.listdir(os.path.join(w.b.state, "snaplayers")))
    store.write(victim, bytes(bad))
    try:
        with pytest.raises(CorruptDataError) as e:
            Volume.connect(va.id, daemon=w.b.url)
        assert victim.split("/")[-1] in str(e.value) and "authentication" in str(e.value), e.value
        # Nothing of it is served or kept on B.
        with api(w.b.sock) as b:
            r = b.get("/v1/volumes/%s/files" % va.id, params={"path": "/small/0"})
            assert victim.split("/")[-1] in api_error(r, 502, "corrupt")["message"], r.text
            assert va.id not in [v["id"] for v in b.get("/v1/volumes").json()["volumes"]]
        assert not os.path.exists(os.path.join(w.b.state, "volumes", va.id))
        assert set(os.listdir(os.path.join(w.b.state, "snaplayers"))) == layers_b
    finally:
        store.write(victim, good)
    vb = Volume.connect(va.id, daemon=w.b.url)
    assert {p: vb.files.read(p, format="bytes") for p in want} == want


def test_store_gc_keeps_what_volume_heads_reach_and_collects_deleted_volumes(w):
    """``store gc`` (POST /v1/remote/gc) with no grace keeps every object a volume's committed
    head reaches; deleting the volume on its writer deletes its head, and the next collection
    takes its objects."""
    store = w.store
    snaps = Snapshots(daemon=URL)
    va = w.volume_on_a()
    big = os.urandom(3_000_000)
    va.files.write("/big.bin", big)
    for i in range(20):
        va.files.write("/small/%d" % i, os.urandom(3000))
    before = set(store.objects())
    va.sync()
    mine = set(store.objects()) - before
    assert mine, "the sync wrote no object"
    snaps.store_gc(grace_seconds=0)
    assert mine <= set(store.objects()), "a collection took objects of a volume's head: %r" % sorted(mine - set(store.objects()))
    vb = Volume.connect(va.id, daemon=w.b.url)
    assert sha256(vb.files.read("/big.bin", format="bytes")) == sha256(big) and len(vb.files.list("/small")) == 20
    # Deleted on its writer, the volume's head goes, and the next collection takes its objects.
    assert va.delete() is True
    r = snaps.store_gc(grace_seconds=0)
    assert not mine & set(store.objects()), "objects of the deleted volume are left: %r" % sorted(mine & set(store.objects()))
    assert r.deleted >= len(mine), r


def test_node_cache_lets_durable_idle_volumes_go_and_pulls_them_back_when_used(w):
    """With --volume-cache-mb 1, the background tick lets the layers of durable volumes that no
    sandbox uses leave the node, least recently used first; the next read or mount pulls them
    back from the store, the same bytes. A volume with unsynced changes and one a sandbox
    mounts keep theirs; with the store down, a read of a volume whose layers went fails with
    503 and serves nothing."""
    w.kill_a()
    start_s(w.daemon, w.store, "a", NO_BACKGROUND_SYNC + ["--volume-cache-mb", "1"])
    try:
        blobs = {}
        v1, v2, changed, mounted = (w.volume_on_a() for _ in range(4))
        for v in (v1, v2, changed, mounted):
            blobs[v.id] = os.urandom(2 << 20)
            v.files.write("/blob", blobs[v.id])
            assert v.sync().durability == "durable"
        changed.files.write("/later", b"not synced")
        sm = w.sandbox_on_a(mounted.id)
        # The tick runs every 10 s.
        wait_until(lambda: not v1.info().cached and not v2.info().cached, timeout=40, what="v1 and v2 let go")
        assert changed.info().cached and mounted.info().cached
        i = v1.info()
        assert (i.durability, i.version, i.size_bytes >= 2 << 20) == ("durable", 1, True), i
        # Read back through the file API, and mounted in a sandbox: pulled, the same bytes.
        assert v1.files.read("/blob", format="bytes") == blobs[v1.id]
        assert v1.info().cached
        s2 = w.sandbox_on_a(v2.id)
        assert sha256_in(s2, "/w/blob") == sha256(blobs[v2.id]) and v2.info().cached
        assert sha256_in(sm, "/w/blob") == sha256(blobs[mounted.id])
        assert changed.files.read("/later") == "not synced"
        # v1 is idle again (v2 is mounted now): it goes at the next tick; with the store down a
        # read cannot bring it back.
        wait_until(lambda: not v1.info().cached, timeout=40, what="v1 let go again")
        with w.store_down(), api(SOCKET) as a:
            err = api_error(a.get("/v1/volumes/%s/files" % v1.id, params={"path": "/blob"}), 503, "unavailable")
            assert "object store" in err["message"], err
            assert not v1.info().cached
        assert sha256(v1.files.read("/blob", format="bytes")) == sha256(blobs[v1.id])
    finally:
        w.cleanup()
        w.kill_a()
        w.start_a()
