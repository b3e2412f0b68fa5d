"""``branchbox bench volume``: persistent volumes against a sandbox's own disk, and what their
snapshots, forks and syncs cost.

Measured:

- file operations, from one python process in ONE sandbox created with
  ``volumes={"/workspace": vol}``: the sandbox's own ``/tmp/bb-bench-local`` against the
  volume's ``/workspace/bb-bench``. Files ``bench/d%04d/f%06d.bin`` (128 per directory) under
  each, content ``bytes(i % 251 for i in range(size))``, 1000 files of 4 KiB and 500 of 256 B.
  Phases: ``write`` (32 threads; an op makes its file's directory, then writes the file),
  ``read`` (32 threads, content checked), ``liststat`` (one thread: ``os.walk`` and an
  ``os.stat`` of each file; the ops are the files, an op's time is its stat). 5 rounds
  alternate which target goes first; a tree is deleted after each run (not timed). Per target
  and phase: the median of the rounds' ops/s and the p95 of all the rounds' op times (ms);
  ``<phase>_ratio`` is volume ops/s / local ops/s. Run on the daemon the CLI talks to (its
  default store, a local directory) and on a daemon of the bench whose store is a MinIO
  (``s3_`` keys); ``small_`` keys are the 256 B files.
- ``snapshot_ms_p50_<n>`` / ``fork_ms_p50_<n>``: ``vol.snapshot()`` and ``vol.fork()`` through
  the SDK (7 samples each, median) on the default daemon, of volumes holding 1,000 and 100,000
  files of 256 B (written by a python loop in a sandbox, unmounted by killing it);
  ``fork_size_ratio`` = ``fork_ms_p50_100k / fork_ms_p50_1k`` (1 when a fork's cost does not
  depend on the volume's size).
- ``shared_snapshot_ms_p50_1`` / ``shared_snapshot_ms_p50_4``: ``vol.snapshot()`` of an
  ``rwx`` volume mounted by one sandbox and of one mounted by :data:`SHARED_HOLDERS` (a freeze
  stops and remounts every sandbox that mounts it), interleaved sample by sample (their order
  flips each sample), each after a one-file write through ``vol.files`` (so there is a
  writable layer to freeze); ``shared_snapshot_ratio`` = the second / the first.
- ``sync_mb_s``: ``vol.sync()`` on the MinIO daemon of ~64 MiB of new incompressible files
  (written through ``vol.files``; four large files and small ones of 16..128 KiB, as
  ``branchbox-store-bench`` makes), MB/s of file content (10^6 bytes); ``raw_mb_s``: a plain
  multipart upload of the same files to the same MinIO (``branchbox-store-bench --dir``, the
  store bench's raw baseline); ``sync_vs_raw_ratio`` = ``sync_mb_s / raw_mb_s``.

The MinIO daemon has a state dir of its own (``/var/lib/branchbox-bench-volume``, kept between
runs: the first run builds the "base" image there) and is started and stopped as ``bench
store``'s daemons are (as root). Every volume and sandbox the bench makes is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from branchbox import Sandbox, Volume
from branchbox.sandbox_sync import health

from .stats import percentile, stats_rows
from .store import (
    RUN_DIR,
    S3_ENV,
    BenchError,
    Daemon,
    Minio,
    daemon_binary,
    ensure_base,
    quiet,
    raw_transfers,
    sigterm_unwinds,
    store_bench_tool,
)

__all__ = [
    "BenchError",
    "VolumeConfig",
    "VolumeResult",
    "run_volume_bench",
    "SUMMARY_KEYS",
    "FILES_SCRIPT",
    "FILL_SCRIPT",
    "file_stats",
    "set_label",
    "sync_layout",
]

MIB = 1 << 20
STATE = "/var/lib/branchbox-bench-volume"
MOUNT = "/workspace"
#: (name, root) of the two targets of the file benchmark, in the sandbox.
TARGETS = (("local", "/tmp/bb-bench-local"), ("volume", MOUNT + "/bb-bench"))
#: (files, bytes each) of the file benchmark.
FILE_SETS = ((1000, 4096), (500, 256))
PER_DIR = 128
PARALLELISM = 32
PHASES = ("write", "read", "liststat")
#: Where the file benchmark leaves its measurements in the sandbox (outside both targets).
RESULT_PATH = "/tmp/bb-bench-volume.json"
#: Files of the volumes whose snapshots and forks are timed, by the label of their keys.
FILLS = (("1k", 1000), ("100k", 100_000))
FILL_SIZE = 256
#: Seconds the in-sandbox file benchmark and fill may take.
SCRIPT_TIMEOUT = 3600.0
#: Seconds a killed sandbox's volume may take to show no mount.
UNMOUNT_WAIT = 60.0

#: Sandboxes that mount the shared (``rwx``) volume of the shared-snapshot part (against one).
SHARED_HOLDERS = 4

SUMMARY_KEYS = (
    "write_ratio",
    "read_ratio",
    "liststat_ratio",
    "s3_write_ratio",
    "s3_read_ratio",
    "s3_liststat_ratio",
    "small_write_ratio",
    "small_read_ratio",
    "small_liststat_ratio",
    "small_s3_write_ratio",
    "small_s3_read_ratio",
    "small_s3_liststat_ratio",
    "snapshot_ms_p50_1k",
    "fork_ms_p50_1k",
    "snapshot_ms_p50_100k",
    "fork_ms_p50_100k",
    "fork_size_ratio",
    "shared_snapshot_ms_p50_1",
    "shared_snapshot_ms_p50_%d" % SHARED_HOLDERS,
    "shared_snapshot_ratio",
    "sync_mb_s",
    "raw_mb_s",
    "sync_vs_raw_ratio",
    "local_store",
    "rounds",
    "samples",
    "sync_mb",
)
METRICS = (
    "snapshot_1k",
    "fork_1k",
    "snapshot_100k",
    "fork_100k",
    "shared_snapshot_1",
    "shared_snapshot_%d" % SHARED_HOLDERS,
    "sync",
)

# The file benchmark, run by the sandbox's python3 (standard library only): argv[1] is its
# JSON configuration; it writes {"runs": [...]} to the configuration's "out", one run per
# (file set, round, target) in that order, with each phase's wall time and op times.
FILES_SCRIPT = r'''
import json, os, shutil, sys, time
from concurrent.futures import ThreadPoolExecutor

cfg = json.loads(sys.argv[1])
PER_DIR = cfg["per_dir"]
POOL = ThreadPoolExecutor(cfg["parallelism"])


def paths(root, n):
    return [os.path.join(root, "bench", "d%04d" % (i // PER_DIR), "f%06d.bin" % i) for i in range(n)]


def write(path, payload):
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(payload)
    return time.perf_counter() - t0


def read(path, payload):
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    took = time.perf_counter() - t0
    if data != payload:
        raise RuntimeError("%s: read %d bytes that differ from the %d written" % (path, len(data), len(payload)))
    return took


def pooled(op, files, payload):
    t0 = time.perf_counter()
    took = list(POOL.map(lambda p: op(p, payload), files))
    return time.perf_counter() - t0, took


def liststat(root, n):
    took = []
    t0 = time.perf_counter()
    for parent, _dirs, names in os.walk(os.path.join(root, "bench")):
        for name in names:
            t = time.perf_counter()
            os.stat(os.path.join(parent, name))
            took.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    if len(took) != n:
        raise RuntimeError("%s: listed %d files, %d were written" % (root, len(took), n))
    return wall, took


def phase(wall, took):
    return {"seconds": wall, "op_ms": [round(t * 1000.0, 4) for t in took]}


runs = []
for n, size in cfg["sets"]:
    payload = bytes(i % 251 for i in range(size))
    for rnd in range(cfg["rounds"]):
        order = cfg["targets"] if rnd % 2 == 0 else cfg["targets"][::-1]
        for name, root in order:
            files = paths(root, n)
            run = {"files": n, "size": size, "target": name}
            run["write"] = phase(*pooled(write, files, payload))
            run["read"] = phase(*pooled(read, files, payload))
            run["liststat"] = phase(*liststat(root, n))
            shutil.rmtree(os.path.join(root, "bench"))
            runs.append(run)
with open(cfg["out"], "w") as f:
    json.dump({"runs": runs}, f)
'''

# Fills directory argv[1] with argv[2] files of argv[3] bytes, argv[4] per subdirectory.
FILL_SCRIPT = r'''
import os, sys

root, n, size, per_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
payload = bytes(i % 251 for i in range(size))
for i in range(n):
    parent = os.path.join(root, "d%04d" % (i // per_dir))
    if i % per_dir == 0:
        os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, "f%06d.bin" % i), "wb") as f:
        f.write(payload)
'''


def set_label(files: int, size: int) -> str:
    """``1000x4KiB``, ``500x256B``: the key of a file set in the summary's ``files``."""
    return "%dx%s" % (files, "%dKiB" % (size // 1024) if size % 1024 == 0 else "%dB" % size)


LARGE_SET, SMALL_SET = (set_label(n, size) for n, size in FILE_SETS)
#: :func:`file_stats`: ``{set: {target: {phase: {"ops_s", "p95_ms", "ops_s_rounds"}}}}``.
FileStats = Dict[str, Dict[str, Dict[str, Dict[str, Any]]]]


def file_stats(runs: Sequence[Dict[str, Any]]) -> FileStats:
    """``{set: {target: {phase: {"ops_s", "p95_ms", "ops_s_rounds"}}}}`` of the file benchmark's
    runs: the median of the rounds' ops/s, the p95 of all their op times (ms)."""
    grouped: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for run in runs:
        for ph in PHASES:
            grouped.setdefault((set_label(run["files"], run["size"]), run["target"], ph), []).append(
                dict(run[ph], files=run["files"])
            )
    out: FileStats = {}
    for (label, target, ph), phases in grouped.items():
        rounds = [p["files"] / p["seconds"] for p in phases if p["seconds"] > 0]
        ops = [ms for p in phases for ms in p["op_ms"]]
        out.setdefault(label, {}).setdefault(target, {})[ph] = {
            "ops_s": round(percentile(rounds, 50), 1) if rounds else None,
            "p95_ms": round(percentile(ops, 95), 4) if ops else None,
            "ops_s_rounds": [round(r, 1) for r in rounds],
        }
    return out


def sync_layout(mb: int) -> List[Tuple[str, int]]:
    """(relative path, bytes) of the ~``mb`` MiB a sync uploads: nine tenths in four large files,
    the rest in files of 16..128 KiB (the layout of ``branchbox-store-bench --mb``)."""
    total = mb * MIB
    big = total * 9 // 10 // 4
    layout = [("big-%d.bin" % i, big) for i in range(4)]
    left, i = total - 4 * big, 0
    while left > 0:
        n = min(left, (16 << 10) + (i * 37_813) % (112 << 10))
        layout.append(("small/f-%05d.bin" % i, n))
        left -= n
        i += 1
    return layout


@dataclass
class VolumeConfig:
    """What ``bench volume`` runs against (``daemon``/``token``: the default daemon) and how long."""

    daemon: Optional[str] = None
    token: Optional[str] = None
    image: str = "base"
    rounds: int = 5
    samples: int = 7
    sync_mb: int = 64
    #: Also run the parts that need a daemon with a MinIO store (started here, as root).
    s3: bool = True


@dataclass
class VolumeResult:
    """The measurements of a run; :meth:`summary` is the JSON line."""

    cfg: VolumeConfig
    #: :func:`file_stats` by store backend ("local_store", "s3_store").
    files: Dict[str, FileStats] = field(default_factory=dict)
    #: Milliseconds per metric (:data:`METRICS`).
    samples: Dict[str, List[float]] = field(default_factory=dict)
    #: File bytes written before each sync, and the volume's backlog the sync found.
    sync_bytes: List[int] = field(default_factory=list)
    sync_backlog_bytes: List[int] = field(default_factory=list)
    #: ``branchbox-store-bench``'s JSON line (the raw upload baseline).
    raw: Dict[str, Any] = field(default_factory=dict)
    #: The default daemon's object store (its health's ``store``).
    local_store: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    def add(self, metric: str, ms: float) -> None:
        self.samples.setdefault(metric, []).append(ms)

    def p50(self, metric: str) -> Optional[float]:
        xs = self.samples.get(metric)
        return round(percentile(xs, 50), 3) if xs else None

    def ratio(self, backend: str, label: str, phase: str) -> Optional[float]:
        """Volume ops/s over local ops/s of one phase (None when not measured)."""
        targets = self.files.get(backend, {}).get(label, {})
        local = targets.get("local", {}).get(phase, {}).get("ops_s")
        vol = targets.get("volume", {}).get(phase, {}).get("ops_s")
        return None if not local or vol is None else round(vol / local, 3)

    def sync_mb_s_samples(self) -> List[float]:
        return [b / 1e6 / (ms / 1000.0) for b, ms in zip(self.sync_bytes, self.samples.get("sync", [])) if ms > 0]

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for small, label in (("", LARGE_SET), ("small_", SMALL_SET)):
            for s3, backend in (("", "local_store"), ("s3_", "s3_store")):
                for ph in PHASES:
                    out["%s%s%s_ratio" % (small, s3, ph)] = self.ratio(backend, label, ph)
        for tag, _ in FILLS:
            out["snapshot_ms_p50_" + tag] = self.p50("snapshot_" + tag)
            out["fork_ms_p50_" + tag] = self.p50("fork_" + tag)
        small_fork, large_fork = out["fork_ms_p50_1k"], out["fork_ms_p50_100k"]
        out["fork_size_ratio"] = None if not small_fork or large_fork is None else round(large_fork / small_fork, 3)
        one, many = self.p50("shared_snapshot_1"), self.p50("shared_snapshot_%d" % SHARED_HOLDERS)
        out["shared_snapshot_ms_p50_1"] = one
        out["shared_snapshot_ms_p50_%d" % SHARED_HOLDERS] = many
        out["shared_snapshot_ratio"] = None if not one or many is None else round(many / one, 3)
        sync = self.sync_mb_s_samples()
        sync_mb_s = round(percentile(sync, 50), 1) if sync else None
        raw_mb_s = self.raw.get("raw_put_mb_s")
        out["sync_mb_s"] = sync_mb_s
        out["raw_mb_s"] = raw_mb_s
        out["sync_vs_raw_ratio"] = None if sync_mb_s is None or not raw_mb_s else round(sync_mb_s / raw_mb_s, 3)
        out["local_store"] = self.local_store
        out["rounds"] = self.cfg.rounds
        out["samples"] = self.cfg.samples
        out["sync_mb"] = self.cfg.sync_mb
        out["files"] = self.files
        out["samples_ms"] = {k: [round(v, 3) for v in xs] for k, xs in self.samples.items()}
        out["sync_mb_s_samples"] = [round(v, 1) for v in sync]
        out["raw_mb_s_samples"] = self.raw.get("raw_put_mb_s_samples", [])
        out["sync_bytes"] = self.sync_bytes
        out["sync_backlog_bytes"] = self.sync_backlog_bytes
        out["notes"] = list(self.notes)
        return out

    def rows(self) -> List[List[str]]:
        return stats_rows(self.samples, METRICS)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _run_script(sbx: Sandbox, argv: List[str], what: str) -> None:
    result = sbx.commands.run(argv, timeout=SCRIPT_TIMEOUT)
    if not result.ok:
        why = "timed out" if result.timed_out else "exit %s" % result.exit_code
        tail = (result.stderr or result.stdout or "").strip()[-1500:]
        raise BenchError("bench volume: %s in sandbox %s failed (%s): %s" % (what, sbx.id, why, tail))


def _unmounted(vol: Volume) -> None:
    """Wait until ``vol`` shows no mount (its sandbox was killed)."""
    deadline = time.monotonic() + UNMOUNT_WAIT
    while vol.info().mounts:
        if time.monotonic() > deadline:
            raise BenchError("bench volume: volume %s is still mounted %.0f s after its sandbox was killed"
                             % (vol.id, UNMOUNT_WAIT))
        time.sleep(0.1)


def _bench_volume(stack: ExitStack, daemon: Optional[str], token: Optional[str], access: str = "rwo") -> Volume:
    """A new volume, deleted with ``stack`` once no sandbox mounts it."""
    vol = stack.enter_context(Volume.create(access=access, daemon=daemon, token=token, request_timeout=600))

    def remove() -> None:
        _unmounted(vol)
        vol.delete()

    stack.callback(quiet, remove)
    return vol


def _mounting(vol: Volume, cfg: VolumeConfig, daemon: Optional[str], token: Optional[str]) -> Sandbox:
    """A sandbox mounting ``vol`` at :data:`MOUNT` (killed at the end of its ``with`` block)."""
    return Sandbox.create(cfg.image, volumes={MOUNT: vol}, timeout=0, daemon=daemon, token=token, request_timeout=600)


def file_bench(cfg: VolumeConfig, daemon: Optional[str], token: Optional[str]) -> FileStats:
    """The file benchmark in one sandbox of ``daemon`` mounting a new volume."""
    with ExitStack() as stack:
        vol = _bench_volume(stack, daemon, token)
        sbx = stack.enter_context(_mounting(vol, cfg, daemon, token))
        script_cfg = {
            "targets": [list(t) for t in TARGETS],
            "sets": [list(s) for s in FILE_SETS],
            "rounds": cfg.rounds,
            "per_dir": PER_DIR,
            "parallelism": PARALLELISM,
            "out": RESULT_PATH,
        }
        _run_script(sbx, ["python3", "-c", FILES_SCRIPT, json.dumps(script_cfg)], "the file benchmark")
        return file_stats(json.loads(sbx.files.read(RESULT_PATH))["runs"])


def snapshot_fork_bench(cfg: VolumeConfig, res: VolumeResult, progress: Callable[[str], None]) -> None:
    """``vol.snapshot()`` and ``vol.fork()`` on the default daemon, of volumes of :data:`FILLS` files."""
    for tag, n in FILLS:
        with ExitStack() as stack:
            vol = _bench_volume(stack, cfg.daemon, cfg.token)
            progress("filling a volume with %d files" % n)
            with _mounting(vol, cfg, cfg.daemon, cfg.token) as sbx:
                fill = ["python3", "-c", FILL_SCRIPT, MOUNT + "/fill", str(n), str(FILL_SIZE), str(PER_DIR)]
                _run_script(sbx, fill, "the fill")
            _unmounted(vol)
            progress("snapshots and forks of a volume of %d files" % n)
            for i in range(cfg.samples):
                t0 = time.perf_counter()
                vol.snapshot("bench volume %d" % i)
                res.add("snapshot_" + tag, _ms(t0))
            for _ in range(cfg.samples):
                t0 = time.perf_counter()
                child = vol.fork()
                res.add("fork_" + tag, _ms(t0))
                with child:
                    child.delete()


def shared_snapshot_bench(cfg: VolumeConfig, res: VolumeResult, progress: Callable[[str], None]) -> None:
    """``vol.snapshot()`` of an ``rwx`` volume mounted by one sandbox and of one mounted by
    :data:`SHARED_HOLDERS`, on the default daemon, interleaved."""
    with ExitStack() as stack:
        vols: Dict[int, Volume] = {}
        for holders in (1, SHARED_HOLDERS):
            progress("an rwx volume mounted by %d sandbox(es)" % holders)
            vol = _bench_volume(stack, cfg.daemon, cfg.token, access="rwx")
            for _ in range(holders):
                stack.enter_context(_mounting(vol, cfg, cfg.daemon, cfg.token))
            vols[holders] = vol
        progress("snapshots of rwx volumes mounted by 1 and %d sandboxes" % SHARED_HOLDERS)
        for i in range(cfg.samples):
            for holders in (1, SHARED_HOLDERS) if i % 2 == 0 else (SHARED_HOLDERS, 1):
                vol = vols[holders]
                vol.files.write("/shared-%d" % i, b"x")
                t0 = time.perf_counter()
                vol.snapshot("bench volume shared %d" % i)
                res.add("shared_snapshot_%d" % holders, _ms(t0))


def _write_files(root: str, layout: List[Tuple[str, int]]) -> int:
    """Incompressible files of ``layout`` under ``root``; their total bytes."""
    for rel, size in layout:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    return sum(size for _, size in layout)


def sync_bench(cfg: VolumeConfig, url: str, minio: Minio, tool: str, work: str, res: VolumeResult,
               progress: Callable[[str], None]) -> None:
    """``vol.sync()`` of fresh data each round on the MinIO daemon at ``url``, then the raw upload
    of the last round's files."""
    layout = sync_layout(cfg.sync_mb)
    src = ""
    with ExitStack() as stack:
        vol = _bench_volume(stack, url, None)
        vol.sync()  # the empty volume's first head: each round times its new data only
        for i in range(cfg.rounds):
            progress("sync %d/%d: %d MiB of new files" % (i + 1, cfg.rounds, cfg.sync_mb))
            if src:
                shutil.rmtree(src)
            src = os.path.join(work, "sync-%d" % i)
            written = _write_files(src, layout)
            for rel, _ in layout:
                vol.files.upload(os.path.join(src, rel), "/sync-%d/%s" % (i, rel))
            backlog = vol.info().backlog_bytes
            t0 = time.perf_counter()
            info = vol.sync()
            res.add("sync", _ms(t0))
            if info.durability != "durable":
                raise BenchError("bench volume: volume %s is %s after a sync" % (vol.id, info.durability))
            res.sync_bytes.append(written)
            res.sync_backlog_bytes.append(backlog)
    progress("raw multipart upload of the same %d MiB" % cfg.sync_mb)
    res.raw = raw_transfers(tool, minio.url("raw"), cfg.rounds, work, src=src)
    if any(b < 0.9 * w for b, w in zip(res.sync_backlog_bytes, res.sync_bytes)):
        res.notes.append("a sync had a backlog under 90% of the bytes written before it (sync_backlog_bytes): "
                         "sync_mb_s counts the bytes written")


def _delete_leftovers(url: str) -> None:
    """Delete the volumes of the bench's own daemon at ``url`` (left by an interrupted run)."""
    for info in Volume.list(daemon=url):
        with Volume.connect(info.id, daemon=url) as vol:
            quiet(vol.delete)


def s3_bench(cfg: VolumeConfig, daemon_bin: str, tool: str, res: VolumeResult, progress: Callable[[str], None]) -> None:
    """The file benchmark and the sync on a daemon of the bench whose store is a fresh MinIO."""
    os.makedirs(RUN_DIR, exist_ok=True)
    os.makedirs(STATE, exist_ok=True)
    with ExitStack() as stack:
        work = tempfile.mkdtemp(prefix="bb-bench-volume-", dir="/var/tmp")
        stack.callback(shutil.rmtree, work, True)
        progress("starting MinIO")
        minio = Minio(work)
        stack.callback(quiet, minio.stop)
        flags = ["--store-url", minio.url("volumes"), "--metadata-url", os.path.join(work, "meta.db"),
                 "--store-key-file", os.path.join(work, "store.key"),
                 "--setns-key-file", os.path.join(STATE, "setns.key")]
        progress("starting the daemon with the MinIO store")
        d = Daemon(daemon_bin, "volume", STATE, flags, S3_ENV, os.path.join(work, "daemon.log"))
        stack.callback(quiet, d.stop)
        d.kill_sandboxes()  # left by an interrupted run
        _delete_leftovers(d.url)
        ensure_base(d, res.notes, progress)
        progress("file operations, MinIO store")
        res.files["s3_store"] = file_bench(cfg, d.url, None)
        sync_bench(cfg, d.url, minio, tool, work, res, progress)


def run_volume_bench(cfg: VolumeConfig, progress: Callable[[str], None] = lambda m: None) -> VolumeResult:
    """Run the benchmark (see the module's docstring); what it needs is checked first."""
    s3_tools: Optional[Tuple[str, str]] = None  # branchboxd, branchbox-store-bench
    if cfg.s3:
        if os.geteuid() != 0:
            raise BenchError("bench volume starts a daemon with a MinIO store: run it as root (or with --no-s3)")
        daemon_bin = daemon_binary()
        s3_tools = (daemon_bin, store_bench_tool(daemon_bin))
    res = VolumeResult(cfg)
    res.local_store = health(daemon=cfg.daemon, token=cfg.token).get("store")
    if not (res.local_store or "").startswith("file://"):
        res.notes.append("the default daemon's store is %s, not a local directory" % res.local_store)
    with sigterm_unwinds():
        progress("file operations, local-directory store")
        res.files["local_store"] = file_bench(cfg, cfg.daemon, cfg.token)
        snapshot_fork_bench(cfg, res, progress)
        shared_snapshot_bench(cfg, res, progress)
        if s3_tools is not None:
            s3_bench(cfg, *s3_tools, res, progress)
        else:
            res.notes.append("--no-s3: nothing measured on a MinIO store (s3_ ratios, sync)")
    return res
