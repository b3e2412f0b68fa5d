"""CLI pieces that need no real daemon: parsing, output, error handling, daemon
start/stop against a fake daemon binary, and the bench math."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from types import SimpleNamespace

import httpx
import pytest
import typer
from typer.testing import CliRunner

from branchbox import CommandResult, Execution
from branchbox_bench import api as bench
from branchbox_cli import app as cli
from conftest import BASE, IMAGE, SANDBOX, SID, FakeDaemon, invoke, ndjson


# ----------------------------------------------------------------------------- helpers


def test_parse_env() -> None:
    assert cli.parse_env(None) == {}
    assert cli.parse_env(["A=1", "B=x=y", "C=", "A=2"]) == {"A": "2", "B": "x=y", "C": ""}
    for bad in ("NOEQUALS", "=value"):
        with pytest.raises(typer.BadParameter):
            cli.parse_env([bad])


def test_fmt_duration() -> None:
    assert [cli.fmt_duration(x) for x in (-1, 45, 299, 7380, 273600)] == ["0s", "45s", "4m59s", "2h03m", "3d04h"]


def test_exit_code_of() -> None:
    assert cli.exit_code_of(CommandResult(exit_code=0)) == 0
    assert cli.exit_code_of(CommandResult(exit_code=3)) == 3
    assert cli.exit_code_of(CommandResult(exit_code=None, signal=9)) == 137
    assert cli.exit_code_of(CommandResult(exit_code=None, signal=9, timed_out=True)) == 124
    assert cli.exit_code_of(CommandResult(exit_code=None)) == 1


# ----------------------------------------------------------------------------- sandbox commands


def test_sandbox_create(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--image", "alpine", "--memory-mb", "64", "--cpu", "0.5",
               "--timeout", "10", "--env", "A=1", "-e", "B=x=y", "-m", "team=ml")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == SID
    assert daemon.body() == {
        "image": "alpine", "cpu": 0.5, "memory_mb": 64, "timeout": 10.0, "network": "none",
        "env": {"A": "1", "B": "x=y"}, "metadata": {"team": "ml"},
    }
    r = invoke(runner, "sandbox", "create", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == SANDBOX
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "none"}
    r = invoke(runner, "sandbox", "create", "--sudo")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "none", "sudo": True}


def test_sandbox_create_bad_env(runner: CliRunner, daemon: FakeDaemon) -> None:
    n = len(daemon.requests)
    r = invoke(runner, "sandbox", "create", "--env", "NOPE")
    assert r.exit_code == 2 and "KEY=VALUE" in r.output + r.stderr
    assert len(daemon.requests) == n


def test_sandbox_exec_streams_and_exits_with_code(runner: CliRunner, daemon: FakeDaemon) -> None:
    events = [
        {"type": "start", "pid": 4},
        {"type": "stdout", "data": "hi\n"},
        {"type": "stderr", "data": "oops\n"},
        {"type": "exit", "exit_code": 3, "signal": None, "timed_out": False},
    ]
    daemon.on("POST", BASE + "/commands/stream", httpx.Response(200, stream=ndjson(*events)))
    r = invoke(runner, "sandbox", "exec", "--env", "X=1", SID, "--", "sh", "-c", "echo hi; exit 3")
    assert r.exit_code == 3, r.stderr
    assert r.stdout == "hi\n" and "oops" in r.stderr
    assert daemon.body() == {"args": ["sh", "-c", "echo hi; exit 3"], "env": {"X": "1"}, "timeout": 600.0}
    r = invoke(runner, "sandbox", "exec", SID, "--", "echo hi | wc -c")
    assert daemon.body()["cmd"] == "echo hi | wc -c"
    r = invoke(runner, "sandbox", "exec", SID, "ls", "-la")  # options after ID belong to the command
    assert daemon.body()["args"] == ["ls", "-la"]


def test_sandbox_exec_as_user(runner: CliRunner, daemon: FakeDaemon) -> None:
    events = [{"type": "stdout", "data": "user\n"}, {"type": "exit", "exit_code": 0, "signal": None, "timed_out": False}]
    daemon.on("POST", BASE + "/commands/stream", lambda r: httpx.Response(200, stream=ndjson(*events)))
    r = invoke(runner, "sandbox", "exec", "--user", "user", SID, "--", "whoami")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "user\n"
    assert daemon.body() == {"cmd": "whoami", "timeout": 600.0, "user": "user"}
    assert invoke(runner, "sandbox", "exec", "-u", "user", SID, "id").exit_code == 0
    assert daemon.body()["user"] == "user"
    assert invoke(runner, "sandbox", "exec", SID, "id").exit_code == 0
    assert "user" not in daemon.body()
    daemon.on("POST", BASE + "/commands/stream", {"error": {"code": "bad_request", "message": "no user bob in the sandbox"}}, 400)
    r = invoke(runner, "sandbox", "exec", "--user", "bob", SID, "id")
    assert r.exit_code != 0 and "bob" in r.stderr


def test_sandbox_ls_info_kill(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/sandboxes", {"sandboxes": [SANDBOX, dict(SANDBOX, id="sb-dead", state="dead", oom_killed=True)]})
    r = invoke(runner, "sandbox", "ls")
    assert r.exit_code == 0 and SID in r.stdout and "sb-dead" in r.stdout and "oom" in r.stdout
    r = invoke(runner, "sandbox", "ls", "--json", "-m", "k=v")
    assert [s["id"] for s in json.loads(r.stdout)] == [SID, "sb-dead"]
    assert dict(daemon.last.url.params) == {"metadata.k": "v"}
    r = invoke(runner, "sandbox", "info", SID)
    assert r.exit_code == 0 and json.loads(r.stdout) == SANDBOX
    r = invoke(runner, "sandbox", "kill", SID)
    assert r.exit_code == 0 and "killed %s" % SID in r.stdout
    assert daemon.last.method == "DELETE"
    r = invoke(runner, "sandbox", "info", "sb-missing")
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr + r.stdout


def test_sandbox_run_code(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/code", {"stdout": "out\n", "stderr": "", "result": "2", "error": None})
    r = invoke(runner, "sandbox", "run-code", SID, "print('out')\n1+1")
    assert r.exit_code == 0 and r.stdout == "out\n2\n"
    assert daemon.body() == {"code": "print('out')\n1+1", "language": "python", "timeout": 60.0}
    err = {"name": "ZeroDivisionError", "value": "division by zero", "traceback": "Traceback...\nZeroDivisionError: division by zero\n"}
    daemon.on("POST", BASE + "/code", {"stdout": "", "stderr": "", "result": None, "error": err})
    r = invoke(runner, "sandbox", "run-code", SID, "-", input="1/0")
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr
    assert daemon.body()["code"] == "1/0"


def test_image_commands(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("GET", "/v1/images", {"images": [IMAGE]})
    events = [
        {"type": "progress", "stage": "download", "done": 1, "total": 4, "message": "a.deb"},
        {"type": "progress", "stage": "download", "done": 4, "total": 4, "message": "d.deb"},
        {"type": "progress", "stage": "unpack", "done": 0, "total": None, "message": ""},
        {"type": "done", "image": IMAGE},
    ]
    daemon.on("POST", "/v1/images/build", httpx.Response(200, stream=ndjson(*events, split=9)))
    daemon.on("POST", "/v1/images/import", httpx.Response(200, stream=ndjson(*events)))
    daemon.on("DELETE", "/v1/images/old", {"removed": True})
    r = invoke(runner, "image", "ls")
    assert r.exit_code == 0 and "base" in r.stdout and "debootstrap" in r.stdout
    r = invoke(runner, "image", "build", "-p", "curl", "--suite", "bookworm")
    assert r.exit_code == 0, r.stderr
    assert "built image base" in r.stdout
    assert daemon.body() == {"name": "base", "suite": "bookworm", "packages": ["curl"]}
    tar = tmp_path / "img.tar"
    r = invoke(runner, "image", "import", "alpine", str(tar))
    assert r.exit_code == 0 and daemon.body() == {"name": "alpine", "path": str(tar)}
    r = invoke(runner, "image", "rm", "old")
    assert r.exit_code == 0 and "removed image old" in r.stdout
    daemon.on("POST", "/v1/images/build", httpx.Response(200, stream=ndjson({"type": "error", "error": {"code": "conflict", "message": "busy"}})))
    r = invoke(runner, "image", "build")
    assert r.exit_code == 1 and "error: busy" in r.stderr


def test_progress_view_tracks_stages() -> None:
    from rich.progress import Progress

    progress = Progress(disable=True)
    view = cli.ProgressView(progress)
    from branchbox import ImageProgress

    view(ImageProgress(stage="a", done=1, total=2))
    view(ImageProgress(stage="b", done=5, total=None))
    view.finish()
    tasks = {t.description.split(":")[0]: t for t in progress.tasks}
    assert set(tasks) == {"a", "b"}
    assert all(t.finished for t in tasks.values())


# ----------------------------------------------------------------------------- errors


def test_unreachable_daemon_is_one_red_line(runner: CliRunner, tmp_path) -> None:
    r = invoke(runner, "--daemon", "unix://%s/none.sock" % tmp_path, "sandbox", "ls")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach branchboxd")
    assert "branchbox daemon start" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_env_url_and_debug_traceback(runner: CliRunner, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRANCHBOX_URL", "unix://%s/env.sock" % tmp_path)
    r = invoke(runner, "daemon", "status")
    assert r.exit_code == 1 and "env.sock" in r.stderr
    monkeypatch.setenv("BRANCHBOX_DEBUG", "1")
    r = invoke(runner, "daemon", "status")
    assert r.exit_code != 0 and type(r.exception).__name__ == "DaemonUnavailableError"


def test_bad_daemon_url(runner: CliRunner) -> None:
    r = invoke(runner, "--daemon", "ftp://x", "sandbox", "ls")
    assert r.exit_code == 1 and "not understood" in r.stderr


# ----------------------------------------------------------------------------- daemon start/stop

FAKE_DAEMON = textwrap.dedent(
    """\
    #!{python}
    import argparse, http.server, json, os, signal, socketserver, sys
    p = argparse.ArgumentParser()
    p.add_argument("--state-dir")
    p.add_argument("--socket")
    a, extra = p.parse_known_args()
    print("fake branchboxd starting", extra, flush=True)
    if os.environ.get("FAKE_FAIL"):
        print("fatal: cannot mount overlayfs", flush=True)
        sys.exit(3)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({{"ok": True, "version": "9.9.9", "cgroup": "v2", "sandboxes": 0}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class S(socketserver.UnixStreamServer):
        def get_request(self):
            conn, _ = self.socket.accept()
            return conn, ("local", 0)

    if os.path.exists(a.socket):
        os.unlink(a.socket)
    srv = S(a.socket, H)
    signal.signal(signal.SIGTERM, lambda *_: (os.unlink(a.socket), os._exit(0)))
    srv.serve_forever()
    """
)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = tmp_path / "fake-branchboxd"
    path.write_text(FAKE_DAEMON.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("BRANCHBOX_DAEMON_BIN", str(path))
    return str(path)


def test_daemon_start_status_stop(runner: CliRunner, fake_bin: str, tmp_path) -> None:
    state, sock, pidfile = tmp_path / "state", tmp_path / "d.sock", tmp_path / "run" / "d.pid"
    args = ["--state-dir", str(state), "--socket", str(sock), "--pidfile", str(pidfile)]
    r = invoke(runner, "daemon", "start", *args, "--", "--log-level", "debug")
    assert r.exit_code == 0, r.stderr
    assert "9.9.9 started" in r.stdout
    pid = int(pidfile.read_text())
    assert cli.pid_alive(pid)
    log = (state / "branchboxd.log").read_text()
    assert "fake branchboxd starting ['--log-level', 'debug']" in log

    r = invoke(runner, "daemon", "start", *args)
    assert r.exit_code == 0 and "already running" in r.stdout

    r = invoke(runner, "--daemon", "unix://%s" % sock, "daemon", "status")
    assert r.exit_code == 0 and json.loads(r.stdout)["version"] == "9.9.9"

    r = invoke(runner, "daemon", "stop", "--pidfile", str(pidfile))
    assert r.exit_code == 0, r.stderr
    assert "stopped" in r.stdout and not pidfile.exists()
    assert not cli.pid_alive(pid)
    r = invoke(runner, "daemon", "stop", "--pidfile", str(pidfile))
    assert r.exit_code == 0 and "not running" in r.stdout


def test_daemon_start_failure_shows_log_tail(runner: CliRunner, fake_bin: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FAIL", "1")
    pidfile = tmp_path / "d.pid"
    t0 = time.monotonic()
    r = invoke(runner, "daemon", "start", "--state-dir", str(tmp_path / "s"), "--socket", str(tmp_path / "d.sock"),
               "--pidfile", str(pidfile))
    assert r.exit_code == 1
    assert "exited with code 3" in r.stderr and "cannot mount overlayfs" in r.stderr
    assert time.monotonic() - t0 < 20 and not pidfile.exists()


def test_daemon_start_missing_binary(runner: CliRunner, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    r = invoke(runner, "daemon", "start", "--state-dir", str(tmp_path))
    assert r.exit_code == 1 and "BRANCHBOX_DAEMON_BIN" in r.stderr


def test_daemon_stop_refuses_foreign_pid(runner: CliRunner, tmp_path) -> None:
    pidfile = tmp_path / "d.pid"
    pidfile.write_text("%d\n" % os.getpid())  # pytest itself: not a branchboxd
    r = invoke(runner, "daemon", "stop", "--pidfile", str(pidfile))
    assert r.exit_code == 1 and "not branchboxd" in r.stderr


# ----------------------------------------------------------------------------- bench


def test_percentile() -> None:
    assert bench.percentile([5.0], 50) == 5.0
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench.percentile([4, 1, 3, 2], 0) == 1
    assert bench.percentile([1, 2, 3, 4], 100) == 4
    assert bench.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert bench.percentile([10, 20], 99) == pytest.approx(19.9)
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    with pytest.raises(ValueError):
        bench.percentile([1], 101)


def test_summary_keys_and_ratio() -> None:
    res = bench.BenchResult(
        n=2,
        samples={
            "create": [10.0, 20.0],
            "exec_true": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0],
            "run_code": [3.0, 5.0],
            "files_write_4k": [1.0, 1.0],
            "host_spawn_true": [0.5, 1.5],
        },
    )
    s = res.summary()
    assert tuple(s) == bench.SUMMARY_KEYS
    assert s["create_ms_p50"] == 15.0 and s["create_ms_p99"] == 19.9
    assert s["exec_true_ms_p50"] == 7.0 and s["host_spawn_true_ms_p50"] == 1.0
    assert s["exec_vs_host_ratio"] == 7.0 and s["n"] == 2
    assert [row[0] for row in res.rows()] == list(bench.METRICS)


class FakeBenchSandbox:
    created = killed = 0
    calls: dict = {}

    @classmethod
    def create(cls, image, daemon=None, token=None):
        cls.created += 1
        return cls()

    def __init__(self) -> None:
        self.id = "sb-fake"
        self.commands = SimpleNamespace(run=self._run)
        self.files = SimpleNamespace(write=self._write)

    def _run(self, cmd):
        assert cmd == ["true"]
        self.calls["exec"] = self.calls.get("exec", 0) + 1
        return CommandResult(exit_code=0)

    def _write(self, path, data):
        assert len(data) == 4096
        self.calls["write"] = self.calls.get("write", 0) + 1

    def run_code(self, code):
        assert code == "1+1"
        return Execution(result="2")

    def kill(self) -> bool:
        type(self).killed += 1
        return True


def test_run_api_bench_with_fake_sandbox() -> None:
    FakeBenchSandbox.created = FakeBenchSandbox.killed = 0
    FakeBenchSandbox.calls = {}
    res = bench.run_api_bench(4, sandbox_cls=FakeBenchSandbox)
    counts = {k: len(v) for k, v in res.samples.items()}
    assert counts == {"create": 4, "exec_true": 12, "run_code": 4, "files_write_4k": 4, "host_spawn_true": 4}
    assert FakeBenchSandbox.created == FakeBenchSandbox.killed == 4 + 2  # + warm-up + shared sandbox
    assert all(x > 0 for xs in res.samples.values() for x in xs)


def test_bench_failing_exec_is_an_error(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(FakeBenchSandbox):
        def _run(self, cmd):
            return CommandResult(exit_code=None, signal=9, stderr="oom")

    monkeypatch.setattr(bench, "Sandbox", Broken)
    Broken.killed = Broken.created = 0
    r = invoke(runner, "bench", "api", "--n", "2")
    assert r.exit_code == 1 and "bench: `true`" in r.stderr
    assert Broken.created == Broken.killed  # nothing leaked


@pytest.mark.parametrize("as_json", [False, True])
def test_bench_cli_last_line_is_json(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    monkeypatch.setattr(bench, "Sandbox", FakeBenchSandbox)
    args = ["bench", "api", "--n", "3"] + (["--json"] if as_json else [])
    r = invoke(runner, *args)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary) == set(bench.SUMMARY_KEYS) and summary["n"] == 3
    assert summary["exec_vs_host_ratio"] == pytest.approx(
        summary["exec_true_ms_p50"] / summary["host_spawn_true_ms_p50"], rel=0.05, abs=2e-3
    )
    if as_json:
        assert len(lines) == 1
    else:
        assert "exec_true" in r.stdout and len(lines) > 3
