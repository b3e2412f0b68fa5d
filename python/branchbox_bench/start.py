"""``branchbox bench start``: how fast a sandbox is usable, from the warm pool, cold, and from a
warm template, and what an idle sandbox costs in memory.

Measured in one run against the daemon (every time is client-side wall time through the SDK):

- ``pool_start``: ``Sandbox.create(image)`` until a first ``commands.run("true")`` returned,
  claiming from a warm pool of ``image`` that is refilled (``ready`` polled through
  ``GET /v1/pool``) before every sample, so each sample is a claim, never a cold start (the
  pool's ``hits`` counter is checked);
- ``pool_concurrent16``: 16 such creates started together (threads behind a barrier), the pool
  holding at least 16; each sample is one create's time from the common start until its first
  exec returned;
- ``cold_start``: the same create + exec with the pool of ``image`` at 0, same run;
- ``template_start``: ``Sandbox.create(template=...)`` of a warm python template whose recipe
  imported numpy, until a first ``run_code("numpy.arange(10).sum()")`` returned (the template's
  ready shells are refilled before every sample);
- ``import_numpy_cold``: the baseline for templates: a cold sandbox of the same numpy image
  until its first ``run_code("import numpy; numpy.arange(10).sum()")`` returned;
- idle memory: ``Private_Clean + Private_Dirty`` and ``Pss`` of ``/proc/<pid>/smaps_rollup``
  summed over the processes of one idle sandbox's cgroup (read on the host, cgroup v1 or v2);
- ``sandboxes_200``: 200 idle sandboxes created (8 at a time), then every one runs ``true``.

The numpy image (``python3-numpy``) and the template are built when missing; the pool settings
the bench changes are restored at the end, even on error, and every sandbox it made is killed
(they also carry a short TTL and the metadata ``branchbox.bench=start``). A template the bench
had to build is removed again. No absolute time is asserted: ``targets_met`` compares this
run's numbers with the issue's targets and the ratios come from the same run.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from branchbox import Images, NotFoundError, Pool, Sandbox, SandboxError, Templates

from .stats import percentile, stats_rows, summary_tail_lines

__all__ = [
    "SUMMARY_KEYS",
    "StartConfig",
    "StartResult",
    "BenchError",
    "run_start_bench",
    "smaps_kib",
    "cgroup_pids",
    "sandbox_memory_mb",
    "targets_met",
]

#: Keys of the JSON summary, in order (``targets_met`` and ``notes`` come last).
SUMMARY_KEYS = (
    "pool_start_ms_p50",
    "pool_start_ms_p99",
    "pool_concurrent16_ms_p50",
    "pool_concurrent16_ms_p99",
    "pool_concurrent16_wall_ms_p50",
    "cold_start_ms_p50",
    "cold_start_ms_p99",
    "template_start_ms_p50",
    "template_start_ms_p99",
    "import_numpy_cold_ms_p50",
    "exec_true_ms_p50",
    "pool_speedup_vs_cold",
    "template_speedup_vs_import_numpy",
    "idle_private_mb",
    "idle_pss_mb",
    "template_idle_private_mb",
    "template_idle_pss_mb",
    "numpy_cold_idle_private_mb",
    "numpy_cold_idle_pss_mb",
    "sandboxes_200_ok",
    "sandboxes_n",
    "sandboxes_ok",
    "sandboxes_create_s",
    "sandboxes_exec_s",
    "sandboxes_memory_mb",
    "sandboxes_private_mb",
    "sandboxes_pss_mb",
    "cgroup_placement",
    "cgroup_placement_ms_p50",
    "pool_refill_ms_p50",
    "pool_hits",
    "pool_misses",
    "pool_recycled",
    "n_pool",
    "n_concurrent",
    "n_cold",
    "n_template",
    "n_import_numpy",
    "image",
    "numpy_image",
    "template",
    "quick",
)
METRICS = ("pool_start", "pool_concurrent16", "cold_start", "template_start", "import_numpy_cold", "exec_true")
CONCURRENCY = 16
NUMPY_PACKAGE = "python3-numpy"
TEMPLATE_CODE = "import numpy"
TEMPLATE_CHECK = "numpy.arange(10).sum()"
COLD_NUMPY_CODE = "import numpy; numpy.arange(10).sum()"
BENCH_TAG = {"branchbox.bench": "start"}
# TTL of every sandbox the bench makes: leftovers of a killed bench go away on their own.
SANDBOX_TTL = 900
KIB = 1024.0


class BenchError(SandboxError):
    """The benchmark could not measure what it should (a failed exec, a pool that never fills)."""

    default_code = "bench"


# ----------------------------------------------------------------------------- configuration


@dataclass
class StartConfig:
    daemon: Optional[str] = None
    token: Optional[str] = None
    image: str = "base"
    numpy_image: str = "py-numpy"
    template: str = "bench-start-numpy"
    quick: bool = False
    n_pool: int = 40
    concurrent_rounds: int = 4
    n_cold: int = 20
    n_template: int = 20
    n_import_numpy: int = 8
    n_memory: int = 4
    sandboxes: int = 200
    workers: int = 8
    #: Seconds to wait for a pool or a template's shells to fill.
    ready_timeout: float = 120.0

    @classmethod
    def make(cls, quick: bool = False, **kw: Any) -> "StartConfig":
        """Defaults for a full run, or for ``--quick`` (CI smoke test: fewer samples, 20
        sandboxes instead of 200); keyword arguments set to None keep the default."""
        base: Dict[str, Any] = {"quick": quick}
        if quick:
            base.update(n_pool=10, concurrent_rounds=1, n_cold=5, n_template=5, n_import_numpy=3, n_memory=2, sandboxes=20)
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)

    def sdk(self) -> Dict[str, Any]:
        return {"daemon": self.daemon, "token": self.token}


# ----------------------------------------------------------------------------- host-side memory


def smaps_kib(text: str, keys: Sequence[str]) -> int:
    """Sum of the given fields (kB) of a ``/proc/<pid>/smaps_rollup`` text."""
    total = 0
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            parts = rest.split()
            if parts:
                total += int(parts[0])
    return total


PRIVATE_KEYS = ("Private_Clean", "Private_Dirty")
PSS_KEYS = ("Pss",)


def cgroup_pids(sandbox_id: str, root: str = "/sys/fs/cgroup") -> Set[int]:
    """Pids in the sandbox's cgroup (``<cgroup-parent>/<id>``): on cgroup v1 the union over
    every hierarchy (``<root>/<controller>/<parent>/<id>/cgroup.procs``), on v2 the unified
    tree (``<root>/<parent>/<id>/cgroup.procs``)."""
    pids: Set[int] = set()
    for depth in range(1, 5):
        for path in glob.glob(os.path.join(root, *(["*"] * depth), sandbox_id, "cgroup.procs")):
            try:
                with open(path) as f:
                    pids.update(int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
    return pids


def sandbox_memory_mb(sandbox_id: str, root: str = "/sys/fs/cgroup", proc: str = "/proc") -> Tuple[Optional[float], Optional[float]]:
    """(private MiB, PSS MiB) of every process of a sandbox, read on the host; (None, None)
    when its cgroup or its processes cannot be read (not root, another host)."""
    pids = cgroup_pids(sandbox_id, root)
    private = pss = 0
    seen = 0
    for pid in pids:
        try:
            with open(os.path.join(proc, str(pid), "smaps_rollup")) as f:
                text = f.read()
        except (OSError, ValueError):
            continue
        seen += 1
        private += smaps_kib(text, PRIVATE_KEYS)
        pss += smaps_kib(text, PSS_KEYS)
    if not seen:
        return None, None
    return private / KIB, pss / KIB


# ----------------------------------------------------------------------------- result


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return percentile(vals, 50) if vals else None


def targets_met(s: Dict[str, Any]) -> Dict[str, Optional[bool]]:
    """The issue's targets against this run (``None``: not measured)."""

    def cmp(key: str, limit: float, le: bool) -> Optional[bool]:
        v = s.get(key)
        if v is None:
            return None
        return v <= limit if le else v >= limit

    return {
        "pool_p50_le_10ms": cmp("pool_start_ms_p50", 10.0, True),
        "pool_concurrent16_p99_le_30ms": cmp("pool_concurrent16_ms_p99", 30.0, True),
        "template_speedup_ge_10x": cmp("template_speedup_vs_import_numpy", 10.0, False),
    }


@dataclass
class StartResult:
    cfg: StartConfig
    samples: Dict[str, List[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    values: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def p(self, metric: str, q: float) -> Optional[float]:
        xs = self.samples.get(metric) or []
        return percentile(xs, q) if xs else None

    def summary(self) -> Dict[str, Any]:
        s: Dict[str, Any] = {k: None for k in SUMMARY_KEYS}
        for metric in METRICS:
            s_p50, s_p99 = "%s_ms_p50" % metric, "%s_ms_p99" % metric
            if s_p50 in s:
                s[s_p50] = self.p(metric, 50)
            if s_p99 in s:
                s[s_p99] = self.p(metric, 99)
        s.update({k: v for k, v in self.values.items() if k in s})
        s["pool_speedup_vs_cold"] = _ratio(s["cold_start_ms_p50"], s["pool_start_ms_p50"])
        s["template_speedup_vs_import_numpy"] = _ratio(s["import_numpy_cold_ms_p50"], s["template_start_ms_p50"])
        n = s.get("sandboxes_n")
        s["sandboxes_200_ok"] = s.get("sandboxes_ok") if n is not None and n >= 200 else None
        s["n_pool"] = len(self.samples["pool_start"])
        s["n_concurrent"] = len(self.samples["pool_concurrent16"])
        s["n_cold"] = len(self.samples["cold_start"])
        s["n_template"] = len(self.samples["template_start"])
        s["n_import_numpy"] = len(self.samples["import_numpy_cold"])
        s["image"] = self.cfg.image
        s["numpy_image"] = self.cfg.numpy_image
        s["template"] = self.cfg.template
        s["quick"] = self.cfg.quick
        s = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}
        s["targets_met"] = targets_met(s)
        s["notes"] = list(self.notes)
        return s

    def rows(self) -> List[List[str]]:
        """Table rows: metric, samples, p50, p99, min, max (ms)."""
        return stats_rows(self.samples, METRICS)


def report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable lines under the table."""

    def num(v: Any, unit: str = "", spec: str = "%.1f") -> str:
        return "-" if v is None else (spec % v) + unit

    lines = [
        "pool vs cold start (p50): %s vs %s (%s faster); 16 concurrent p99: %s"
        % (
            num(s.get("pool_start_ms_p50"), " ms", "%.2f"),
            num(s.get("cold_start_ms_p50"), " ms", "%.2f"),
            num(s.get("pool_speedup_vs_cold"), "x"),
            num(s.get("pool_concurrent16_ms_p99"), " ms", "%.2f"),
        ),
        "template (numpy imported) to first run_code: %s vs cold import numpy %s (%s faster)"
        % (
            num(s.get("template_start_ms_p50"), " ms", "%.2f"),
            num(s.get("import_numpy_cold_ms_p50"), " ms", "%.2f"),
            num(s.get("template_speedup_vs_import_numpy"), "x"),
        ),
        "idle sandbox: private %s, PSS %s; from the template: private %s, PSS %s; cold numpy session: private %s"
        % (
            num(s.get("idle_private_mb"), " MiB", "%.2f"),
            num(s.get("idle_pss_mb"), " MiB", "%.2f"),
            num(s.get("template_idle_private_mb"), " MiB", "%.2f"),
            num(s.get("template_idle_pss_mb"), " MiB", "%.2f"),
            num(s.get("numpy_cold_idle_private_mb"), " MiB", "%.2f"),
        ),
        "%s idle sandboxes: all answered: %s; created in %s, cgroup memory %s, private %s"
        % (
            s.get("sandboxes_n") if s.get("sandboxes_n") is not None else "-",
            {True: "yes", False: "NO", None: "-"}[s.get("sandboxes_ok")],
            num(s.get("sandboxes_create_s"), " s", "%.2f"),
            num(s.get("sandboxes_memory_mb"), " MiB"),
            num(s.get("sandboxes_private_mb"), " MiB"),
        ),
        "cgroup placement: %s (p50 %s); pool refill p50 %s"
        % (s.get("cgroup_placement") or "-", num(s.get("cgroup_placement_ms_p50"), " ms", "%.2f"), num(s.get("pool_refill_ms_p50"), " ms")),
    ]
    return lines + summary_tail_lines(s)


# ----------------------------------------------------------------------------- the run


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class _Run:
    def __init__(self, cfg: StartConfig, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.say = say
        self.res = StartResult(cfg)
        self.pool = Pool(**cfg.sdk())
        self.templates = Templates(**cfg.sdk())
        self.saved: Dict[str, Tuple[int, int]] = {}
        self.live: List[Sandbox] = []
        self.lock = threading.Lock()
        self.built_template = False

    # -- pool and template helpers

    def set_pool(self, image: str, lo: int, hi: int) -> None:
        if image not in self.saved:
            p = self.pool.stats().images.get(image)
            self.saved[image] = (p.min, p.max) if p is not None else (0, 0)
        self.pool.set(image, lo, hi)

    def wait_pool(self, image: str, ready: int, exactly: bool = False) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout
        while True:
            s = self.pool.stats()
            n = s.ready(image)
            if (n == ready) if exactly else (n >= ready):
                return
            if time.monotonic() > deadline:
                raise BenchError(
                    "bench: the pool of %s has %d ready sandboxes after %gs, waiting for %d (last_error: %s)"
                    % (image, n, self.cfg.ready_timeout, ready, s.last_error)
                )
            time.sleep(0.005)

    def wait_template(self, shells: int) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout
        while True:
            t = self.templates.get(self.cfg.template)
            if t.ready_shells >= min(shells, t.shells):
                return
            if time.monotonic() > deadline:
                raise BenchError(
                    "bench: template %s has %d of %d shells ready after %gs"
                    % (self.cfg.template, t.ready_shells, t.shells, self.cfg.ready_timeout)
                )
            time.sleep(0.005)

    # -- sandboxes

    def create(self, image: Optional[str] = None, template: Optional[str] = None) -> Sandbox:
        sbx = Sandbox.create(image, template=template, timeout=SANDBOX_TTL, metadata=BENCH_TAG, **self.cfg.sdk())
        with self.lock:
            self.live.append(sbx)
        return sbx

    def kill(self, sbx: Sandbox) -> None:
        try:
            sbx.kill()
        except SandboxError:
            pass
        finally:
            sbx.close()
            with self.lock:
                if sbx in self.live:
                    self.live.remove(sbx)

    def kill_many(self, sbxs: Sequence[Sandbox]) -> None:
        with ThreadPoolExecutor(self.cfg.workers) as ex:
            list(ex.map(self.kill, list(sbxs)))

    @staticmethod
    def exec_true(sbx: Sandbox) -> None:
        r = sbx.commands.run("true", timeout=60)
        if r.exit_code != 0:
            raise BenchError(
                "bench: `true` in sandbox %s failed (exit_code=%r, signal=%r, stderr=%r)"
                % (sbx.id, r.exit_code, r.signal, (r.stderr or "")[-200:])
            )

    @staticmethod
    def run_numpy(sbx: Sandbox, code: str) -> None:
        ex = sbx.run_code(code, timeout=120)
        if ex.error is not None or ex.result is None or "45" not in ex.result:
            raise BenchError("bench: run_code(%r) in %s returned %r (error: %s)" % (code, sbx.id, ex.result, ex.error))

    def start_and_exec(self, image: str) -> Tuple[float, Sandbox]:
        t0 = time.perf_counter()
        sbx = self.create(image)
        self.exec_true(sbx)
        return _ms_since(t0), sbx

    # -- phases

    def ensure_numpy_image(self) -> None:
        with Images(**self.cfg.sdk()) as images:
            if any(i.name == self.cfg.numpy_image for i in images.list()):
                return
            self.say("building image %s (%s, debootstrap: a minute or two)" % (self.cfg.numpy_image, NUMPY_PACKAGE))
            t0 = time.perf_counter()
            images.build(self.cfg.numpy_image, packages=[NUMPY_PACKAGE], on_progress=lambda p: self.say("image: %s %s" % (p.stage, p.message)))
        self.res.notes.append("built image %s with %s in %.0f s" % (self.cfg.numpy_image, NUMPY_PACKAGE, time.perf_counter() - t0))

    def ensure_template(self) -> None:
        cfg = self.cfg
        try:
            t = self.templates.get(cfg.template)
        except NotFoundError:
            t = None
        if t is not None and t.image == cfg.numpy_image and t.alive:
            self.res.notes.append("template %s existed (image %s) and was reused" % (cfg.template, t.image))
            return
        self.say("building template %s (image %s, code %r)" % (cfg.template, cfg.numpy_image, TEMPLATE_CODE))
        t0 = time.perf_counter()
        self.templates.build(cfg.template, image=cfg.numpy_image, code=TEMPLATE_CODE, metadata=BENCH_TAG)
        self.built_template = True
        self.res.notes.append(
            "template %s built for this run in %.2f s and removed afterwards" % (cfg.template, time.perf_counter() - t0)
        )

    def measure_memory(self, sbxs: Sequence[Sandbox], prefix: str) -> None:
        time.sleep(0.3)  # let the exec's processes go
        mem = [sandbox_memory_mb(s.id) for s in sbxs]
        self.res.values[prefix + "_private_mb"] = _median([m[0] for m in mem])
        self.res.values[prefix + "_pss_mb"] = _median([m[1] for m in mem])
        if all(m[0] is None for m in mem) and "memory" not in " ".join(self.res.notes):
            self.res.notes.append("memory: the sandboxes' cgroups or /proc/<pid>/smaps_rollup could not be read (run as root on the daemon's host)")

    def phase_pool(self) -> None:
        cfg, res = self.cfg, self.res
        self.say("pool: filling %d sandboxes of %s" % (CONCURRENCY, cfg.image))
        self.set_pool(cfg.image, CONCURRENCY, CONCURRENCY)
        self.wait_pool(cfg.image, CONCURRENCY)
        before = self.pool.stats()
        for _ in range(2):  # warm-up (connections, page cache)
            _, sbx = self.start_and_exec(cfg.image)
            self.kill(sbx)
            self.wait_pool(cfg.image, CONCURRENCY)
        misses = 0
        self.say("pool: create + first exec (%d samples)" % cfg.n_pool)
        for _ in range(cfg.n_pool):
            self.wait_pool(cfg.image, CONCURRENCY)
            hits = self.pool.stats().hits
            ms, sbx = self.start_and_exec(cfg.image)
            if self.pool.stats().hits == hits:
                misses += 1
            res.samples["pool_start"].append(ms)
            self.kill(sbx)
        if misses:
            res.notes.append("%d of %d pool samples were not served from the pool" % (misses, cfg.n_pool))

        self.say("pool: %d concurrent creates x %d rounds" % (CONCURRENCY, cfg.concurrent_rounds))
        walls = []
        with ThreadPoolExecutor(CONCURRENCY) as ex:
            for _ in range(cfg.concurrent_rounds):
                self.wait_pool(cfg.image, CONCURRENCY)
                hits = self.pool.stats().hits
                barrier = threading.Barrier(CONCURRENCY + 1, timeout=cfg.ready_timeout)
                box: Dict[str, float] = {}

                def one(_i: int) -> Tuple[float, Sandbox]:
                    barrier.wait()
                    sbx = self.create(cfg.image)
                    self.exec_true(sbx)
                    return _ms_since(box["t0"]), sbx

                futures = [ex.submit(one, i) for i in range(CONCURRENCY)]
                try:
                    box["t0"] = time.perf_counter()
                    barrier.wait()
                    done = [f.result() for f in futures]
                except BaseException:
                    barrier.abort()  # release the workers (Ctrl-C, a failed create): clean-up kills theirs
                    raise
                walls.append(_ms_since(box["t0"]))
                res.samples["pool_concurrent16"].extend(ms for ms, _ in done)
                served = self.pool.stats().hits - hits
                if served < CONCURRENCY:
                    res.notes.append("a concurrent round had %d of %d creates served from the pool" % (served, CONCURRENCY))
                self.kill_many([s for _, s in done])
        res.values["pool_concurrent16_wall_ms_p50"] = _median(walls)

        self.say("pool: idle memory")
        self.wait_pool(cfg.image, CONCURRENCY)
        idle = [self.start_and_exec(cfg.image)[1] for _ in range(cfg.n_memory)]
        self.measure_memory(idle, "idle")
        # exec round trip in a running sandbox: how much of a start is the first exec
        for _ in range(3):
            self.exec_true(idle[0])
        for _ in range(max(10, cfg.n_pool)):
            t0 = time.perf_counter()
            self.exec_true(idle[0])
            res.samples["exec_true"].append(_ms_since(t0))
        self.kill_many(idle)
        after = self.pool.stats()
        res.values["pool_hits"] = after.hits - before.hits
        res.values["pool_misses"] = after.misses - before.misses
        res.values["pool_recycled"] = after.recycled - before.recycled
        res.values["pool_refill_ms_p50"] = after.refill_ms_p50

    def phase_cold(self) -> None:
        cfg, res = self.cfg, self.res
        self.say("cold: draining the pool of %s" % cfg.image)
        self.set_pool(cfg.image, 0, 0)
        self.wait_pool(cfg.image, 0, exactly=True)
        _, sbx = self.start_and_exec(cfg.image)  # warm-up
        self.kill(sbx)
        self.say("cold: create + first exec (%d samples)" % cfg.n_cold)
        for _ in range(cfg.n_cold):
            ms, sbx = self.start_and_exec(cfg.image)
            res.samples["cold_start"].append(ms)
            self.kill(sbx)

    def phase_template(self) -> None:
        cfg, res = self.cfg, self.res
        self.ensure_template()
        shells = self.templates.get(cfg.template).shells
        if shells == 0:
            res.notes.append("template %s keeps no ready shells: every sample forks one on demand" % cfg.template)

        def sample() -> Tuple[float, Sandbox]:
            self.wait_template(shells)
            t0 = time.perf_counter()
            sbx = self.create(template=cfg.template)
            self.run_numpy(sbx, TEMPLATE_CHECK)
            return _ms_since(t0), sbx

        self.kill(sample()[1])  # warm-up
        self.say("template: create(template=%s) + first run_code (%d samples)" % (cfg.template, cfg.n_template))
        for _ in range(cfg.n_template):
            ms, sbx = sample()
            res.samples["template_start"].append(ms)
            self.kill(sbx)
        idle = [sample()[1] for _ in range(cfg.n_memory)]
        self.measure_memory(idle, "template_idle")
        self.kill_many(idle)

    def phase_import_numpy(self) -> None:
        cfg, res = self.cfg, self.res
        p = self.pool.stats().images.get(cfg.numpy_image)
        if p is not None and (p.min or p.max or p.ready):
            self.set_pool(cfg.numpy_image, 0, 0)
            self.wait_pool(cfg.numpy_image, 0, exactly=True)

        def sample() -> Tuple[float, Sandbox]:
            t0 = time.perf_counter()
            sbx = self.create(cfg.numpy_image)
            self.run_numpy(sbx, COLD_NUMPY_CODE)
            return _ms_since(t0), sbx

        self.say("baseline: cold %s sandbox + import numpy (%d samples)" % (cfg.numpy_image, cfg.n_import_numpy))
        self.kill(sample()[1])  # warm-up (page cache of numpy's files)
        kept: List[Sandbox] = []
        for i in range(cfg.n_import_numpy):
            ms, sbx = sample()
            res.samples["import_numpy_cold"].append(ms)
            if len(kept) < cfg.n_memory:
                kept.append(sbx)
            else:
                self.kill(sbx)
        self.measure_memory(kept, "numpy_cold_idle")
        self.kill_many(kept)

    def phase_many(self) -> None:
        cfg, res = self.cfg, self.res
        n = cfg.sandboxes
        if n <= 0:
            res.notes.append("the many-sandboxes part was skipped")
            return
        if n < 200:
            res.notes.append("%d idle sandboxes instead of 200 (%s)" % (n, "--quick" if cfg.quick else "--sandboxes"))
        self.say("%d idle sandboxes: creating (%d at a time)" % (n, cfg.workers))
        made: List[Sandbox] = []
        try:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(cfg.workers) as ex:
                futures = [ex.submit(self.create, cfg.image) for _ in range(n)]
                errors = []
                for f in futures:
                    try:
                        made.append(f.result())
                    except SandboxError as e:
                        errors.append(str(e))
            res.values["sandboxes_create_s"] = time.perf_counter() - t0
            res.values["sandboxes_n"] = n
            if errors:
                res.values["sandboxes_ok"] = False
                res.notes.append("%d of %d creates failed, first: %s" % (len(errors), n, errors[0]))
            time.sleep(0.3)
            infos = {i.id: i for i in Sandbox.list(metadata=BENCH_TAG, **cfg.sdk())}
            res.values["sandboxes_memory_mb"] = sum((infos[s.id].memory_bytes or 0) for s in made if s.id in infos) / (KIB * KIB)
            mem = [sandbox_memory_mb(s.id) for s in made]
            if any(m[0] is not None for m in mem):
                res.values["sandboxes_private_mb"] = sum(m[0] or 0.0 for m in mem)
                res.values["sandboxes_pss_mb"] = sum(m[1] or 0.0 for m in mem)
            self.say("%d idle sandboxes: every one runs `true`" % len(made))

            def answers(s: Sandbox) -> bool:
                try:
                    self.exec_true(s)
                    return True
                except SandboxError:
                    return False

            t0 = time.perf_counter()
            with ThreadPoolExecutor(cfg.workers) as ex:
                ok = list(ex.map(answers, made))
            res.values["sandboxes_exec_s"] = time.perf_counter() - t0
            if not all(ok):
                res.notes.append("%d of %d idle sandboxes did not answer an exec" % (ok.count(False), len(made)))
            res.values["sandboxes_ok"] = not errors and all(ok) and len(made) == n
        finally:
            self.say("%d idle sandboxes: killing" % len(made))
            self.kill_many(made)

    # -- clean-up

    def sweep(self) -> None:
        """Kill every sandbox tagged by the bench (an interrupted create is not in ``live``)."""
        leftovers = []
        for info in Sandbox.list(metadata=BENCH_TAG, **self.cfg.sdk()):
            try:
                leftovers.append(Sandbox.connect(info.id, **self.cfg.sdk()))
            except SandboxError:
                pass
        self.kill_many(leftovers)

    def cleanup(self) -> None:
        problems = []
        self.kill_many(list(self.live))
        try:
            self.sweep()
            # A create interrupted on the client side (Ctrl-C) may still be finishing in the
            # daemon: look again a moment later (the TTL reaps anything later still).
            time.sleep(0.5)
            self.sweep()
        except SandboxError as e:
            problems.append("listing leftover sandboxes: %s" % e)
        if self.built_template:
            try:
                self.templates.remove(self.cfg.template)
            except SandboxError as e:
                problems.append("removing template %s: %s" % (self.cfg.template, e))
        for image, (lo, hi) in self.saved.items():
            try:
                self.pool.set(image, lo, hi)
            except SandboxError as e:
                problems.append("restoring the pool of %s to min %d max %d: %s" % (image, lo, hi, e))
        if self.saved:
            self.res.notes.append(
                "pool settings restored: "
                + ", ".join("%s min %d max %d" % (i, lo, hi) for i, (lo, hi) in sorted(self.saved.items()))
            )
        for p in problems:
            self.res.notes.append("clean-up: " + p)
        self.pool.close()
        self.templates.close()


def run_start_bench(cfg: StartConfig, progress: Optional[Callable[[str], None]] = None) -> StartResult:
    """Run every phase against the daemon; settings it changed are restored even on error."""
    say = progress or (lambda _msg: None)
    run = _Run(cfg, say)
    try:
        run.ensure_numpy_image()
        run.phase_pool()
        run.phase_cold()
        run.phase_template()
        run.phase_import_numpy()
        run.phase_many()
        stats = run.pool.stats()
        run.res.values["cgroup_placement"] = stats.cgroup_placement
        run.res.values["cgroup_placement_ms_p50"] = stats.cgroup_placement_ms_p50
        if stats.cgroup_placement == "migrate":
            run.res.notes.append("cgroup v1: sandbox inits are moved into their cgroup after clone (migrate)")
    finally:
        say("restoring pool settings and cleaning up")
        run.cleanup()
    return run.res
