"""``branchbox bench durable``: process images (CRIU) against the in-memory fast paths.

Measured in one run against the running daemon (which must have CRIU):

- ``template_rollback``: rollback to a snapshot whose session template is in memory (the fast
  path: a fork of the template, or its spare copy made ahead), session of ``heap_mb`` MiB;
- ``evict_dump``: the dump of that template into a process image (``snapshots.offload``, which
  runs the same dump an eviction runs in the background);
- ``restore_evicted``: rollback to the same snapshot once its template left memory: the
  session is restored from the image (lazy pages: its memory is copied in after the rollback
  returns), then forked; the session's state is checked after each;
- ``restore_evicted_eager``: the same rollback after the template left memory again, with
  ``lazy_pages=False`` (all memory read before the rollback returns): the baseline lazy pages
  are measured against;
- ``criu_plain_restore`` / ``criu_lazy_restore``: CRIU's own time for those two restores (the
  elapsed time their restore logs end with), without the daemon's work around them;
- ``evict_blocking``: how much slower a session request (``run_code``) and a rollback of the
  same sandbox are while a template of it is being dumped, against the same requests without a
  dump (p50 difference, 0 when not slower);
- ``fork4_processes``: ``fork(4, processes="all")`` of a sandbox with a background process
  holding ``heap_mb`` MiB (dumped once, restored into each child) against ``fork4_sessions``,
  ``fork(4)`` of the same sandbox (its session copied, the process left behind), interleaved;
- ``pause`` / ``resume`` of a sandbox whose session holds 50 and 500 MiB (all of its processes
  dumped, memory given back; restored with the same pids), the memory the paused 500 MiB
  sandbox still holds on the host, and a cold start (create and first ``run_code``) as the
  baseline a resume replaces.
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from branchbox import Sandbox, Snapshots
from branchbox.sandbox_sync import health

from .stats import percentile, stats_rows

__all__ = ["BenchError", "DurableResult", "run_durable_bench", "SUMMARY_KEYS", "restore_log_ms"]

SUMMARY_KEYS = (
    "restore_evicted_ms_p50",
    "restore_evicted_ms_p99",
    "template_rollback_ms_p50",
    "restore_evicted_eager_ms_p50",
    "criu_plain_restore_ms_p50",
    "criu_lazy_restore_ms_p50",
    "evict_dump_ms_p50",
    "evict_blocking_ms_p50",
    "evict_blocking_rollback_ms_p50",
    "pause_50mib_ms_p50",
    "resume_50mib_ms_p50",
    "pause_500mib_ms_p50",
    "resume_500mib_ms_p50",
    "paused_host_mb",
    "cold_start_ms_p50",
    "fork4_processes_ms_p50",
    "fork4_sessions_ms_p50",
    "fork4_processes_vs_sessions_ratio",
    "restore_evicted_vs_template_ratio",
    "restore_evicted_vs_eager_ratio",
    "resume_500mib_vs_cold_start_ratio",
    "heap_mb",
    "n",
)
METRICS = (
    "template_rollback",
    "restore_evicted",
    "restore_evicted_eager",
    "criu_plain_restore",
    "criu_lazy_restore",
    "evict_dump",
    "run_code_idle",
    "run_code_during_dump",
    "rollback_idle",
    "rollback_during_dump",
    "pause_50mib",
    "resume_50mib",
    "pause_500mib",
    "resume_500mib",
    "cold_start",
    "fork4_processes",
    "fork4_sessions",
)
MIB = 1 << 20


class BenchError(RuntimeError):
    pass


def restore_log_ms(text: str) -> Optional[float]:
    """CRIU's elapsed time (ms) at the last timestamped line of its log: ``(00.061234) ...``."""
    stamps = re.findall(r"^\((\d+)\.(\d+)\)", text, re.M)
    if not stamps:
        return None
    sec, frac = stamps[-1]
    return (int(sec) + int(frac) / 10 ** len(frac)) * 1000.0


@dataclass
class DurableResult:
    n: int
    heap_mb: int
    samples: Dict[str, List[float]] = field(default_factory=dict)
    paused_host_mb: Optional[float] = None
    notes: List[str] = field(default_factory=list)

    def add(self, metric: str, ms: float) -> None:
        self.samples.setdefault(metric, []).append(ms)

    def p50(self, metric: str) -> Optional[float]:
        xs = self.samples.get(metric)
        return percentile(xs, 50) if xs else None

    def p99(self, metric: str) -> Optional[float]:
        xs = self.samples.get(metric)
        return percentile(xs, 99) if xs else None

    def summary(self) -> Dict[str, Any]:
        def r(v: Optional[float]) -> Optional[float]:
            return None if v is None else round(v, 3)

        def slower(during: str, idle: str) -> Optional[float]:
            d, i = self.p50(during), self.p50(idle)
            return None if d is None or i is None else max(0.0, d - i)

        def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return None if a is None or not b else round(a / b, 2)

        out = {
            "restore_evicted_ms_p50": r(self.p50("restore_evicted")),
            "restore_evicted_ms_p99": r(self.p99("restore_evicted")),
            "template_rollback_ms_p50": r(self.p50("template_rollback")),
            "restore_evicted_eager_ms_p50": r(self.p50("restore_evicted_eager")),
            "criu_plain_restore_ms_p50": r(self.p50("criu_plain_restore")),
            "criu_lazy_restore_ms_p50": r(self.p50("criu_lazy_restore")),
            "evict_dump_ms_p50": r(self.p50("evict_dump")),
            "evict_blocking_ms_p50": r(slower("run_code_during_dump", "run_code_idle")),
            "evict_blocking_rollback_ms_p50": r(slower("rollback_during_dump", "rollback_idle")),
            "pause_50mib_ms_p50": r(self.p50("pause_50mib")),
            "resume_50mib_ms_p50": r(self.p50("resume_50mib")),
            "pause_500mib_ms_p50": r(self.p50("pause_500mib")),
            "resume_500mib_ms_p50": r(self.p50("resume_500mib")),
            "paused_host_mb": r(self.paused_host_mb),
            "cold_start_ms_p50": r(self.p50("cold_start")),
            "fork4_processes_ms_p50": r(self.p50("fork4_processes")),
            "fork4_sessions_ms_p50": r(self.p50("fork4_sessions")),
            "fork4_processes_vs_sessions_ratio": ratio(self.p50("fork4_processes"), self.p50("fork4_sessions")),
            "restore_evicted_vs_template_ratio": ratio(self.p50("restore_evicted"), self.p50("template_rollback")),
            "restore_evicted_vs_eager_ratio": ratio(self.p50("restore_evicted"), self.p50("restore_evicted_eager")),
            "resume_500mib_vs_cold_start_ratio": ratio(self.p50("resume_500mib"), self.p50("cold_start")),
            "heap_mb": self.heap_mb,
            "n": self.n,
        }
        out["notes"] = list(self.notes)
        return out

    def rows(self) -> List[List[str]]:
        return stats_rows(self.samples, METRICS)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _heap_code(mb: int) -> str:
    # Distinct, touched 4 KiB objects (a real heap, not one zero page mapped many times).
    return (
        "import os, hashlib\n"
        "heap = [os.urandom(4096) for _ in range(%d)]\n"
        "digest = hashlib.sha256(b''.join(heap[::64])).hexdigest()\n" % (mb * MIB // 4096)
    )


def _check(sbx: Sandbox, expect_mark: int) -> None:
    got = sbx.run_code("(mark, hashlib.sha256(b''.join(heap[::64])).hexdigest() == digest)").result
    if got != repr((expect_mark, True)):
        raise BenchError("bench: the session came back wrong: %r (expected mark %d and its heap)" % (got, expect_mark))


def _newest_image_log(state_dir: str, since: float) -> Optional[float]:
    # restore.log: a lazy restore's; eager-restore.log: the newest eager one's.
    logs = [p for p in glob.glob(os.path.join(state_dir, "images", "pi-*", "*restore.log")) if os.path.getmtime(p) >= since]
    if not logs:
        return None
    with open(max(logs, key=os.path.getmtime), "r", errors="replace") as f:
        return restore_log_ms(f.read())


def _restore_evicted(
    sbx: Sandbox, snap: str, mark: int, lazy_pages: Optional[bool], res: DurableResult, metric: str,
    criu_metric: str, state_dir: str,
) -> None:
    """Change the session, roll back to ``snap`` (its template in a process image), check the
    session came back; ``metric``: the rollback's time, ``criu_metric``: CRIU's own."""
    sbx.run_code("mark = -1")
    since = time.time() - 1
    t0 = time.perf_counter()
    r = sbx.rollback(snap, lazy_pages=lazy_pages)
    res.add(metric, _ms(t0))
    if r.sessions_restarted:
        raise BenchError("bench: a session restarted: %r" % r.raw.get("restarted"))
    _check(sbx, mark)
    criu = _newest_image_log(state_dir, since)
    if criu is not None:
        res.add(criu_metric, criu)


def run_durable_bench(
    n: int = 10,
    heap_mb: int = 50,
    big_mb: int = 500,
    pause_n: int = 5,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    state_dir: str = "/var/lib/branchbox",
    progress: Callable[[str], None] = lambda m: None,
) -> DurableResult:
    h = health(daemon=daemon, token=token)
    pi = (h.get("process_images") if isinstance(h, dict) else h.raw.get("process_images")) or {}
    if not pi.get("criu"):
        raise BenchError("bench durable needs CRIU in the daemon: %s" % (pi.get("unavailable") or "not reported"))
    res = DurableResult(n=n, heap_mb=heap_mb)
    kw: Dict[str, Any] = {"daemon": daemon, "token": token}

    # Evicted templates against the in-memory ones, same sandbox, same snapshots.
    sbx = Sandbox.create(timeout=0, memory_mb=max(1024, heap_mb * 8), request_timeout=600, **kw)
    try:
        with Snapshots(request_timeout=600, **kw) as snaps:
            progress("session of %d MiB" % heap_mb)
            sbx.run_code(_heap_code(heap_mb), timeout=300)
            for i in range(n):
                progress("evicted template %d/%d" % (i + 1, n))
                sbx.run_code("mark = %d" % i)
                snap = sbx.checkpoint()
                sbx.run_code("mark = -1")
                time.sleep(0.1)  # let the spare copy be made, as between an agent's steps
                t0 = time.perf_counter()
                sbx.rollback(snap)
                res.add("template_rollback", _ms(t0))
                _check(sbx, i)
                off = snaps.offload(snap)
                if off.images < 1 or off.lost:
                    raise BenchError("bench: the snapshot's session was not kept in an image: %r" % off.raw)
                if off.offloaded:
                    res.add("evict_dump", off.took_ms or 0.0)
                _restore_evicted(sbx, snap, i, None, res, "restore_evicted", "criu_lazy_restore", state_dir)
                # The baseline: the same restore with all memory read first.
                snaps.offload(snap)
                _restore_evicted(sbx, snap, i, False, res, "restore_evicted_eager", "criu_plain_restore", state_dir)
            # Requests of the same sandbox while one of its templates is dumped.
            progress("requests during a dump")
            base = sbx.checkpoint()
            for _ in range(n):
                t0 = time.perf_counter()
                sbx.run_code("1")
                res.add("run_code_idle", _ms(t0))
                t0 = time.perf_counter()
                sbx.rollback(base)
                res.add("rollback_idle", _ms(t0))
            for i in range(n):
                sbx.run_code("mark = %d" % (100 + i))
                snap = sbx.checkpoint()
                done = threading.Event()
                errors: List[BaseException] = []

                def offload(s: Any = snap) -> None:
                    try:
                        snaps.offload(s)
                    except BaseException as e:  # noqa: BLE001 - reported below
                        errors.append(e)
                    finally:
                        done.set()

                th = threading.Thread(target=offload, daemon=True)
                th.start()
                time.sleep(0.01)  # the dump under way
                if not done.is_set():
                    t0 = time.perf_counter()
                    sbx.run_code("1")
                    if not done.is_set():
                        res.add("run_code_during_dump", _ms(t0))
                if not done.is_set():
                    t0 = time.perf_counter()
                    sbx.rollback(base)
                    res.add("rollback_during_dump", _ms(t0))
                th.join()
                if errors:
                    raise BenchError("bench: offload failed: %s" % errors[0])
    finally:
        sbx.kill()
        sbx.close()

    # Forks that carry a background process, against forks that leave it behind.
    progress("forks with a background process of %d MiB" % heap_mb)
    s = Sandbox.create(timeout=0, memory_mb=max(1024, heap_mb * 8), request_timeout=600, **kw)
    try:
        s.files.write("/root/holder.py", _heap_code(heap_mb) + "open('/root/held', 'w').close()\nimport time\ntime.sleep(1e6)\n")
        holder = s.commands.run(["python3", "/root/holder.py"], background=True)
        deadline = time.monotonic() + 120
        while not s.files.exists("/root/held"):
            if time.monotonic() > deadline:
                raise BenchError("bench: the background process did not fill its heap in 120 s")
            time.sleep(0.05)
        s.run_code("x = 1")
        for i in range(max(2, n // 2)):
            progress("fork with and without the process %d/%d" % (i + 1, max(2, n // 2)))
            for metric, processes in (("fork4_processes", "all"), ("fork4_sessions", None)):
                t0 = time.perf_counter()
                kids, r = s.fork_info(4, processes=processes)
                res.add(metric, _ms(t0))
                try:
                    if r.processes_not_restored:
                        raise BenchError("bench: a fork child lacks the process: %s" % r.processes_not_restored[0])
                    running = {p.pid for p in kids[-1].commands.list() if p.running}
                    if (holder.pid in running) != (processes == "all"):
                        raise BenchError("bench: fork(processes=%r): the process is %s in a child" % (processes, "running" if holder.pid in running else "missing"))
                finally:
                    for k in kids:
                        k.kill()
                        k.close()
    finally:
        s.kill()
        s.close()

    # Pause and resume.
    for mb, runs in ((heap_mb, pause_n), (big_mb, max(1, pause_n // 2 + 1))):
        progress("pause/resume of %d MiB" % mb)
        s = Sandbox.create(timeout=0, memory_mb=max(1024, mb * 3), request_timeout=600, **kw)
        try:
            s.run_code(_heap_code(mb), timeout=600)
            for i in range(runs):
                s.run_code("mark = %d" % i)
                t0 = time.perf_counter()
                s.pause()
                res.add("pause_%dmib" % mb, _ms(t0))
                if mb == big_mb and res.paused_host_mb is None:
                    res.paused_host_mb = (s.info().memory_bytes or 0) / MIB
                t0 = time.perf_counter()
                s.resume()
                res.add("resume_%dmib" % mb, _ms(t0))
                _check(s, i)
        finally:
            s.kill()
            s.close()

    progress("cold starts")
    for _ in range(pause_n):
        t0 = time.perf_counter()
        s = Sandbox.create(timeout=60, **kw)
        try:
            s.run_code("1")
            res.add("cold_start", _ms(t0))
        finally:
            s.kill()
            s.close()
    if heap_mb != 50 or big_mb != 500:
        res.notes.append("sizes differ from the targets' 50 / 500 MiB: pause_/resume_ keys are named by the sizes used")
    return res

