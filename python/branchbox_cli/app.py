"""The ``branchbox`` command line (typer + rich).

Errors print one red line on stderr and exit 1; set ``BRANCHBOX_DEBUG=1`` for tracebacks.
"""

# No `from __future__ import annotations`: typer evaluates these annotations at runtime
# and must work on Python 3.9.
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import typer
from rich.console import Group
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from branchbox import (
    ImageProgress,
    Images,
    NetworkInfo,
    Pool,
    PoolStats,
    RollbackResult,
    Sandbox,
    SandboxError,
    SnapshotInfo,
    Snapshots,
    TemplateInfo,
    Templates,
)
from branchbox import _core
from branchbox._transport import DEFAULT_SOCKET
from branchbox.sandbox_sync import health

from .base import Ctx, cli_errors, connected, ctx_of, err, fail, fmt_bytes, fmt_duration, fmt_num, out, print_json
from .bench import bench_app
from .files import files_app
from .volumes import VOLUME_FLAG, parse_volume_flags, volume_app, volume_flag

DEFAULT_STATE_DIR = "/var/lib/branchbox"
DEFAULT_PIDFILE = "/run/branchbox/branchboxd.pid"
DAEMON_BIN_ENV = "BRANCHBOX_DAEMON_BIN"

app = typer.Typer(
    name="branchbox",
    help="branchbox: sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
daemon_app = typer.Typer(help="Run the local branchboxd daemon.", no_args_is_help=True)
sandbox_app = typer.Typer(help="Create, inspect and use sandboxes.", no_args_is_help=True)
image_app = typer.Typer(help="Manage root filesystem images.", no_args_is_help=True)
snapshot_app = typer.Typer(help="Inspect and clean up sandbox snapshots.", no_args_is_help=True)
template_app = typer.Typer(help="Build and manage warm templates (sandboxes pre-built from a recipe).", no_args_is_help=True)
pool_app = typer.Typer(help="The warm pool: sandboxes kept ready per image.", no_args_is_help=True)
store_app = typer.Typer(help="The object store of pushed snapshots.", no_args_is_help=True)
app.add_typer(daemon_app, name="daemon")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(image_app, name="image")
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(template_app, name="template")
app.add_typer(pool_app, name="pool")
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
app.add_typer(files_app, name="files")
app.add_typer(volume_app, name="volume")


def parse_env(items: Optional[List[str]], what: str = "--env") -> Dict[str, str]:
    """``["K=V", ...]`` -> ``{"K": "V"}`` (the value may contain ``=``; it may be empty)."""
    env: Dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter("expected KEY=VALUE, got %r" % item, param_hint=what)
        env[key] = value
    return env


#: ``--network``'s help: the modes.
NETWORK_HELP = (
    "Network mode: none (loopback only), allowlist (only what --allow lists) or open (anything but the host, "
    "the daemon, other sandboxes and link-local/metadata addresses, unless listed)."
)
#: ``--allow``'s help: the entries.
ALLOW_HELP = (
    "What the sandbox may reach (repeatable): a name (api.example.com), a wildcard (*.example.org), an IPv4 "
    "address or CIDR (10.0.0.0/8), each with an optional :PORT or :LOW-HIGH."
)


def parse_network(mode: Optional[str], what: str = "--network") -> Optional[str]:
    """``mode`` if it is a network mode (or None), else a usage error."""
    if mode is not None and mode not in _core.NETWORK_MODES:
        raise typer.BadParameter(
            "%r is not a network mode: use %s" % (mode, ", ".join(_core.NETWORK_MODES)), param_hint=what
        )
    return mode


def parse_allow(allow: Optional[List[str]], clear: bool = False) -> Optional[List[str]]:
    """The ``--allow`` entries (None: not given), or ``[]`` with ``--clear-allow``."""
    if clear:
        if allow:
            raise typer.BadParameter("give --allow or --clear-allow, not both", param_hint="--clear-allow")
        return []
    return list(allow) if allow else None


#: ``--max-connections``' help.
MAX_CONNECTIONS_HELP = (
    "Most TCP connections the sandbox may have open at once through eth0 (a new one past it is reset) and, "
    "counted apart, through its proxy (%d..%d)." % _core.MAX_CONNECTIONS
)
#: ``--bandwidth-mbps``' help.
BANDWIDTH_HELP = "Bandwidth each way on eth0, megabits per second (%g..%g; modes allowlist and open)." % _core.BANDWIDTH_MBPS


def max_connections_option(help_prefix: str = "") -> Any:
    lo, hi = _core.MAX_CONNECTIONS
    return typer.Option(None, "--max-connections", metavar="N", min=lo, max=hi, help=help_prefix + MAX_CONNECTIONS_HELP)


def bandwidth_option(help_prefix: str = "") -> Any:
    lo, hi = _core.BANDWIDTH_MBPS
    return typer.Option(None, "--bandwidth-mbps", metavar="MBPS", min=lo, max=hi, help=help_prefix + BANDWIDTH_HELP)


def parse_limits(
    max_connections: Optional[int], bandwidth_mbps: Optional[float], clear: bool = False
) -> Optional[Dict[str, Any]]:
    """The ``--max-connections``/``--bandwidth-mbps`` limits (None: neither given), or ``{}`` with
    ``--clear-limits``."""
    given = max_connections is not None or bandwidth_mbps is not None
    if clear:
        if given:
            raise typer.BadParameter(
                "give --max-connections/--bandwidth-mbps or --clear-limits, not both", param_hint="--clear-limits"
            )
        return {}
    if not given:
        return None
    return {k: v for k, v in (("max_connections", max_connections), ("bandwidth_mbps", bandwidth_mbps)) if v is not None}


def exit_code_of(result: Any) -> int:
    """Shell-style exit status of a CommandResult (124 for a timeout, 128+N for signal N)."""
    if result.timed_out:
        return 124
    if result.exit_code is not None:
        return int(result.exit_code)
    if result.signal:
        return 128 + int(result.signal)
    return 1


@app.callback()
def _root(
    ctx: typer.Context,
    daemon: Optional[str] = typer.Option(
        None, "--daemon", envvar="BRANCHBOX_URL", help="Daemon address: unix:///path.sock or http://host:port."
    ),
    token: Optional[str] = typer.Option(
        None, "--token", envvar="BRANCHBOX_TOKEN", help="Bearer token (TCP listeners).", show_default=False
    ),
) -> None:
    ctx.obj = Ctx(daemon=daemon, token=token)


# ----------------------------------------------------------------------------- daemon


def _daemon_bin() -> str:
    path = os.environ.get(DAEMON_BIN_ENV)
    if path:
        if not os.access(path, os.X_OK):
            raise fail("%s=%s is not an executable file" % (DAEMON_BIN_ENV, path))
        return path
    found = shutil.which("branchboxd")
    if not found:
        raise fail("branchboxd not found on PATH: install it or set %s=/path/to/branchboxd" % DAEMON_BIN_ENV)
    return found


def read_pidfile(pidfile: str) -> Optional[int]:
    try:
        with open(pidfile) as f:
            return int(f.read().strip() or "0") or None
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _looks_like_daemon(pid: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return True  # cannot tell: trust the pidfile
    names = {b"branchboxd"}
    if os.environ.get(DAEMON_BIN_ENV):
        names.add(os.path.basename(os.environ[DAEMON_BIN_ENV]).encode())
    return any(os.path.basename(a) in names for a in argv[:2])


def _log_tail(path: str, offset: int = 0, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            start = max(offset, end - 16384)
            f.seek(start)
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _health_ok(url: str, timeout: float = 2.0) -> Optional[Dict[str, Any]]:
    try:
        return health(daemon=url, request_timeout=timeout)
    except SandboxError:
        return None


@daemon_app.command("start")
@cli_errors
def daemon_start(
    state_dir: str = typer.Option(DEFAULT_STATE_DIR, "--state-dir", help="Daemon state directory."),
    socket_path: str = typer.Option(DEFAULT_SOCKET, "--socket", help="Unix socket to listen on."),
    pidfile: str = typer.Option(DEFAULT_PIDFILE, "--pidfile", help="Where to record the daemon pid."),
    wait: float = typer.Option(30.0, "--wait", help="Seconds to wait for /v1/health."),
    extra: Optional[List[str]] = typer.Argument(None, help="Extra branchboxd arguments (after --)."),
) -> None:
    """Start branchboxd in the background and wait until it is healthy."""
    binary = _daemon_bin()
    url = "unix://" + os.path.abspath(socket_path)
    pid = read_pidfile(pidfile)
    if pid and pid_alive(pid) and _looks_like_daemon(pid):
        info = _health_ok(url)
        if info is not None:
            out.print("branchboxd already running (pid %d, %s)" % (pid, url))
            return
        raise fail("branchboxd (pid %d from %s) is running but %s is not healthy" % (pid, pidfile, url))
    info = _health_ok(url, timeout=1.0)
    if info is not None:
        out.print("a branchboxd %s is already answering on %s" % (info.get("version", "?"), url))
        return
    state_dir = os.path.abspath(state_dir)
    for d in (state_dir, os.path.dirname(os.path.abspath(socket_path)), os.path.dirname(os.path.abspath(pidfile))):
        os.makedirs(d, exist_ok=True)
    log_path = os.path.join(state_dir, "branchboxd.log")
    argv = [binary, "--state-dir", state_dir, "--socket", os.path.abspath(socket_path)] + list(extra or [])
    with open(log_path, "ab") as log:
        offset = log.tell()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd="/",
        )
    tmp = pidfile + ".tmp"
    with open(tmp, "w") as f:
        f.write("%d\n" % proc.pid)
    os.replace(tmp, pidfile)

    deadline = time.monotonic() + wait
    info = None
    rc = None
    with err.status("waiting for branchboxd (pid %d) on %s" % (proc.pid, url)):
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc is not None:
                break
            info = _health_ok(url, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            if info is not None:
                break
            time.sleep(0.1)
    if info is not None:
        out.print(
            "branchboxd %s started (pid %d, %s, log %s)" % (info.get("version", "?"), proc.pid, url, log_path)
        )
        return
    if rc is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        why = "did not answer GET /v1/health within %gs (stopped it)" % wait
    else:
        why = "exited with code %d" % rc
    try:
        os.unlink(pidfile)
    except OSError:
        pass
    tail = _log_tail(log_path, offset)
    err.print(Text("error: branchboxd %s; log: %s" % (why, log_path), style="red"))
    if tail:
        err.print(Text(tail))
    raise typer.Exit(1)


@daemon_app.command("stop")
@cli_errors
def daemon_stop(
    pidfile: str = typer.Option(DEFAULT_PIDFILE, "--pidfile", help="The daemon's pidfile."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the daemon to exit."),
    force: bool = typer.Option(False, "--force", help="SIGKILL it if it does not exit in time."),
) -> None:
    """Stop branchboxd (SIGTERM via the pidfile, then wait)."""
    pid = read_pidfile(pidfile)
    if pid is None:
        out.print("branchboxd is not running (no pidfile at %s)" % pidfile)
        return
    if not pid_alive(pid):
        os.unlink(pidfile)
        out.print("branchboxd is not running (removed stale pidfile for pid %d)" % pid)
        return
    if not _looks_like_daemon(pid):
        raise fail("pid %d from %s is not branchboxd (stale pidfile?); not signalling it" % (pid, pidfile))
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        if not force:
            raise fail("branchboxd (pid %d) still running after %gs; retry with --force" % (pid, timeout))
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.05)
    try:
        os.unlink(pidfile)
    except OSError:
        pass
    out.print("branchboxd stopped (pid %d)" % pid)


@daemon_app.command("status")
@cli_errors
def daemon_status(ctx: typer.Context) -> None:
    """Print the daemon's health JSON (exit 1 if it cannot be reached)."""
    c = ctx_of(ctx)
    print_json(health(daemon=c.daemon, token=c.token))


# ----------------------------------------------------------------------------- sandbox


@sandbox_app.command("create")
@cli_errors
def sandbox_create(
    ctx: typer.Context,
    image: Optional[str] = typer.Option(None, "--image", help="Image name (default base, or the template's)."),
    template: Optional[str] = typer.Option(None, "--template", "-t", help="Start as a live fork of this template (`template ls`)."),
    snapshot: Optional[str] = typer.Option(
        None, "--snapshot", "-s", help="Start from this snapshot (local, or pushed by any daemon: pulled first)."
    ),
    memory_mb: Optional[int] = typer.Option(None, "--memory-mb", help="Memory limit (MiB)."),
    cpu: Optional[float] = typer.Option(None, "--cpu", help="CPU limit (cores)."),
    pids: Optional[int] = typer.Option(None, "--pids", help="Max number of processes."),
    timeout: float = typer.Option(300, "--timeout", help="Time to live in seconds (0 = none)."),
    env: Optional[List[str]] = typer.Option(None, "--env", "-e", help="KEY=VALUE (repeatable)."),
    cwd: Optional[str] = typer.Option(None, "--cwd", help="Working directory."),
    metadata: Optional[List[str]] = typer.Option(None, "--metadata", "-m", help="KEY=VALUE (repeatable)."),
    volume: Optional[List[str]] = typer.Option(
        None, "--volume", "-v",
        help="Mount a volume (id or name): %s (repeatable; ro: read-only, nobranch: not snapshotted, rolled "
        "back or forked with the sandbox)." % VOLUME_FLAG,
    ),
    network: Optional[str] = typer.Option(
        None, "--network", metavar="MODE",
        help=NETWORK_HELP + " Default none (with --snapshot or --template: the snapshot's or template's).",
    ),
    allow: Optional[List[str]] = typer.Option(None, "--allow", metavar="ENTRY", help=ALLOW_HELP),
    proxy: bool = typer.Option(
        False, "--proxy",
        help="Give the sandbox the daemon's HTTP(S) proxy (http://127.0.0.1:3128 inside, in HTTP_PROXY/HTTPS_PROXY): "
        "it lets through what --allow lists (with --network open also any public destination), in every mode "
        "(with none it is the only way out).",
    ),
    proxy_record: bool = typer.Option(
        False, "--proxy-record",
        help="Record the proxy's answers (plain HTTP): after a rollback, in fork children and in sandboxes made from "
        "a snapshot the same requests get the same answers. Needs --proxy.",
    ),
    max_connections: Optional[int] = max_connections_option(),
    bandwidth_mbps: Optional[float] = bandwidth_option(),
    sudo: bool = typer.Option(
        False, "--sudo",
        help="Let commands run as another user (--user user) use sudo and other setuid programs: root of the "
        "sandbox's user namespace, never of the host (with --snapshot or --template: theirs unless given).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the SandboxInfo JSON."),
) -> None:
    """Create a sandbox and print its id."""
    c = ctx_of(ctx)
    network = parse_network(network)
    net_limits = parse_limits(max_connections, bandwidth_mbps)
    sbx = Sandbox.create(
        image,
        cpu=cpu,
        memory_mb=memory_mb,
        pids=pids,
        env=parse_env(env) or None,
        cwd=cwd,
        timeout=timeout,
        metadata=parse_env(metadata, "--metadata") or None,
        template=template,
        snapshot=snapshot,
        volumes=parse_volume_flags(volume) or None,
        network=network,
        allow=parse_allow(allow),
        proxy=proxy,
        proxy_record=True if proxy_record else None,
        net_limits=net_limits,
        sudo=True if sudo else None,
        **c.sdk(),
    )
    sbx.close()
    if as_json:
        info = sbx._info
        print_json(info.raw if info is not None and info.raw else {"id": sbx.id})
    else:
        out.print(sbx.id)


@sandbox_app.command(
    "exec", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True}
)
@cli_errors
def sandbox_exec(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    cmd: List[str] = typer.Argument(..., metavar="-- CMD...", help="One argument runs via /bin/sh -c; several run as argv."),
    cwd: Optional[str] = typer.Option(None, "--cwd", help="Working directory."),
    env: Optional[List[str]] = typer.Option(None, "--env", "-e", help="KEY=VALUE (repeatable)."),
    timeout: float = typer.Option(600, "--timeout", help="Kill the command after this many seconds."),
    stdin: bool = typer.Option(False, "--stdin", "-i", help="Forward this process's stdin."),
    user: Optional[str] = typer.Option(
        None, "--user", "-u", help="Run as this user of the sandbox (e.g. user; its home is the default cwd). Default root."
    ),
) -> None:
    """Run a command, streaming its output; exits with the command's exit code."""
    c = ctx_of(ctx)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise typer.BadParameter("missing command", param_hint="CMD")
    data = sys.stdin.buffer.read() if stdin else None
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())

    def write(stream: Any) -> Callable[[str], None]:
        def cb(chunk: str) -> None:
            stream.write(chunk)
            stream.flush()

        return cb

    try:
        result = sbx.commands.run(
            cmd[0] if len(cmd) == 1 else cmd,
            cwd=cwd,
            env=parse_env(env) or None,
            timeout=timeout,
            stdin=data,
            user=user,
            on_stdout=write(sys.stdout),
            on_stderr=write(sys.stderr),
        )
    finally:
        sbx.close()
    if result.timed_out:
        err.print(Text("command timed out after %gs" % timeout, style="yellow"))
    raise typer.Exit(exit_code_of(result))


@sandbox_app.command("ls")
@cli_errors
def sandbox_ls(
    ctx: typer.Context,
    metadata: Optional[List[str]] = typer.Option(None, "--metadata", "-m", help="Filter KEY=VALUE."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List sandboxes."""
    c = ctx_of(ctx)
    infos = Sandbox.list(metadata=parse_env(metadata, "--metadata") or None, **c.sdk())
    if as_json:
        print_json([i.raw for i in infos])
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    table.add_column("ID", no_wrap=True, min_width=max([len(i.id) for i in infos] + [2]))
    for col in ("IMAGE", "STATE", "CPU", "MEMORY", "AGE", "EXPIRES"):
        table.add_column(col, no_wrap=True)
    for i in infos:
        state = i.state + (" (oom)" if i.oom_killed else "")
        table.add_row(
            i.id,
            i.image,
            Text(state, style={"running": "green", "paused": "yellow"}.get(i.state, "red")),
            "-" if i.cpu is None else "%g" % i.cpu,
            "-" if i.memory_mb is None else "%d MiB" % i.memory_mb,
            fmt_duration(now - i.created_at) if i.created_at else "-",
            ("in " + fmt_duration(i.expires_at - now)) if i.expires_at else "never",
        )
    out.print(table)


@sandbox_app.command("info")
@cli_errors
def sandbox_info(ctx: typer.Context, sandbox_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Print a sandbox's SandboxInfo JSON."""
    c = ctx_of(ctx)
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())
    sbx.close()
    info = sbx._info
    print_json(info.raw if info is not None else {"id": sandbox_id})


@sandbox_app.command("kill")
@cli_errors
def sandbox_kill(ctx: typer.Context, sandbox_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Kill a sandbox."""
    c = ctx_of(ctx)
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())
    try:
        if not sbx.kill():
            raise fail("sandbox %s not found" % sandbox_id)
    finally:
        sbx.close()
    out.print("killed %s" % sandbox_id)


@sandbox_app.command("pause")
@cli_errors
def sandbox_pause(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    files_only: bool = typer.Option(
        False, "--files-only", help="Keep the files only: every process ends, and the resume is a cold boot."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the PauseResult JSON."),
) -> None:
    """Pause a sandbox: its processes go to disk and free their memory; `resume` brings them back."""
    with connected(ctx, sandbox_id) as sbx:
        r = sbx.pause(mode="filesystem" if files_only else "full")
    if as_json:
        print_json(r.raw)
        return
    out.print(
        "paused %s: %d process tree(s), %d session(s), %s of process images, %s"
        % (sandbox_id, r.processes, r.sessions, fmt_bytes(r.image_bytes), fmt_num(r.took_ms, " ms", "%.0f"))
    )


@sandbox_app.command("resume")
@cli_errors
def sandbox_resume(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="New time to live in seconds (0 = none; default: the sandbox's own)."),
    reboot: bool = typer.Option(False, "--reboot", help="Cold-boot it (files only, a new boot id) instead of restoring its processes."),
    as_json: bool = typer.Option(False, "--json", help="Print the ResumeResult JSON."),
) -> None:
    """Resume a paused sandbox: its processes come back under their pids, with their sessions."""
    with connected(ctx, sandbox_id) as sbx:
        r = sbx.resume(timeout=timeout, reboot=reboot)
    if as_json:
        print_json(r.raw)
        return
    out.print(
        "%s %s: %d process tree(s), %d session(s), %s"
        % ("rebooted" if r.rebooted else "resumed", sandbox_id, r.processes, r.sessions, fmt_num(r.took_ms, " ms", "%.0f"))
    )


@sandbox_app.command("run-code")
@cli_errors
def sandbox_run_code(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    code: str = typer.Argument(..., help="Python code ('-' reads it from stdin)."),
    timeout: float = typer.Option(60, "--timeout", help="Seconds before the run is killed."),
) -> None:
    """Run python code in the sandbox's default session; prints output and the result."""
    c = ctx_of(ctx)
    if code == "-":
        code = sys.stdin.read()
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())
    try:
        ex = sbx.run_code(code, timeout=timeout)
    finally:
        sbx.close()
    if ex.stdout:
        sys.stdout.write(ex.stdout)
        sys.stdout.flush()
    if ex.stderr:
        sys.stderr.write(ex.stderr)
        sys.stderr.flush()
    if ex.result is not None:
        out.print(Text(ex.result))
    if ex.timed_out:
        raise fail("run timed out after %gs (the session was killed)" % timeout)
    if ex.error is not None:
        err.print(Text((ex.error.traceback or str(ex.error)).rstrip("\n"), style="red"))
        raise typer.Exit(1)


@sandbox_app.command("checkpoint")
@cli_errors
def sandbox_checkpoint(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    label: Optional[str] = typer.Option(None, "--label", "-l", help="Label shown in `snapshot ls`."),
    processes: str = typer.Option(
        "sessions",
        "--processes",
        help='"sessions"; "all": background processes too (CRIU); "keepable": those of them CRIU can keep; '
        '"none": the files alone.',
    ),
) -> None:
    """Snapshot a sandbox (files and live sessions) and print the snapshot id."""
    c = ctx_of(ctx)
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())
    try:
        sid = sbx.checkpoint(label, processes=None if processes == "sessions" else processes)
    finally:
        sbx.close()
    out.print(sid)


def rollback_summary(sandbox_id: str, result: RollbackResult) -> str:
    """One line: where the sandbox went, whether sessions restarted, which pids were killed."""
    took = (" in %.1f ms" % result.took_ms) if result.took_ms is not None else ""
    killed = ", ".join(str(p) for p in result.killed) if result.killed else "none"
    line = "rolled back %s to %s%s (sessions restarted: %s, killed pids: %s)" % (
        sandbox_id,
        result.snapshot,
        took,
        "yes" if result.sessions_restarted else "no",
        killed,
    )
    if result.restored_processes:
        line += ", restored pids: " + ", ".join(str(p) for p in result.restored_processes)
    for why in result.processes_not_restored:
        line += "; not restored: " + why
    return line


@sandbox_app.command("rollback")
@cli_errors
def sandbox_rollback(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    snapshot: str = typer.Argument(..., metavar="SNAPSHOT", help="Snapshot id to return to."),
) -> None:
    """Return a sandbox to a snapshot (its other processes are killed)."""
    c = ctx_of(ctx)
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())
    try:
        result = sbx.rollback(snapshot)
    finally:
        sbx.close()
    out.print(rollback_summary(sandbox_id, result))


@sandbox_app.command("fork")
@cli_errors
def sandbox_fork(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    n: int = typer.Option(1, "-n", "--count", min=1, max=64, help="Number of children (1..64)."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", "-s", help="Fork from this snapshot (default: checkpoint now)."),
    isolated: bool = typer.Option(False, "--isolated", help="Independent children: own namespaces, fresh sessions."),
    network: Optional[str] = typer.Option(
        None, "--network", metavar="MODE", help="The children's network mode (default: ID's). " + NETWORK_HELP
    ),
    allow: Optional[List[str]] = typer.Option(
        None, "--allow", metavar="ENTRY", help="The children's allow entries (default: ID's). " + ALLOW_HELP
    ),
    clear_allow: bool = typer.Option(False, "--clear-allow", help="The children get no allow entries."),
    replay_inflight: bool = typer.Option(
        False,
        "--replay-inflight",
        help="Children that send a request the parent has in flight through the proxy get the parent's answer "
        "(needs --proxy on the sandbox).",
    ),
    processes: str = typer.Option(
        "sessions",
        "--processes",
        help='What the checkpoint keeps for the children: "sessions"; "all": background processes too (CRIU); '
        '"keepable": those of them CRIU can keep; "none": the files alone.',
    ),
) -> None:
    """Start new sandboxes from a snapshot of ID; prints the child ids, one per line.

    The children get the background processes the snapshot kept (--processes all/keepable, or a --snapshot taken
    with them); those that did not come back are named on stderr."""
    c = ctx_of(ctx)
    network = parse_network(network)
    entries = parse_allow(allow, clear_allow)
    sbx = Sandbox.connect(sandbox_id, resume=False, **c.sdk())
    try:
        children, result = sbx.fork_info(
            n,
            snapshot=snapshot,
            isolated=isolated,
            network=network,
            allow=entries,
            replay_inflight=replay_inflight,
            processes=None if processes == "sessions" else processes,
        )
    finally:
        sbx.close()
    for why in result.processes_not_restored:
        err.print("not restored: %s" % why)
    for child in children:
        child.close()
        out.print(child.id)


# ----------------------------------------------------------------------------- ports


@sandbox_app.command("port")
@cli_errors
def sandbox_port(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    port: int = typer.Argument(..., metavar="PORT", min=1, max=65535, help="Port a server listens on in the sandbox (1..65535)."),
    url: bool = typer.Option(False, "--url", help="Print the URL (http://HOST) instead of the host."),
    close: bool = typer.Option(False, "--close", help="Close the port instead (its host address stops answering)."),
    as_json: bool = typer.Option(False, "--json", help='Print the PortInfo JSON (with --close: {"removed": ...}).'),
) -> None:
    """Print the host address (e.g. 127.0.0.1:41234) that reaches a server on PORT in the sandbox.

    The forwarder is opened on first ask (the same address after) and closed with --close or when the sandbox is killed."""
    if close:
        if url:
            raise typer.BadParameter("--url does not go with --close", param_hint="--url")
        with connected(ctx, sandbox_id) as sbx:
            removed = sbx.close_port(port)
        if as_json:
            print_json({"removed": removed})
        elif removed:
            out.print("closed port %d of sandbox %s" % (port, sandbox_id))
        else:
            out.print("port %d of sandbox %s was not open" % (port, sandbox_id))
        return
    with connected(ctx, sandbox_id) as sbx:
        info = sbx.open_port(port)
    if as_json:
        print_json(info.raw or {"sandbox": info.sandbox, "port": info.port, "host": info.host, "url": info.url})
    else:
        out.print(info.url if url else info.host)


@sandbox_app.command("ports")
@cli_errors
def sandbox_ports(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the ports of a sandbox open to the host (`sandbox port ID PORT` opens one)."""
    with connected(ctx, sandbox_id) as sbx:
        infos = sbx.ports()
    if as_json:
        print_json([i.raw for i in infos])
        return
    if not infos:
        out.print("no ports open in sandbox %s" % sandbox_id)
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("PORT", "HOST", "AGE"):
        table.add_column(col, no_wrap=True)
    for i in infos:
        table.add_row(str(i.port), i.host, fmt_duration(now - i.opened_at) if i.opened_at else "-")
    out.print(table)


# ----------------------------------------------------------------------------- network


def limits_text(limits: Any) -> str:
    """``"64 connections, 100 Mbit/s"`` (a NetLimits; ``-`` without limits)."""
    parts = []
    if limits is not None and limits.max_connections is not None:
        parts.append("%d connection%s" % (limits.max_connections, "" if limits.max_connections == 1 else "s"))
    if limits is not None and limits.bandwidth_mbps is not None:
        parts.append("%g Mbit/s" % limits.bandwidth_mbps)
    return ", ".join(parts) or "-"


def network_lines(info: NetworkInfo) -> List[str]:
    """A NetworkInfo as aligned ``key value`` lines (mode, address, allow, proxy, limits, rx, tx)."""
    return [
        "mode     %s" % (info.network or "-"),
        "address  %s" % (info.address or "-"),
        "allow    %s" % (", ".join(info.allow) if info.allow else "-"),
        "proxy    %s" % (info.proxy or "-"),
        "limits   %s" % limits_text(info.limits),
        "rx       %s" % fmt_bytes(info.rx_bytes),
        "tx       %s" % fmt_bytes(info.tx_bytes),
    ]


@sandbox_app.command("network")
@cli_errors
def sandbox_network(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    set_mode: Optional[str] = typer.Option(None, "--set-mode", metavar="MODE", help="Change the mode. " + NETWORK_HELP),
    allow: Optional[List[str]] = typer.Option(
        None, "--allow", metavar="ENTRY", help="Replace the allow entries with these. " + ALLOW_HELP
    ),
    clear_allow: bool = typer.Option(False, "--clear-allow", help="Remove every allow entry."),
    max_connections: Optional[int] = max_connections_option("Replace the limits (one not given is lifted). "),
    bandwidth_mbps: Optional[float] = bandwidth_option("Replace the limits (one not given is lifted). "),
    clear_limits: bool = typer.Option(False, "--clear-limits", help="Lift every limit."),
    as_json: bool = typer.Option(False, "--json", help="Print the NetworkInfo JSON."),
) -> None:
    """Show a sandbox's network (mode, address, allow entries, proxy, limits, bytes received and sent), or change it.

    With --set-mode, --allow, --clear-allow, --max-connections, --bandwidth-mbps or --clear-limits the new rules apply to connections made from then on; what is left out stays as it is (--set-mode none also clears the entries; --max-connections and --bandwidth-mbps replace the limits together: one not given is lifted)."""
    mode = parse_network(set_mode, "--set-mode")
    entries = parse_allow(allow, clear_allow)
    limits = parse_limits(max_connections, bandwidth_mbps, clear_limits)
    with connected(ctx, sandbox_id) as sbx:
        if mode is None and entries is None and limits is None:
            info = sbx.network.get()
        else:
            info = sbx.network.update(network=mode, allow=entries, limits=limits)
    if as_json:
        print_json(
            info.raw
            or {"sandbox": info.sandbox, "network": info.network, "allow": info.allow, "limits": _core.net_limits_body(info.limits)}
        )
        return
    for line in network_lines(info):
        out.print(Text(line))


# ----------------------------------------------------------------------------- snapshots


def _snapshot_label(s: SnapshotInfo, now: float) -> Text:
    text = Text(s.id, style="bold")
    if s.label:
        text.append("  ")
        text.append(s.label, style="cyan")
    text.append("  %s" % (fmt_duration(now - s.created_at) + " ago" if s.created_at else "-"), style="dim")
    text.append("  %s" % fmt_bytes(s.size_bytes))
    if s.lightweight:
        text.append("  lightweight", style="dim")
    if s.sandbox_id:
        text.append("  (%s)" % s.sandbox_id, style="dim")
    return text


def snapshot_tree(snapshots: List[SnapshotInfo], title: str = "snapshots", now: Optional[float] = None) -> Tree:
    """A rich Tree of ``snapshots`` built from their parent/children links.

    Roots are snapshots without a parent, or whose parent is not in the list; children keep
    the list's order (by creation time). A run of snapshots where each is the only child of
    the one above is one entry, one line each (a chain of a thousand checkpoints is a list,
    not a thousand levels of indentation); the children of a snapshot with several are
    entries nested under its run.
    """
    now = time.time() if now is None else now
    by_id = {s.id: s for s in snapshots}
    order = {s.id: i for i, s in enumerate(snapshots)}
    kids: Dict[str, List[str]] = {s.id: [] for s in snapshots}
    for s in snapshots:
        for child in s.children:
            if child in by_id and child not in kids[s.id]:
                kids[s.id].append(child)
        if s.parent in by_id and s.id not in kids[s.parent]:
            kids[s.parent].append(s.id)
    for ids in kids.values():
        ids.sort(key=order.__getitem__)
    tree = Tree(Text(title, style="bold"))
    seen: set = set()

    def add(node: Tree, sid: str) -> None:
        # Without recursion: trees can be deep.
        todo = [(node, sid)]
        while todo:
            parent, cur = todo.pop()
            if cur in seen:  # a malformed answer must not loop forever
                continue
            run: List[Text] = []
            while True:
                seen.add(cur)
                run.append(_snapshot_label(by_id[cur], now))
                nxt = [k for k in kids[cur] if k not in seen]
                if len(nxt) != 1:
                    break
                cur = nxt[0]
            branch = parent.add(run[0] if len(run) == 1 else Group(*run))
            todo.extend((branch, child) for child in reversed(nxt))

    for s in snapshots:
        if s.parent is None or s.parent not in by_id:
            add(tree, s.id)
    for s in snapshots:  # whatever a cycle left unreachable
        if s.id not in seen:
            add(tree, s.id)
    return tree


@snapshot_app.command("ls")
@cli_errors
def snapshot_ls(
    ctx: typer.Context,
    sandbox: Optional[str] = typer.Option(None, "--sandbox", help="Only the tree this sandbox belongs to."),
    remote: bool = typer.Option(False, "--remote", help="The snapshots pushed to the metadata store (by any daemon)."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON list."),
) -> None:
    """Show snapshots as a tree (id, label, age, size); with --remote, the pushed ones."""
    c = ctx_of(ctx)
    if remote:
        with Snapshots(**c.sdk()) as snaps:
            pushed = snaps.list_remote()
        if as_json:
            print_json([i.raw for i in pushed])
            return
        if not pushed:
            out.print("no pushed snapshots")
            return
        table = Table("ID", "LABEL", "NODE", "IMAGE", "SESSIONS", "SIZE", "HERE", box=None)
        for i in pushed:
            table.add_row(
                i.id, i.label or "", i.node, i.image, str(len(i.sessions)), fmt_bytes(i.bytes), "yes" if i.local else ""
            )
        out.print(table)
        return
    with Snapshots(**c.sdk()) as snaps:
        infos = snaps.list(sandbox=sandbox)
    if as_json:
        print_json([i.raw for i in infos])
        return
    if not infos:
        out.print("no snapshots" + (" for sandbox %s" % sandbox if sandbox else ""))
        return
    # soft_wrap off: a long label wraps under its tree guide instead of being cropped.
    out.print(snapshot_tree(infos, "snapshots of %s" % sandbox if sandbox else "snapshots"), soft_wrap=False)


@snapshot_app.command("rm")
@cli_errors
def snapshot_rm(
    ctx: typer.Context,
    sid: str = typer.Argument(..., metavar="SID", help="Snapshot id."),
    subtree: bool = typer.Option(False, "--subtree", help="Also delete every descendant."),
    remote: bool = typer.Option(
        False, "--remote", help="Delete its record in the metadata store instead (objects go with `store gc`)."
    ),
) -> None:
    """Delete a snapshot (or, with --remote, its pushed record)."""
    c = ctx_of(ctx)
    if remote:
        with Snapshots(**c.sdk()) as snaps:
            snaps.delete_remote(sid)
        out.print("removed the pushed record of snapshot %s (a local copy stays)" % sid)
        return
    with Snapshots(**c.sdk()) as snaps:
        snaps.delete(sid, subtree=subtree)
    out.print("removed snapshot %s%s" % (sid, " and its descendants" if subtree else ""))


@snapshot_app.command("offload")
@cli_errors
def snapshot_offload(
    ctx: typer.Context,
    sid: str = typer.Argument(..., metavar="SID", help="Snapshot id."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON result."),
) -> None:
    """Move a snapshot's live sessions out of memory into process images (needs CRIU)."""
    c = ctx_of(ctx)
    with Snapshots(**c.sdk()) as snaps:
        r = snaps.offload(sid)
    if as_json:
        print_json(r.raw)
        return
    out.print(
        "snapshot %s: %d session%s in process images (%s), %d dumped now, in %.0f ms"
        % (sid, r.images, "" if r.images == 1 else "s", fmt_bytes(r.image_bytes), r.offloaded, r.took_ms or 0)
    )
    for why in r.lost:
        out.print("[yellow]lost[/yellow] " + why)


@snapshot_app.command("push")
@cli_errors
def snapshot_push(
    ctx: typer.Context,
    sid: str = typer.Argument(..., metavar="SID", help="Snapshot id."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON result."),
) -> None:
    """Make a snapshot durable: its layers and session state to the object store, its record to
    the metadata store (deduplicated; pushing again is a no-op)."""
    c = ctx_of(ctx)
    with Snapshots(**c.sdk()) as snaps:
        r = snaps.push(sid)
    if as_json:
        print_json(r.raw)
        return
    if r.already:
        out.print("snapshot %s was pushed before: durable" % sid)
        return
    out.print(
        "snapshot %s durable: %d layer%s and %d process image%s pushed, %s uploaded (%s read), in %.0f ms"
        % (
            sid,
            r.layers_pushed,
            "" if r.layers_pushed == 1 else "s",
            r.images_pushed,
            "" if r.images_pushed == 1 else "s",
            fmt_bytes(r.uploaded_bytes),
            fmt_bytes(r.read_bytes),
            r.took_ms or 0,
        )
    )
    for why in r.lost:
        out.print("[yellow]not kept[/yellow] " + why)


@snapshot_app.command("pull")
@cli_errors
def snapshot_pull(
    ctx: typer.Context,
    sid: str = typer.Argument(..., metavar="SID", help="Snapshot id (see `snapshot ls --remote`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON result."),
) -> None:
    """Bring a pushed snapshot onto this daemon (creating a sandbox from it does this too)."""
    c = ctx_of(ctx)
    with Snapshots(**c.sdk()) as snaps:
        r = snaps.pull(sid)
    if as_json:
        print_json(r.raw)
        return
    if r.already:
        out.print("snapshot %s is here already" % sid)
        return
    out.print(
        "snapshot %s pulled: %d layer%s, %d process image%s, %s downloaded, in %.0f ms"
        % (
            sid,
            r.layers_pulled,
            "" if r.layers_pulled == 1 else "s",
            r.images_pulled,
            "" if r.images_pulled == 1 else "s",
            fmt_bytes(r.downloaded_bytes),
            r.took_ms or 0,
        )
    )


@snapshot_app.command("gc")
@cli_errors
def snapshot_gc(
    ctx: typer.Context,
    keep: Optional[List[str]] = typer.Option(None, "--keep", "-k", help="Snapshot to keep with its ancestors (repeatable)."),
    sandbox: Optional[str] = typer.Option(None, "--sandbox", help="Only this sandbox's snapshot tree."),
) -> None:
    """Delete every snapshot not kept (nor an ancestor of a kept one)."""
    c = ctx_of(ctx)
    with Snapshots(**c.sdk()) as snaps:
        result = snaps.gc(keep or [], sandbox=sandbox)
    n = len(result.deleted)
    line = "deleted %d snapshot%s, freed %s" % (n, "" if n == 1 else "s", fmt_bytes(result.freed_bytes))
    if result.deleted:
        line += ": " + " ".join(result.deleted)
    out.print(line)


@store_app.command("gc")
@cli_errors
def store_gc(
    ctx: typer.Context,
    grace: Optional[float] = typer.Option(
        None, "--grace", help="Keep unreachable objects younger than this many seconds (default: the daemon's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON result."),
) -> None:
    """Delete the objects no pushed snapshot reaches (safe while other daemons push: it waits for
    none, and refuses while a push runs)."""
    c = ctx_of(ctx)
    with Snapshots(**c.sdk()) as snaps:
        r = snaps.store_gc(grace)
    if as_json:
        print_json(r.raw)
        return
    out.print(
        "%d objects, %d reachable: deleted %d (%s), kept %d younger than the grace period, in %.0f ms"
        % (r.objects, r.reachable, r.deleted, fmt_bytes(r.deleted_bytes), r.young, r.took_ms or 0)
    )


# ----------------------------------------------------------------------------- images


@image_app.command("ls")
@cli_errors
def image_ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List images."""
    c = ctx_of(ctx)
    with Images(**c.sdk()) as images:
        infos = images.list()
    if as_json:
        print_json([i.raw for i in infos])
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("NAME", "ID", "SOURCE", "SIZE", "LAYERS", "AGE"):
        table.add_column(col, no_wrap=True)
    for i in infos:
        table.add_row(
            i.name,
            (i.id or "-")[:19],
            i.source or "-",
            fmt_bytes(i.size_bytes),
            str(len(i.layers)),
            fmt_duration(now - i.created_at) if i.created_at else "-",
        )
    out.print(table)


class ProgressView:
    """Renders NDJSON image progress events as rich progress bars (one task per stage)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: Dict[str, Any] = {}
        self.totals: Dict[str, Optional[float]] = {}
        self.current: Optional[str] = None

    def __call__(self, ev: ImageProgress) -> None:
        stage = ev.stage or "working"
        if stage != self.current:
            self._complete(self.current)
            if stage not in self.tasks:
                self.tasks[stage] = self.progress.add_task(stage, total=None)
            self.current = stage
        total = ev.total or None
        self.totals[stage] = total
        desc = stage + (": " + ev.message if ev.message else "")
        self.progress.update(self.tasks[stage], description=desc, total=total, completed=ev.done or 0)

    def _complete(self, stage: Optional[str]) -> None:
        if stage in self.tasks:
            total = self.totals.get(stage) or 1
            self.progress.update(self.tasks[stage], total=total, completed=total)

    def finish(self) -> None:
        for stage in self.tasks:
            self._complete(stage)


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


def _print_image(info: Any, verb: str) -> None:
    out.print("%s image %s (%s, %s)" % (verb, info.name, (info.id or "?")[:19], fmt_bytes(info.size_bytes)))


@image_app.command("build")
@cli_errors
def image_build(
    ctx: typer.Context,
    name: str = typer.Argument("base", help="Image name."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Debian suite (daemon default: bookworm)."),
    package: Optional[List[str]] = typer.Option(None, "--package", "-p", help="Extra package (repeatable)."),
) -> None:
    """Build an image with debootstrap, showing progress."""
    c = ctx_of(ctx)
    with Images(**c.sdk()) as images, _progress() as progress:
        view = ProgressView(progress)
        info = images.build(name, suite=suite, packages=package or None, on_progress=view)
        view.finish()
    _print_image(info, "built")


@image_app.command("import")
@cli_errors
def image_import(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Image name."),
    path: str = typer.Argument(..., help="OCI/docker image tarball (path on the daemon's host)."),
) -> None:
    """Import an OCI/docker image tarball, showing progress."""
    c = ctx_of(ctx)
    with Images(**c.sdk()) as images, _progress() as progress:
        view = ProgressView(progress)
        info = images.import_(name, os.path.abspath(path), on_progress=view)
        view.finish()
    _print_image(info, "imported")


@image_app.command("rm")
@cli_errors
def image_rm(ctx: typer.Context, name: str = typer.Argument(..., help="Image name.")) -> None:
    """Remove an image."""
    c = ctx_of(ctx)
    with Images(**c.sdk()) as images:
        images.remove(name)
    out.print("removed image %s" % name)


# ----------------------------------------------------------------------------- templates


def _toml_loads(text: str) -> Dict[str, Any]:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise SandboxError("reading a TOML recipe needs Python 3.11+ (tomllib) or the tomli package") from None
    return tomllib.loads(text)


def load_recipe(path: str) -> Dict[str, Any]:
    """A template recipe from a TOML file: the keys of the API body (``name``, ``image``,
    ``run``, ``code``, ``env``, ``cwd``, ``cpu``, ``memory_mb``, ``pids``, ``metadata``,
    ``timeout``, ``shells``, ``volumes``: a ``{path = volume}`` table or a list of mount tables,
    ``network``, ``allow``: a list of entries).
    Unknown keys and wrongly typed values are errors naming the file."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SandboxError("cannot read recipe %s: %s" % (path, e)) from None
    try:
        data = _toml_loads(text)
    except ValueError as e:  # tomllib.TOMLDecodeError is a ValueError
        raise SandboxError("recipe %s is not valid TOML: %s" % (path, e)) from None
    unknown = sorted(set(data) - set(_core.RECIPE_KEYS))
    if unknown:
        raise SandboxError(
            "recipe %s: unknown key%s %s (allowed: %s)"
            % (path, "s" if len(unknown) > 1 else "", ", ".join(unknown), ", ".join(_core.RECIPE_KEYS))
        )
    kinds: Dict[str, Any] = {
        "name": str, "image": str, "code": str, "cwd": str, "run": (list, str), "env": dict, "metadata": dict,
        "cpu": (int, float), "timeout": (int, float), "memory_mb": int, "pids": int, "shells": int,
        "volumes": (dict, list), "network": str, "allow": list,
    }
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, kinds[key]):
            raise SandboxError("recipe %s: %s has the wrong type (%s)" % (path, key, type(value).__name__))
    for key in ("env", "metadata"):
        for k, v in (data.get(key) or {}).items():
            if isinstance(v, (dict, list)):
                raise SandboxError("recipe %s: %s.%s must be a string, not a %s" % (path, key, k, type(v).__name__))
    if "volumes" in data:
        try:
            data["volumes"] = _core.volume_mounts(data["volumes"])
        except SandboxError as e:
            raise SandboxError("recipe %s: %s" % (path, e)) from None
    return data


def merge_recipe(recipe: Dict[str, Any], flags: Dict[str, Any]) -> Dict[str, Any]:
    """Command-line values over the recipe file's: scalars and ``run`` replace the file's,
    ``env``/``metadata`` entries are merged over the file's (the flag wins per key), and so are
    ``volumes`` (a ``--volume`` replaces the file's mount at its path)."""
    out = dict(recipe)
    for key, value in flags.items():
        if value is None:
            continue
        if key in ("env", "metadata"):
            if value:
                merged = {str(k): str(v) for k, v in (out.get(key) or {}).items()}
                merged.update(value)
                out[key] = merged
        elif key == "run":
            if value:
                out["run"] = list(value)
        elif key == "volumes":
            if value:
                mounts = {m["path"]: m for m in _core.volume_mounts(out.get("volumes") or [])}
                mounts.update((m["path"], m) for m in _core.volume_mounts(value))
                out["volumes"] = list(mounts.values())
        else:
            out[key] = value
    return out


class TemplateProgressView:
    """One rich progress bar for a template build: ``stage: message``, step done/total."""

    def __init__(self, progress: Progress, name: str) -> None:
        self.progress = progress
        self.task = progress.add_task("template %s" % name, total=None)
        self.total: Optional[float] = None

    def __call__(self, ev: Any) -> None:
        desc = (ev.stage or "working") + (": " + " ".join(ev.message.split()) if ev.message else "")
        if ev.total:
            self.total = float(ev.total)
        kw: Dict[str, Any] = {"description": desc, "total": self.total}
        if ev.done is not None:
            kw["completed"] = ev.done
        self.progress.update(self.task, **kw)

    def finish(self) -> None:
        total = self.total or 1
        self.progress.update(self.task, total=total, completed=total)


def _template_volumes(info: TemplateInfo) -> str:
    """A template's mounts as their ``--volume`` flags: ``/workspace=vol-...``, ``...:ro``."""
    return ", ".join(volume_flag(m) for m in info.volumes)


@template_app.command("build")
@cli_errors
def template_build(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Template name (letters, digits, '.', '_', '-')."),
    recipe_file: Optional[str] = typer.Option(None, "--file", "-f", help="TOML recipe with the API body's keys; flags override it."),
    image: Optional[str] = typer.Option(None, "--image", help="Image (default base)."),
    run: Optional[List[str]] = typer.Option(None, "--run", "-r", help="Shell command run in order (repeatable; replaces the recipe's)."),
    code: Optional[str] = typer.Option(None, "--code", help="Python code whose session state the template keeps (e.g. imports)."),
    code_file: Optional[str] = typer.Option(None, "--code-file", help="Read --code from this file ('-' = stdin)."),
    shells: Optional[int] = typer.Option(None, "--shells", min=0, help="Sandboxes kept ready to hand out (daemon default 4)."),
    memory_mb: Optional[int] = typer.Option(None, "--memory-mb", min=1, help="Memory limit (MiB) of the build sandbox."),
    cpu: Optional[float] = typer.Option(None, "--cpu", help="CPU limit (cores)."),
    pids: Optional[int] = typer.Option(None, "--pids", min=1, help="Max number of processes."),
    env: Optional[List[str]] = typer.Option(None, "--env", "-e", help="KEY=VALUE (repeatable)."),
    cwd: Optional[str] = typer.Option(None, "--cwd", help="Working directory."),
    metadata: Optional[List[str]] = typer.Option(None, "--metadata", "-m", help="KEY=VALUE (repeatable)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds each command and the code may take (daemon default 600)."),
    volume: Optional[List[str]] = typer.Option(
        None, "--volume", "-v",
        help="Mount a volume (id or name) while the recipe runs: %s (repeatable; sandboxes created from the "
        "template get a copy-on-write fork of each branching volume at the same path)." % VOLUME_FLAG,
    ),
    network: Optional[str] = typer.Option(
        None, "--network", metavar="MODE",
        help=NETWORK_HELP + " The network of the recipe's sandbox while it runs (e.g. for pip install) and the "
        "default of sandboxes created from the template (daemon default none).",
    ),
    allow: Optional[List[str]] = typer.Option(
        None, "--allow", metavar="ENTRY", help=ALLOW_HELP + " Replaces the recipe file's entries."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the TemplateInfo JSON."),
) -> None:
    """Build a warm template from a recipe, showing progress.

    Sandboxes created with `sandbox create --template NAME` start as copy-on-write forks of it: the recipe's files and its python session's state (imports) are there at once, and its volumes (`--volume`) are mounted at the same paths (copy-on-write forks of the branching ones).
    """
    c = ctx_of(ctx)
    network = parse_network(network)
    if code is not None and code_file is not None:
        raise typer.BadParameter("give --code or --code-file, not both", param_hint="--code-file")
    if code_file is not None:
        if code_file == "-":
            code = sys.stdin.read()
        else:
            try:
                with open(code_file, encoding="utf-8") as f:
                    code = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise fail("cannot read --code-file %s: %s" % (code_file, e)) from None
    recipe = load_recipe(recipe_file) if recipe_file else {}
    recipe = merge_recipe(
        recipe,
        {
            "name": name,
            "image": image,
            "run": run,
            "code": code,
            "shells": shells,
            "memory_mb": memory_mb,
            "cpu": cpu,
            "pids": pids,
            "env": parse_env(env),
            "cwd": cwd,
            "metadata": parse_env(metadata, "--metadata"),
            "timeout": timeout,
            "volumes": parse_volume_flags(volume) or None,
            "network": network,
            "allow": parse_allow(allow),
        },
    )
    name = recipe.pop("name")
    _core.template_recipe(name, **recipe)  # bad values fail here, before the progress bar shows
    with Templates(**c.sdk()) as templates, _progress() as progress:
        view = TemplateProgressView(progress, name)
        info = templates.build(name, on_progress=view, **recipe)
        view.finish()
    if as_json:
        print_json(info.raw or {"name": info.name})
        return
    out.print(
        "built template %s (image %s, snapshot %s, %d shell%s, %s%s)"
        % (
            info.name, info.image, info.snapshot, info.shells, "" if info.shells == 1 else "s",
            fmt_bytes(info.memory_bytes), "; volumes " + _template_volumes(info) if info.volumes else "",
        )
    )


@template_app.command("ls")
@cli_errors
def template_ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List templates."""
    c = ctx_of(ctx)
    with Templates(**c.sdk()) as templates:
        infos = templates.list()
    if as_json:
        print_json([i.raw for i in infos])
        return
    if not infos:
        out.print("no templates (build one with `branchbox template build NAME`)")
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("NAME", "IMAGE", "SHELLS", "ALIVE", "MEMORY", "AGE", "SNAPSHOT", "SANDBOX"):
        table.add_column(col, no_wrap=True)
    for i in infos:
        table.add_row(
            i.name,
            i.image or "-",
            "%d/%d" % (i.ready_shells, i.shells),
            Text("yes", style="green") if i.alive else Text("no", style="red"),
            fmt_bytes(i.memory_bytes),
            fmt_duration(now - i.created_at) if i.created_at else "-",
            i.snapshot or "-",
            i.sandbox_id or "-",
        )
    out.print(table)
    # Mounts (as --volume flags) under the table: volume ids are too wide for a column.
    for i in infos:
        if i.volumes:
            out.print("%s volumes: %s" % (i.name, _template_volumes(i)))


@template_app.command("info")
@cli_errors
def template_info(ctx: typer.Context, name: str = typer.Argument(..., help="Template name.")) -> None:
    """Print a template's TemplateInfo JSON."""
    c = ctx_of(ctx)
    with Templates(**c.sdk()) as templates:
        info = templates.get(name)
    print_json(info.raw or {"name": info.name})


@template_app.command("rm")
@cli_errors
def template_rm(ctx: typer.Context, name: str = typer.Argument(..., help="Template name.")) -> None:
    """Remove a template (sandboxes created from it keep running)."""
    c = ctx_of(ctx)
    with Templates(**c.sdk()) as templates:
        templates.remove(name)
    out.print("removed template %s" % name)


# ----------------------------------------------------------------------------- warm pool


def pool_counter_lines(s: PoolStats) -> List[str]:
    """Human-readable counters of a PoolStats (under the `pool ls` table)."""
    lines = [
        "hits %d, misses %d, recycled %d, created %d, failures %d" % (s.hits, s.misses, s.recycled, s.created, s.failures),
        "refill p50 %s, p99 %s; cgroup placement %s (p50 %s)"
        % (
            fmt_num(s.refill_ms_p50, " ms", "%.1f"),
            fmt_num(s.refill_ms_p99, " ms", "%.1f"),
            s.cgroup_placement or "-",
            fmt_num(s.cgroup_placement_ms_p50, " ms", "%.1f"),
        ),
    ]
    if s.last_error:
        lines.append("last error: " + " ".join(s.last_error.split()))
    return lines


def _pool_line(s: PoolStats, image: str) -> str:
    p = s.images.get(image)
    if p is None or (p.min == 0 and p.max == 0):
        return "pool %s: drained (ready %d)" % (image, p.ready if p is not None else 0)
    return "pool %s: min %d, max %d, ready %d" % (image, p.min, p.max, p.ready)


@pool_app.command("ls")
@cli_errors
def pool_ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print the PoolStats JSON.")) -> None:
    """Show the warm pool: per image min/max/ready (and how many are wired for egress), then the counters."""
    c = ctx_of(ctx)
    with Pool(**c.sdk()) as pool:
        stats = pool.stats()
    if as_json:
        print_json(stats.raw)
        return
    if stats.images:
        table = Table(box=None, header_style="bold")
        for col in ("IMAGE", "MIN", "MAX", "READY", "WIRED"):
            table.add_column(col, no_wrap=True, justify="left" if col == "IMAGE" else "right")
        for name, p in sorted(stats.images.items()):
            table.add_row(name, str(p.min), str(p.max), str(p.ready), str(p.wired))
        out.print(table)
    else:
        out.print("no pools (set one with `branchbox pool set IMAGE --min N`)")
    for i, line in enumerate(pool_counter_lines(stats)):
        out.print(Text(line, style="yellow" if line.startswith("last error") else ""))


@pool_app.command("set")
@cli_errors
def pool_set(
    ctx: typer.Context,
    image: str = typer.Argument(..., help="Image name."),
    min_: int = typer.Option(..., "--min", min=0, help="Ready sandboxes to keep (built in the background)."),
    max_: Optional[int] = typer.Option(None, "--max", min=0, help="Recycle killed sandboxes while fewer are ready (default: --min)."),
    as_json: bool = typer.Option(False, "--json", help="Print the PoolStats JSON."),
) -> None:
    """Keep --min sandboxes of IMAGE ready; persisted by the daemon."""
    c = ctx_of(ctx)
    if max_ is not None and min_ > max_:
        raise typer.BadParameter("--min (%d) must not exceed --max (%d)" % (min_, max_), param_hint="--min")
    with Pool(**c.sdk()) as pool:
        stats = pool.set(image, min_, max_)
    if as_json:
        print_json(stats.raw)
        return
    out.print(_pool_line(stats, image))


@pool_app.command("drain")
@cli_errors
def pool_drain(
    ctx: typer.Context,
    image: str = typer.Argument(..., help="Image name."),
    as_json: bool = typer.Option(False, "--json", help="Print the PoolStats JSON."),
) -> None:
    """Remove IMAGE's pool (min 0, max 0): its ready sandboxes are torn down."""
    c = ctx_of(ctx)
    with Pool(**c.sdk()) as pool:
        stats = pool.drain(image)
    if as_json:
        print_json(stats.raw)
        return
    out.print(_pool_line(stats, image))
