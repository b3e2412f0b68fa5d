"""``branchbox bench net``: what a sandbox's network costs, mode ``allowlist`` against ``none``
and a sandbox's traffic against the same traffic from the host.

The upstream is :mod:`branchbox_bench.networld` (brought up by the bench, as root: a network
namespace ``bbworld`` reached from the host through a veth, with networld's python HTTP server
on 198.18.0.1:80). Sandboxes with egress reach it as they would any address routed from the
host (through the daemon's bridge, NAT'd). Every in-sandbox program is passed with ``python3
-c`` (no file is written first) and talks plain sockets: one request per TCP connection,
``HTTP/1.0``, a ``200`` answer checked. Nothing is retried: a request that fails fails the run.

Measured, on the daemon the CLI talks to, with the client's ``time.perf_counter`` around SDK
calls (create, fork, checkpoint) and the program's own ``perf_counter`` inside the processes
that make requests:

- ``create_none_ms_p50`` / ``create_allowlist_ms_p50``: ``Sandbox.create(network="none")``
  against ``Sandbox.create(network="allowlist", allow=["198.18.0.1:80"])``, alternated (the
  order flips each round), ``samples`` of each, each sandbox killed afterwards (not timed). The
  same sandboxes give ``create_allowlist_first_request_ms_p50`` (create, then one GET of
  ``http://198.18.0.1/`` from inside it, until the command's answer) and
  ``create_none_first_command_ms_p50`` (create, then the same program told to make no
  request: the baseline of a first command). The warm pool's hits and misses per mode are in
  ``pool``. ``create_allowlist_names_ms_p50``: ``Sandbox.create(network="allowlist",
  allow=["allowed.test", "*.allowed.test"])`` in the same rounds (names only: the daemon's DNS
  lets their addresses through; no address entry to add to the sandbox's rules), and
  ``create_open_ms_p50``: ``Sandbox.create(network="open")``, in the same rounds, create only.
- ``fork16_allowlist_ms``: from ``fork(16)`` of an allowlist parent until each of the 16
  children has made one successful GET (the children's commands run concurrently, one thread
  each); ``fork16_none_ms``: the same with a parent in mode ``none`` and the no-request program.
  The median of ``fork_reps`` forks of each (alternated); children are killed afterwards.
- ``http_rtt_ms_p50``: one python process in an allowlist sandbox makes ``rtt_requests``
  sequential GETs, each on a new TCP connection, timing each (connect to the answer's end);
  the p50. ``host_http_rtt_ms_p50``: the same program run on the host.
  ``http_rtt_vs_host_ratio`` = sandbox / host (above 1: the sandbox is slower).
- ``throughput_mb_s``: the sandbox downloads ``/bytes/N`` (N = ``throughput_mb`` MiB) with a
  ``recv_into`` loop over one 1 MiB buffer, timed inside (connect to the last byte), MB/s
  (10^6 bytes), the median of ``throughput_rounds``; ``host_throughput_mb_s``: the same on the
  host, rounds alternated with the sandbox's. ``throughput_vs_host_ratio`` = sandbox / host
  (below 1: the sandbox is slower). Both sides read from the same single-threaded python
  server, which may be the bound of both. The sandbox's ``net_rx_bytes`` is checked against
  the bytes it downloaded.
- ``ckpt_ms_p50``: ``checkpoint()`` of an idle allowlist sandbox (one GET made first), a small
  file changed before each; ``ckpt_samples``.
- ``ckpt_during_inflight_ms_p50``: ``checkpoint()`` of a sandbox in mode ``none`` with the
  daemon's proxy (``proxy=True``, ``allow=["allowed.test"]``: the proxy is its only way out)
  while one of its processes waits for the answer of ``GET http://allowed.test/slow`` through
  the proxy (the upstream answers after 2 s); the process writes a "sent" marker just before
  the request, the bench polls it and waits :data:`INFLIGHT_SETTLE` more, then times the
  checkpoint. ``inflight_samples`` rounds, a fresh process and request each; each answer must
  then reach the original sandbox (its body file holds ``/slow``), or the run fails.
  ``ckpt_inflight_vs_idle_ms`` = that p50 - ``ckpt_ms_p50`` (a different sandbox, with no
  process of its own running: the difference includes the process's cost, not only the
  request's). The proxy resolves ``allowed.test`` through the daemon's ``--net-dns``
  (networld's DNS, 198.18.0.1:53).
- ``ckpt_same_process_idle_ms_p50``: the paired baseline, in the same sandbox and the same
  rounds: the round's process first writes a "ready" marker and waits (polling every 10 ms) for
  a "go" file; the bench polls the ready marker, waits :data:`INFLIGHT_SETTLE` more and times a
  checkpoint, then writes the go file (``files.write``) and only then does the process send its
  request (the in-flight checkpoint above follows). ``ckpt_inflight_vs_same_process_idle_ms``
  = ``ckpt_during_inflight_ms_p50`` - that p50: what the request in flight itself costs.

Every sandbox the bench makes is killed, and the snapshots its checkpoints and forks made are
deleted, at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from branchbox import CommandHandle, NotFoundError, Pool, Sandbox, SandboxError, Snapshots
from branchbox.sandbox_sync import health

from . import networld
from .stats import diff, percentile, ratio, stats_rows
from .store import BenchError, quiet, sigterm_unwinds

__all__ = [
    "BenchError",
    "NetConfig",
    "NetResult",
    "run_net_bench",
    "SUMMARY_KEYS",
    "METRICS",
    "GET_SCRIPT",
    "RTT_SCRIPT",
    "THROUGHPUT_SCRIPT",
    "INFLIGHT_SCRIPT",
    "UPSTREAM",
    "ALLOW",
]

MIB = 1 << 20
#: The upstream server every request goes to, and the allow entry that lets sandboxes reach it.
UPSTREAM = (networld.ALLOWED, 80)
ALLOW = ["%s:%d" % UPSTREAM]
#: The names-only allow list of ``create_allowlist_names``.
NAMES_ALLOW = ["allowed.test", "*.allowed.test"]
#: Arguments of :data:`GET_SCRIPT` that make it skip the request (the no-network baseline).
NO_REQUEST = ["-", "0"]
#: Sandbox TTLs (s): the create samples' sandboxes, and the others (a killed bench leaves none
#: running for long).
SAMPLE_TTL = 120
TTL = 900
COMMAND_TIMEOUT = 60.0
THROUGHPUT_TIMEOUT = 600.0
FORK_N = 16

SUMMARY_KEYS = (
    "create_none_ms_p50",
    "create_allowlist_ms_p50",
    "create_allowlist_names_ms_p50",
    "create_open_ms_p50",
    "create_none_first_command_ms_p50",
    "create_allowlist_first_request_ms_p50",
    "fork16_none_ms",
    "fork16_allowlist_ms",
    "http_rtt_ms_p50",
    "host_http_rtt_ms_p50",
    "http_rtt_vs_host_ratio",
    "throughput_mb_s",
    "host_throughput_mb_s",
    "throughput_vs_host_ratio",
    "ckpt_ms_p50",
    "ckpt_during_inflight_ms_p50",
    "ckpt_inflight_vs_idle_ms",
    "ckpt_same_process_idle_ms_p50",
    "ckpt_inflight_vs_same_process_idle_ms",
    "samples",
    "ckpt_samples",
    "inflight_samples",
    "fork_reps",
    "rtt_requests",
    "throughput_mb",
    "throughput_rounds",
    "upstream",
)
#: Millisecond metrics of the table, in its order (``http_rtt`` / ``host_http_rtt``: one
#: sample per request).
METRICS = (
    "create_none",
    "create_allowlist",
    "create_allowlist_names",
    "create_open",
    "create_none_first_command",
    "create_allowlist_first_request",
    "fork16_none",
    "fork16_allowlist",
    "http_rtt",
    "host_http_rtt",
    "ckpt",
    "ckpt_same_process_idle",
    "ckpt_during_inflight",
)
#: What the in-flight checkpoints' sandbox may reach through its proxy, and what it asks for
#: (networld answers ``/slow`` after 2 s, with a body that starts with the path).
PROXY_ALLOW = ["allowed.test"]
SLOW_URL = "http://allowed.test/slow"
#: Seconds between one of the in-flight program's markers and the checkpoint that follows it
#: (the program is waiting for the go file, or its request is sent, by then).
INFLIGHT_SETTLE = 0.2
#: Seconds a marker is waited for (the program's start, or its answer to the go file).
MARKER_TIMEOUT = 30.0

# One GET of http://argv[1]:argv[2]/ on a new connection, the answer read to its end and its
# status checked; with argv[1] "-" no request is made (the same program and argv shape).
GET_SCRIPT = r'''
import socket, sys
if sys.argv[1] != "-":
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 10)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    d = b"".join(iter(lambda: s.recv(65536), b""))
    if d.split(b" ", 2)[1:2] != [b"200"]:
        sys.exit("answer: %r" % d[:200])
'''

# argv: url ready go sent out. Writes the ready marker and waits for the go file (polled every
# 10 ms), then writes the sent marker, GETs url through $HTTP_PROXY (urllib honours it) and
# writes the answer's body to out (complete or not at all: renamed into place).
INFLIGHT_SCRIPT = r'''
import os, sys, time, urllib.request
url, ready, go, sent, out = sys.argv[1:6]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
open(sent, "w").close()
body = urllib.request.urlopen(url, timeout=30).read()
with open(out + ".part", "wb") as f:
    f.write(body)
os.rename(out + ".part", out)
'''

# argv: host port n. n sequential GETs of / on new connections; prints the JSON list of each
# one's milliseconds (connect to the answer's end).
RTT_SCRIPT = r'''
import json, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ms = []
for _ in range(n):
    t = time.perf_counter()
    s = socket.create_connection((host, port), 10)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    d = b"".join(iter(lambda: s.recv(65536), b""))
    ms.append((time.perf_counter() - t) * 1000.0)
    s.close()
    if d.split(b" ", 2)[1:2] != [b"200"]:
        sys.exit("answer: %r" % d[:200])
print(json.dumps([round(x, 4) for x in ms]))
'''

# argv: host port nbytes. GET /bytes/<nbytes>, the body read with recv_into one 1 MiB buffer;
# prints {"seconds": connect to the last byte, "bytes": body bytes}.
THROUGHPUT_SCRIPT = r'''
import json, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = bytearray(1 << 20)
mv = memoryview(buf)
t = time.perf_counter()
s = socket.create_connection((host, port), 10)
s.sendall(b"GET /bytes/%d HTTP/1.0\r\n\r\n" % n)
head = b""
while b"\r\n\r\n" not in head:
    k = s.recv_into(mv)
    if not k:
        sys.exit("closed in the headers: %r" % head[:200])
    head += mv[:k].tobytes()
head, _, body = head.partition(b"\r\n\r\n")
got = len(body)
while True:
    k = s.recv_into(mv)
    if not k:
        break
    got += k
seconds = time.perf_counter() - t
s.close()
if head.split(b" ", 2)[1:2] != [b"200"] or got != n:
    sys.exit("answer %r, %d body bytes of %d" % (head[:200], got, n))
print(json.dumps({"seconds": seconds, "bytes": got}))
'''


@dataclass
class NetConfig:
    """What ``bench net`` runs against (``daemon``/``token``: the CLI's daemon) and how long."""

    daemon: Optional[str] = None
    token: Optional[str] = None
    image: str = "base"
    #: Creates of each mode.
    samples: int = 15
    ckpt_samples: int = 10
    #: Rounds of the proxied sandbox: a checkpoint of its process before its request, then one
    #: with the request in flight through the proxy.
    inflight_samples: int = 7
    fork_reps: int = 3
    rtt_requests: int = 200
    throughput_mb: int = 256
    throughput_rounds: int = 3


@dataclass
class NetResult:
    """The measurements of a run; :meth:`summary` is the JSON line."""

    cfg: NetConfig
    #: Milliseconds per metric (:data:`METRICS`).
    samples: Dict[str, List[float]] = field(default_factory=dict)
    #: Downloads: {"sandbox"|"host": [{"seconds", "bytes"}, ...]}.
    downloads: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    #: Growth of the sandbox's ``net_rx_bytes`` over each of its downloads.
    rx_bytes: List[int] = field(default_factory=list)
    #: Milliseconds of the fork requests alone and the daemon's ``took_ms``, by mode.
    fork_request_ms: Dict[str, List[float]] = field(default_factory=dict)
    fork_server_ms: Dict[str, List[float]] = field(default_factory=dict)
    #: The daemon's ``took_ms`` of each checkpoint: idle, the proxied sandbox's process before
    #: its request, and with the request in flight.
    ckpt_server_ms: List[float] = field(default_factory=list)
    same_process_idle_server_ms: List[float] = field(default_factory=list)
    inflight_server_ms: List[float] = field(default_factory=list)
    #: In-flight checkpoints whose request had already been answered when they returned.
    answered_before_ckpt: int = 0
    #: Warm-pool hits and misses of the create samples, by mode.
    pool: Dict[str, Dict[str, int]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def add(self, metric: str, ms: float) -> None:
        self.samples.setdefault(metric, []).append(ms)

    def p(self, metric: str, q: float = 50) -> Optional[float]:
        xs = self.samples.get(metric)
        return round(percentile(xs, q), 3) if xs else None

    def mb_s(self, side: str) -> List[float]:
        """MB/s (10^6 bytes) of each download of ``side`` ("sandbox" or "host")."""
        return [d["bytes"] / 1e6 / d["seconds"] for d in self.downloads.get(side, []) if d["seconds"] > 0]

    def mb_s_p50(self, side: str) -> Optional[float]:
        xs = self.mb_s(side)
        return round(percentile(xs, 50), 1) if xs else None

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for m in (
            "create_none",
            "create_allowlist",
            "create_allowlist_names",
            "create_open",
            "create_none_first_command",
            "create_allowlist_first_request",
        ):
            out[m + "_ms_p50"] = self.p(m)
        out["fork16_none_ms"] = self.p("fork16_none")
        out["fork16_allowlist_ms"] = self.p("fork16_allowlist")
        out["http_rtt_ms_p50"] = self.p("http_rtt")
        out["host_http_rtt_ms_p50"] = self.p("host_http_rtt")
        out["http_rtt_vs_host_ratio"] = ratio(out["http_rtt_ms_p50"], out["host_http_rtt_ms_p50"])
        out["throughput_mb_s"] = self.mb_s_p50("sandbox")
        out["host_throughput_mb_s"] = self.mb_s_p50("host")
        out["throughput_vs_host_ratio"] = ratio(out["throughput_mb_s"], out["host_throughput_mb_s"])
        out["ckpt_ms_p50"] = self.p("ckpt")
        out["ckpt_during_inflight_ms_p50"] = self.p("ckpt_during_inflight")
        out["ckpt_inflight_vs_idle_ms"] = diff(out["ckpt_during_inflight_ms_p50"], out["ckpt_ms_p50"])
        out["ckpt_same_process_idle_ms_p50"] = self.p("ckpt_same_process_idle")
        out["ckpt_inflight_vs_same_process_idle_ms"] = diff(
            out["ckpt_during_inflight_ms_p50"], out["ckpt_same_process_idle_ms_p50"]
        )
        cfg = self.cfg
        out["samples"] = cfg.samples
        out["ckpt_samples"] = cfg.ckpt_samples
        out["inflight_samples"] = cfg.inflight_samples
        out["fork_reps"] = cfg.fork_reps
        out["rtt_requests"] = cfg.rtt_requests
        out["throughput_mb"] = cfg.throughput_mb
        out["throughput_rounds"] = cfg.throughput_rounds
        out["upstream"] = "%s:%d" % UPSTREAM
        # Details.
        out["image"] = cfg.image
        out["http_rtt_ms"] = {side: self._spread(m) for side, m in (("sandbox", "http_rtt"), ("host", "host_http_rtt"))}
        out["create_allowlist_extra_ms_p50"] = diff(out["create_allowlist_ms_p50"], out["create_none_ms_p50"])
        out["create_allowlist_names_extra_ms_p50"] = diff(
            out["create_allowlist_names_ms_p50"], out["create_none_ms_p50"]
        )
        out["create_open_extra_ms_p50"] = diff(out["create_open_ms_p50"], out["create_none_ms_p50"])
        out["first_request_extra_ms_p50"] = diff(
            out["create_allowlist_first_request_ms_p50"], out["create_none_first_command_ms_p50"]
        )
        out["fork16_request_ms_p50"] = {k: round(percentile(v, 50), 3) for k, v in self.fork_request_ms.items() if v}
        out["fork16_server_ms_p50"] = {k: round(percentile(v, 50), 3) for k, v in self.fork_server_ms.items() if v}
        out["ckpt_server_ms_p50"] = _p50(self.ckpt_server_ms)
        out["ckpt_same_process_idle_server_ms_p50"] = _p50(self.same_process_idle_server_ms)
        out["ckpt_during_inflight_server_ms_p50"] = _p50(self.inflight_server_ms)
        out["inflight_answered_before_ckpt"] = self.answered_before_ckpt
        out["pool"] = self.pool
        out["throughput_mb_s_samples"] = [round(v, 1) for v in self.mb_s("sandbox")]
        out["host_throughput_mb_s_samples"] = [round(v, 1) for v in self.mb_s("host")]
        out["sandbox_rx_bytes"] = list(self.rx_bytes)
        out["samples_ms"] = {
            k: [round(v, 3) for v in xs] for k, xs in self.samples.items() if k not in ("http_rtt", "host_http_rtt")
        }
        out["notes"] = list(self.notes)
        return out

    def _spread(self, metric: str) -> Dict[str, Optional[float]]:
        return {"p50": self.p(metric, 50), "p90": self.p(metric, 90), "p99": self.p(metric, 99)}

    def rows(self) -> List[List[str]]:
        return stats_rows(self.samples, METRICS, digits=3)


def _p50(xs: Sequence[float]) -> Optional[float]:
    return round(percentile(xs, 50), 3) if xs else None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


# ----------------------------------------------------------------------------- running programs


def _failed(result: Any) -> str:
    why = "timed out" if result.timed_out else "exit %s" % result.exit_code
    return "%s: %s" % (why, (result.stderr or result.stdout or "").strip()[-800:])


def _in_sandbox(sbx: Sandbox, script: str, args: Sequence[str], what: str, timeout: float = COMMAND_TIMEOUT) -> str:
    """Stdout of ``python3 -c script args`` in ``sbx``; a failure raises :class:`BenchError`."""
    r = sbx.commands.run(["python3", "-c", script, *args], timeout=timeout)
    if r.exit_code != 0 or r.timed_out:
        raise BenchError("bench net: %s in sandbox %s failed (%s)" % (what, sbx.id, _failed(r)))
    return r.stdout


def _on_host(script: str, args: Sequence[str], what: str, timeout: float = COMMAND_TIMEOUT) -> str:
    """Stdout of ``script`` run by this python on the host."""
    try:
        r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError("bench net: %s on the host timed out after %.0f s" % (what, timeout)) from None
    if r.returncode != 0:
        raise BenchError("bench net: %s on the host failed (exit %d): %s" % (what, r.returncode, r.stderr.strip()[-800:]))
    return r.stdout


def _get_args() -> List[str]:
    return [UPSTREAM[0], str(UPSTREAM[1])]


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BenchError("bench net: %s printed %r, not its JSON line" % (what, text[-300:])) from None


# ----------------------------------------------------------------------------- the parts


class _Run:
    """A run's connections and what it must clean up."""

    def __init__(self, cfg: NetConfig, res: NetResult, stack: ExitStack, progress: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.res = res
        self.stack = stack
        self.progress = progress
        self.kw: Dict[str, Any] = {"daemon": cfg.daemon, "token": cfg.token}
        self.pool_stats = stack.enter_context(Pool(**self.kw))
        self.snaps = stack.enter_context(Snapshots(**self.kw))
        self.threads = stack.enter_context(ThreadPoolExecutor(max_workers=FORK_N))
        #: Sandboxes whose snapshots are deleted at the end (after they are killed).
        self.snapshotted: List[str] = []
        stack.callback(self._delete_snapshots)

    def _delete_snapshots(self) -> None:
        for sid in self.snapshotted:
            quiet(lambda: self.snaps.gc([], sandbox=sid))

    def create(self, network: str, ttl: float = TTL, proxy: bool = False) -> Sandbox:
        """A sandbox in mode ``network``; allowlist allows the upstream (:data:`ALLOW`). With
        ``proxy`` it has the daemon's proxy, which lets through :data:`PROXY_ALLOW`."""
        allow = PROXY_ALLOW if proxy else ALLOW if network == "allowlist" else None
        return Sandbox.create(self.cfg.image, network=network, allow=allow, proxy=proxy, timeout=ttl, **self.kw)

    def sandbox(self, network: str, proxy: bool = False) -> Sandbox:
        """A sandbox killed at the end of the run."""
        return self.stack.enter_context(self.create(network, proxy=proxy))

    def kill_all(self, sandboxes: Sequence[Sandbox]) -> None:
        def one(s: Sandbox) -> None:
            try:
                s.kill()
            except SandboxError:
                pass
            finally:
                s.close()

        list(self.threads.map(one, sandboxes))

    # -- creates

    def pool_counts(self) -> Tuple[int, int]:
        st = self.pool_stats.stats()
        return st.hits, st.misses

    def create_sample(self, network: str) -> None:
        """One create of ``network`` and its first command (a GET, or none in mode ``none``)."""
        hits, misses = self.pool_counts()
        t0 = time.perf_counter()
        sbx = self.create(network, SAMPLE_TTL)
        with sbx:
            created = _ms(t0)
            args = _get_args() if network == "allowlist" else NO_REQUEST
            r = sbx.commands.run(["python3", "-c", GET_SCRIPT, *args], timeout=COMMAND_TIMEOUT)
            first = _ms(t0)
            if r.exit_code != 0 or r.timed_out:
                what = "the first request to %s:%d" % UPSTREAM if network == "allowlist" else "the first command"
                raise BenchError(
                    "bench net: %s of a fresh %s sandbox %s failed, %.0f ms after the create was sent (%s)"
                    % (what, network, sbx.id, first, _failed(r))
                )
        hits2, misses2 = self.pool_counts()
        pool = self.res.pool.setdefault(network, {"hits": 0, "misses": 0})
        pool["hits"] += hits2 - hits
        pool["misses"] += misses2 - misses
        self.res.add("create_" + network, created)
        self.res.add("create_none_first_command" if network == "none" else "create_allowlist_first_request", first)

    def create_only_sample(self, metric: str, network: str, allow: Sequence[str] = ()) -> None:
        """One create in mode ``network`` with ``allow``, timed alone, as ``metric``."""
        t0 = time.perf_counter()
        sbx = Sandbox.create(self.cfg.image, network=network, allow=list(allow) or None, timeout=SAMPLE_TTL, **self.kw)
        with sbx:
            self.res.add(metric, _ms(t0))

    def creates(self) -> None:
        for i in range(self.cfg.samples):
            self.progress("creates %d/%d (none, allowlist, allowlist of names, open)" % (i + 1, self.cfg.samples))
            for network in ("none", "allowlist") if i % 2 == 0 else ("allowlist", "none"):
                self.create_sample(network)
            self.create_only_sample("create_allowlist_names", "allowlist", NAMES_ALLOW)
            self.create_only_sample("create_open", "open")
        pool = self.res.pool
        if pool.get("none") != pool.get("allowlist"):
            self.res.notes.append(
                "the warm pool served the two modes' creates differently (pool: hits and misses by mode)"
            )

    # -- forks

    def fork16(self, parent: Sandbox, network: str) -> None:
        args = _get_args() if network == "allowlist" else NO_REQUEST
        t0 = time.perf_counter()
        kids, fork = parent.fork_info(FORK_N, timeout=SAMPLE_TTL)
        forked = _ms(t0)
        try:
            results = list(
                self.threads.map(
                    lambda k: k.commands.run(["python3", "-c", GET_SCRIPT, *args], timeout=COMMAND_TIMEOUT), kids
                )
            )
            wall = _ms(t0)
            if len(kids) != FORK_N:
                raise BenchError("bench net: fork(%d) of %s returned %d sandboxes" % (FORK_N, parent.id, len(kids)))
            bad = [(k, r) for k, r in zip(kids, results) if r.exit_code != 0 or r.timed_out]
            if bad:
                k, r = bad[0]
                what = "the request to %s:%d" % UPSTREAM if network == "allowlist" else "the command"
                raise BenchError(
                    "bench net: %s failed in %d of the %d children of fork(%d) of %s sandbox %s; first, %s: %s"
                    % (what, len(bad), FORK_N, FORK_N, network, parent.id, k.id, _failed(r))
                )
        finally:
            self.kill_all(kids)
        self.res.add("fork16_" + network, wall)
        self.res.fork_request_ms.setdefault(network, []).append(forked)
        if fork.took_ms is not None:
            self.res.fork_server_ms.setdefault(network, []).append(fork.took_ms)

    def forks(self) -> None:
        parents = {}
        for network in ("none", "allowlist"):
            parents[network] = p = self.sandbox(network)
            self.snapshotted.append(p.id)
            # The parents' first command (a request, in allowlist) is behind them.
            _in_sandbox(p, GET_SCRIPT, _get_args() if network == "allowlist" else NO_REQUEST, "the parent's first command")
        for i in range(self.cfg.fork_reps):
            self.progress("fork(%d) %d/%d (none and allowlist)" % (FORK_N, i + 1, self.cfg.fork_reps))
            for network in ("none", "allowlist") if i % 2 == 0 else ("allowlist", "none"):
                self.fork16(parents[network], network)

    # -- traffic

    def rtt(self, sbx: Sandbox) -> None:
        args = _get_args() + [str(self.cfg.rtt_requests)]
        self.progress("%d requests from the sandbox" % self.cfg.rtt_requests)
        for ms in _json(_in_sandbox(sbx, RTT_SCRIPT, args, "the round-trip program"), "the round-trip program"):
            self.res.add("http_rtt", ms)
        self.progress("%d requests from the host" % self.cfg.rtt_requests)
        for ms in _json(_on_host(RTT_SCRIPT, args, "the round-trip program"), "the round-trip program"):
            self.res.add("host_http_rtt", ms)

    def throughput(self, sbx: Sandbox) -> None:
        n = self.cfg.throughput_mb * MIB
        args = _get_args() + [str(n)]
        what = "the download of %d MiB" % self.cfg.throughput_mb
        for i in range(self.cfg.throughput_rounds):
            for side in ("sandbox", "host") if i % 2 == 0 else ("host", "sandbox"):
                self.progress("download %d/%d of %d MiB, %s" % (i + 1, self.cfg.throughput_rounds, self.cfg.throughput_mb, side))
                if side == "sandbox":
                    rx = sbx.info().net_rx_bytes
                    got = _json(_in_sandbox(sbx, THROUGHPUT_SCRIPT, args, what, THROUGHPUT_TIMEOUT), what)
                    self.res.rx_bytes.append(sbx.info().net_rx_bytes - rx)
                else:
                    got = _json(_on_host(THROUGHPUT_SCRIPT, args, what, THROUGHPUT_TIMEOUT), what)
                self.res.downloads.setdefault(side, []).append(got)
        short = [b for b in self.res.rx_bytes if b < n]
        if short:
            self.res.notes.append(
                "the sandbox's net_rx_bytes grew by less than the %d bytes of a download (sandbox_rx_bytes): %s"
                % (n, short)
            )

    # -- checkpoints

    def checkpoints(self) -> None:
        sbx = self.sandbox("allowlist")
        self.snapshotted.append(sbx.id)
        _in_sandbox(sbx, GET_SCRIPT, _get_args(), "the checkpointed sandbox's request")
        for i in range(self.cfg.ckpt_samples):
            self.progress("checkpoint %d/%d" % (i + 1, self.cfg.ckpt_samples))
            sbx.files.write("/root/bb-bench-net.txt", "change %d\n" % i)
            self._timed_checkpoint(sbx, "bench net %d" % i, "ckpt", self.res.ckpt_server_ms)

    def _timed_checkpoint(self, sbx: Sandbox, label: str, key: str, server_ms: List[float]):
        """A checkpoint of ``sbx``, its round trip added to sample ``key`` and the daemon's own
        time (if it says) to ``server_ms``; returns its info."""
        t0 = time.perf_counter()
        info = sbx.checkpoint_info(label)
        self.res.add(key, _ms(t0))
        if info.took_ms is not None:
            server_ms.append(info.took_ms)
        return info

    def inflight_checkpoints(self) -> None:
        """Rounds of checkpoints of a proxied sandbox in mode ``none``: one while the round's
        process waits for the go file (before its request), then one while its request through
        the proxy waits for the upstream's answer; each answer must reach the sandbox afterwards."""
        sbx = self.sandbox("none", proxy=True)
        self.snapshotted.append(sbx.id)
        if not sbx.info().proxy:
            raise BenchError(
                "bench net: sandbox %s was created with proxy=True but has no proxy (a daemon without one?)" % sbx.id
            )
        n = self.cfg.inflight_samples
        for i in range(n):
            self.progress("checkpoint %d/%d of the proxied sandbox, its process before its request" % (i + 1, n))
            base = "/root/bb-bench-inflight-%d" % i
            ready, go, sent, out = base + ".ready", base + ".go", base + ".sent", base + ".body"
            what = "the request %d to %s through the proxy" % (i + 1, SLOW_URL)
            proc = sbx.commands.run(
                ["python3", "-c", INFLIGHT_SCRIPT, SLOW_URL, ready, go, sent, out],
                background=True,
                timeout=COMMAND_TIMEOUT,
            )
            # The same process, waiting for the go file: no request sent yet.
            self._wait_for(sbx, ready, proc, what, "ready")
            time.sleep(INFLIGHT_SETTLE)
            self._timed_checkpoint(
                sbx, "bench net same process idle %d" % i, "ckpt_same_process_idle", self.res.same_process_idle_server_ms
            )
            # Its request in flight.
            self.progress("checkpoint %d/%d with a request in flight" % (i + 1, n))
            sbx.files.write(go, "go\n")
            self._wait_for(sbx, sent, proc, what, "sent")
            time.sleep(INFLIGHT_SETTLE)
            info = self._timed_checkpoint(
                sbx, "bench net in flight %d" % i, "ckpt_during_inflight", self.res.inflight_server_ms
            )
            if sbx.files.exists(out):
                self.res.answered_before_ckpt += 1
            r = proc.wait(timeout=COMMAND_TIMEOUT)
            if r.exit_code != 0 or r.timed_out:
                raise BenchError(
                    "bench net: %s in sandbox %s failed after the checkpoint (%s)" % (what, sbx.id, _failed(r))
                )
            try:
                body: Optional[str] = sbx.files.read(out)
            except NotFoundError:
                body = None
            if body is None or "/slow" not in body:
                raise BenchError(
                    "bench net: the answer of %s, in flight during checkpoint %s, did not arrive in sandbox %s "
                    "(%s: %s)" % (what, info.id, sbx.id, out, "missing" if body is None else repr(body[:200]))
                )
        if self.res.answered_before_ckpt:
            self.res.notes.append(
                "%d of the %d in-flight requests were answered before their checkpoint returned "
                "(inflight_answered_before_ckpt): those checkpoints were not wholly in flight"
                % (self.res.answered_before_ckpt, n)
            )

    def _wait_for(self, sbx: Sandbox, marker: str, proc: CommandHandle, what: str, kind: str) -> None:
        """Until ``marker`` exists in ``sbx`` (``kind`` "ready": the program waits for the go
        file; "sent": it is about to send its request)."""
        deadline = time.monotonic() + MARKER_TIMEOUT
        while not sbx.files.exists(marker):
            if time.monotonic() > deadline:
                r = proc.wait(timeout=0.1)  # 0 would wait without a limit
                state = _failed(r) if not r.timed_out else "still running"
                raise BenchError(
                    "bench net: %s in sandbox %s: its program wrote no %s marker (%s) in %.0f s (%s)"
                    % (what, sbx.id, kind, marker, MARKER_TIMEOUT, state)
                )
            time.sleep(0.02)


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise BenchError(
            "bench net brings up its upstream servers in a network namespace (%s): run it as root" % networld.NETNS
        )
    if not shutil.which("ip"):
        raise BenchError("bench net: `ip` (iproute2) not found on PATH")
    if os.path.exists(os.path.join("/run/netns", networld.NETNS)):
        raise BenchError(
            "bench net: network namespace %s exists (the network tests' world, or a killed bench's?): the bench "
            "would tear it down; remove it with `ip netns del %s; ip link del %s` if nothing uses it"
            % (networld.NETNS, networld.NETNS, networld.HOST_IF)
        )


def run_net_bench(cfg: NetConfig, progress: Callable[[str], None] = lambda m: None) -> NetResult:
    """Run the benchmark (see the module's docstring); what it needs is checked first."""
    _check_prerequisites()
    health(daemon=cfg.daemon, token=cfg.token)  # reachable, before the world goes up
    res = NetResult(cfg)
    with sigterm_unwinds(), ExitStack() as stack:
        progress("bringing up the upstream (network namespace %s)" % networld.NETNS)
        stack.enter_context(networld.world())
        run = _Run(cfg, res, stack, progress)
        run.creates()
        run.forks()
        with run.create("allowlist") as sbx:
            _in_sandbox(sbx, GET_SCRIPT, _get_args(), "the traffic sandbox's first request")
            run.rtt(sbx)
            run.throughput(sbx)
        run.checkpoints()
        run.inflight_checkpoints()
    return res
