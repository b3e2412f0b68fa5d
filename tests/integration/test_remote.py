"""Durable snapshots across daemons: push to an object store, record in a metadata store, pull,
create and fork on another daemon after the first one's node is gone.

Run twice: against the embedded defaults' kind (a local directory store, a shared SQLite file)
and against real servers started here on 127.0.0.1 (MinIO for S3, PostgreSQL). Three daemons
share the store: the suite's daemon ("S", restarted with the store flags; it has the base
image), and daemons A and B with empty state dirs of their own (everything they run comes from
pulled snapshots).
"""
import hashlib
import os
import signal
import threading
import time

import pytest

from branchbox import CorruptDataError, NotFoundError, Sandbox, SandboxError, Snapshots
from helpers import CGROUP_PARENT, S3_SECRET, URL, shared_store, start_s, wait_until


@pytest.fixture(scope="module", params=["local", "s3"])
def world(request, daemon):
    """(store, peer): the suite's daemon ("S") and peers sharing a store (helpers.shared_store)."""
    with shared_store(daemon, request.param) as w:
        yield w


def digest(sbx, path):
    return sbx.commands.run("sha256sum %s | cut -d' ' -f1" % path).stdout.strip()


def test_a_snapshot_outlives_its_node(world):
    store, peer = world
    snaps_s = Snapshots(daemon=URL)
    # S: files and a python session, checkpointed and pushed.
    s = Sandbox.create(daemon=URL, timeout=600)
    s.commands.run("mkdir -p /root/w && head -c 3000000 /dev/urandom > /root/w/big && echo hi > /root/w/small")
    s.run_code("import hashlib\nsecret = hashlib.sha256(b'state').hexdigest()\ncounter = 41")
    sn0 = s.checkpoint("base")
    assert snaps_s.get(sn0).durability == "node-local"
    r = snaps_s.push(sn0)
    assert r.durability == "durable" and not r.already and r.layers_pushed >= 2 and r.images_pushed == 1, r
    assert snaps_s.get(sn0).durability == "durable"
    again = snaps_s.push(sn0)
    assert again.already and again.uploaded_bytes == 0
    big = digest(s, "/root/w/big")

    # A: empty state dir; everything comes from the store.
    a = peer("a")
    remote = {i.id: i for i in a.snapshots().list_remote()}
    assert sn0 in remote and remote[sn0].node == "s" and not remote[sn0].local
    sa = a.create(snapshot=sn0)
    assert digest(sa, "/root/w/big") == big
    assert sa.run_code("print(secret, counter)").stdout.strip() == hashlib.sha256(b"state").hexdigest() + " 41"
    sa.run_code("counter += 1\nmore = list(range(5))")
    sa.commands.run("echo changed > /root/w/small && head -c 1000000 /dev/urandom > /root/w/new")
    sn1 = sa.checkpoint("on a")
    r1 = a.snapshots().push(sn1)
    # The child uploads its own layer and what changed of the session's memory, not the chain.
    assert r1.layers_pushed == 1, r1
    new = digest(sa, "/root/w/new")
    # A's node dies: its daemon killed, its state dir gone.
    a.lose_node()

    b = peer("b")
    sb = b.create(snapshot=sn1)
    assert digest(sb, "/root/w/big") == big and digest(sb, "/root/w/new") == new
    assert sb.files.read("/root/w/small").strip() == "changed"
    assert sb.run_code("print(secret, counter, more)").stdout.strip() == hashlib.sha256(b"state").hexdigest() + " 42 [0, 1, 2, 3, 4]"
    assert b.snapshots().get(sn1).durability == "durable"
    # Forks of the pulled snapshot are live copies of its session.
    fork, res = sb.fork_info(2)
    assert not res.sessions_restarted, res.raw
    for child in fork:
        out = child.run_code("print(counter)")
        assert out.stdout.strip() == "42", out
        assert digest(child, "/root/w/new") == new
        child.kill()
    # And B's sandbox rolls back to it.
    sb.run_code("counter = -1")
    sb.rollback(sn1)
    assert sb.run_code("print(counter)").stdout.strip() == "42"
    s.kill()


def test_tampered_object_is_refused_by_name(world):
    store, peer = world
    snaps_s = Snapshots(daemon=URL)
    s = Sandbox.create(daemon=URL, timeout=600)
    s.commands.run("head -c 2000000 /dev/urandom > /root/tamper.bin")
    sid = s.checkpoint("tamper")
    before = set(store.objects())
    snaps_s.push(sid)
    new = [k for k in set(store.objects()) - before if k.startswith("chunks/")]
    assert new, "the push wrote no chunk object of its own"
    # The largest: a chunk of the random file (incompressible), which no other snapshot shares.
    victim = max(new, key=lambda k: len(store.read(k)))
    good = store.read(victim)
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    store.write(victim, bytes(data))
    try:
        b = peer("t")
        with pytest.raises(CorruptDataError) as e:
            b.create(snapshot=sid)
        assert victim.split("/")[-1] in str(e.value) and "authentication" in str(e.value), e.value
        # Nothing of it was taken in.
        with pytest.raises(NotFoundError):
            b.snapshots().get(sid)
        # Truncated: the same.
        store.write(victim, good[: len(good) // 2])
        with pytest.raises(CorruptDataError) as e:
            b.create(snapshot=sid)
        assert victim.split("/")[-1] in str(e.value), e.value
    finally:
        store.write(victim, good)
    assert b.create(snapshot=sid).commands.run("wc -c < /root/tamper.bin").stdout.strip() == "2000000"
    s.kill()


def test_gc_collects_what_no_record_reaches_and_spares_pushes(world):
    store, peer = world
    snaps_s = Snapshots(daemon=URL)
    s = Sandbox.create(daemon=URL, timeout=600)
    s.commands.run("head -c 1500000 /dev/urandom > /root/gone.bin")
    doomed = s.checkpoint("doomed")
    snaps_s.push(doomed)
    s.commands.run("rm /root/gone.bin && head -c 1500000 /dev/urandom > /root/kept.bin")
    kept = s.checkpoint("kept")
    snaps_s.delete_remote(doomed)
    # Pushes and collections race: each collection either runs alone or is refused.
    errors, done = [], threading.Event()

    def collect():
        while not done.is_set():
            try:
                snaps_s.store_gc(grace_seconds=0)
            except SandboxError as e:
                if "under way" not in str(e):
                    errors.append(e)
            time.sleep(0.01)

    t = threading.Thread(target=collect)
    t.start()
    try:
        snaps_s.push(kept)
    finally:
        done.set()
        t.join()
    assert not errors, errors
    r = snaps_s.store_gc(grace_seconds=0)
    assert r.deleted == 0 and r.reachable > 0, r
    b = peer("g")
    sb = b.create(snapshot=kept)
    assert sb.files.exists("/root/kept.bin") and not sb.files.exists("/root/gone.bin")
    with pytest.raises(NotFoundError):
        b.create(snapshot=doomed)
    s.kill()


def test_credentials_never_reach_a_sandbox(world, daemon):
    store, peer = world
    if store.kind != "s3":
        pytest.skip("the local store has no credentials")
    sbx = Sandbox.create(daemon=URL, timeout=600)
    # What every process in it sees: its environment, and a search of its files.
    env = sbx.commands.run("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'").stdout
    assert S3_SECRET not in env and "bbtest:bbtest" not in env
    found = sbx.commands.run("grep -rls %s / 2>/dev/null | head -3; true" % S3_SECRET).stdout.strip()
    assert not found, found
    # Nor any process of a sandbox, seen from the host (its cgroup), nor the daemon's helpers
    # (CRIU, inits): the daemon dropped the credentials from its environment at start.
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/cgroup" % p) as f:
                cg = f.read()
            with open("/proc/%s/status" % p) as f:
                ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
            with open("/proc/%s/environ" % p, "rb") as f:
                e = f.read()
        except (OSError, StopIteration):
            continue
        if CGROUP_PARENT in cg or ppid == daemon.pid:
            assert S3_SECRET.encode() not in e, "pid %s (a sandbox's or the daemon's child) holds the S3 secret" % p
    sbx.kill()


def test_outages_give_clear_errors_and_pushing_again_resumes(world):
    store, peer = world
    if store.kind != "s3":
        pytest.skip("needs servers to stop")
    snaps_s = Snapshots(daemon=URL)
    s = Sandbox.create(daemon=URL, timeout=600)
    s.commands.run("head -c 1000000 /dev/urandom > /root/outage.bin")
    sid = s.checkpoint("outage")
    store.minio.stop()
    try:
        with pytest.raises(SandboxError) as e:
            snaps_s.push(sid)
        assert "127.0.0.1" in str(e.value) or "object store" in str(e.value), e.value
        assert snaps_s.get(sid).durability == "node-local"
        # Local work goes on.
        assert s.commands.run("cat /root/outage.bin | wc -c").stdout.strip() == "1000000"
        s.checkpoint("still local")
    finally:
        store.minio.start()
    assert snaps_s.push(sid).durability == "durable"
    store.pg.stop()
    try:
        sid2 = s.checkpoint("pg down")
        with pytest.raises(SandboxError) as e:
            snaps_s.push(sid2)
        assert "unreachable" in str(e.value), e.value
    finally:
        store.pg.start()
    assert snaps_s.push(sid2).durability == "durable"
    s.kill()


def test_a_sandbox_paused_into_the_store_resumes_on_another_daemon(world):
    store, peer = world
    s = Sandbox.create(daemon=URL, timeout=600)
    s.commands.run("head -c 500000 /dev/urandom > /root/p.bin")
    s.run_code("import os\nnotes = ['paused', os.getpid() > 0]")
    want = digest(s, "/root/p.bin")
    r = s.pause(push=True)
    assert r.durability == "durable" and r.snapshot, r
    # It left S: S does not run it any more; the store lists it as paused.
    assert s.id not in [i.id for i in Sandbox.list(daemon=URL)]
    paused = {p.id: p for p in Snapshots(daemon=URL).list_paused_remote()}
    assert paused[s.id].snapshot == r.snapshot and paused[s.id].node == "s"
    b = peer("p")
    sb = Sandbox.connect(s.id, daemon=b.url)
    assert sb.id == s.id and sb.info().state == "running"
    assert digest(sb, "/root/p.bin") == want
    assert sb.run_code("print(notes)").stdout.strip() == "['paused', True]"
    # Resumed once: the record is gone, another daemon does not find it.
    assert s.id not in [p.id for p in b.snapshots().list_paused_remote()]
    c = peer("q")
    with pytest.raises(NotFoundError):
        Sandbox.connect(s.id, daemon=c.url)
    sb.kill()


def test_kill_9_during_push_and_pull_leaves_nothing_half_recorded(world, daemon):
    store, peer = world
    snaps_s = Snapshots(daemon=URL)
    s = Sandbox.create(daemon=URL, timeout=0)
    s.commands.run("head -c 200000000 /dev/urandom > /root/huge.bin")
    want = digest(s, "/root/huge.bin")
    sid = s.checkpoint("huge")
    before = len(store.objects())
    pushing = threading.Thread(target=lambda: pytest.raises(Exception, snaps_s.push, sid))
    pushing.start()
    # Killed once the push has written part of it.
    wait_until(lambda: len(store.objects()) > before + 20, timeout=60, interval=0.01, what="the push to write objects")
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    pushing.join()
    start_s(daemon, store)
    # Nothing recorded: the snapshot is not durable, and no daemon can find it.
    assert snaps_s.get(sid).durability == "node-local"
    assert sid not in [i.id for i in snaps_s.list_remote()]
    # Pushing again resumes: what was written is not written again.
    written = store.sizes()
    r = snaps_s.push(sid)
    total = store.sizes()
    assert r.durability == "durable", r
    assert all(total[k] == n for k, n in written.items()), "an object written before the kill changed"
    new_bytes = sum(n for k, n in total.items() if k not in written)
    assert sum(written.values()) > 0 and r.uploaded_bytes <= new_bytes, (r, new_bytes)
    # A pull killed half-way leaves nothing behind that a later pull trips over.
    b = peer("k")
    pulling = threading.Thread(target=lambda: pytest.raises(Exception, b.snapshots().pull, sid))
    pulling.start()
    time.sleep(0.5)
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait()
    pulling.join()
    b.start()
    sb = b.create(snapshot=sid)
    assert digest(sb, "/root/huge.bin") == want
    sb.kill()
    Sandbox.connect(s.id, daemon=URL).kill()


def test_a_push_after_a_collection_does_not_name_collected_packs(world):
    store, peer = world
    snaps_s = Snapshots(daemon=URL)
    s = Sandbox.create(daemon=URL, timeout=600)
    # Small files: their chunks go into packs, which this daemon's store remembers.
    s.commands.run("mkdir /root/small && for i in $(seq 1 40); do head -c 3000 /dev/urandom > /root/small/$i; done")
    want = s.commands.run("cat /root/small/* | sha256sum").stdout
    first = s.checkpoint("first")
    snaps_s.push(first)
    snaps_s.delete_remote(first)
    r = snaps_s.store_gc(grace_seconds=0)
    assert r.deleted > 0, r
    # The same layer again, under a new snapshot: its packs must be written again, not named.
    s.commands.run("echo more > /root/more")
    second = s.checkpoint("second")
    snaps_s.push(second)
    sb = peer("r").create(snapshot=second)
    assert sb.commands.run("cat /root/small/* | sha256sum").stdout == want
    s.kill()
