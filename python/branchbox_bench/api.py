"""``branchbox bench api``: latency of the daemon API against a host baseline.

Measured in one run (``n`` samples each, after a warm-up):

- ``create``: ``Sandbox.create()`` until the first ``commands.run(["true"])`` returned
  (the sandbox is killed afterwards, outside the timed region);
- ``exec_true``: ``n * 3`` round trips of ``true`` in one sandbox;
- ``run_code``: ``run_code("1+1")`` in the sandbox's python session;
- ``files_write_4k``: ``files.write`` of 4 KiB;
- ``host_spawn_true``: ``subprocess.run(["true"])`` on the host, in-process.

The summary's ``exec_vs_host_ratio`` is ``exec_true_ms_p50 / host_spawn_true_ms_p50``.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from branchbox import Sandbox, SandboxError

from .stats import percentile, stats_rows

__all__ = ["percentile", "BenchResult", "run_api_bench", "SUMMARY_KEYS"]

SUMMARY_KEYS = (
    "create_ms_p50",
    "create_ms_p99",
    "exec_true_ms_p50",
    "exec_true_ms_p99",
    "run_code_ms_p50",
    "files_write_4k_ms_p50",
    "host_spawn_true_ms_p50",
    "exec_vs_host_ratio",
    "n",
)
METRICS = ("create", "exec_true", "run_code", "files_write_4k", "host_spawn_true")
WARMUP = 3


@dataclass
class BenchResult:
    """Raw samples in milliseconds per metric."""

    n: int
    samples: Dict[str, List[float]] = field(default_factory=dict)

    def p(self, metric: str, q: float) -> float:
        return percentile(self.samples[metric], q)

    def summary(self) -> Dict[str, Any]:
        """The JSON summary (keys :data:`SUMMARY_KEYS`), milliseconds rounded to µs."""
        exec_p50 = self.p("exec_true", 50)
        host_p50 = self.p("host_spawn_true", 50)
        out: Dict[str, Any] = {
            "create_ms_p50": self.p("create", 50),
            "create_ms_p99": self.p("create", 99),
            "exec_true_ms_p50": exec_p50,
            "exec_true_ms_p99": self.p("exec_true", 99),
            "run_code_ms_p50": self.p("run_code", 50),
            "files_write_4k_ms_p50": self.p("files_write_4k", 50),
            "host_spawn_true_ms_p50": host_p50,
            "exec_vs_host_ratio": (exec_p50 / host_p50) if host_p50 > 0 else None,
        }
        out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}
        out["n"] = self.n
        return out

    def rows(self) -> List[List[str]]:
        """Table rows: metric, samples, p50, p99, min, max (ms)."""
        return stats_rows(self.samples, METRICS, digits=3)


def _ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def _exec_true(sbx: Any) -> None:
    result = sbx.commands.run(["true"])
    if result.exit_code != 0:
        raise SandboxError(
            "bench: `true` in sandbox %s failed (exit_code=%r, signal=%r, stderr=%r)"
            % (sbx.id, result.exit_code, result.signal, (result.stderr or "")[-200:])
        )


def _run_code(sbx: Any) -> None:
    execution = sbx.run_code("1+1")
    if execution.error is not None or execution.result != "2":
        raise SandboxError("bench: run_code('1+1') returned %r (error: %s)" % (execution.result, execution.error))


def _host_true() -> None:
    subprocess.run(["true"], check=True)


def run_api_bench(
    n: int = 30,
    *,
    image: str = "base",
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    sandbox_cls: Any = None,
    progress: Optional[Callable[[str], None]] = None,
) -> BenchResult:
    """Run the benchmark against the daemon; every sandbox created is killed."""
    if n < 1:
        raise ValueError("n must be at least 1")
    say = progress or (lambda _msg: None)
    sandbox_cls = sandbox_cls or Sandbox
    res = BenchResult(n=n, samples={m: [] for m in METRICS})

    def create() -> Any:
        return sandbox_cls.create(image, daemon=daemon, token=token)

    def kill(sbx: Any) -> None:
        try:
            sbx.kill()
        finally:
            close = getattr(sbx, "close", None)
            if close is not None:
                close()

    say("warming up")
    for _ in range(WARMUP):
        _host_true()
    sbx = create()
    try:
        _exec_true(sbx)
    finally:
        kill(sbx)

    say("create + first exec (%d samples)" % n)
    for _ in range(n):
        holder: List[Any] = []
        t0 = time.perf_counter()
        try:
            holder.append(create())
            _exec_true(holder[0])
            res.samples["create"].append((time.perf_counter() - t0) * 1000.0)
        finally:
            if holder:
                kill(holder[0])

    sbx = create()
    try:
        for _ in range(WARMUP):
            _exec_true(sbx)
        say("exec `true` (%d samples)" % (n * 3))
        res.samples["exec_true"] = [_ms(lambda: _exec_true(sbx)) for _ in range(n * 3)]

        for _ in range(WARMUP):  # the first run_code starts the python session
            _run_code(sbx)
        say("run_code 1+1 (%d samples)" % n)
        res.samples["run_code"] = [_ms(lambda: _run_code(sbx)) for _ in range(n)]

        payload = os.urandom(4096)
        path = "/tmp/branchbox-bench-4k.bin"
        for _ in range(WARMUP):
            sbx.files.write(path, payload)
        say("files.write 4 KiB (%d samples)" % n)
        res.samples["files_write_4k"] = [_ms(lambda: sbx.files.write(path, payload)) for _ in range(n)]
    finally:
        kill(sbx)

    say("host spawn `true` (%d samples)" % n)
    res.samples["host_spawn_true"] = [_ms(_host_true) for _ in range(n)]
    return res
