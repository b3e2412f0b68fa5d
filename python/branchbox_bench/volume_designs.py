"""``branchbox bench volume-designs``: the two designs of persistent volumes, measured on the same
small-file benchmark on the host before one is chosen.

- design (a), what a volume is now: a node-local overlayfs (layers + a writable dir) mounted
  into the sandbox;
- design (b): a FUSE filesystem served by the daemon, with kernel caching, and with FUSE
  passthrough. ``branchbox-fuse-probe`` (crate ``bb-fuse-probe``) stands in for that daemon.

The workload is ``bench volume``'s file benchmark, run unchanged (its script
:data:`branchbox_bench.volume.FILES_SCRIPT` and :func:`branchbox_bench.volume.file_stats`):
files ``bench/d%04d/f%06d.bin`` (128 per directory), content ``bytes(i % 251 for i in
range(size))``, 1000 of 4 KiB and 500 of 256 B. Phases: ``write`` (32 threads; an op makes its
file's directory, then writes the file), ``read`` (32 threads, content checked), ``liststat``
(one thread: ``os.walk`` and an ``os.stat`` of each file). 5 rounds alternate the targets'
order; a tree is deleted after each run (not timed). One python process (as root) measures the
four targets, all on the state disk (``--work-dir``, default /var/tmp):

- ``local``: a plain directory;
- ``overlay``: an overlayfs of an empty lower dir, upper and work dirs beside it, options
  ``index=off,metacopy=off,xino=off,redirect_dir=on`` (those of ``bb-layers``' overlay mounts);
- ``fuse``: the probe serving a directory: entries and attributes cached 1 s, keep_cache,
  readdirplus, the kernel's writeback cache;
- ``fuse-passthrough``: the probe with ``--passthrough``: opened files are read and written by
  the kernel itself (no writeback cache: the kernel does not take both).

Per target and phase: the median of the rounds' ops/s and the p95 of all op times (ms);
``<target>_<phase>_ratio`` is target ops/s / local ops/s (``small_`` keys: the 256 B files).
``passthrough_active`` is whether the fuse-passthrough probe really opened files with
passthrough (the probe counts its opens and reports them when it stops); when it could not, it
says why (``why_not_passthrough``) and served the files itself.

The probe is ``$BRANCHBOX_FUSE_PROBE``, else ``target/release/branchbox-fuse-probe`` of this
repository, else the one next to ``branchboxd`` on PATH, else ``branchbox-fuse-probe`` on PATH;
build it with ``cargo build --release -p bb-fuse-probe``. Every mount the bench makes is undone
at the end, also on Ctrl-C, SIGTERM or an error, and its directories are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .stats import stats_row, summary_tail_lines
from .store import REPO, BenchError, find_tool, quiet, sigterm_unwinds
from .volume import FILE_SETS, FILES_SCRIPT, LARGE_SET, PARALLELISM, PER_DIR, PHASES, SMALL_SET, FileStats, file_stats

__all__ = [
    "BenchError",
    "DesignsConfig",
    "DesignsResult",
    "run_designs_bench",
    "report_lines",
    "find_probe",
    "ratio",
    "probe_events",
    "SUMMARY_KEYS",
    "TARGETS",
]

#: The targets, the baseline first.
TARGETS = ("local", "overlay", "fuse", "fuse-passthrough")
#: The overlay options of a volume (``bb-layers``' ``OVERLAY_OPTIONS``).
OVERLAY_OPTIONS = "index=off,metacopy=off,xino=off,redirect_dir=on"
PROBE = "branchbox-fuse-probe"
PROBE_ENV = "BRANCHBOX_FUSE_PROBE"
BUILD_HINT = "build it with `cargo build --release -p bb-fuse-probe` (then target/release), or set %s" % PROBE_ENV
#: Seconds a probe may take to mount, and to stop.
PROBE_WAIT = 15.0
#: Seconds the file benchmark may take.
SCRIPT_TIMEOUT = 3600.0


def _key(target: str) -> str:
    return target.replace("-", "_")


SUMMARY_KEYS = tuple(
    "%s%s_%s_ratio" % (small, _key(t), ph) for small in ("", "small_") for t in TARGETS[1:] for ph in PHASES
) + (
    "passthrough_active",
    "passthrough_opens",
    "passthrough_cached_opens",
    "why_not_passthrough",
    "fuse_writeback_cache",
    "rounds",
    "state_fs",
    "kernel",
)


def ratio(stats: FileStats, label: str, target: str, phase: str) -> Optional[float]:
    """``target``'s ops/s over ``local``'s of one phase of file set ``label`` (None when either
    was not measured)."""
    targets = stats.get(label, {})
    local = targets.get("local", {}).get(phase, {}).get("ops_s")
    other = targets.get(target, {}).get(phase, {}).get("ops_s")
    return None if not local or other is None else round(other / local, 3)


def probe_events(text: str) -> Dict[str, Dict[str, Any]]:
    """The probe's JSON lines in its output ``text``, by ``event`` ("mounted", "unmounted")."""
    events: Dict[str, Dict[str, Any]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and "event" in ev:
                events[ev["event"]] = ev
    return events


def find_probe() -> str:
    """``$BRANCHBOX_FUSE_PROBE``, else ``target/release`` of the repository, else next to
    ``branchboxd`` on PATH, else PATH."""
    env = os.environ.get(PROBE_ENV)
    if env:
        if not os.access(env, os.X_OK):
            raise BenchError("bench volume-designs: %s=%s is not an executable file; %s" % (PROBE_ENV, env, BUILD_HINT))
        return env
    daemon = shutil.which("branchboxd")
    near = [os.path.join(REPO, "target", "release", PROBE)]
    if daemon:
        near.append(os.path.join(os.path.dirname(os.path.realpath(daemon)), PROBE))
    probe = find_tool(PROBE, PROBE_ENV, near)
    if not probe:
        raise BenchError("bench volume-designs: %s not found (%s, %s, next to branchboxd or on PATH); %s"
                         % (PROBE, PROBE_ENV, near[0], BUILD_HINT))
    return probe


@dataclass
class DesignsConfig:
    rounds: int = 5
    #: Where the targets' directories are made (on the state disk).
    work_dir: str = "/var/tmp"
    #: The probe binary (default: :func:`find_probe`).
    probe: Optional[str] = None


@dataclass
class DesignsResult:
    cfg: DesignsConfig
    #: :func:`branchbox_bench.volume.file_stats` of the runs: ``{set: {target: {phase: ...}}}``.
    files: FileStats = field(default_factory=dict)
    #: The probes' JSON lines by target, then by event ("mounted", "unmounted").
    probes: Dict[str, Dict[str, Dict[str, Any]]] = field(default_factory=dict)
    probe: Optional[str] = None
    state_fs: Optional[str] = None
    kernel: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    def passthrough(self) -> Dict[str, Any]:
        """Whether the fuse-passthrough target's opens were passthrough, and why not."""
        mounted = self.probes.get("fuse-passthrough", {}).get("mounted", {})
        done = self.probes.get("fuse-passthrough", {}).get("unmounted", {})
        opens, cached = done.get("passthrough_opens"), done.get("cached_opens")
        active = None if opens is None else bool(opens) and not cached and mounted.get("mode") == "passthrough"
        why = done.get("why_not_passthrough") or mounted.get("why_not_passthrough")
        return {"passthrough_active": active, "passthrough_opens": opens, "passthrough_cached_opens": cached,
                "why_not_passthrough": why}

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for small, label in (("", LARGE_SET), ("small_", SMALL_SET)):
            for target in TARGETS[1:]:
                for ph in PHASES:
                    out["%s%s_%s_ratio" % (small, _key(target), ph)] = ratio(self.files, label, target, ph)
        out.update(self.passthrough())
        out["fuse_writeback_cache"] = self.probes.get("fuse", {}).get("mounted", {}).get("writeback_cache")
        out["rounds"] = self.cfg.rounds
        out["state_fs"] = self.state_fs
        out["kernel"] = self.kernel
        out["probe"] = self.probe
        out["files"] = self.files
        out["probes"] = self.probes
        out["notes"] = list(self.notes)
        return out

    def rows(self) -> List[List[str]]:
        """Table rows: ops/s of each round, per file size ("4KiB": the 1000 files), phase and target."""
        rows = []
        for label in (LARGE_SET, SMALL_SET):
            for ph in PHASES:
                for target in TARGETS:
                    xs = self.files.get(label, {}).get(target, {}).get(ph, {}).get("ops_s_rounds")
                    if xs:
                        rows.append(stats_row("%s %s %s" % (label.split("x", 1)[1], ph, target), xs, 0))
        return rows


def report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable lines under the table, from the JSON summary."""

    def num(v: Any, spec: str, unit: str = "") -> str:
        return "-" if v is None else (spec % v) + unit

    lines = []
    for label, small in ((LARGE_SET, ""), (SMALL_SET, "small_")):
        targets = (s.get("files") or {}).get(label, {})
        for ph in PHASES:
            parts = []
            for t in TARGETS:
                st = targets.get(t, {}).get(ph, {})
                r = "" if t == "local" else ", %sx" % num(s.get("%s%s_%s_ratio" % (small, _key(t), ph)), "%.2f")
                parts.append("%s %s ops/s (p95 %s%s)" % (t, num(st.get("ops_s"), "%.0f"), num(st.get("p95_ms"), "%.3f", " ms"), r))
            lines.append("%s %s: %s" % (label, ph, "; ".join(parts)))
    active = s.get("passthrough_active")
    state = {True: "active", False: "NOT active", None: "unknown"}[active]
    why = s.get("why_not_passthrough")
    lines.append("fuse-passthrough: passthrough %s (%s opens passthrough, %s served by the probe)%s; fuse: writeback cache %s"
                 % (state, num(s.get("passthrough_opens"), "%d"), num(s.get("passthrough_cached_opens"), "%d"),
                    ": " + why if why else "", s.get("fuse_writeback_cache")))
    lines.append("state disk %s, kernel %s, %s rounds" % (s.get("state_fs"), s.get("kernel"), s.get("rounds")))
    return lines + summary_tail_lines(s)


# ----------------------------------------------------------------------------- mounts


def _mounts() -> Dict[str, str]:
    """Mount point -> filesystem type, of this process's mount namespace."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out[fields[4].replace("\\040", " ")] = fields[sep + 1]
    return out


def _fs_type(path: str) -> Optional[str]:
    """The type of the filesystem ``path`` is on (its deepest mount point)."""
    path, best = os.path.realpath(path), None
    for point, fstype in _mounts().items():
        if (path == point or path.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[0])):
            best = (point, fstype)
    return best[1] if best else None


def _umount(point: str) -> None:
    """Unmount ``point`` when mounted (lazily when busy)."""
    if point in _mounts():
        if subprocess.run(["umount", point], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True)


def _unmount_under(path: str) -> List[str]:
    """Unmount whatever is still mounted under ``path``, deepest first; what stays mounted."""
    prefix = path.rstrip("/") + "/"
    for point in sorted((p for p in _mounts() if p.startswith(prefix)), key=len, reverse=True):
        _umount(point)
    return [p for p in _mounts() if p.startswith(prefix)]


def _mount_overlay(base: str, stack: ExitStack) -> str:
    """An overlayfs as a volume is one (an empty lower dir), unmounted with ``stack``."""
    dirs = {name: os.path.join(base, name) for name in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        os.makedirs(d)
    opts = "lowerdir=%s,upperdir=%s,workdir=%s,%s" % (dirs["lower"], dirs["upper"], dirs["work"], OVERLAY_OPTIONS)
    out = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, "-o", "nodev", dirs["merged"]],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError("bench volume-designs: mounting the overlay (%s) failed: %s" % (opts, out.stderr.strip()))
    stack.callback(quiet, lambda: _umount(dirs["merged"]))
    return dirs["merged"]


class ProbeMount:
    """``branchbox-fuse-probe`` serving ``base/src`` at ``base/mnt`` until :meth:`stop`."""

    def __init__(self, binary: str, base: str, passthrough: bool) -> None:
        self.src, self.mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
        os.makedirs(self.src)
        os.makedirs(self.mnt)
        self.log_path = os.path.join(base, "probe.log")
        argv = [binary, self.src, self.mnt] + (["--passthrough"] if passthrough else [])
        with open(self.log_path, "w") as log:
            # Its own session: a Ctrl-C reaches the bench, which stops the probe after the workload.
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.events: Dict[str, Dict[str, Any]] = {}

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_mounted(self) -> None:
        deadline = time.monotonic() + PROBE_WAIT
        while True:
            self.events = probe_events(self.output())
            if "mounted" in self.events and _mounts().get(self.mnt) == "fuse":
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("bench volume-designs: %s did not mount %s (%s): %s"
                                 % (PROBE, self.mnt, "exit %s" % self.proc.returncode if self.proc.returncode is not None
                                    else "%.0f s" % PROBE_WAIT, self.output().strip()[-1500:]))
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (the probe unmounts), SIGKILL when it hangs; then no mount is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(PROBE_WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _umount(self.mnt)
        self.events = probe_events(self.output())


def run_designs_bench(cfg: DesignsConfig, progress: Callable[[str], None] = lambda m: None) -> DesignsResult:
    """Run the benchmark (see the module's docstring); what it needs is checked first."""
    if os.geteuid() != 0:
        raise BenchError("bench volume-designs mounts an overlayfs and FUSE filesystems: run it as root")
    res = DesignsResult(cfg, probe=cfg.probe or find_probe(), kernel=os.uname().release)
    os.makedirs(cfg.work_dir, exist_ok=True)
    res.state_fs = _fs_type(cfg.work_dir)
    with sigterm_unwinds(), ExitStack() as stack:
        work = os.path.realpath(tempfile.mkdtemp(prefix="bb-bench-volume-designs-", dir=cfg.work_dir))

        def remove_work() -> None:
            left = _unmount_under(work)
            if left:
                res.notes.append("still mounted, %s left in place: %s" % (work, ", ".join(left)))
            else:
                shutil.rmtree(work, ignore_errors=True)

        stack.callback(remove_work)
        roots = {"local": os.path.join(work, "local")}
        os.makedirs(roots["local"])
        progress("mounting the overlay")
        roots["overlay"] = _mount_overlay(os.path.join(work, "overlay"), stack)
        probes: Dict[str, ProbeMount] = {}
        for target, passthrough in (("fuse", False), ("fuse-passthrough", True)):
            progress("starting %s%s" % (PROBE, " --passthrough" if passthrough else ""))
            probe = ProbeMount(res.probe, os.path.join(work, target), passthrough)
            stack.callback(quiet, probe.stop)
            probe.wait_mounted()
            probes[target], roots[target] = probe, probe.mnt
        progress("file operations on %s (%d rounds)" % (", ".join(TARGETS), cfg.rounds))
        out = os.path.join(work, "runs.json")
        script_cfg = {
            "targets": [[t, roots[t]] for t in TARGETS],
            "sets": [list(s) for s in FILE_SETS],
            "rounds": cfg.rounds,
            "per_dir": PER_DIR,
            "parallelism": PARALLELISM,
            "out": out,
        }
        run = subprocess.run([sys.executable, "-c", FILES_SCRIPT, json.dumps(script_cfg)], capture_output=True,
                             text=True, timeout=SCRIPT_TIMEOUT)
        if run.returncode != 0:
            raise BenchError("bench volume-designs: the file benchmark failed (exit %s): %s"
                             % (run.returncode, (run.stderr or run.stdout).strip()[-1500:]))
        with open(out) as f:
            res.files = file_stats(json.load(f)["runs"])
        progress("stopping the probes")
        for target, probe in probes.items():
            probe.stop()
            res.probes[target] = probe.events
    return res

