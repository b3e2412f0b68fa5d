"""``branchbox bench SUITE``: the suites live in the ``branchbox_bench`` package (imported
when a suite runs); this prints their tables and, always last on stdout, the JSON summary."""

# No `from __future__ import annotations`: typer evaluates annotations at runtime.
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

import typer
from rich.table import Table
from rich.text import Text

from branchbox_bench.stats import summary_tail_lines

from .base import cli_errors, ctx_of, err, fail, fmt_bytes, fmt_num, out

bench_app = typer.Typer(help="Benchmarks (the last line of stdout is the JSON summary).", no_args_is_help=True)


def _report(title: str, rows: Sequence[Sequence[str]], lines: Sequence[str], summary: Dict[str, Any], as_json: bool) -> None:
    """The table and the lines under it (unless ``as_json``), then the summary: one line,
    the last one on stdout."""
    if not as_json:
        table = Table(title=title, header_style="bold")
        for col in ("metric", "samples", "p50", "p99", "min", "max"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for row in rows:
            table.add_row(*row)
        out.print(table)
        for line in lines:
            out.print(Text(line))
    sys.stdout.flush()
    print(json.dumps(summary, separators=(", ", ": ")))


@bench_app.command("api")
@cli_errors
def bench_api(
    ctx: typer.Context,
    n: int = typer.Option(30, "--n", min=1, help="Samples per metric (exec uses 3n)."),
    image: str = typer.Option("base", "--image", help="Image for the sandboxes."),
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
) -> None:
    """Measure API latencies against the running daemon and a host-spawn baseline.

    The last line of stdout is always the JSON summary.
    """
    c = ctx_of(ctx)
    from branchbox_bench import api

    with err.status("benchmarking") as status:
        result = api.run_api_bench(
            n, image=image, daemon=c.daemon, token=c.token, progress=lambda m: status.update("bench: " + m)
        )
    summary = result.summary()
    ratio = summary["exec_vs_host_ratio"]
    lines = [] if ratio is None else ["exec `true` p50 is %.1fx a host spawn of `true`" % ratio]
    _report("branchbox bench api (n=%d, ms)" % n, result.rows(), lines, summary, as_json)


def cr_report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable summary lines of a ``bench cr`` JSON summary."""
    lines = [
        "workload %s, session heap %s MiB (session RssAnon %s MiB), seed %s"
        % (s.get("workload"), fmt_num(s.get("heap_mb"), "", "%.0f"), fmt_num(s.get("heap_rss_mb"), "", "%.1f"), s.get("seed")),
        "fork n=16 until all exec'd: %s (server %s), n=64: %s (server %s), n=16 without sessions: %s"
        % (
            fmt_num(s.get("fork_n16_ms"), " ms", "%.1f"),
            fmt_num(s.get("fork_n16_server_ms"), " ms", "%.1f"),
            fmt_num(s.get("fork_n64_ms"), " ms", "%.1f"),
            fmt_num(s.get("fork_n64_server_ms"), " ms", "%.1f"),
            fmt_num(s.get("fork_n16_files_only_ms"), " ms", "%.1f"),
        ),
        "idle fork child private memory: %s" % fmt_num(s.get("child_private_mb"), " MiB", "%.1f"),
        "speedup vs copytree: checkpoint %s, rollback %s; vs commit: checkpoint %s, rollback %s"
        % tuple(
            fmt_num(s.get(k), "x", "%.1f")
            for k in (
                "ckpt_speedup_vs_copytree",
                "rollback_speedup_vs_copytree",
                "ckpt_speedup_vs_commit",
                "rollback_speedup_vs_commit",
            )
        ),
        "bytes per 10-byte edit of a 64 MiB file: state dir (%s, reflink %s) %s, XFS (reflink %s) %s"
        % (
            s.get("default_fs_type") or "?",
            s.get("default_fs_reflink_supported"),
            fmt_bytes(s.get("default_fs_bytes_per_edit")),
            s.get("xfs_reflink_supported"),
            fmt_bytes(s.get("xfs_bytes_per_edit")),
        ),
        "rollbacks with sessions restarted: %s; verifications passed: %s; test runs: %s (%s failing as expected)"
        % (s.get("rollback_sessions_restarted"), s.get("verifications"), s.get("test_runs"), s.get("failing_test_runs")),
    ]
    return lines + summary_tail_lines(s)


@bench_app.command("cr")
@cli_errors
def bench_cr(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    quick: bool = typer.Option(False, "--quick", help="Few iterations, no XFS part (CI smoke test)."),
    seed: int = typer.Option(1, "--seed", help="Seed of the scripted tree search."),
    checkpoints: Optional[int] = typer.Option(None, "--checkpoints", min=2, help="Checkpoints of the search (default 80, quick 16)."),
    image: str = typer.Option("base", "--image", help="Image for the sandboxes."),
    xfs: Optional[bool] = typer.Option(None, "--xfs/--no-xfs", help="Measure write amplification on an XFS loop device (default: on unless --quick)."),
    daemon_bin: Optional[str] = typer.Option(None, "--daemon-bin", help="branchboxd for the XFS daemon (default: the running daemon's binary)."),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="Where the workload sdist is cached."),
    workload: str = typer.Option(
        "django", "--workload", help="Project the search edits and tests: django (6,900 files) or more-itertools (38)."
    ),
    warm_children: Optional[int] = typer.Option(
        None, "--warm-children", min=0, max=32,
        help="Async-warm experiment: fork children pre-faulted, and as many not (default 4, quick 2; 0 = skip).",
    ),
) -> None:
    """Checkpoint / rollback / fork on a real workload, against copytree and commit baselines.

    The last line of stdout is always the JSON summary.
    """
    from branchbox_bench import cr

    if workload not in cr.WORKLOADS:
        raise typer.BadParameter("one of: %s" % ", ".join(cr.WORKLOADS), param_hint="--workload")
    c = ctx_of(ctx)
    cfg = cr.CrConfig.make(
        quick,
        daemon=c.daemon,
        token=c.token,
        image=image,
        seed=seed,
        checkpoints=checkpoints,
        xfs=xfs,
        daemon_bin=daemon_bin,
        cache_dir=cache_dir,
        workload=workload,
        warm_children=warm_children,
    )
    with err.status("benchmarking") as status:
        result = cr.run_cr_bench(cfg, progress=lambda m: status.update("bench cr: " + m))
    summary = result.summary()
    _report("branchbox bench cr (ms)", result.rows(), cr_report_lines(summary), summary, as_json)


@bench_app.command("start")
@cli_errors
def bench_start(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    quick: bool = typer.Option(False, "--quick", help="Few samples, 20 sandboxes instead of 200 (CI smoke test)."),
    image: str = typer.Option("base", "--image", help="Image for the pool, cold and many-sandbox parts."),
    numpy_image: str = typer.Option("py-numpy", "--numpy-image", help="Image with python3-numpy (built when missing)."),
    template: str = typer.Option("bench-start-numpy", "--template", help="Template name (built when missing, then removed)."),
    n: Optional[int] = typer.Option(None, "--n", min=1, help="Sequential pool samples (default 40, quick 10)."),
    sandboxes: Optional[int] = typer.Option(None, "--sandboxes", min=0, help="Idle sandboxes to start at once (default 200, quick 20; 0 = skip)."),
) -> None:
    """Start latency from the warm pool, cold and from a warm numpy template; idle memory; 200 sandboxes.

    The pool settings it changes are restored at the end. The last line of stdout is always
    the JSON summary.
    """
    from branchbox_bench import start as bs

    c = ctx_of(ctx)
    cfg = bs.StartConfig.make(
        quick, daemon=c.daemon, token=c.token, image=image, numpy_image=numpy_image, template=template,
        n_pool=n, sandboxes=sandboxes,
    )
    with err.status("benchmarking") as status:
        result = bs.run_start_bench(cfg, progress=lambda m: status.update("bench start: " + m))
    summary = result.summary()
    _report("branchbox bench start (ms)", result.rows(), bs.report_lines(summary), summary, as_json)


@bench_app.command("durable")
@cli_errors
def bench_durable(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    n: int = typer.Option(10, "--n", min=1, help="Samples of the evicted-template metrics."),
    heap_mb: int = typer.Option(50, "--heap-mb", min=1, help="Session heap for the template metrics and the small pause."),
    big_mb: int = typer.Option(500, "--big-mb", min=1, help="Session heap for the large pause."),
    pause_n: int = typer.Option(5, "--pause-n", min=1, help="Pause/resume cycles of the small sandbox (the large one: about half)."),
    state_dir: str = typer.Option("/var/lib/branchbox", "--state-dir", help="The daemon's state dir (CRIU's restore logs are read there)."),
) -> None:
    """Process images: rollback to an evicted template, dumps, forks with a process, pause/resume at 50 and 500 MiB.

    Needs a daemon with CRIU. The last line of stdout is always the JSON summary.
    """
    from branchbox_bench import durable

    c = ctx_of(ctx)
    with err.status("benchmarking") as status:
        result = durable.run_durable_bench(
            n=n, heap_mb=heap_mb, big_mb=big_mb, pause_n=pause_n, daemon=c.daemon, token=c.token,
            state_dir=state_dir, progress=lambda m: status.update("bench durable: " + m),
        )
    summary = result.summary()
    lines = [
        "rollback to an evicted template: %s p50 (all memory read first: %s; in memory: %s; "
        "CRIU's own restore: %s lazy, %s eager)"
        % tuple(
            fmt_num(summary.get(k), " ms", "%.1f")
            for k in (
                "restore_evicted_ms_p50",
                "restore_evicted_eager_ms_p50",
                "template_rollback_ms_p50",
                "criu_lazy_restore_ms_p50",
                "criu_plain_restore_ms_p50",
            )
        ),
        "fork(4) with a %d MiB background process: %s (without it: %s, ratio %s)"
        % (
            heap_mb,
            fmt_num(summary.get("fork4_processes_ms_p50"), " ms", "%.0f"),
            fmt_num(summary.get("fork4_sessions_ms_p50"), " ms", "%.0f"),
            fmt_num(summary.get("fork4_processes_vs_sessions_ratio"), "", "%.2f"),
        ),
        "pause / resume 500 MiB: %s / %s (cold start %s); paused sandbox holds %s"
        % (
            fmt_num(summary.get("pause_500mib_ms_p50"), " ms", "%.0f"),
            fmt_num(summary.get("resume_500mib_ms_p50"), " ms", "%.0f"),
            fmt_num(summary.get("cold_start_ms_p50"), " ms", "%.0f"),
            fmt_num(summary.get("paused_host_mb"), " MiB", "%.2f"),
        ),
    ] + summary_tail_lines(summary)
    _report("branchbox bench durable (heap %d MiB, ms)" % heap_mb, result.rows(), lines, summary, as_json)


def store_report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable summary lines of a ``bench store`` JSON summary."""
    mb_s = lambda k: fmt_num(s.get(k), " MB/s", "%.0f")  # noqa: E731
    ratio = lambda k: fmt_num(s.get(k), "", "%.2f")  # noqa: E731
    return [
        "push %s vs raw multipart upload %s (ratio %s); pull %s vs raw download %s (ratio %s); %s MiB"
        % (mb_s("push_mb_s"), mb_s("raw_put_mb_s"), ratio("push_vs_raw_ratio"), mb_s("pull_mb_s"),
           mb_s("raw_get_mb_s"), ratio("pull_vs_raw_ratio"), s.get("throughput_mb")),
        "push again (unchanged): %s worst, %s p50; first push %s (%s)"
        % (fmt_num(s.get("push_again_ms"), " ms", "%.1f"), fmt_num(s.get("push_again_ms_p50"), " ms", "%.1f"),
           fmt_num(s.get("first_push_ms"), " ms", "%.0f"), fmt_bytes(s.get("first_push_uploaded_bytes"))),
        "child snapshot with 1 MiB of files + 1 MiB of session memory changed uploads %s (%sx 2 MiB)"
        % (fmt_bytes(s.get("delta_push_bytes_p50")), ratio("delta_push_ratio")),
        "restore of a %s MiB session on a fresh daemon: %s p50 (of which pulling %s: %s), on the daemon that has "
        "it: %s (metadata: %s)"
        % (s.get("session_mb"), fmt_num(s.get("cross_daemon_restore_ms_p50"), " ms", "%.0f"),
           fmt_bytes(s.get("cross_daemon_pull_bytes")), fmt_num(s.get("cross_daemon_pull_ms_p50"), " ms", "%.0f"),
           fmt_num(s.get("local_restore_ms_p50"), " ms", "%.0f"), s.get("metadata")),
    ] + summary_tail_lines(s)


@bench_app.command("store")
@cli_errors
def bench_store(
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    n: int = typer.Option(5, "--n", min=1, help="Samples (throughput rounds, delta pushes, restores)."),
    mb: int = typer.Option(64, "--mb", min=1, help="MiB of files for the throughput part."),
    session_mb: int = typer.Option(50, "--session-mb", min=1, help="MiB of python session memory to restore."),
) -> None:
    """Durable snapshots over S3: push/pull against raw transfers, deltas, cross-daemon restores.

    Starts its own MinIO, PostgreSQL and daemons (as root; the first run builds the base image
    for its daemon A). The last line of stdout is always the JSON summary.
    """
    from branchbox_bench import store

    with err.status("benchmarking") as status:
        result = store.run_store_bench(n=n, mb=mb, session_mb=session_mb, progress=lambda m: status.update("bench store: " + m))
    summary = result.summary()
    _report("branchbox bench store (ms)", result.rows(), store_report_lines(summary), summary, as_json)


def volume_report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable summary lines of a ``bench volume`` JSON summary."""
    from branchbox_bench.volume import SHARED_HOLDERS
    ratio = lambda k: fmt_num(s.get(k), "", "%.2f")  # noqa: E731
    lines = []
    for backend, sets in (s.get("files") or {}).items():
        for label, targets in sets.items():
            local, vol = targets.get("local", {}), targets.get("volume", {})
            parts = [
                "%s %s vs %s ops/s, p95 %s vs %s"
                % (
                    phase,
                    fmt_num(vol.get(phase, {}).get("ops_s"), "", "%.0f"),
                    fmt_num(local.get(phase, {}).get("ops_s"), "", "%.0f"),
                    fmt_num(vol.get(phase, {}).get("p95_ms"), " ms", "%.3f"),
                    fmt_num(local.get(phase, {}).get("p95_ms"), " ms", "%.3f"),
                )
                for phase in ("write", "read", "liststat")
            ]
            lines.append("%s, %s, volume vs sandbox disk: %s" % (backend, label, "; ".join(parts)))
    lines += [
        "ratios volume/local, 4 KiB files: write %s, read %s, list+stat %s (MinIO store: %s, %s, %s); "
        "256 B: %s, %s, %s (MinIO: %s, %s, %s)"
        % tuple(
            ratio(small + s3 + phase + "_ratio")
            for small in ("", "small_")
            for s3 in ("", "s3_")
            for phase in ("write", "read", "liststat")
        ),
        "snapshot p50 %s (1k files), %s (100k); fork p50 %s (1k), %s (100k): fork size ratio %s"
        % (
            fmt_num(s.get("snapshot_ms_p50_1k"), " ms", "%.1f"),
            fmt_num(s.get("snapshot_ms_p50_100k"), " ms", "%.1f"),
            fmt_num(s.get("fork_ms_p50_1k"), " ms", "%.1f"),
            fmt_num(s.get("fork_ms_p50_100k"), " ms", "%.1f"),
            ratio("fork_size_ratio"),
        ),
        "snapshot p50 of an rwx volume mounted by 1 sandbox %s, by %d %s: ratio %s"
        % (
            fmt_num(s.get("shared_snapshot_ms_p50_1"), " ms", "%.1f"),
            SHARED_HOLDERS,
            fmt_num(s.get("shared_snapshot_ms_p50_%d" % SHARED_HOLDERS), " ms", "%.1f"),
            ratio("shared_snapshot_ratio"),
        ),
        "sync %s vs raw multipart upload %s (ratio %s), %s MiB of new files"
        % (
            fmt_num(s.get("sync_mb_s"), " MB/s", "%.0f"),
            fmt_num(s.get("raw_mb_s"), " MB/s", "%.0f"),
            ratio("sync_vs_raw_ratio"),
            s.get("sync_mb"),
        ),
    ]
    return lines + summary_tail_lines(s)


@bench_app.command("volume")
@cli_errors
def bench_volume(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Rounds of the file benchmark and of the sync."),
    samples: int = typer.Option(7, "--samples", min=1, help="Snapshots and forks timed per volume size."),
    sync_mb: int = typer.Option(64, "--sync-mb", min=1, help="MiB of new files each sync uploads."),
    image: str = typer.Option("base", "--image", help="Image for the sandboxes."),
    s3: bool = typer.Option(True, "--s3/--no-s3", help="Also measure on a daemon with a MinIO store (started here, as root)."),
) -> None:
    """Volumes against the sandbox's own disk (files), snapshots and forks by volume size, sync against a raw upload.

    Uses the running daemon (its local-directory store) and starts MinIO and a daemon on it (as
    root; the first run builds that daemon's base image). The last line of stdout is always the
    JSON summary.
    """
    from branchbox_bench import volume

    c = ctx_of(ctx)
    cfg = volume.VolumeConfig(
        daemon=c.daemon, token=c.token, image=image, rounds=rounds, samples=samples, sync_mb=sync_mb, s3=s3
    )
    with err.status("benchmarking") as status:
        result = volume.run_volume_bench(cfg, progress=lambda m: status.update("bench volume: " + m))
    summary = result.summary()
    _report("branchbox bench volume (ms)", result.rows(), volume_report_lines(summary), summary, as_json)


@bench_app.command("volume-designs")
@cli_errors
def bench_volume_designs(
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Rounds of the file benchmark (the targets' order alternates)."),
    work_dir: str = typer.Option("/var/tmp", "--work-dir", help="Where the targets' directories are made (the state disk)."),
) -> None:
    """Volume designs on the host: a plain dir, overlayfs (a), a FUSE probe (b), and (b) with FUSE passthrough.

    Runs as root; needs branchbox-fuse-probe ($BRANCHBOX_FUSE_PROBE, else target/release of the
    repository, else next to branchboxd or on PATH; build it with `cargo build --release -p
    bb-fuse-probe`). The last line of stdout is always the JSON summary.
    """
    from branchbox_bench import volume_designs as vd

    cfg = vd.DesignsConfig(rounds=rounds, work_dir=work_dir)
    with err.status("benchmarking") as status:
        result = vd.run_designs_bench(cfg, progress=lambda m: status.update("bench volume-designs: " + m))
    summary = result.summary()
    _report("branchbox bench volume-designs (ops/s per round)", result.rows(), vd.report_lines(summary), summary, as_json)


def net_report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable summary lines of a ``bench net`` JSON summary."""
    ms = lambda k: fmt_num(s.get(k), " ms", "%.1f")  # noqa: E731
    ratio = lambda k: fmt_num(s.get(k), "", "%.2f")  # noqa: E731
    rtt = s.get("http_rtt_ms") or {}
    p99 = lambda side: fmt_num((rtt.get(side) or {}).get("p99"), " ms", "%.3f")  # noqa: E731
    lines = [
        "create p50: allowlist %s (names only %s) vs none %s; with the first request %s vs a first command"
        " without network %s"
        % (ms("create_allowlist_ms_p50"), ms("create_allowlist_names_ms_p50"), ms("create_none_ms_p50"),
           ms("create_allowlist_first_request_ms_p50"), ms("create_none_first_command_ms_p50")),
        "fork(16) until every child made one request: allowlist %s vs none %s (without requests)"
        % (ms("fork16_allowlist_ms"), ms("fork16_none_ms")),
        "HTTP round trip to %s p50: sandbox %s vs host %s (ratio %s); p99 %s vs %s"
        % (s.get("upstream"), fmt_num(s.get("http_rtt_ms_p50"), " ms", "%.3f"),
           fmt_num(s.get("host_http_rtt_ms_p50"), " ms", "%.3f"), ratio("http_rtt_vs_host_ratio"),
           p99("sandbox"), p99("host")),
        "download of %s MiB: sandbox %s vs host %s (ratio %s)"
        % (s.get("throughput_mb"), fmt_num(s.get("throughput_mb_s"), " MB/s", "%.0f"),
           fmt_num(s.get("host_throughput_mb_s"), " MB/s", "%.0f"), ratio("throughput_vs_host_ratio")),
        "checkpoint of an idle allowlist sandbox p50: %s; with a request in flight through the proxy: %s (%s vs idle)"
        % (ms("ckpt_ms_p50"), ms("ckpt_during_inflight_ms_p50"),
           fmt_num(s.get("ckpt_inflight_vs_idle_ms"), " ms", "%+.1f")),
        "checkpoint of the proxied sandbox p50, its process before its request: %s; with the request in flight: %s "
        "(%s vs the same process before its request)"
        % (ms("ckpt_same_process_idle_ms_p50"), ms("ckpt_during_inflight_ms_p50"),
           fmt_num(s.get("ckpt_inflight_vs_same_process_idle_ms"), " ms", "%+.1f")),
    ]
    return lines + summary_tail_lines(s)


@bench_app.command("net")
@cli_errors
def bench_net(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    samples: int = typer.Option(15, "--samples", min=1, help="Creates of each network mode (checkpoints: as many, 10 at most)."),
    image: str = typer.Option("base", "--image", help="Image for the sandboxes."),
) -> None:
    """Network modes: create and fork in allowlist against none, HTTP round trips and a download against the host.

    Also checkpoints with a request in flight through a sandbox's proxy. Uses the running daemon
    (which needs --net-bridge, and --net-dns 198.18.0.1:53 for the proxy's upstream name); brings
    up its own upstream servers in a network namespace (as root). The last line of stdout is
    always the JSON summary.
    """
    from branchbox_bench import net

    c = ctx_of(ctx)
    cfg = net.NetConfig(
        daemon=c.daemon, token=c.token, image=image, samples=samples, ckpt_samples=min(samples, net.NetConfig.ckpt_samples)
    )
    with err.status("benchmarking") as status:
        result = net.run_net_bench(cfg, progress=lambda m: status.update("bench net: " + m))
    summary = result.summary()
    _report("branchbox bench net (ms)", result.rows(), net_report_lines(summary), summary, as_json)


def e2b_report_lines(s: Dict[str, Any]) -> List[str]:
    """Human-readable summary lines of a ``bench e2b`` JSON summary."""
    ms = lambda k: fmt_num(s.get(k), " ms", "%.2f")  # noqa: E731
    ratio = lambda k: fmt_num(s.get(k), "", "%.2f")  # noqa: E731
    pool = s.get("pool") or {}
    hits = lambda side: "%s/%s" % (  # noqa: E731
        (pool.get(side) or {}).get("hits", "-"),
        sum((pool.get(side) or {}).values()) if pool.get(side) else "-",
    )
    lines = [
        "E2B endpoint %s (E2B SDK) vs branchbox's SDK on the same daemon; ratio = E2B / branchbox" % s.get("e2b_url"),
        "create p50: E2B %s vs branchbox %s (ratio %s); warm pool hits: E2B %s, branchbox %s"
        % (ms("e2b_create_ms_p50"), ms("bb_create_ms_p50"), ratio("e2b_overhead_ratio_create"), hits("e2b"), hits("bb")),
        "commands.run(\"true\") p50: E2B %s vs branchbox %s (ratio %s); branchbox running E2B's argv "
        "(/bin/bash -l -c true) %s (ratio %s)"
        % (ms("e2b_run_true_ms_p50"), ms("bb_run_true_ms_p50"), ratio("e2b_overhead_ratio_run"),
           ms("bb_run_bash_login_true_ms_p50"), ratio("e2b_overhead_ratio_run_same_argv")),
        "run_code(\"1+1\") p50: E2B code interpreter %s vs branchbox %s (ratio %s)"
        % (ms("e2b_run_code_ms_p50"), ms("bb_run_code_ms_p50"), ratio("e2b_overhead_ratio_run_code")),
        "the endpoint without the E2B SDK (bare HTTP, the SDK's requests): create %s (ratio %s), run %s (ratio %s), "
        "run_code %s (ratio %s); the E2B SDK's own work: create %s, run %s, run_code %s"
        % (ms("e2b_http_create_ms_p50"), ratio("e2b_endpoint_overhead_ratio_create"), ms("e2b_http_run_true_ms_p50"),
           ratio("e2b_endpoint_overhead_ratio_run"), ms("e2b_http_run_code_ms_p50"),
           ratio("e2b_endpoint_overhead_ratio_run_code"), ms("e2b_sdk_client_ms_create"), ms("e2b_sdk_client_ms_run"),
           ms("e2b_sdk_client_ms_run_code")),
        "fork(%s), median of %s: E2B %s vs branchbox %s (ratio %s)"
        % (s.get("fork_n"), s.get("fork_reps"), ms("e2b_fork16_ms"), ms("bb_fork16_ms"), ratio("e2b_overhead_ratio_fork16")),
        "E2B cloud create %s (documented by E2B, not measured) / E2B endpoint create p50 %s: %s faster"
        % (fmt_num(s.get("e2b_cloud_create_ms"), " ms", "%.0f"), ms("e2b_create_ms_p50"),
           fmt_num(s.get("e2b_vs_cloud_create_speedup"), "x", "%.1f")),
    ]
    return lines + summary_tail_lines(s)


@bench_app.command("e2b")
@cli_errors
def bench_e2b(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Only print the JSON summary line."),
    samples: int = typer.Option(15, "--samples", min=1, help="Samples of create, run and run_code, per side."),
    fork_reps: int = typer.Option(3, "--fork-reps", min=1, help="fork(16)s per side (the median is reported)."),
    image: str = typer.Option("base", "--image", help="Image (E2B template id) of every sandbox."),
    e2b_url: str = typer.Option(
        "http://127.0.0.1:49999", "--e2b-url", envvar="BRANCHBOX_E2B_URL",
        help="The daemon's E2B endpoint (its --e2b-listen address).",
    ),
    e2b_api_key: Optional[str] = typer.Option(
        None, "--e2b-api-key", envvar="BRANCHBOX_TOKEN", show_default=False,
        help="The E2B API key: the daemon's --token (default: --token).",
    ),
) -> None:
    """branchbox's E2B-compatible endpoint, driven by E2B's SDKs, against branchbox's own SDK.

    create, commands.run("true"), run_code("1+1") and fork(16), the two sides interleaved in one
    process on the same daemon (--daemon and --e2b-url must name the same one). Needs the `e2b`
    and `e2b-code-interpreter` packages. The last line of stdout is always the JSON summary.
    """
    c = ctx_of(ctx)
    key = e2b_api_key or c.token
    if not key:
        raise fail(
            "bench e2b: no API key for the E2B endpoint: pass the daemon's token as --e2b-api-key "
            "(or set BRANCHBOX_TOKEN)"
        )
    from branchbox_bench import e2b as be

    cfg = be.E2bConfig(
        e2b_url=e2b_url, e2b_api_key=key, daemon=c.daemon, token=c.token, image=image, samples=samples,
        fork_reps=fork_reps,
    )
    with err.status("benchmarking") as status:
        result = be.run_e2b_bench(cfg, progress=lambda m: status.update("bench e2b: " + m))
    summary = result.summary()
    _report("branchbox bench e2b (ms)", result.rows(), e2b_report_lines(summary), summary, as_json)
