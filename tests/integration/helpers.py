"""Plain helpers shared by the live-daemon tests (constants, host-side probes, assertions,
commands and file trees in sandboxes, object and metadata stores shared by several daemons).

Fixtures live in conftest.py; everything here is importable with ``from helpers import ...``.
"""
import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

from branchbox import Sandbox, Snapshots

STATE = os.environ.get("BRANCHBOX_TEST_STATE", "/var/lib/branchbox-test")
RUN = os.environ.get("BRANCHBOX_TEST_RUN", "/run/branchbox-test")
SOCKET = os.path.join(RUN, "d.sock")
URL = "unix://" + SOCKET
CGROUP_PARENT = os.environ.get("BRANCHBOX_TEST_CGROUP", "branchbox-test")
CGROUP_ROOT = "/sys/fs/cgroup"
# Host uid the sandbox's root maps to (branchboxd --uid-base default).
UID_BASE = 1_000_000
# The suite's daemon compacts snapshot chains deeper than this (--max-chain): small, so that
# every test that checkpoints a few times runs over compacted chains.
MAX_CHAIN = int(os.environ.get("BRANCHBOX_TEST_MAX_CHAIN", "6"))
# The suite's daemon's bridge and range for sandboxes with egress (--net-bridge, --net-range).
NET_BRIDGE = os.environ.get("BRANCHBOX_TEST_BRIDGE", "bbt0")
NET_RANGE = os.environ.get("BRANCHBOX_TEST_NET", "10.231.0.0/24")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def daemon_bin() -> str:
    b = os.environ.get("BRANCHBOX_DAEMON_BIN") or shutil.which("branchboxd")
    if not b:
        pytest.fail("branchboxd not found: run `make install` or set BRANCHBOX_DAEMON_BIN")
    return b


def missing(what):
    """A prerequisite is missing: skip, or fail under MUST_WORK (CI)."""
    if os.environ.get("MUST_WORK"):
        pytest.fail(what + " (make deps installs it)")
    pytest.skip(what)


# ----------------------------------------------------------------------------- waiting


def wait_until(predicate, timeout=10.0, interval=0.05, what="condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1fs waiting for %s (last value: %r)" % (timeout, what, last))
        time.sleep(interval)


# ----------------------------------------------------------------------------- host-side probes


def state_mounts(needle=None):
    """Lines of the host's /proc/self/mountinfo that mention the test state dir (and ``needle``)."""
    with open("/proc/self/mountinfo") as f:
        lines = [line.rstrip("\n") for line in f if STATE in line]
    if needle is not None:
        lines = [line for line in lines if needle in line]
    return lines


def cgroup_hierarchies():
    """Distinct cgroup v1 hierarchy roots that hold the test parent group."""
    seen = {}
    for d in sorted(glob.glob(os.path.join(CGROUP_ROOT, "*", CGROUP_PARENT))):
        seen.setdefault(os.path.realpath(d), d)
    return sorted(seen.values())


def cgroup_children():
    """{hierarchy dir: sorted child group names} under the test cgroup parent."""
    out = {}
    for d in cgroup_hierarchies():
        out[d] = sorted(e.name for e in os.scandir(d) if e.is_dir())
    return out


def cgroup_dirs_of(sandbox_id):
    """Every cgroup directory of one sandbox that still exists on the host."""
    return [p for p in (os.path.join(d, sandbox_id) for d in cgroup_hierarchies()) if os.path.isdir(p)]


def cgroup_file(controller, sandbox_id, name):
    with open(os.path.join(CGROUP_ROOT, controller, CGROUP_PARENT, sandbox_id, name)) as f:
        return f.read().strip()


def sandbox_dir(sandbox_id):
    return os.path.join(STATE, "sandboxes", sandbox_id)


def sandbox_entries():
    return sorted(os.listdir(os.path.join(STATE, "sandboxes")))


def host_traces(sandbox_id):
    """What the host still holds for a sandbox: its dir, cgroups and mounts (all empty when gone)."""
    return {
        "dir": os.path.exists(sandbox_dir(sandbox_id)),
        "cgroups": cgroup_dirs_of(sandbox_id),
        "mounts": state_mounts(sandbox_id),
    }


def assert_no_host_traces(sandbox_id, timeout=10.0):
    """Wait (bounded) until a killed/reaped sandbox left nothing on the host."""
    def gone():
        t = host_traces(sandbox_id)
        return not t["dir"] and not t["cgroups"] and not t["mounts"]

    try:
        wait_until(gone, timeout=timeout, what="host traces of %s to disappear" % sandbox_id)
    except AssertionError:
        raise AssertionError("sandbox %s left host traces: %r" % (sandbox_id, host_traces(sandbox_id))) from None


def proc_stat(pid):
    """(state, ppid, comm) of a host process, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            s = f.read()
    except OSError:
        return None
    comm = s[s.index("(") + 1 : s.rindex(")")]
    rest = s[s.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), comm


def zombies():
    """{pid: (ppid, comm)} of every zombie on the host."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st and st[0] == "Z":
                out[int(name)] = (st[1], st[2])
    return out


def fd_targets(pid):
    """Sorted readlink targets of a process's open fds."""
    out = []
    for p in glob.glob("/proc/%d/fd/*" % pid):
        try:
            out.append(os.readlink(p))
        except OSError:
            pass
    return sorted(out)


# ----------------------------------------------------------------------------- assertions


def expect_output(result, stdout=None, stderr=None, exit_code=0):
    """Assert a foreground CommandResult exactly (streams given as None are not checked)."""
    assert result.exit_code == exit_code, "exit code %r != %r: %r" % (result.exit_code, exit_code, result)
    assert not result.timed_out, "unexpected timeout: %r" % (result,)
    if stdout is not None:
        assert result.stdout == stdout, "stdout is %r, expected %r (result: %r)" % (result.stdout, stdout, result)
    if stderr is not None:
        assert result.stderr == stderr, "stderr is %r, expected %r (result: %r)" % (result.stderr, stderr, result)


def expect_in(result, stream, needle, exit_code=None):
    """Assert ``needle`` occurs in ``result.<stream>`` (and the exit code, if given)."""
    if exit_code is not None:
        assert result.exit_code == exit_code, "exit code %r != %r: %r" % (result.exit_code, exit_code, result)
    got = getattr(result, stream)
    assert needle in got, "%r not in %s %r (result: %r)" % (needle, stream, got, result)


def api_error(response, status, code=None):
    """Assert an HTTP error answer: status, JSON body {"error": {"code", "message"}}; returns it."""
    assert response.status_code == status, "HTTP %d != %d: %s" % (response.status_code, status, response.text[:500])
    assert response.headers.get("content-type", "").startswith("application/json"), (
        "error body is not JSON (content-type %r): %r" % (response.headers.get("content-type"), response.text[:200])
    )
    body = response.json()
    assert set(body) == {"error"}, "unexpected error body %r" % (body,)
    err = body["error"]
    assert isinstance(err.get("code"), str) and isinstance(err.get("message"), str) and err["message"], body
    if code is not None:
        assert err["code"] == code, "error code %r != %r: %r" % (err["code"], code, body)
    return err


# ----------------------------------------------------------------------------- raw API calls
# For tests that pin the mechanism through plain HTTP (``raw``: an httpx client on the socket).


def ckpt(raw, sid, label=None):
    r = raw.post("/v1/sandboxes/%s/checkpoint" % sid, json={"label": label} if label else {})
    assert r.status_code == 201, r.text
    return r.json()


def rollback(raw, sid, snap):
    r = raw.post("/v1/sandboxes/%s/rollback" % sid, json={"snapshot": snap})
    assert r.status_code == 200, r.text
    return r.json()


def sh(raw, sid, cmd, code=0):
    """stdout of ``cmd``; its exit code must be ``code`` (None: any)."""
    r = raw.post("/v1/sandboxes/%s/commands" % sid, json={"cmd": cmd, "timeout": 30})
    assert r.status_code == 200, r.text
    res = r.json()
    if code is not None:
        assert res["exit_code"] == code, res
    return res["stdout"]


def py(raw, sid, code):
    """The result of ``code`` in the default python session (it must not raise)."""
    r = raw.post("/v1/sandboxes/%s/code" % sid, json={"code": code})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res.get("error") is None, res
    return res


# ----------------------------------------------------------------------------- commands and file trees in a sandbox


def ok(result, what="command"):
    """Assert a foreground command succeeded; returns its stdout."""
    assert result.exit_code == 0 and not result.timed_out, "%s failed (exit %r, timed out %r)\nstdout:\n%s\nstderr:\n%s" % (
        what, result.exit_code, result.timed_out, result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout


def sh_in(sbx, cmd, timeout=60):
    """stdout of shell command ``cmd`` run in the sandbox (an SDK ``Sandbox``); it must succeed."""
    return ok(sbx.commands.run(["sh", "-c", cmd], timeout=timeout), cmd)


def py_in(sbx, script, *args, timeout=120):
    """Run a python script in the sandbox (it asserts what it checks); returns its stdout."""
    return ok(sbx.commands.run(["python3", "-c", script, *args], timeout=timeout), "python script")


# sha256 over a tree: relative names (bytes), types, modes, owners, contents, link targets,
# user.* xattrs and the mtimes of everything but directories.
TREE_DIGEST_PY = r'''
import hashlib, os, stat, sys
def digest(top):
    top = os.fsencode(top)
    h = hashlib.sha256()
    n = 0
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            n += 1
            h.update(b"%s\0%o\0%d:%d\0" % (os.path.relpath(p, top), st.st_mode, st.st_uid, st.st_gid))
            if not stat.S_ISDIR(st.st_mode):
                h.update(b"%d\0" % st.st_mtime_ns)
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
                for x in sorted(os.listxattr(p)):
                    if x.startswith("user."):
                        h.update(x.encode() + b"=" + os.getxattr(p, x))
    return "%s:%d" % (h.hexdigest(), n)
print(" ".join(digest(t) for t in sys.argv[1:]))
'''


def tree_digests(sbx, *paths):
    """``"<sha256>:<entries>"`` of each tree, computed inside the sandbox."""
    return py_in(sbx, TREE_DIGEST_PY, *paths).split()


def tree_digest(sbx, path):
    return tree_digests(sbx, path)[0]


# A tree of a few hundred files (seeded, so the same seed writes the same tree): nested dirs,
# sizes from 0 to 200 KiB, a symlink, modes.
TREE_PY = r'''
import os, random, sys
top, seed = sys.argv[1], int(sys.argv[2])
rnd = random.Random(seed)
for d in range(6):
    dd = os.path.join(top, "d%d" % d, "sub%d" % (d % 2))
    os.makedirs(dd, exist_ok=True)
    for i in range(40):
        with open(os.path.join(dd, "f%d.txt" % i), "wb") as f:
            f.write(rnd.randbytes(rnd.choice([0, 1, 100, 4096, 70000, 200000])))
    os.chmod(os.path.join(dd, "f0.txt"), 0o751)
os.symlink("d0/sub0/f1.txt", os.path.join(top, "link"))
with open(os.path.join(top, "seed"), "w") as f:
    f.write(str(seed))
'''

# Changes of every kind to a tree TREE_PY wrote (applicable again and again, with new tags).
MUTATE_PY = r'''
import os, shutil, sys
top, tag = sys.argv[1], sys.argv[2]
def first(cands):
    for c in cands:
        if os.path.lexists(os.path.join(top, c)):
            return os.path.join(top, c)
    raise AssertionError("nothing left to change among %r in %s" % (cands, top))
with open(os.path.join(top, "d0/sub0/f2.txt"), "ab") as f:
    f.write(tag.encode())
os.unlink(first(["d1/sub1/f%d.txt" % i for i in range(40)]))
shutil.rmtree(first(["d2"] + sorted(n for n in os.listdir(top) if n.startswith("new-"))))
os.rename(first(sorted(n for n in os.listdir(top) if n.startswith("d3"))), os.path.join(top, "d3-" + tag))
os.truncate(first([p for p in ("d4/sub0/f%d.txt" % i for i in range(40)) if os.path.getsize(os.path.join(top, p)) > 7]), 7)
f6 = os.path.join(top, "d5/sub1/f6.txt")
os.chmod(f6, 0o640 if os.stat(f6).st_mode & 0o777 == 0o600 else 0o600)
os.makedirs(os.path.join(top, "new-" + tag))
with open(os.path.join(top, "new-" + tag, "x"), "w") as f:
    f.write(tag)
with open(os.path.join(top, "seed"), "w") as f:
    f.write(tag)
'''


def make_tree(sbx, path, seed):
    py_in(sbx, TREE_PY, path, str(seed))


def mutate(sbx, path, tag):
    py_in(sbx, MUTATE_PY, path, tag)


# Write argv[2] to the file argv[1] durably: a temp file fsync'd, renamed over it, the dir fsync'd.
FSYNC_WRITE_PY = r'''
import os, sys
path, data = sys.argv[1], sys.argv[2].encode()
fd = os.open(path + ".tmp", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, data)
os.fsync(fd)
os.close(fd)
os.rename(path + ".tmp", path)
dfd = os.open(os.path.dirname(path), os.O_RDONLY)
os.fsync(dfd)
os.close(dfd)
'''


# ----------------------------------------------------------------------------- stores shared by daemons
# An object store and a metadata store shared by several daemons: the suite's daemon restarted
# on them, and peers (other daemons with state dirs of their own). Used by test_remote.py and
# test_volumes_remote.py.

MINIO = "/usr/local/lib/branchbox/minio"
S3_USER, S3_SECRET = "bbtest", "bbtest-secret-key-0123456789"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Where the daemons of one test module keep pushed snapshots and synced volumes, and the
    flags that say so: ``kind`` "local" (a directory, a SQLite file) or "s3" (MinIO and
    PostgreSQL started here, on 127.0.0.1)."""

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


def sandbox_pids(cgroup_parent):
    """Pids of the processes of the sandboxes a daemon started under ``cgroup_parent`` (its
    --cgroup-parent), found by their cgroups: they outlive a daemon that was killed."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/cgroup" % p) as f:
                if any(line.rstrip("\n").split(":", 2)[2].startswith("/%s/" % cgroup_parent) for line in f):
                    out.append(int(p))
        except (OSError, IndexError):
            pass
    return out


class Peer:
    """Another branchboxd on a state dir, socket and cgroup of its own, sharing the store;
    ``extra``: more daemon flags."""

    def __init__(self, name, store, extra=()):
        self.name, self.store, self.extra = name, store, list(extra)
        self.state = os.path.join(store.root, "state-" + name)
        self.cgroup = "%s-%s" % (CGROUP_PARENT, name)
        self.sock = os.path.join(RUN, "peer-%s.sock" % name)
        self.url = "unix://" + self.sock
        self.log = os.path.join(store.root, "daemon-%s.log" % name)
        self.proc = None

    def start(self):
        argv = [daemon_bin(), "--state-dir", self.state, "--socket", self.sock, "--cgroup-parent", self.cgroup,
                "--pool-size", "0", "--node-name", self.name] + self.store.flags
        if os.environ.get("BRANCHBOX_INIT_BIN"):
            argv += ["--init-bin", os.environ["BRANCHBOX_INIT_BIN"]]
        env = dict(os.environ, **self.store.env)
        self.proc = subprocess.Popen(argv + self.extra, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,
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
        for pid in sandbox_pids(self.cgroup):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not sandbox_pids(self.cgroup), what="the sandboxes of %s to die" % self.name)

        def cgroups_removed():  # the sandboxes' cgroups (empty now; removable once the kernel let go)
            for d in glob.glob(os.path.join(CGROUP_ROOT, "*", self.cgroup, "*", "")):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            return not glob.glob(os.path.join(CGROUP_ROOT, "*", self.cgroup, "*", ""))

        wait_until(cgroups_removed, what="the sandbox cgroups of %s to go" % self.name)
        self.unmount_state()
        shutil.rmtree(self.state)

    def unmount_state(self):
        """Detach whatever is still mounted under the state dir of this (stopped) daemon, such
        as the host-side views of volumes it still held."""
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if line.split()[4].startswith(self.state + "/")]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            for info in Sandbox.list(daemon=self.url):
                Sandbox.connect(info.id, daemon=self.url, resume=False).kill()
            self.proc.send_signal(signal.SIGTERM)
            rc = self.proc.wait(timeout=30)
            assert rc == 0, "peer branchboxd %s exited with status %r at SIGTERM: see %s" % (self.name, rc, self.log)

    def snapshots(self):
        return Snapshots(daemon=self.url)

    def create(self, **kw):
        kw.setdefault("timeout", 600)
        return Sandbox.create(daemon=self.url, **kw)


def start_s(daemon, store, node="s", extra=()):
    """The suite's daemon started sharing ``store`` as node ``node`` (its credentials in its
    environment); ``extra``: more daemon flags."""
    saved = dict(os.environ)
    os.environ.update(store.env)
    try:
        daemon.start(extra=store.flags + ["--node-name", node] + list(extra))
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def shared_store(daemon, kind, node="s", extra=()):
    """Daemons sharing a fresh ``Store`` of ``kind`` under /var/tmp: the suite's daemon (it has
    the base image) restarted on it as node ``node``, and ``peer(name)`` starting a ``Peer``;
    both with the daemon flags ``extra``. Yields (store, peer). Afterwards the peers are
    stopped, the suite's daemon restarted as it was, the servers stopped and the dir deleted
    (kept with BB_KEEP_REMOTE_TEST=1)."""
    root = tempfile.mkdtemp(prefix="bb-remote-", dir="/var/tmp")
    os.chmod(root, 0o755)  # the sandboxes' root (a mapped uid) walks to its state dir
    store = Store(kind, root)
    peers = []

    def peer(name):
        p = Peer(name, store, extra).start()
        peers.append(p)
        return p

    try:
        daemon.stop()
        start_s(daemon, store, node, extra)
        yield store, peer
    finally:
        for p in peers:
            try:
                p.stop()
            except Exception:
                pass
            p.unmount_state()
        daemon.stop()
        daemon.start()
        store.close()
        if not os.environ.get("BB_KEEP_REMOTE_TEST"):
            shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def killing(sandboxes):
    """Yields ``sandboxes``; afterwards each is killed and its connection closed."""
    try:
        yield sandboxes
    finally:
        for sbx in sandboxes:
            try:
                sbx.kill()
            finally:
                sbx.close()


@contextlib.contextmanager
def host_server(addr):
    """A TCP server on the host at ``addr`` answering "host" to anything; yields its port."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, 0))
    srv.listen(8)

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\nhost")
            c.close()

    threading.Thread(target=loop, daemon=True).start()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


@contextlib.contextmanager
def e2b_sdk_env(daemon):
    """The E2B SDKs pointed at the daemon's E2B endpoint (E2B_API_URL, E2B_SANDBOX_URL,
    E2B_VOLUME_API_URL, E2B_API_KEY = its token; nothing of E2B's debug or domain settings);
    yields the URL."""
    mp = pytest.MonkeyPatch()
    url = "http://127.0.0.1:%d" % daemon.e2b_port
    mp.setenv("E2B_API_URL", url)
    mp.setenv("E2B_SANDBOX_URL", url)
    mp.setenv("E2B_VOLUME_API_URL", url)
    mp.setenv("E2B_API_KEY", daemon.tcp_token)
    for v in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
        mp.delenv(v, raising=False)
    try:
        yield url
    finally:
        mp.undo()
