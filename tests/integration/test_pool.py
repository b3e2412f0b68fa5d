"""Warm pool against a live daemon: claims are hits, request settings apply to a claimed
sandbox, drain tears shells down, a pool that cannot refill degrades to cold creates without
starving the other pools, removing an image takes its pool along, and a recycled sandbox
carries nothing of its previous tenant (files, processes, environment, sockets, SysV IPC,
session memory, hostname) even when claims race recycles.

Every test puts the pool settings it changed back to 0 (the suite's daemon runs with
``--pool-size 0``), so the final leak check sees no pooled shells.
"""
import hashlib
import json
import os
import sqlite3
import tarfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from branchbox import InvalidArgumentError, NotFoundError, Pool, Sandbox
from branchbox.images import Images
from helpers import (
    STATE,
    URL,
    api_error,
    assert_no_host_traces,
    cgroup_children,
    cgroup_file,
    expect_output,
    host_traces,
    sandbox_entries,
    wait_until,
)

POOL_TIMEOUT = 60.0


class PoolCtl:
    """The pool API plus bookkeeping: every image touched is drained again at teardown."""

    def __init__(self):
        self.api = Pool(daemon=URL)
        self.touched = set()

    def set(self, image, lo, hi=None):
        self.touched.add(image)
        return self.api.set(image, lo, hi)

    def stats(self):
        return self.api.stats()

    def ready(self, image):
        return self.stats().ready(image)

    def wait_ready(self, image, n, exactly=False, timeout=POOL_TIMEOUT):
        def ok():
            r = self.ready(image)
            return (r == n) if exactly else (r >= n)

        wait_until(ok, timeout=timeout, interval=0.01, what="%s%d ready sandboxes of %s (stats: %r)" % ("" if exactly else ">=", n, image, self.stats().raw))

    def restore(self):
        for image in sorted(self.touched):
            self.api.set(image, 0, 0)  # works whether or not the image still exists
            self.wait_ready(image, 0, exactly=True)
        self.api.close()


@pytest.fixture
def pool(daemon):
    ctl = PoolCtl()
    # Start from no pool for base whatever an earlier test left.
    ctl.set("base", 0, 0)
    ctl.wait_ready("base", 0, exactly=True)
    yield ctl
    ctl.restore()


@pytest.fixture
def killer():
    """Sandboxes to kill at teardown (tests kill most themselves)."""
    made = []
    yield made
    for s in made:
        try:
            s.kill()
        except Exception:
            pass
        s.close()


def create(killer, **kw):
    kw.setdefault("timeout", 600)
    s = Sandbox.create(daemon=URL, **kw)
    killer.append(s)
    return s


# ----------------------------------------------------------------------------- claims, stats, drain


def test_claims_are_hits_and_drain_tears_shells_down(pool, killer):
    baseline_cgroups = cgroup_children()
    listed = {i.id for i in Sandbox.list(daemon=URL)}
    st = pool.set("base", 2, 3)
    assert (st.images["base"].min, st.images["base"].max) == (2, 3)
    pool.wait_ready("base", 2)
    # Pooled sandboxes are not anyone's yet: not listed.
    assert {i.id for i in Sandbox.list(daemon=URL)} == listed
    before = pool.stats()
    assert before.created >= 2 and before.refill_ms_p50 is not None and before.cgroup_placement in ("migrate", "clone_into_cgroup")

    a = create(killer)
    b = create(killer)
    after = pool.stats()
    assert after.hits - before.hits == 2 and after.misses == before.misses, (before.raw, after.raw)
    for s in (a, b):
        expect_output(s.commands.run("echo ok; hostname"), stdout="ok\n%s\n" % s.id)
        assert s.info().state == "running" and s.info().image == "base"
        s.files.write("/root/x.txt", s.id)
        assert s.files.read("/root/x.txt") == s.id
        assert s.run_code("6 * 7").result == "42"
    assert a.id != b.id and {a.id, b.id} <= {i.id for i in Sandbox.list(daemon=URL)}
    # The background refill brings the pool back to min.
    pool.wait_ready("base", 2)
    assert pool.stats().created >= before.created + 2

    st = pool.set("base", 0, 0)
    assert "base" not in st.images, "a drained pool is not listed: %r" % st.raw
    assert "base" not in pool.stats().images
    assert persisted_targets().get("base") is None
    a.kill(), b.kill()
    # Drained: a create starts cold, and no shell is left on the host.
    s = pool.stats()
    c = create(killer)
    assert pool.stats().misses == s.misses + 1 and pool.stats().hits == s.hits
    c.kill()
    try:
        wait_until(lambda: cgroup_children() == baseline_cgroups, timeout=15, what="cgroups back to the baseline after drain")
    except AssertionError:
        now = cgroup_children()
        diff = {d: (sorted(set(now.get(d, [])) - set(v)), sorted(set(v) - set(now.get(d, [])))) for d, v in baseline_cgroups.items()}
        raise AssertionError("cgroups (added, removed) since the baseline: %r" % diff) from None


def test_claimed_sandbox_gets_the_request_settings(pool, killer):
    pool.set("base", 1, 1)
    pool.wait_ready("base", 1)
    hits = pool.stats().hits
    s = create(killer, memory_mb=256, cpu=0.5, pids=64, env={"BB_K": "v1"}, cwd="/work/dir", metadata={"who": "claim"}, timeout=120)
    assert pool.stats().hits == hits + 1
    info = s.info()
    assert (info.memory_mb, info.cpu, info.pids, info.cwd, info.env, info.metadata) == (256, 0.5, 64, "/work/dir", {"BB_K": "v1"}, {"who": "claim"})
    assert info.expires_at is not None and 100 < info.expires_at - info.created_at <= 121
    expect_output(s.commands.run('pwd; echo "$BB_K"'), stdout="/work/dir\nv1\n")
    assert int(cgroup_file("memory", s.id, "memory.limit_in_bytes")) == 256 * 1024 * 1024
    assert cgroup_file("pids", s.id, "pids.max") == "64"
    assert [i.id for i in Sandbox.list(daemon=URL, metadata={"who": "claim"})] == [s.id]


def test_pool_api_errors(pool, raw):
    with pytest.raises(InvalidArgumentError, match="must not exceed"):
        pool.set("base", 3, 1)  # refused by the SDK before any request
    api_error(raw.put("/v1/pool/base", json={"min": 3, "max": 1}), 400, "bad_request")
    api_error(raw.put("/v1/pool/base", json={"min": 1, "max": 100000}), 400, "bad_request")
    api_error(raw.put("/v1/pool/base", json={"min": 1, "bogus": 1}), 400)
    api_error(raw.put("/v1/pool/base", json={}), 400)
    err = api_error(raw.put("/v1/pool/no-such-image", json={"min": 1}), 404, "not_found")
    assert "no-such-image" in err["message"]
    with pytest.raises(NotFoundError):
        pool.set("no-such-image", 1)
    assert "no-such-image" not in pool.stats().images


def test_draining_needs_no_image_and_is_idempotent(pool, raw):
    """A stale target (its image gone) can always be cleared: min = max = 0 is accepted for
    any name, twice in a row too."""
    name = "no-such-image-%s" % uuid.uuid4().hex[:6]
    for _ in range(2):
        r = raw.put("/v1/pool/%s" % name, json={"min": 0, "max": 0})
        assert r.status_code == 200, r.text
        assert name not in r.json()["images"]
    assert name not in pool.api.drain(name).images
    assert persisted_targets().get(name) is None


def persisted_targets():
    """{image: (min, max)} of the daemon's pool_targets table (what a restart rebuilds)."""
    db = sqlite3.connect("file:%s?mode=ro" % os.path.join(STATE, "branchbox.db"), uri=True, timeout=10)
    try:
        return {image: (lo, hi) for image, lo, hi in db.execute("SELECT image, min, max FROM pool_targets")}
    finally:
        db.close()


# ----------------------------------------------------------------------------- a pool that cannot refill


def tiny_image_tar(directory, startable=True):
    """A `docker save` tarball of a one-layer image with a few empty directories: sandboxes
    start from it (init comes from the host) though nothing can be executed in them. With
    ``startable=False`` its /proc is a regular file, so no sandbox can start from it."""
    layer = os.path.join(directory, "layer.tar")
    with tarfile.open(layer, "w") as t:
        for d in ("root", "tmp", "etc", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            if d == "proc" and not startable:
                info.type, info.mode = tarfile.REGTYPE, 0o644
            t.addfile(info)
    digest = hashlib.sha256(open(layer, "rb").read()).hexdigest()
    config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]}, "rootfs": {"type": "layers", "diff_ids": ["sha256:" + digest]}}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump([{"Config": "config.json", "RepoTags": ["tiny:latest"], "Layers": ["layer.tar"]}], f)
    out = os.path.join(directory, "tiny.tar")
    with tarfile.open(out, "w") as t:
        for name in ("manifest.json", "config.json", "layer.tar"):
            t.add(os.path.join(directory, name), arcname=name)
    return out


@pytest.fixture
def broken_pool(pool, tmp_path):
    """A pool whose image cannot start a sandbox (its /proc is a file): every refill fails. Its
    name sorts before "base" (a refill task serving images in name order would starve base)."""
    name = "aaa-pool-broken-%s" % uuid.uuid4().hex[:6]
    images = Images(daemon=URL)
    images.import_(name, tiny_image_tar(str(tmp_path), startable=False))
    failures = pool.stats().failures
    pool.set(name, 1, 1)
    yield name, failures
    pool.set(name, 0, 0)
    try:
        images.remove(name)
    except NotFoundError:
        pass  # the test removed it
    images.close()


def test_refill_failure_degrades_to_cold_creates(pool, broken_pool, killer):
    name, failures = broken_pool
    wait_until(lambda: pool.stats().failures > failures, timeout=POOL_TIMEOUT, what="a failed refill of %s" % name)
    st = pool.stats()
    assert st.last_error and name in st.last_error, st.raw
    assert st.ready(name) == 0 and (st.images[name].min, st.images[name].max) == (1, 1), st.raw
    # Creates do not wait for the pool: a create of another image starts cold at once...
    t0 = time.monotonic()
    s = create(killer, request_timeout=30)
    assert time.monotonic() - t0 < 10
    expect_output(s.commands.run("echo cold"), stdout="cold\n")
    assert pool.stats().misses == st.misses + 1
    assert pool.stats().last_error, "last_error stays set while refills fail"
    # Removing the image takes its pool along: no target left to fail, no error reported.
    Images(daemon=URL).remove(name)
    st = pool.stats()
    assert name not in st.images and st.last_error is None, st.raw
    assert name not in persisted_targets()
    # ... and a create of the removed image fails fast with a clear error, not a hang.
    t0 = time.monotonic()
    with pytest.raises(NotFoundError, match=name):
        Sandbox.create(name, daemon=URL, request_timeout=30)
    assert time.monotonic() - t0 < 10


def test_a_failing_image_does_not_starve_the_other_pools(pool, broken_pool):
    name, failures = broken_pool
    wait_until(lambda: pool.stats().failures > failures, timeout=POOL_TIMEOUT, what="a failed refill of %s" % name)
    pool.set("base", 3, 3)
    pool.wait_ready("base", 3)
    # The failing image keeps being retried (with a pause) meanwhile, and reported.
    wait_until(lambda: pool.stats().failures > failures + 1, timeout=POOL_TIMEOUT, what="another failed refill of %s" % name)
    st = pool.stats()
    assert st.ready(name) == 0 and st.ready("base") == 3 and name in st.last_error, st.raw


def test_removing_an_image_tears_its_pooled_sandboxes_down_first(pool, tmp_path):
    """Pooled sandboxes stand on their image's layers: removing the image tears them down
    before the layers go, and forgets the pool (so no refill fails on the missing image)."""
    name = "tiny-pool-%s" % uuid.uuid4().hex[:6]
    images = Images(daemon=URL)
    try:
        images.import_(name, tiny_image_tar(str(tmp_path)))
        before = set(sandbox_entries())
        pool.set(name, 2, 2)
        pool.wait_ready(name, 2)
        shells = sorted(set(sandbox_entries()) - before)
        assert len(shells) == 2, shells
        assert all(host_traces(sid)["mounts"] for sid in shells), "pooled sandboxes have their roots mounted"
        failures = pool.stats().failures
        assert images.remove(name) is True
        # Gone when the removal answers, not at some later refill pass.
        left = {sid: host_traces(sid) for sid in shells}
        assert all(not t["dir"] and not t["cgroups"] and not t["mounts"] for t in left.values()), left
        st = pool.stats()
        assert name not in st.images and st.failures == failures, st.raw
        assert name not in persisted_targets()
    finally:
        pool.touched.discard(name)
        try:
            pool.api.set(name, 0, 0)
            images.remove(name)
        except NotFoundError:
            pass
        images.close()


# ----------------------------------------------------------------------------- recycling hygiene

PROBE = r"""
import glob, json, os, sys
marker = sys.argv[1].encode()
found = []
for f in ("/root/secret.txt", "/tmp/secret.txt", "/var/tmp/secret.txt", "/dev/shm/secret"):
    if os.path.lexists(f):
        found.append("file " + f)
for top in ("/root", "/tmp", "/var/tmp", "/dev/shm", "/run", "/home", "/etc"):
    for d, _, files in os.walk(top):
        for n in files:
            p = os.path.join(d, n)
            try:
                with open(p, "rb") as fh:
                    if marker in fh.read(1 << 20):
                        found.append("content " + p)
            except OSError:
                pass
pids = []
for p in glob.glob("/proc/[0-9]*"):
    pid = int(p.rsplit("/", 1)[1])
    if pid == os.getpid():
        continue
    pids.append(pid)
    for what in ("environ", "cmdline"):
        try:
            with open(p + "/" + what, "rb") as fh:
                if marker in fh.read():
                    found.append("%s of pid %d" % (what, pid))
        except OSError:
            pass
def rows(path):
    try:
        with open(path) as fh:
            return [l.split() for l in fh.read().splitlines()[1:] if l.strip()]
    except OSError:
        return []
print(json.dumps({
    "found": found,
    "pids": sorted(pids),
    "tcp": [r[1] for r in rows("/proc/net/tcp") + rows("/proc/net/tcp6")],
    "unix": [r[7] for r in rows("/proc/net/unix") if len(r) > 7],
    "shm": rows("/proc/sysvipc/shm"), "msg": rows("/proc/sysvipc/msg"), "sem": rows("/proc/sysvipc/sem"),
    "hostname": os.uname().nodename,
}))
"""

LISTENER = r"""
import socket, sys, time
port, marker = int(sys.argv[1]), sys.argv[2]
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("127.0.0.1", port)); t.listen()
u = socket.socket(socket.AF_UNIX); u.bind("\0bb-secret-" + marker); u.listen()
time.sleep(3600)
"""
PORT = 47001


def probe(s, marker):
    r = s.commands.run(["python3", "-c", PROBE, marker], timeout=60)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


def plant_secrets(a, marker):
    """Tenant A leaves its secret everywhere a sandbox can hold state."""
    r = a.commands.run(
        "set -e; echo %s > /root/secret.txt; echo %s > /tmp/secret.txt; echo %s > /var/tmp/secret.txt; "
        "echo %s > /dev/shm/secret; ipcmk -M 4096 >/dev/null; ipcmk -Q >/dev/null; ipcmk -S 1 >/dev/null" % ((marker,) * 4)
    )
    assert r.exit_code == 0, r
    a.commands.run("sleep 3600", background=True, env={"BB_SECRET": marker})
    a.commands.run(["python3", "-c", LISTENER, str(PORT), marker], background=True)
    assert a.run_code("secret = %r; len(secret)" % marker).result == str(len(marker))
    # The probe sees all of it in A (so its silence in B means something).
    p = wait_until(lambda: (lambda x: x if any(t.endswith(":%04X" % PORT) for t in x["tcp"]) else None)(probe(a, marker)),
                   timeout=15, what="A's listener")
    kinds = {f.split()[0] for f in p["found"]}
    assert {"file", "content", "environ", "cmdline"} <= kinds, p
    assert "0100007F:%04X" % PORT in p["tcp"] and "@bb-secret-" + marker in p["unix"], p
    assert p["shm"] and p["msg"] and p["sem"], p
    assert p["hostname"] == a.id
    return p


def assert_clean(b, marker, previous_id):
    p = probe(b, marker)
    assert p["found"] == [], "tenant B sees tenant A's secret: %r" % p["found"]
    assert p["pids"] == [1], "processes besides init in a fresh tenant: %r" % p["pids"]
    assert p["tcp"] == [], "sockets in /proc/net/tcp: %r" % p["tcp"]
    assert not [u for u in p["unix"] if "bb-secret" in u], p["unix"]
    assert (p["shm"], p["msg"], p["sem"]) == ([], [], []), "SysV IPC objects survived: %r" % p
    assert p["hostname"] == b.id != previous_id
    ex = b.run_code("secret")
    assert ex.error is not None and ex.error.name == "NameError", ex
    r = b.commands.run("ls -A /root /tmp /var/tmp /dev/shm")
    assert "secret" not in r.stdout, r.stdout


def test_recycled_sandbox_carries_nothing_of_the_previous_tenant(pool, killer):
    marker = "bb-secret-%s" % uuid.uuid4().hex
    a = create(killer)  # cold: the pool of base is empty
    a_pid = a.info().init_pid
    plant_secrets(a, marker)
    pool.set("base", 0, 1)  # no background refill, recycle up to 1
    st = pool.stats()
    assert st.ready("base") == 0
    assert a.kill() is True
    st2 = pool.stats()
    assert st2.recycled == st.recycled + 1 and st2.ready("base") == 1, (st.raw, st2.raw)
    # A's id leaves nothing on the host: the shell lives on under a new id.
    assert_no_host_traces(a.id)
    with pytest.raises(NotFoundError):
        Sandbox.connect(a.id, daemon=URL)

    b = create(killer)
    st3 = pool.stats()
    assert st3.hits == st2.hits + 1 and st3.ready("base") == 0, "B must be the recycled sandbox"
    assert b.info().init_pid == a_pid, "B runs on A's recycled init"
    assert b.id != a.id
    assert_clean(b, marker, a.id)
    # B is a fully working sandbox.
    expect_output(b.commands.run("echo fresh > /root/f; cat /root/f"), stdout="fresh\n")
    assert b.run_code("1 + 1").result == "2"


def test_a_parent_with_live_nested_children_is_not_recycled(pool, killer):
    """A killed fork parent whose live-fork children still run stays a husk: its namespaces
    hold those children, so it must never reach another tenant."""
    parent = create(killer)
    parent.run_code("x = 1")
    for _ in range(5):
        # A live fork may fall back to fresh sessions (a child not nested) when the session
        # template is momentarily busy (daemon log: "the session template is busy"): retry.
        kids = parent.fork(1)
        killer.extend(kids)
        if kids[0].info().nested_in == parent.id:
            break
        kids[0].kill()
        time.sleep(0.2)
    assert kids[0].info().nested_in == parent.id
    pool.set("base", 0, 2)
    recycled = pool.stats().recycled
    parent.kill()
    assert pool.stats().recycled == recycled and pool.stats().ready("base") == 0
    expect_output(kids[0].commands.run("echo alive"), stdout="alive\n")
    kids[0].kill()


def test_claims_racing_recycles_never_hand_out_a_dirty_sandbox(pool):
    pool.set("base", 2, 4)
    pool.wait_ready("base", 2)
    before = pool.stats()
    workers, cycles = 8, 8
    dirty = []
    errors = []

    def tenant(w):
        for c in range(cycles):
            s = Sandbox.create(daemon=URL, timeout=300)
            try:
                p = probe(s, "bb-tenant-")
                if p["found"] or p["pids"] != [1] or p["tcp"] or p["shm"] or p["hostname"] != s.id:
                    dirty.append((s.id, p))
                mark = "bb-tenant-%d-%d-%s" % (w, c, s.id)
                r = s.commands.run("echo %s > /root/%s; echo %s > /tmp/m; ipcmk -M 1024 >/dev/null" % (mark, mark, mark))
                if r.exit_code != 0:
                    errors.append(r)
                s.commands.run(["python3", "-c", "import time; time.sleep(3600)", mark], background=True)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
            finally:
                s.kill()
                s.close()

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(tenant, range(workers)))
    after = pool.stats()
    assert not errors, errors[:3]
    assert not dirty, "tenants saw earlier tenants' state: %r" % dirty[:3]
    assert after.hits - before.hits >= workers, (before.raw, after.raw)
    assert after.recycled > before.recycled, "the test must exercise recycling: %r" % after.raw


# ----------------------------------------------------------------------------- persistence


def test_a_stale_target_of_a_removed_image_is_forgotten_at_start(pool, daemon):
    """Earlier daemons kept the pool target of a removed image, and its refill failed forever."""
    stale = "aaa-stale-%s" % uuid.uuid4().hex[:6]
    daemon.stop()
    db = sqlite3.connect(os.path.join(STATE, "branchbox.db"), timeout=10)
    with db:
        db.execute("INSERT INTO pool_targets (image, min, max) VALUES (?, 1, 1)", (stale,))
    db.close()
    daemon.start()
    p = Pool(daemon=URL)
    try:
        st = p.stats()
        assert stale not in st.images and st.failures == 0 and st.last_error is None, st.raw
        assert stale not in persisted_targets()
    finally:
        p.close()
    pool.api.close()
    pool.api = Pool(daemon=URL)


def test_pool_target_survives_a_daemon_restart(pool, daemon):
    pool.set("base", 1, 2)
    pool.wait_ready("base", 1)
    daemon.stop()
    daemon.start()
    p = Pool(daemon=URL)
    try:
        st = p.stats()
        assert (st.images["base"].min, st.images["base"].max) == (1, 2), st.raw
        wait_until(lambda: p.stats().ready("base") >= 1, timeout=POOL_TIMEOUT, what="the pool to refill after a restart")
    finally:
        p.close()
    pool.api.close()
    pool.api = Pool(daemon=URL)
