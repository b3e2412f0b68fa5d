"""``branchbox bench store``: durable snapshots over a real S3 server, against plain transfers.

Everything it needs is started here and stopped at the end (also on error or Ctrl-C): MinIO on
127.0.0.1 (data in a temporary directory), PostgreSQL for metadata (``scripts/pg-test-server.sh``;
without it, a shared SQLite file, said in the notes), daemon A and fresh daemons B sharing the
store. Measured:

- ``push_mb_s`` / ``pull_mb_s``: the store's ``put_tree`` / ``get_tree`` of ``mb`` MiB of
  incompressible files, beside a plain multipart upload / ranged download of the same bytes by
  the same client in the same process (``raw_put_mb_s`` / ``raw_get_mb_s``, and the ratios):
  the ``branchbox-store-bench`` binary, alternating rounds, fresh prefixes (nothing dedups);
- ``push_again_ms``: pushing an unchanged, already pushed snapshot again through daemon A;
- ``delta_push_ratio``: bytes uploaded for a child snapshot that changed 1 MiB of files (a new
  random file) and 1 MiB of session memory (1 MiB of a bytearray overwritten in place),
  divided by 2 MiB;
- ``cross_daemon_restore_ms``: ``Sandbox.create(snapshot=sid)`` on a daemon B with a fresh
  state dir (nothing cached: everything is pulled) until its first ``run_code`` (which checks
  the ``session_mb`` MiB session) answers; ``local_restore_ms``: the same create on daemon A,
  which took the snapshot (its layers local, its session in a process image since the push).

Daemon A keeps its state dir (``/var/lib/branchbox-bench-store/a``) between runs: the first
run builds the "base" image there (debootstrap; the demo daemon's package cache is copied in
first when present).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

from branchbox import Images, Sandbox, Snapshots
from branchbox.sandbox_sync import health

from .stats import percentile, stats_rows

__all__ = [
    "BenchError",
    "StoreResult",
    "run_store_bench",
    "SUMMARY_KEYS",
    "TARGETS",
    "find_tool",
    "Minio",
    "Daemon",
    "daemon_binary",
    "store_bench_tool",
    "raw_transfers",
    "ensure_base",
    "sigterm_unwinds",
    "quiet",
]

MIB = 1 << 20
LIBDIR = "/usr/local/lib/branchbox"
A_STATE = "/var/lib/branchbox-bench-store/a"
RUN_DIR = "/run/branchbox-bench"
DEMO_CACHE = "/var/lib/branchbox/cache/debootstrap"
S3_USER, S3_SECRET = "bbbench", "bbbench-secret-" + os.urandom(8).hex()
#: The environment giving a daemon (or ``branchbox-store-bench``) the MinIO's credentials.
S3_ENV = {"AWS_ACCESS_KEY_ID": S3_USER, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
BUCKET = "bench"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUMMARY_KEYS = (
    "push_mb_s",
    "pull_mb_s",
    "raw_put_mb_s",
    "raw_get_mb_s",
    "push_vs_raw_ratio",
    "pull_vs_raw_ratio",
    "push_again_ms",
    "push_again_ms_p50",
    "first_push_ms",
    "first_push_uploaded_bytes",
    "delta_push_ratio",
    "delta_push_bytes_p50",
    "cross_daemon_restore_ms_p50",
    "cross_daemon_restore_ms_p99",
    "cross_daemon_pull_ms_p50",
    "cross_daemon_pull_bytes",
    "local_restore_ms_p50",
    "cross_vs_local_restore_ratio",
    "metadata",
    "throughput_mb",
    "session_mb",
    "n",
)
# name: (summary key, "min" (at least), "max" (at most) or "below", bound)
TARGETS = {
    "push_vs_raw": ("push_vs_raw_ratio", "min", 0.7),
    "pull_vs_raw": ("pull_vs_raw_ratio", "min", 0.7),
    "push_again": ("push_again_ms", "below", 50.0),
    "delta_push": ("delta_push_ratio", "max", 2.0),
}
METRICS = ("first_push", "push_again", "delta_push", "local_restore", "cross_daemon_restore", "cross_daemon_pull")


class BenchError(RuntimeError):
    pass


@dataclass
class StoreResult:
    n: int
    throughput_mb: int
    session_mb: int
    metadata: str = "postgres"
    #: The throughput binary's JSON line.
    throughput: Dict[str, Any] = field(default_factory=dict)
    samples: Dict[str, List[float]] = field(default_factory=dict)
    #: Bytes uploaded by each delta push, and by the first push.
    delta_bytes: List[int] = field(default_factory=list)
    first_push_bytes: Optional[int] = None
    #: Bytes daemon B downloaded for the restored snapshot (its log's pull line).
    pull_bytes: Optional[int] = None
    notes: List[str] = field(default_factory=list)

    def add(self, metric: str, ms: float) -> None:
        self.samples.setdefault(metric, []).append(ms)

    def p(self, metric: str, q: float = 50) -> Optional[float]:
        xs = self.samples.get(metric)
        return percentile(xs, q) if xs else None

    def summary(self) -> Dict[str, Any]:
        def r(v: Optional[float], digits: int = 3) -> Optional[float]:
            return None if v is None else round(v, digits)

        t = self.throughput
        local, cross = self.p("local_restore"), self.p("cross_daemon_restore")
        delta = percentile([float(b) for b in self.delta_bytes], 50) if self.delta_bytes else None
        out: Dict[str, Any] = {
            "push_mb_s": t.get("push_mb_s"),
            "pull_mb_s": t.get("pull_mb_s"),
            "raw_put_mb_s": t.get("raw_put_mb_s"),
            "raw_get_mb_s": t.get("raw_get_mb_s"),
            "push_vs_raw_ratio": t.get("push_vs_raw_ratio"),
            "pull_vs_raw_ratio": t.get("pull_vs_raw_ratio"),
            # The worst of the samples: every unchanged push is to be fast, not the typical one.
            "push_again_ms": r(max(self.samples["push_again"])) if self.samples.get("push_again") else None,
            "push_again_ms_p50": r(self.p("push_again")),
            "first_push_ms": r(self.p("first_push")),
            "first_push_uploaded_bytes": self.first_push_bytes,
            "delta_push_ratio": None if delta is None else round(delta / (2 * MIB), 3),
            "delta_push_bytes_p50": None if delta is None else int(delta),
            "cross_daemon_restore_ms_p50": r(cross),
            "cross_daemon_restore_ms_p99": r(self.p("cross_daemon_restore", 99)),
            "cross_daemon_pull_ms_p50": r(self.p("cross_daemon_pull")),
            "cross_daemon_pull_bytes": self.pull_bytes,
            "local_restore_ms_p50": r(local),
            "cross_vs_local_restore_ratio": None if cross is None or not local else round(cross / local, 2),
            "metadata": self.metadata,
            "throughput_mb": self.throughput_mb,
            "session_mb": self.session_mb,
            "n": self.n,
        }
        out["targets_met"] = {name: met(out.get(k), kind, bound) for name, (k, kind, bound) in TARGETS.items()}
        out["throughput_samples_mb_s"] = {
            k[: -len("_mb_s_samples")]: v for k, v in t.items() if k.endswith("_mb_s_samples")
        }
        out["notes"] = list(self.notes)
        return out

    def rows(self) -> List[List[str]]:
        return stats_rows(self.samples, METRICS)


def met(value: Optional[float], kind: str, bound: float) -> Optional[bool]:
    """Whether ``value`` meets a target: at least ``bound`` ("min"), at most it ("max") or
    below it ("below"); None when not measured."""
    if value is None:
        return None
    return {"min": value >= bound, "max": value <= bound, "below": value < bound}[kind]


def find_tool(name: str, env: str, also: Optional[List[str]] = None) -> Optional[str]:
    """``$env``, else the first of ``also`` that exists, else ``name`` on PATH."""
    if os.environ.get(env):
        return os.environ[env]
    for p in also or []:
        if p and os.path.exists(p):
            return p
    return shutil.which(name)


def pulled_from_log(text: str) -> Optional[Dict[str, float]]:
    """The last "snapshot pulled" line of a daemon's log: ``{"took_ms", "downloaded"}``."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line for line in plain.splitlines() if "snapshot pulled" in line]
    if not lines:
        return None
    fields = dict(re.findall(r"(\w+)=(\S+)", lines[-1]))
    try:
        return {"took_ms": float(fields["took_ms"]), "downloaded": float(fields["downloaded"])}
    except (KeyError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(ok: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise BenchError("bench: timed out waiting for " + what)
        time.sleep(0.05)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


class Minio:
    def __init__(self, root: str) -> None:
        binary = find_tool("minio", "BRANCHBOX_MINIO", [os.path.join(LIBDIR, "minio")])
        if not binary:
            raise BenchError("bench: MinIO is needed (%s/minio; scripts/install-minio.sh installs it)" % LIBDIR)
        self.port = free_port()
        self.log = os.path.join(root, "minio.log")
        env = dict(os.environ, MINIO_ROOT_USER=S3_USER, MINIO_ROOT_PASSWORD=S3_SECRET, MINIO_BROWSER="off")
        argv = [binary, "server", "--quiet", "--address", "127.0.0.1:%d" % self.port,
                "--console-address", "127.0.0.1:%d" % free_port(), os.path.join(root, "minio")]
        self.proc = subprocess.Popen(argv, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            _wait(lambda: self._alive() and self._curl(["http://127.0.0.1:%d/minio/health/ready" % self.port]), 60,
                  "MinIO to serve")
            if not self._curl(["-X", "PUT", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user",
                               "%s:%s" % (S3_USER, S3_SECRET), "http://127.0.0.1:%d/%s" % (self.port, BUCKET)]):
                raise BenchError("bench: could not create bucket %s in MinIO" % BUCKET)
        except BaseException:
            self.stop()
            raise

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise BenchError("bench: MinIO exited: " + _tail(self.log))
        return True

    @staticmethod
    def _curl(args: List[str]) -> bool:
        return subprocess.run(["curl", "-sf", "-o", "/dev/null"] + args, capture_output=True).returncode == 0

    def url(self, prefix: str) -> str:
        return "s3://%s/%s?endpoint=http://127.0.0.1:%d&region=us-east-1" % (BUCKET, prefix, self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_postgres(root: str, stack: ExitStack) -> Optional[str]:
    """A PostgreSQL for the run (stopped with ``stack``): its URL, or None without the script
    or the server."""
    script = find_tool("pg-test-server.sh", "BRANCHBOX_PG_SCRIPT",
                       [os.path.join(REPO, "scripts", "pg-test-server.sh"), os.path.join(LIBDIR, "pg-test-server.sh")])
    if not script:
        return None
    pg_dir = os.path.join(root, "pg")
    out = subprocess.run([script, "start", pg_dir, str(free_port())], capture_output=True, text=True)
    stack.callback(subprocess.run, [script, "stop", pg_dir], capture_output=True)
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.strip().splitlines()[-1]


class Daemon:
    """A branchboxd of the bench: its own state dir, socket and cgroup parent, sharing the store."""

    def __init__(self, binary: str, name: str, state: str, flags: List[str], env: Dict[str, str], log: str) -> None:
        self.name, self.state, self.log = name, state, log
        self.sock = os.path.join(RUN_DIR, "%s.sock" % name)
        self.url = "unix://" + self.sock
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        argv = [binary, "--state-dir", state, "--socket", self.sock, "--cgroup-parent", "branchbox-bench-" + name,
                "--pool-size", "0", "--node-name", "bench-" + name, "--kill-on-exit"] + flags
        self.proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **env), start_new_session=True)
        try:
            _wait(self._healthy, 60, "daemon %s to serve" % name)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise BenchError("bench: daemon %s exited: %s" % (self.name, _tail(self.log)))
        try:
            health(daemon=self.url, request_timeout=2)
            return True
        except Exception:  # noqa: BLE001 - not serving yet
            return False

    def kill_sandboxes(self) -> None:
        for info in Sandbox.list(daemon=self.url):
            try:
                Sandbox.connect(info.id, daemon=self.url, resume=False).kill()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.kill_sandboxes()
            finally:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        _unmount_under(self.state)


def _unmount_under(path: str) -> None:
    """Lazily unmount whatever is still mounted under ``path`` (deepest first)."""
    prefix = os.path.realpath(path) + "/"
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return
    for p in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], capture_output=True)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While it runs, SIGTERM unwinds like Ctrl-C, so everything a bench started is stopped."""
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)


def quiet(f: Callable[[], Any]) -> None:
    """Clean-up: ``f()``, whose failure must not hide the run's own error (or stop the rest)."""
    try:
        f()
    except Exception:  # noqa: BLE001 - best effort
        pass


def daemon_binary() -> str:
    """The branchboxd the bench daemons run (PATH or ``$BRANCHBOX_DAEMON_BIN``)."""
    binary = find_tool("branchboxd", "BRANCHBOX_DAEMON_BIN")
    if not binary:
        raise BenchError("bench: branchboxd not found (PATH or BRANCHBOX_DAEMON_BIN)")
    return binary


def store_bench_tool(daemon_bin: str) -> str:
    """``branchbox-store-bench``: next to ``daemon_bin``, in the lib dir, ``$BRANCHBOX_STORE_BENCH_BIN``
    or on PATH."""
    daemon_dir = os.path.dirname(os.path.realpath(daemon_bin))
    tool = find_tool("branchbox-store-bench", "BRANCHBOX_STORE_BENCH_BIN",
                     [os.path.join(daemon_dir, "branchbox-store-bench"), os.path.join(LIBDIR, "branchbox-store-bench")])
    if not tool:
        raise BenchError("bench: branchbox-store-bench not found (next to branchboxd, %s, PATH or "
                         "BRANCHBOX_STORE_BENCH_BIN)" % LIBDIR)
    return tool


def raw_transfers(tool: str, url: str, rounds: int, work: str, mb: Optional[int] = None,
                  src: Optional[str] = None) -> Dict[str, Any]:
    """The JSON line of ``branchbox-store-bench`` against the MinIO at ``url``: the store's
    push/pull beside a plain multipart upload (``raw_put_mb_s``) and ranged download
    (``raw_get_mb_s``) of the files of directory ``src``, or of ``mb`` MiB of incompressible
    files it makes; ``rounds`` rounds, medians."""
    data = ["--dir", src] if src is not None else ["--mb", str(mb)]
    out = subprocess.run([tool, "--url", url, "--rounds", str(rounds), "--work", work] + data,
                         capture_output=True, text=True, env=dict(os.environ, **S3_ENV))
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise BenchError("bench: %s failed: %s" % (tool, out.stderr.strip()[-1500:]))
    return json.loads(lines[-1])


def ensure_base(d: Daemon, notes: List[str], progress: Callable[[str], None]) -> None:
    """Build the "base" image on daemon ``d`` unless it has it (once: it stays in its state dir;
    the demo daemon's package cache is copied in first when present)."""
    if any(i.name == "base" for i in Images(daemon=d.url).list()):
        return
    cache = os.path.join(d.state, "cache", "debootstrap")
    if os.path.isdir(DEMO_CACHE) and not os.path.isdir(cache):
        shutil.copytree(DEMO_CACHE, cache)
    progress("building the base image in %s (once)" % d.state)
    t0 = time.perf_counter()
    Images(daemon=d.url, request_timeout=3600).build("base")
    notes.append("built the base image for daemon %s in %.0f s (kept in %s for later runs)"
                 % (d.name, _ms(t0) / 1000, d.state))


def _session_code(mb: int) -> str:
    return "import os, hashlib\nheap = bytearray(os.urandom(%d))\ndigest = hashlib.sha256(heap).hexdigest()\n" % (mb * MIB)


CHECK = "(len(heap), hashlib.sha256(heap).hexdigest() == digest)"


def _restore(daemon: str, sid: str, expect: str) -> float:
    """``Sandbox.create(snapshot=sid)`` (the snapshot's limits) until the first ``run_code``
    answered (checked); ms."""
    t0 = time.perf_counter()
    sbx = Sandbox.create(daemon=daemon, snapshot=sid, timeout=0, request_timeout=600)
    try:
        ex = sbx.run_code(CHECK)
        ms = _ms(t0)
        if ex.result != expect:
            raise BenchError("bench store: the restored session came back wrong: %r (expected %r)"
                             % (ex.error or ex.result, expect))
        return ms
    finally:
        sbx.kill()
        sbx.close()


def run_store_bench(
    n: int = 5,
    mb: int = 64,
    session_mb: int = 50,
    progress: Callable[[str], None] = lambda m: None,
) -> StoreResult:
    if os.geteuid() != 0:
        raise BenchError("bench store starts daemons: run it as root")
    daemon_bin = daemon_binary()
    tool = store_bench_tool(daemon_bin)
    res = StoreResult(n=n, throughput_mb=mb, session_mb=session_mb)
    memory_mb = max(1024, session_mb * 8)
    expect = repr((session_mb * MIB, True))
    os.makedirs(RUN_DIR, exist_ok=True)
    os.makedirs(A_STATE, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bb-bench-store-", dir="/var/tmp")
    os.chmod(root, 0o755)  # the sandboxes' root (a mapped uid) walks to B's state dirs
    with sigterm_unwinds(), ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        progress("starting MinIO and PostgreSQL")
        minio = Minio(root)
        stack.callback(quiet, minio.stop)
        meta = start_postgres(root, stack)
        if meta is None:
            meta = os.path.join(root, "meta.db")
            res.metadata = "sqlite"
            res.notes.append("PostgreSQL unavailable (scripts/pg-test-server.sh or its server): metadata in a "
                             "shared SQLite file")

        progress("throughput: %d MiB, store against raw transfers" % mb)
        res.throughput = raw_transfers(tool, minio.url("throughput"), n, root, mb=mb)

        flags = ["--store-url", minio.url("snaps"), "--metadata-url", meta,
                 "--store-key-file", os.path.join(root, "store.key"),
                 "--setns-key-file", os.path.join(A_STATE, "setns.key")]
        progress("starting daemon A")
        a = Daemon(daemon_bin, "a", A_STATE, flags, S3_ENV, os.path.join(root, "daemon-a.log"))
        stack.callback(quiet, a.stop)
        a.kill_sandboxes()  # left by an interrupted run
        ensure_base(a, res.notes, progress)

        snaps = stack.enter_context(Snapshots(daemon=a.url, request_timeout=600))
        made: List[str] = []  # the bench's snapshots on A (kept in its state dir otherwise)
        stack.callback(quiet, lambda: made and snaps.delete(made[0], subtree=True))
        sbx = Sandbox.create(daemon=a.url, timeout=0, memory_mb=memory_mb, request_timeout=600)
        stack.callback(sbx.close)
        stack.callback(quiet, sbx.kill)
        progress("session of %d MiB on daemon A" % session_mb)
        sbx.run_code(_session_code(session_mb), timeout=300)
        sbx.commands.run("mkdir -p /root/work && head -c %d /dev/urandom > /root/work/base.bin" % MIB)
        sid = sbx.checkpoint("bench-store base")
        made.append(sid)
        t0 = time.perf_counter()
        first = snaps.push(sid)
        res.add("first_push", _ms(t0))
        res.first_push_bytes = first.uploaded_bytes
        for _ in range(max(n, 5)):
            t0 = time.perf_counter()
            again = snaps.push(sid)
            res.add("push_again", _ms(t0))
            if not again.already or again.uploaded_bytes:
                raise BenchError("bench store: pushing again uploaded something: %r" % again.raw)

        for i in range(n):
            progress("delta push %d/%d" % (i + 1, n))
            sbx.run_code("off = (%d * %d) %% (len(heap) - %d)\nheap[off:off + %d] = os.urandom(%d)\n"
                         "digest = hashlib.sha256(heap).hexdigest()" % (i, 7 * MIB + 4096, MIB, MIB, MIB))
            sbx.commands.run("head -c %d /dev/urandom > /root/work/delta-%d.bin" % (MIB, i))
            child = sbx.checkpoint("bench-store delta %d" % i)
            t0 = time.perf_counter()
            r = snaps.push(child)
            res.add("delta_push", _ms(t0))
            res.delta_bytes.append(r.uploaded_bytes)

        for i in range(n):
            progress("local restore %d/%d" % (i + 1, n))
            res.add("local_restore", _restore(a.url, sid, expect))
        for i in range(n):
            progress("cross-daemon restore %d/%d" % (i + 1, n))
            state = os.path.join(root, "b-%d" % i)
            b = Daemon(daemon_bin, "b%d" % i, state, flags, S3_ENV, os.path.join(root, "daemon-b%d.log" % i))
            try:
                res.add("cross_daemon_restore", _restore(b.url, sid, expect))
            finally:
                quiet(b.stop)
                shutil.rmtree(state, ignore_errors=True)
            pulled = pulled_from_log(_tail(b.log, 1 << 20))
            if pulled:
                res.add("cross_daemon_pull", pulled["took_ms"])
                res.pull_bytes = int(pulled["downloaded"])
    if mb != 64 or session_mb != 50:
        res.notes.append("sizes differ from the issue's 64 MiB throughput / 50 MiB session")
    res.notes.append("local restore: Sandbox.create(snapshot=sid) on daemon A, which took and pushed the snapshot; "
                     "cross-daemon pull: the part of the restore daemon B spent pulling (its log)")
    return res
