"""Unit tests of the net bench's pure parts, of its programs (run here against networld's HTTP
handler on 127.0.0.1), and of a whole run on a fake daemon whose "sandboxes" run those programs
on this machine (the measurements need root, a network namespace and a daemon with a bridge)."""

import contextlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import pytest

import branchbox.sandbox_sync as sync_mod
from branchbox_bench import net as bn
from branchbox_bench import networld
from branchbox_cli import app as cli
from branchbox_cli import bench as bench_cli
from conftest import RESULT, SANDBOX, cli_runner

MIB = 1 << 20


@contextlib.contextmanager
def upstream(handler: Any = networld._Handler) -> Iterator[Tuple[str, int]]:
    """networld's HTTP server (or ``handler``) on 127.0.0.1, for the ``with`` block."""
    srv = networld._HTTP(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[0], srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


class Refusing(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"no")

    def log_message(self, *a: Any) -> None:
        pass


class SlowProxy(http.server.BaseHTTPRequestHandler):
    """An HTTP proxy in front of networld, as a sandbox's ``HTTP_PROXY`` sees it: a request for
    ``http://allowed.test/slow`` (the absolute URI a client sends a proxy) gets networld's
    answer ("/slow 198.18.0.1:80") after ``delay`` seconds; anything else is refused (403)."""

    delay = 0.0

    def do_GET(self) -> None:
        if self.path != bn.SLOW_URL:
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        time.sleep(self.delay)
        body = b"/slow 198.18.0.1:80"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: Any) -> None:
        pass


def proxy_env(url: str) -> Dict[str, str]:
    """This process's environment with ``url`` as the proxy (as the daemon sets a sandbox's)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(HTTP_PROXY=url, http_proxy=url, NO_PROXY="localhost,127.0.0.1,::1", no_proxy="localhost,127.0.0.1,::1")
    return env


def py(script: str, *args: Any, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=60, env=env
    )


def test_networld_is_a_module_of_the_package_that_runs_by_path() -> None:
    assert networld.__file__.endswith("branchbox_bench/networld.py")
    assert (networld.ALLOWED, networld.DNS, networld.NETNS) == ("198.18.0.1", "198.18.0.1:53", "bbworld")
    assert bn.UPSTREAM == ("198.18.0.1", 80) and bn.ALLOW == ["198.18.0.1:80"]
    assert bn.PROXY_ALLOW == ["allowed.test"] and networld.NAMES["allowed.test"] == networld.ALLOWED
    assert bn.SLOW_URL == "http://allowed.test/slow"
    # Its servers re-execute the file by path; a run of it that is not "serve" does nothing.
    r = subprocess.run([sys.executable, networld.__file__], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == ""


def test_the_get_program_makes_one_request_or_none() -> None:
    with upstream() as (host, port):
        assert py(bn.GET_SCRIPT, host, port).returncode == 0
        assert py(bn.GET_SCRIPT, *bn.NO_REQUEST).returncode == 0
    with upstream(Refusing) as (host, port):
        r = py(bn.GET_SCRIPT, host, port)
        assert r.returncode == 1 and "403" in r.stderr
    r = py(bn.GET_SCRIPT, host, port)  # nothing listens any more: no retry, a failure
    assert r.returncode == 1 and "Connection refused" in r.stderr


def test_the_round_trip_program_times_each_request() -> None:
    with upstream() as (host, port):
        r = py(bn.RTT_SCRIPT, host, port, 7)
        assert r.returncode == 0, r.stderr
        ms = json.loads(r.stdout)
        assert len(ms) == 7 and all(0 < x < 10_000 for x in ms)
    with upstream(Refusing) as (host, port):
        assert py(bn.RTT_SCRIPT, host, port, 3).returncode == 1


def test_the_download_program_counts_the_body() -> None:
    n = 3 * MIB + 5
    with upstream() as (host, port):
        r = py(bn.THROUGHPUT_SCRIPT, host, port, n)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["bytes"] == n and got["seconds"] > 0
    with upstream(Refusing) as (host, port):
        r = py(bn.THROUGHPUT_SCRIPT, host, port, n)
        assert r.returncode == 1 and "403" in r.stderr


def wait_until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_inflight_program_waits_for_go_then_asks_through_the_proxy(tmp_path: Path) -> None:
    ready, go, sent, out = (tmp_path / n for n in ("ready", "go", "sent", "body"))
    with upstream(SlowProxy) as (host, port):
        proc = subprocess.Popen(
            [sys.executable, "-c", bn.INFLIGHT_SCRIPT, bn.SLOW_URL, str(ready), str(go), str(sent), str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proxy_env("http://%s:%d" % (host, port)),
        )
        try:
            wait_until(ready.exists)
            # Ready, and waiting for the go file: no request sent, no sent marker.
            time.sleep(0.2)
            assert proc.poll() is None and not sent.exists() and not out.exists()
            go.write_text("go\n")
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, stderr
    assert sent.exists() and out.read_text() == "/slow 198.18.0.1:80"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["body", "go", "ready", "sent"], "no part file left"
    # A refusal by the proxy: a failure, and no body file (written whole or not at all).
    for f in (ready, sent, out):
        f.unlink()
    with upstream(Refusing) as (host, port):
        r = py(bn.INFLIGHT_SCRIPT, bn.SLOW_URL, ready, go, sent, out, env=proxy_env("http://%s:%d" % (host, port)))
    assert r.returncode == 1 and "403" in r.stderr
    assert ready.exists() and sent.exists() and not out.exists()


def fake_result() -> bn.NetResult:
    res = bn.NetResult(bn.NetConfig(samples=3, ckpt_samples=2, fork_reps=1, rtt_requests=4, throughput_mb=8))
    for ms in (10.0, 30.0, 20.0):
        res.add("create_none", ms)
        res.add("create_allowlist", ms + 5)
        res.add("create_allowlist_names", ms + 2)
        res.add("create_open", ms + 3)
        res.add("create_none_first_command", ms + 40)
        res.add("create_allowlist_first_request", ms + 60)
    res.add("fork16_none", 100.0)
    res.add("fork16_allowlist", 150.0)
    for ms in (1.0, 2.0, 3.0, 4.0):
        res.add("http_rtt", ms * 0.3)
        res.add("host_http_rtt", ms * 0.2)
    res.downloads["sandbox"] = [{"seconds": 1.0, "bytes": 500_000_000}, {"seconds": 0.5, "bytes": 500_000_000}]
    res.downloads["host"] = [{"seconds": 0.5, "bytes": 1_000_000_000}, {"seconds": 0.5, "bytes": 1_000_000_000}]
    res.rx_bytes = [8 * MIB + 700, 8 * MIB + 650]
    res.add("ckpt", 8.0)
    res.add("ckpt", 12.0)
    res.ckpt_server_ms = [5.0, 7.0]
    for ms in (15.0, 21.0, 17.0):
        res.add("ckpt_during_inflight", ms)
    for ms in (14.0, 16.0, 12.0):
        res.add("ckpt_same_process_idle", ms)
    res.inflight_server_ms = [6.0, 8.0]
    res.same_process_idle_server_ms = [5.0, 6.0]
    res.fork_request_ms = {"none": [60.0], "allowlist": [90.0]}
    res.fork_server_ms = {"none": [50.0], "allowlist": [80.0]}
    res.pool = {"none": {"hits": 3, "misses": 0}, "allowlist": {"hits": 3, "misses": 0}}
    return res


def test_summary_shape_and_ratios() -> None:
    s = fake_result().summary()
    assert tuple(s)[: len(bn.SUMMARY_KEYS)] == bn.SUMMARY_KEYS
    assert json.loads(json.dumps(s)) == s
    assert (s["create_none_ms_p50"], s["create_allowlist_ms_p50"]) == (20.0, 25.0)
    assert (s["create_none_first_command_ms_p50"], s["create_allowlist_first_request_ms_p50"]) == (60.0, 80.0)
    assert (s["create_allowlist_extra_ms_p50"], s["first_request_extra_ms_p50"]) == (5.0, 20.0)
    assert (s["create_allowlist_names_ms_p50"], s["create_allowlist_names_extra_ms_p50"]) == (22.0, 2.0)
    assert (s["create_open_ms_p50"], s["create_open_extra_ms_p50"]) == (23.0, 3.0)
    assert (s["fork16_none_ms"], s["fork16_allowlist_ms"]) == (100.0, 150.0)
    assert (s["http_rtt_ms_p50"], s["host_http_rtt_ms_p50"], s["http_rtt_vs_host_ratio"]) == (0.75, 0.5, 1.5)
    assert s["http_rtt_ms"]["sandbox"]["p99"] == pytest.approx(1.191)
    # 500 MB/s and 1000 MB/s: median 750, against 2000 on the host.
    assert (s["throughput_mb_s"], s["host_throughput_mb_s"], s["throughput_vs_host_ratio"]) == (750.0, 2000.0, 0.375)
    assert s["throughput_mb_s_samples"] == [500.0, 1000.0] and s["host_throughput_mb_s_samples"] == [2000.0, 2000.0]
    assert (s["ckpt_ms_p50"], s["ckpt_server_ms_p50"]) == (10.0, 6.0)
    assert (s["ckpt_during_inflight_ms_p50"], s["ckpt_during_inflight_server_ms_p50"]) == (17.0, 7.0)
    assert s["ckpt_inflight_vs_idle_ms"] == 7.0 and s["inflight_answered_before_ckpt"] == 0
    assert (s["ckpt_same_process_idle_ms_p50"], s["ckpt_same_process_idle_server_ms_p50"]) == (14.0, 5.5)
    assert s["ckpt_inflight_vs_same_process_idle_ms"] == 3.0
    assert s["fork16_request_ms_p50"] == {"none": 60.0, "allowlist": 90.0}
    assert s["fork16_server_ms_p50"] == {"none": 50.0, "allowlist": 80.0}
    assert (s["samples"], s["ckpt_samples"], s["fork_reps"], s["rtt_requests"], s["throughput_mb"]) == (3, 2, 1, 4, 8)
    assert s["inflight_samples"] == 7
    assert s["upstream"] == "198.18.0.1:80" and s["image"] == "base"
    assert "http_rtt" not in s["samples_ms"] and s["samples_ms"]["create_none"] == [10.0, 30.0, 20.0]
    assert s["samples_ms"]["ckpt_during_inflight"] == [15.0, 21.0, 17.0] and s["notes"] == []
    assert s["samples_ms"]["ckpt_same_process_idle"] == [14.0, 16.0, 12.0]
    assert [row[0] for row in fake_result().rows()] == list(bn.METRICS)


def test_nothing_measured_is_none_not_an_error() -> None:
    s = bn.NetResult(bn.NetConfig()).summary()
    assert all(s[k] is None for k in bn.SUMMARY_KEYS if k.endswith(("_p50", "_ms", "ratio", "mb_s")))
    assert s["throughput_mb_s_samples"] == [] and s["samples_ms"] == {} and s["pool"] == {}
    lines = bench_cli.net_report_lines(s)
    assert any("download of 256 MiB: sandbox - vs host - (ratio -)" in line for line in lines)
    # A host time of 0 gives no ratio rather than a division error.
    res = bn.NetResult(bn.NetConfig())
    res.add("http_rtt", 1.0)
    res.add("host_http_rtt", 0.0)
    assert res.summary()["http_rtt_vs_host_ratio"] is None


def test_it_needs_root_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bn.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(bn, "health", lambda **kw: pytest.fail("no daemon call before the check"))
    monkeypatch.setattr(bn.networld, "world", lambda: pytest.fail("no world before the check"))
    with pytest.raises(bn.BenchError, match="run it as root"):
        bn.run_net_bench(bn.NetConfig())


def test_it_leaves_an_existing_world_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bn.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bn.shutil, "which", lambda name: "/usr/sbin/" + name)
    monkeypatch.setattr(bn.os.path, "exists", lambda p: p == "/run/netns/bbworld")
    monkeypatch.setattr(bn, "health", lambda **kw: pytest.fail("no daemon call before the check"))
    with pytest.raises(bn.BenchError, match="ip netns del bbworld"):
        bn.run_net_bench(bn.NetConfig())


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(cfg, progress=None):
        seen["cfg"] = cfg
        progress("x")
        return fake_result()

    monkeypatch.setattr(bn, "run_net_bench", fake_run)
    r = cli_runner().invoke(cli.app, ["--daemon", "unix:///x.sock", "bench", "net", "--samples", "4", "--image", "img"])
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["http_rtt_vs_host_ratio"] == 1.5 and s["throughput_vs_host_ratio"] == 0.375
    text = r.stdout
    assert "create_allowlist_first_request" in text and "fork16_allowlist" in text
    assert "create p50: allowlist 25.0 ms (names only 22.0 ms) vs none 20.0 ms" in text
    assert "HTTP round trip to 198.18.0.1:80 p50: sandbox 0.750 ms vs host 0.500 ms (ratio 1.50)" in text
    assert "download of 8 MiB: sandbox 750 MB/s vs host 2000 MB/s (ratio 0.38)" in text
    assert "checkpoint of an idle allowlist sandbox p50: 10.0 ms; with a request in flight through the proxy: " \
        "17.0 ms (+7.0 ms vs idle)" in text
    assert "checkpoint of the proxied sandbox p50, its process before its request: 14.0 ms; with the request in " \
        "flight: 17.0 ms (+3.0 ms vs the same process before its request)" in text
    assert "ckpt_during_inflight" in text and "note:" not in text
    cfg = seen["cfg"]
    assert (cfg.samples, cfg.ckpt_samples, cfg.image, cfg.daemon) == (4, 4, "img", "unix:///x.sock")
    assert cfg.inflight_samples == 7
    r = cli_runner().invoke(cli.app, ["bench", "net", "--json"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1
    assert (seen["cfg"].samples, seen["cfg"].ckpt_samples, seen["cfg"].image) == (15, 10, "base")


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg, progress=None):
        raise bn.BenchError("bench net: the first request to 198.18.0.1:80 of a fresh allowlist sandbox sb-1 failed")

    monkeypatch.setattr(bn, "run_net_bench", broken)
    r = cli_runner().invoke(cli.app, ["bench", "net"])
    assert r.exit_code == 1 and "bench net: the first request" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- a whole run on a fake daemon


#: The proxy URL of the fake daemon's proxied sandboxes.
PROXY_URL = "http://127.0.0.1:3128"


class NetDaemon:
    """Just enough of branchboxd for ``bench net``: creates (pool counters), commands (run
    here by this python, against a local upstream; background ones too), info with
    ``net_rx_bytes`` and ``proxy``, forks, checkpoints, kills, snapshot gc, a file's stat, read
    and write (a sandbox's files under ``root``/<id>, where its background programs see them;
    a kill ends its programs still running). Sandboxes in mode ``none`` cannot reach the
    upstream; those created with ``proxy`` reach :class:`SlowProxy` (``proxy_url``) through
    ``HTTP_PROXY``."""

    def __init__(self, root: Path, proxy_url: str) -> None:
        self.root = root
        self.proxy_url = proxy_url
        self.procs: Dict[int, Tuple[str, subprocess.Popen]] = {}
        self.running: Dict[str, List[str]] = {}  # per sandbox: its in-flight program's ready, go, sent, body
        self.sandbox_procs: Dict[str, List[subprocess.Popen]] = {}  # ended when their sandbox is killed
        self.killed_running = 0  # background programs still running when their sandbox was killed
        self.proxied: List[Dict[str, Any]] = []  # the bodies of creates with a proxy
        self.ignore_proxy = False  # a daemon without the proxy: creates with one get none
        self.lose_answers = False  # the in-flight answers' files are gone when the program ends
        self.ignore_go = False  # a written go file never reaches the sandbox's programs
        #: Per checkpoint of a sandbox running the in-flight program: (sandbox, the markers that
        #: existed then: "ready", "go", "sent", "body").
        self.ckpt_markers: List[Tuple[str, List[str]]] = []
        self.sandboxes: Dict[str, Dict[str, Any]] = {}
        self.created: List[Tuple[str, Any]] = []
        self.killed: List[str] = []
        self.forks: List[Tuple[str, Dict[str, Any]]] = []
        self.checkpoints: List[str] = []
        self.files: List[Tuple[str, str]] = []
        self.gc: List[Dict[str, Any]] = []
        self.commands: List[Tuple[str, List[str]]] = []
        self.children: List[str] = []
        self.hits = 0
        self.fail_get_in: str = ""  # "fork child": the request fails in the 3rd child
        self.n = 0

    def _sandbox(self, network: str, allow: Any) -> Dict[str, Any]:
        self.n += 1
        sid = "sb-%012x" % self.n
        self.sandboxes[sid] = dict(SANDBOX, id=sid, network=network, allow=allow or [], net_rx_bytes=0,
                                   address=None if network == "none" else "10.0.0.%d" % self.n)
        return self.sandboxes[sid]

    def path(self, sid: str, path: str) -> Path:
        """Where ``path`` of sandbox ``sid`` is on this machine."""
        return self.root / sid / path.lstrip("/")

    def _start(self, sid: str, argv: List[str]) -> int:
        """A background command: only the in-flight program, through the proxy if it has one
        (else to a port nothing listens on: mode none has no way out)."""
        assert argv[:3] == ["python3", "-c", bn.INFLIGHT_SCRIPT], argv
        self.commands.append((sid, argv))
        self.path(sid, "/root").mkdir(parents=True, exist_ok=True)
        args = [str(self.path(sid, a)) if a.startswith("/") else a for a in argv[3:]]
        proxy = self.proxy_url if self.sandboxes[sid]["proxy"] else "http://127.0.0.1:9"
        proc = subprocess.Popen([sys.executable, "-c", argv[2], *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=proxy_env(proxy))
        self.procs[proc.pid] = (args[-1], proc)
        self.running[sid] = args[1:]
        self.sandbox_procs.setdefault(sid, []).append(proc)
        return proc.pid

    def _wait(self, pid: int, timeout: Optional[float]) -> Dict[str, Any]:
        """The program's result, or (still running after ``timeout`` s) a timed-out one."""
        out, proc = self.procs[pid]
        try:
            stdout, stderr = proc.communicate(timeout=60 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            return dict(RESULT, pid=pid, exit_code=None, stdout="", stderr="", timed_out=True)
        del self.procs[pid]
        if self.lose_answers and os.path.exists(out):
            os.unlink(out)
        return dict(RESULT, pid=pid, exit_code=proc.returncode, stdout=stdout, stderr=stderr)

    def _run(self, sid: str, argv: List[str]) -> Dict[str, Any]:
        self.commands.append((sid, argv))
        assert argv[:2] == ["python3", "-c"]
        sbx = self.sandboxes[sid]
        if argv[3] != "-" and sbx["network"] == "none":
            return dict(RESULT, exit_code=1, stdout="", stderr="OSError: [Errno 101] Network is unreachable")
        if self.fail_get_in == "fork child" and sbx.get("child") == 3 and sbx["network"] == "allowlist":
            return dict(RESULT, exit_code=1, stdout="", stderr="ConnectionRefusedError: [Errno 111] Connection refused")
        r = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
        if argv[2] == bn.THROUGHPUT_SCRIPT and r.returncode == 0:
            sbx["net_rx_bytes"] += int(argv[5]) + 1000
        return dict(RESULT, exit_code=r.returncode, stdout=r.stdout, stderr=r.stderr)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        m, path = request.method, request.url.path
        body = json.loads(request.content) if request.content and m != "PUT" else None
        ok = lambda data, status=200: httpx.Response(status, json=data)  # noqa: E731
        if (m, path) == ("GET", "/v1/health"):
            return ok({"ok": True})
        if (m, path) == ("GET", "/v1/pool"):
            return ok({"hits": self.hits, "misses": 0})
        if (m, path) == ("POST", "/v1/snapshots/gc"):
            self.gc.append(body)
            return ok({"deleted": [], "freed_bytes": 0})
        if (m, path) == ("POST", "/v1/sandboxes"):
            self.created.append((body.get("network"), body.get("allow")))
            self.hits += 1
            sbx = self._sandbox(body.get("network") or "none", body.get("allow"))
            if body.get("proxy"):
                self.proxied.append(body)
            sbx["proxy"] = PROXY_URL if body.get("proxy") and not self.ignore_proxy else None
            return ok(sbx, 201)
        ms = re.match(r"^/v1/sandboxes/(sb-[0-9a-f]+)(/.*)?$", path)
        if ms and ms.group(1) in self.sandboxes:
            sid, rest = ms.group(1), ms.group(2) or ""
            sbx = self.sandboxes[sid]
            if (m, rest) == ("GET", ""):
                return ok(sbx)
            if (m, rest) == ("DELETE", ""):
                del self.sandboxes[sid]
                self.killed.append(sid)
                for proc in self.sandbox_procs.pop(sid, []):
                    if proc.poll() is None:
                        self.killed_running += 1
                        proc.kill()
                    proc.communicate()
                    self.procs.pop(proc.pid, None)
                return ok({"killed": True})
            if (m, rest) == ("POST", "/commands"):
                if body.get("background"):
                    return ok({"pid": self._start(sid, body["args"])})
                return ok(self._run(sid, body["args"]))
            mw = re.match(r"^/commands/(\d+)/wait$", rest)
            if m == "POST" and mw:
                return ok(self._wait(int(mw.group(1)), (body or {}).get("timeout")))
            if (m, rest) in (("GET", "/files/stat"), ("GET", "/files")):
                p = self.path(sid, request.url.params["path"])
                if not p.exists():
                    return ok({"error": {"code": "not_found", "message": "no such file"}}, 404)
                if rest == "/files":
                    return httpx.Response(200, content=p.read_bytes())
                return ok({"name": p.name, "path": request.url.params["path"], "type": "file",
                           "size": p.stat().st_size})
            if (m, rest) == ("PUT", "/files"):
                self.files.append((sid, request.url.params["path"]))
                if not self.ignore_go or not request.url.params["path"].endswith(".go"):
                    p = self.path(sid, request.url.params["path"])
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_bytes(request.content)
                return ok({"name": "f", "path": request.url.params["path"], "type": "file", "size": 1})
            if (m, rest) == ("POST", "/checkpoint"):
                self.checkpoints.append(sid)
                if sid in self.running:
                    names = ("ready", "go", "sent", "body")
                    self.ckpt_markers.append(
                        (sid, [k for k, f in zip(names, self.running[sid]) if os.path.exists(f)])
                    )
                return ok({"id": "sn-%012x" % len(self.checkpoints), "sandbox_id": sid, "took_ms": 3.0}, 201)
            if (m, rest) == ("POST", "/fork"):
                self.forks.append((sid, body))
                kids = []
                for i in range(body["count"]):
                    kid = self._sandbox(sbx["network"], sbx["allow"])
                    kid["child"], kid["proxy"] = i + 1, sbx["proxy"]
                    self.children.append(kid["id"])
                    kids.append(kid)
                return ok({"snapshot": "sn-f", "sandboxes": kids, "sessions_restarted": False, "took_ms": 9.0}, 201)
        return ok({"error": {"code": "not_found", "message": "no route %s %s" % (m, path)}}, 404)


@pytest.fixture
def net_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[NetDaemon]:
    proxy = contextlib.ExitStack()
    monkeypatch.setattr(SlowProxy, "delay", 0.5)
    d = NetDaemon(tmp_path, "http://%s:%d" % proxy.enter_context(upstream(SlowProxy)))
    real = sync_mod.ConnectionConfig
    transport = httpx.MockTransport(d)

    class Patched(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.transport = transport

    monkeypatch.setattr(sync_mod, "ConnectionConfig", Patched)
    monkeypatch.setattr(bn, "_check_prerequisites", lambda: None)
    worlds = []

    @contextlib.contextmanager
    def world():
        worlds.append("up")
        try:
            yield
        finally:
            worlds.append("down")

    monkeypatch.setattr(bn.networld, "world", world)
    d.worlds = worlds  # type: ignore[attr-defined]
    # The request is sent soon after its marker here; the settle only has to stay below the delay.
    monkeypatch.setattr(bn, "INFLIGHT_SETTLE", 0.05)
    with proxy, upstream() as addr:
        monkeypatch.setattr(bn, "UPSTREAM", addr)
        yield d


def small() -> bn.NetConfig:
    return bn.NetConfig(samples=2, ckpt_samples=3, inflight_samples=2, fork_reps=2, rtt_requests=5, throughput_mb=2,
                        throughput_rounds=2)


def test_whole_run_on_a_fake_daemon(net_daemon: NetDaemon) -> None:
    d = net_daemon
    seen: List[str] = []
    res = bn.run_net_bench(small(), seen.append)
    s = res.summary()
    assert d.worlds == ["up", "down"]  # type: ignore[attr-defined]
    for key in bn.SUMMARY_KEYS[:14]:
        assert s[key] is not None and s[key] > 0, key
    assert s["ckpt_inflight_vs_idle_ms"] == round(s["ckpt_during_inflight_ms_p50"] - s["ckpt_ms_p50"], 3)
    # Creates alternate, and flip the order each round; allowlist lists the upstream only; each
    # round ends with an allowlist of names and mode open.
    up, names = ("allowlist", ["198.18.0.1:80"]), ("allowlist", ["allowed.test", "*.allowed.test"])
    opened = ("open", None)
    assert d.created[:8] == [("none", None), up, names, opened, up, ("none", None), names, opened]
    assert [len(s["samples_ms"][k]) for k in bn.METRICS if k in s["samples_ms"]] == [2, 2, 2, 2, 2, 2, 2, 2, 3, 2, 2]
    assert s["pool"] == {"none": {"hits": 2, "misses": 0}, "allowlist": {"hits": 2, "misses": 0}}
    # fork(16) twice per mode with the children's TTL; each child ran one command.
    assert [b["count"] for _, b in d.forks] == [16] * 4 and all(b["timeout"] == bn.SAMPLE_TTL for _, b in d.forks)
    child_cmds = [a[3] for sid, a in d.commands if sid in d.children]
    assert len(d.children) == 64 and len(child_cmds) == 64
    assert sorted(set(child_cmds)) == sorted({"-", bn.UPSTREAM[0]})
    # The round trips and downloads on both sides; the sandbox's rx counter checked.
    assert len(res.samples["http_rtt"]) == len(res.samples["host_http_rtt"]) == 5
    assert len(s["throughput_mb_s_samples"]) == len(s["host_throughput_mb_s_samples"]) == 2
    assert s["sandbox_rx_bytes"] == [2 * MIB + 1000] * 2
    # Checkpoints with a file changed before each, then rounds on a sandbox in mode none with
    # a proxy that allows allowed.test: a fresh process each, checkpointed while it waits for
    # the go file (ready, nothing sent), then again with its request in flight (sent, not yet
    # answered), the answer arriving in the sandbox afterwards.
    assert len(d.checkpoints) == 7
    assert d.proxied == [{"image": "base", "timeout": bn.TTL, "network": "none", "allow": ["allowed.test"],
                          "proxy": True}]
    proxied = d.checkpoints[3]
    assert d.checkpoints[3:] == [proxied] * 4 and proxied != d.checkpoints[0]
    assert d.files == [(d.checkpoints[0], "/root/bb-bench-net.txt")] * 3 + [
        (proxied, "/root/bb-bench-inflight-%d.go" % i) for i in range(2)
    ]
    assert d.ckpt_markers == [(proxied, ["ready"]), (proxied, ["ready", "go", "sent"])] * 2
    inflight = [a for sid, a in d.commands if a[2] == bn.INFLIGHT_SCRIPT]
    assert [a[3:] for a in inflight] == [
        [bn.SLOW_URL] + ["/root/bb-bench-inflight-%d.%s" % (i, ext) for ext in ("ready", "go", "sent", "body")]
        for i in range(2)
    ]
    assert d.path(proxied, "/root/bb-bench-inflight-1.body").read_text() == "/slow 198.18.0.1:80"
    assert s["inflight_answered_before_ckpt"] == 0 and len(s["samples_ms"]["ckpt_during_inflight"]) == 2
    assert len(s["samples_ms"]["ckpt_same_process_idle"]) == 2
    assert s["ckpt_during_inflight_server_ms_p50"] == s["ckpt_same_process_idle_server_ms_p50"] == 3.0
    assert s["ckpt_same_process_idle_ms_p50"] > 0
    assert s["ckpt_inflight_vs_same_process_idle_ms"] == round(
        s["ckpt_during_inflight_ms_p50"] - s["ckpt_same_process_idle_ms_p50"], 3
    )
    assert d.procs == {} and d.killed_running == 0
    assert d.sandboxes == {}, "every sandbox killed"
    assert [g["keep"] for g in d.gc] == [[], [], [], []] and len({g["sandbox"] for g in d.gc}) == 4
    assert s["notes"] == []
    assert any(m.startswith("checkpoint 2/2 with a request in flight") for m in seen)
    assert any(m.startswith("checkpoint 2/2 of the proxied sandbox, its process before its request") for m in seen)
    assert any(m.startswith("fork(16) 2/2") for m in seen)


def test_a_failing_child_request_fails_the_run_and_cleans_up(net_daemon: NetDaemon) -> None:
    net_daemon.fail_get_in = "fork child"
    with pytest.raises(bn.BenchError, match=r"failed in 1 of the 16 children of fork\(16\) of allowlist sandbox"):
        bn.run_net_bench(small())
    assert net_daemon.sandboxes == {} and net_daemon.worlds == ["up", "down"]  # type: ignore[attr-defined]


def test_a_sandbox_without_egress_fails_the_first_request(net_daemon: NetDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    # A daemon that ignored the mode: the allowlist sandbox cannot reach the upstream.
    real = net_daemon._sandbox
    monkeypatch.setattr(net_daemon, "_sandbox", lambda network, allow: real("none", allow))
    with pytest.raises(bn.BenchError, match="the first request to .* of a fresh allowlist sandbox sb-.* failed, .*unreachable"):
        bn.run_net_bench(small())
    assert net_daemon.sandboxes == {}



def inflight_only(cfg: bn.NetConfig) -> bn.NetResult:
    """The bench's in-flight checkpoints alone (its sandboxes killed, its snapshots deleted)."""
    res = bn.NetResult(cfg)
    with contextlib.ExitStack() as stack:
        bn._Run(cfg, res, stack, lambda m: None).inflight_checkpoints()
    return res


def test_a_daemon_without_the_proxy_fails_the_inflight_part(net_daemon: NetDaemon) -> None:
    net_daemon.ignore_proxy = True
    with pytest.raises(bn.BenchError, match=r"created with proxy=True but has no proxy"):
        inflight_only(small())
    assert len(net_daemon.proxied) == 1 and net_daemon.sandboxes == {} and net_daemon.commands == []


def test_a_failed_inflight_request_fails_the_run(net_daemon: NetDaemon) -> None:
    net_daemon.proxy_url = "http://127.0.0.1:9"  # the proxy lets nothing through
    with pytest.raises(bn.BenchError, match=r"(?s)the request 1 to http://allowed.test/slow through the proxy in "
                                            r"sandbox sb-\w+ failed after the checkpoint \(exit 1: .*refused"):
        inflight_only(small())
    assert net_daemon.sandboxes == {} and len(net_daemon.checkpoints) == 2


def test_a_program_that_never_gets_the_go_fails_the_run_and_is_ended(
    net_daemon: NetDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    net_daemon.ignore_go = True
    monkeypatch.setattr(bn, "MARKER_TIMEOUT", 0.5)
    with pytest.raises(bn.BenchError, match=r"the request 1 .* in sandbox sb-\w+: its program wrote no sent marker "
                                            r"\(/root/bb-bench-inflight-0.sent\) in 0 s \(still running\)"):
        inflight_only(small())
    # Only the checkpoint of the waiting process was taken; the kill ended the program.
    assert len(net_daemon.checkpoints) == 1 and net_daemon.ckpt_markers[0][1] == ["ready"]
    assert net_daemon.sandboxes == {} and net_daemon.killed_running == 1 and net_daemon.procs == {}


def test_an_answer_that_does_not_arrive_fails_the_run(net_daemon: NetDaemon) -> None:
    net_daemon.lose_answers = True
    with pytest.raises(bn.BenchError, match=r"the answer of the request 1 .*, in flight during checkpoint sn-\w+, "
                                            r"did not arrive in sandbox sb-\w+ "
                                            r"\(/root/bb-bench-inflight-0.body: missing\)"):
        inflight_only(small())
    assert net_daemon.sandboxes == {} and net_daemon.procs == {} and len(net_daemon.gc) == 1


def test_a_request_answered_before_its_checkpoint_returned_is_noted(
    net_daemon: NetDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SlowProxy, "delay", 0.0)
    monkeypatch.setattr(bn, "INFLIGHT_SETTLE", 0.3)
    s = inflight_only(small()).summary()
    assert s["inflight_answered_before_ckpt"] == 2 and len(s["samples_ms"]["ckpt_during_inflight"]) == 2
    assert any("2 of the 2 in-flight requests were answered before" in n for n in s["notes"])
