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
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

from branchbox import NotFoundError, Sandbox, SandboxError, Snapshots
from conftest import daemon_bin
from helpers import CGROUP_PARENT, RUN, STATE, URL, wait_until

MINIO = "/usr/local/lib/branchbox/minio"
S3_USER, S3_SECRET = "bbtest", "bbtest-secret-key-0123456789"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(what):
    if os.environ.get("MUST_WORK"):
        pytest.fail(what + " (make deps installs it)")
    pytest.skip(what)


class Minio:
    def __init__(self, root):
        if not os.path.exists(MINIO):
            missing("MinIO is not installed at " + MINIO)
        self.data = os.path.join(root, "minio")
        self.port = free_port()
        self.proc = None
        self.start()
        # Buckets are made with a signed PUT (curl --aws-sigv4): no S3 client to install.
        self.s3("PUT", "bbtest")

    def start(self):
        env = dict(os.environ, MINIO_ROOT_USER=S3_USER, MINIO_ROOT_PASSWORD=S3_SECRET)
        console = "127.0.0.1:%d" % free_port()
        self.proc = subprocess.Popen(
            [MINIO, "server", "--quiet", "--address", "127.0.0.1:%d" % self.port, "--console-address", console, self.data],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: self.ready(), timeout=30, what="MinIO to serve")

    def ready(self):
        try:
            return httpx.get("http://127.0.0.1:%d/minio/health/ready" % self.port, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def s3(self, method, path, data_file=None):
        argv = ["curl", "-sf", "-X", method, "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "%s:%s" % (S3_USER, S3_SECRET)]
        if data_file:
            # curl signs a body's hash wrong for MinIO: say the payload is unsigned.
            argv += ["-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "--data-binary", "@" + data_file]
        subprocess.run(argv + ["http://127.0.0.1:%d/%s" % (self.port, path)], check=True, capture_output=True)

    def get(self, path):
        argv = ["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "%s:%s" % (S3_USER, S3_SECRET)]
        return subprocess.run(argv + ["http://127.0.0.1:%d/bbtest/%s" % (self.port, path)], check=True,
                              capture_output=True).stdout


class Postgres:
    def __init__(self, root):
        if not any(os.path.exists("/usr/lib/postgresql/%s/bin/initdb" % v) for v in os.listdir("/usr/lib/postgresql")
                   ) if os.path.isdir("/usr/lib/postgresql") else True:
            missing("PostgreSQL is not installed")
        self.dir = os.path.join(root, "pg")
        self.port = free_port()
        self.url = self.start()

    def start(self):
        out = subprocess.run([os.path.join(REPO, "scripts/pg-test-server.sh"), "start", self.dir, str(self.port)],
                             check=True, capture_output=True, text=True)
        return out.stdout.strip().splitlines()[-1]

    def stop(self):
        subprocess.run([os.path.join(REPO, "scripts/pg-test-server.sh"), "stop", self.dir], capture_output=True)


class Store:
    """Where the daemons of one test module keep pushed snapshots, and the flags that say so."""

    def __init__(self, kind, root):
        self.kind, self.root = kind, root
        self.minio = self.pg = None
        self.env = {}
        key = os.path.join(root, "store.key")
        if kind == "local":
            self.url = "file://" + os.path.join(root, "objects")
            self.meta = os.path.join(root, "meta.db")
        else:
            self.minio = Minio(root)
            self.pg = Postgres(root)
            self.url = "s3://bbtest/snaps?endpoint=http://127.0.0.1:%d&region=us-east-1" % self.minio.port
            self.meta = self.pg.url
            self.env = {"AWS_ACCESS_KEY_ID": S3_USER, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        # The deployment's secrets, shared by its daemons: the store key, and the setns key that
        # restored processes carry in their seccomp filters (the suite daemon's).
        self.flags = ["--store-url", self.url, "--metadata-url", self.meta, "--store-key-file", key,
                      "--setns-key-file", os.path.join(STATE, "setns.key")]

    def objects(self):
        """Keys of the store's chunk and pack objects."""
        return sorted(self.sizes())

    def sizes(self):
        """{key: bytes} of the store's chunk and pack objects."""
        if self.kind == "local":
            base = os.path.join(self.root, "objects")
            out = {}
            for d, _, fs in os.walk(base):
                for f in fs:
                    # object_store writes `<name>#<n>` and renames it: a file may go while we look.
                    if "#" in f or f.startswith("."):
                        continue
                    try:
                        out[os.path.relpath(os.path.join(d, f), base)] = os.path.getsize(os.path.join(d, f))
                    except FileNotFoundError:
                        pass
            return out
        out = subprocess.run(
            ["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "%s:%s" % (S3_USER, S3_SECRET),
             "http://127.0.0.1:%d/bbtest?list-type=2&max-keys=100000" % self.minio.port],
            check=True, capture_output=True, text=True).stdout
        import re
        found = re.findall(r"<Key>([^<]+)</Key>.*?<Size>(\d+)</Size>", out)
        return {k[len("snaps/"):]: int(n) for k, n in found if k.startswith("snaps/")}

    def read(self, key):
        if self.kind == "local":
            with open(os.path.join(self.root, "objects", key), "rb") as f:
                return f.read()
        return self.minio.get("snaps/" + key)

    def write(self, key, data):
        if self.kind == "local":
            with open(os.path.join(self.root, "objects", key), "wb") as f:
                f.write(data)
            return
        path = os.path.join(self.root, "upload")
        with open(path, "wb") as f:
            f.write(data)
        self.minio.s3("PUT", "bbtest/snaps/" + key, path)

    def close(self):
        if self.minio:
            self.minio.stop()
        if self.pg:
            self.pg.stop()


class Peer:
    """Another branchboxd on a state dir, socket and cgroup of its own, sharing the store."""

    def __init__(self, name, store):
        self.name, self.store = name, store
        self.state = os.path.join(store.root, "state-" + name)
        self.sock = os.path.join(RUN, "peer-%s.sock" % name)
        self.url = "unix://" + self.sock
        self.log = os.path.join(store.root, "daemon-%s.log" % name)
        self.proc = None

    def start(self):
        argv = [daemon_bin(), "--state-dir", self.state, "--socket", self.sock, "--cgroup-parent",
                "branchbox-test-" + self.name, "--pool-size", "0", "--node-name", self.name] + self.store.flags
        if os.environ.get("BRANCHBOX_INIT_BIN"):
            argv += ["--init-bin", os.environ["BRANCHBOX_INIT_BIN"]]
        env = dict(os.environ, **self.store.env)
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

        def healthy():
            assert self.proc.poll() is None, "daemon %s exited: %s" % (self.name, open(self.log).read()[-2000:])
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=self.sock), base_url="http://d") as c:
                    return c.get("/v1/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=30, what="daemon %s to serve" % self.name)
        return self

    def lose_node(self):
        """As if the node died: the daemon killed (-9), its sandboxes gone, its state dir deleted."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for pid in sandbox_pids(self.state):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if line.split()[4].startswith(self.state + "/")]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        shutil.rmtree(self.state)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            for info in Sandbox.list(daemon=self.url):
                Sandbox.connect(info.id, daemon=self.url, resume=False).kill()
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def snapshots(self):
        return Snapshots(daemon=self.url)

    def create(self, **kw):
        kw.setdefault("timeout", 600)
        return Sandbox.create(daemon=self.url, **kw)


def start_s(daemon, store):
    """The suite's daemon ("S") started sharing `store` (its credentials in its environment)."""
    saved = dict(os.environ)
    os.environ.update(store.env)
    try:
        daemon.start(extra=store.flags + ["--node-name", "s"])
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module", params=["local", "s3"])
def world(request, daemon):
    root = tempfile.mkdtemp(prefix="bb-remote-", dir="/var/tmp")
    os.chmod(root, 0o755)  # the sandboxes' root (a mapped uid) walks to its state dir
    store = Store(request.param, root)
    # The suite's daemon, sharing the store (it has the base image).
    daemon.stop()
    start_s(daemon, store)
    peers = []

    def peer(name):
        p = Peer(name, store).start()
        peers.append(p)
        return p

    yield store, peer
    for p in peers:
        try:
            p.stop()
        except Exception:
            pass
    daemon.stop()
    daemon.start()
    store.close()
    if not os.environ.get("BB_KEEP_REMOTE_TEST"):
        shutil.rmtree(root, ignore_errors=True)


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


def sandbox_pids(state):
    """Pids of processes whose root is under a (dead) daemon's state dir."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if os.readlink("/proc/%s/root" % p).startswith(state):
                out.append(int(p))
        except OSError:
            pass
    return out


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
        with pytest.raises(SandboxError) as e:
            b.create(snapshot=sid)
        assert victim.split("/")[-1] in str(e.value) and "authentication" in str(e.value), e.value
        # Nothing of it was taken in.
        with pytest.raises(NotFoundError):
            b.snapshots().get(sid)
        # Truncated: the same.
        store.write(victim, good[: len(good) // 2])
        with pytest.raises(SandboxError) as e:
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
