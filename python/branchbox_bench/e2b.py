"""``branchbox bench e2b``: branchbox's E2B-compatible endpoint (``branchboxd --e2b-listen``,
driven by E2B's own ``e2b`` and ``e2b-code-interpreter`` SDKs) against branchbox's own SDK, in
the same process, on the same daemon.

The E2B SDKs are pointed at the endpoint with explicit connection parameters (``api_key``,
``api_url`` and ``sandbox_url`` = the endpoint's URL, ``debug=False``), not environment
variables; the E2B API key is the daemon's token. A sandbox the endpoint creates is a branchbox
sandbox whose id lacks the dash (``sb0123456789ab`` is ``sb-0123456789ab``): the run checks once
that the daemon of ``--daemon`` sees the endpoint's sandboxes (both name the same daemon).

Measured with the client's ``time.perf_counter`` around each SDK call, the two sides
interleaved sample by sample (their order flips each sample) so that noise hits both alike,
after a warm-up of each:

- ``e2b_create_ms_p50``: ``e2b.Sandbox.create(template=image)`` against
  ``bb_create_ms_p50``, branchbox's ``Sandbox.create(image)``; ``samples`` of each, each sandbox
  killed afterwards (not timed). Before each create the bench waits (up to :data:`POOL_WAIT`
  s) for the image's warm pool to have a sandbox ready, so both sides are measured from the
  pool; the pool's hits and misses per side are in ``pool``.
  ``e2b_http_create_ms_p50`` is the same create as a bare ``POST /sandboxes`` (the body the
  SDK sends) on one kept-alive HTTP/1.1 connection, in the same rounds: the endpoint's own cost
  without the E2B SDK's; ``e2b_endpoint_overhead_ratio_create`` = it / ``bb_create_ms_p50``,
  and ``e2b_sdk_client_ms_create`` = ``e2b_create_ms_p50`` - it: the E2B SDK's own work.
  ``bb_http_create_ms_p50`` is branchbox's create as a bare ``POST /v1/sandboxes`` through the
  same HTTP client library (httpx, one kept-alive connection to the daemon's address), in the
  same rounds; ``e2b_endpoint_server_ratio_create`` = ``e2b_http_create_ms_p50`` / it: the two
  servers compared with the clients alike (branchbox's SDK reaches a unix socket through
  ``http.client``, faster than httpx, so ``e2b_endpoint_overhead_ratio_*`` counts client
  libraries too).
- ``e2b_run_true_ms_p50``: ``commands.run("true")`` in a sandbox made by the E2B SDK, against
  ``bb_run_true_ms_p50``, branchbox's ``commands.run("true")`` (``/bin/sh -c true``). The E2B
  SDK runs its command as ``/bin/bash -l -c true`` (a login shell, which reads the profile) as
  ``user``: ``bb_run_bash_login_true_ms_p50`` is branchbox's SDK running that same argv as that
  same user, in the same rounds, and ``e2b_overhead_ratio_run_same_argv`` the ratio against it.
  ``e2b_http_run_true_ms_p50`` is the SDK's request as a bare Connect call (``POST
  /process.Process/Start``, one JSON envelope with that argv, the user as the SDK names it,
  the stream read to its end) on the kept-alive connection, in the same rounds;
  ``e2b_endpoint_overhead_ratio_run`` = it / ``bb_run_true_ms_p50`` and
  ``e2b_sdk_client_ms_run`` = ``e2b_run_true_ms_p50`` - it. ``bb_http_run_true_ms_p50``: the
  same argv as the same user as a bare ``POST /v1/sandboxes/{id}/commands`` (httpx, as above);
  ``e2b_endpoint_server_ratio_run`` = ``e2b_http_run_true_ms_p50`` / it.
- ``e2b_run_code_ms_p50``: ``e2b_code_interpreter.Sandbox.run_code("1+1")`` against
  ``bb_run_code_ms_p50``, branchbox's ``run_code("1+1")`` (the default python session); each
  run once first (that starts the session), every answer checked ("2", no error).
  ``e2b_http_run_code_ms_p50`` is the same run as a bare ``POST /execute`` (the sandbox and
  port headers and the access token the SDK sends, the NDJSON stream read to its end) on the
  kept-alive connection, in the same rounds; ``e2b_endpoint_overhead_ratio_run_code`` = it /
  ``bb_run_code_ms_p50`` and ``e2b_sdk_client_ms_run_code`` = ``e2b_run_code_ms_p50`` - it.
  ``bb_http_run_code_ms_p50``: a bare ``POST /v1/sandboxes/{id}/code`` (httpx, as above);
  ``e2b_endpoint_server_ratio_run_code`` = ``e2b_http_run_code_ms_p50`` / it.
- ``e2b_fork16_ms``: ``sbx.fork(count=16)`` of the E2B SDK's sandbox (``POST
  /sandboxes/{id}/fork``) against ``bb_fork16_ms``, branchbox's ``sbx.fork(16)``; the median
  of ``fork_reps`` forks of each (the parents of the ``run`` part), children killed after
  each (not timed).

``e2b_overhead_ratio_*`` = E2B side / branchbox side (above 1: the endpoint is slower).
``e2b_cloud_create_ms`` is E2B's documented sandbox start time (:data:`E2B_CLOUD_CREATE_MS`),
a constant, not measured here; ``e2b_vs_cloud_create_speedup`` = it / ``e2b_create_ms_p50``.

Every sandbox is created with the metadata ``{RUN_KEY: <run id>}`` (fork children inherit it)
and killed at the latest at the end, on success or failure: the E2B side's through the E2B SDK
(through branchbox's if that fails), then whatever the daemon still lists with the run's
metadata.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import httpx

from branchbox import NotFoundError, Pool, Sandbox, SandboxError, sandbox_sync
from branchbox.sandbox_sync import health

from .stats import diff, percentile, ratio, stats_rows
from .store import BenchError, quiet, sigterm_unwinds

__all__ = [
    "BenchError",
    "E2bConfig",
    "E2bResult",
    "E2bSdk",
    "run_e2b_bench",
    "load_e2b_sdk",
    "check_endpoint",
    "bb_id",
    "SUMMARY_KEYS",
    "METRICS",
    "DEFAULT_E2B_URL",
    "E2B_CLOUD_CREATE_MS",
]

#: Where the endpoint listens unless told (``--e2b-url``, ``$BRANCHBOX_E2B_URL``).
DEFAULT_E2B_URL = "http://127.0.0.1:49999"
E2B_URL_ENV = "BRANCHBOX_E2B_URL"
#: E2B's documented sandbox start time in its cloud (ms): a constant for the comparison.
E2B_CLOUD_CREATE_MS = 150.0
E2B_CLOUD_CREATE_SOURCE = "E2B's documented sandbox start time in its cloud (~150 ms): a documented figure, not measured"
FORK_N = 16
#: The argv E2B's SDK runs for ``commands.run(cmd)``, and who it runs as by default.
E2B_RUN_ARGV = ["/bin/bash", "-l", "-c", "true"]
E2B_USER = "user"
#: The ports of envd (processes, files) and of the code interpreter (``/execute``) in an E2B sandbox.
E2B_ENVD_PORT = 49983
E2B_CODE_PORT = 49999
#: The E2B SDK's ``Start`` request for ``E2B_RUN_ARGV`` as one Connect envelope (flags 0, length, JSON).
_START_MESSAGE = json.dumps(
    {"process": {"cmd": E2B_RUN_ARGV[0], "args": E2B_RUN_ARGV[1:], "envs": {}}, "stdin": False}
).encode()
_START_ENVELOPE = b"\x00" + len(_START_MESSAGE).to_bytes(4, "big") + _START_MESSAGE
#: Each E2B SDK call timed also as bare HTTP: (name, the SDK's metric, the bare one, branchbox's,
#: branchbox's as bare HTTP).
BARE = (
    ("create", "e2b_create", "e2b_http_create", "bb_create", "bb_http_create"),
    ("run_code", "e2b_run_code", "e2b_http_run_code", "bb_run_code", "bb_http_run_code"),
    ("run", "e2b_run_true", "e2b_http_run_true", "bb_run_true", "bb_http_run_true"),
)
#: The User-Agent of the bench's bare requests (either server's logs tell them from the SDKs').
BARE_USER_AGENT = "branchbox-bench-bare"
#: Sandbox TTLs (s): the create samples' and fork children's, and the others'.
SAMPLE_TTL = 120
TTL = 900
#: Seconds a create waits for the warm pool to have a sandbox ready.
POOL_WAIT = 10.0
#: The metadata key every sandbox of a run carries (its value: the run's id).
RUN_KEY = "branchbox_bench_run"

SUMMARY_KEYS = (
    "e2b_create_ms_p50",
    "bb_create_ms_p50",
    "e2b_overhead_ratio_create",
    "e2b_run_true_ms_p50",
    "bb_run_true_ms_p50",
    "e2b_overhead_ratio_run",
    "e2b_run_code_ms_p50",
    "bb_run_code_ms_p50",
    "e2b_overhead_ratio_run_code",
    "e2b_fork16_ms",
    "bb_fork16_ms",
    "e2b_overhead_ratio_fork16",
    "e2b_cloud_create_ms",
    "e2b_vs_cloud_create_speedup",
    "e2b_cloud_create_source",
    "samples",
    "fork_reps",
    "sample_counts",
)
#: Millisecond metrics of the table, in its order.
METRICS = (
    "e2b_create",
    "e2b_http_create",
    "bb_create",
    "bb_http_create",
    "e2b_run_true",
    "bb_run_true",
    "bb_run_bash_login_true",
    "e2b_http_run_true",
    "bb_http_run_true",
    "e2b_run_code",
    "e2b_http_run_code",
    "bb_run_code",
    "bb_http_run_code",
    "e2b_fork16",
    "bb_fork16",
)
#: The E2B side of each pair, and branchbox's.
PAIRS = (
    ("create", "e2b_create", "bb_create"),
    ("run", "e2b_run_true", "bb_run_true"),
    ("run_code", "e2b_run_code", "bb_run_code"),
    ("fork16", "e2b_fork16", "bb_fork16"),
)

_DASHLESS_ID = re.compile(r"^sb[0-9a-f]{12}$")


def bb_id(e2b_id: str) -> str:
    """branchbox's id of a sandbox the E2B endpoint names ``e2b_id`` (``sb0123456789ab`` ->
    ``sb-0123456789ab``); any other id is returned as it is."""
    return "sb-" + e2b_id[2:] if _DASHLESS_ID.match(e2b_id) else e2b_id


@dataclass
class E2bSdk:
    """The E2B SDK classes the bench drives (:func:`load_e2b_sdk`; tests give fakes)."""

    #: ``e2b.Sandbox``.
    sandbox: Any
    #: ``e2b_code_interpreter.Sandbox``.
    code_sandbox: Any
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    #: The transport of the bare-HTTP side (None: the network; tests give a fake).
    http_transport: Optional[httpx.BaseTransport] = None


def load_e2b_sdk() -> E2bSdk:
    """E2B's SDKs, imported now (a clear error if they are not installed)."""
    try:
        import e2b
        import e2b_code_interpreter
    except ImportError as e:
        raise BenchError(
            "bench e2b needs E2B's SDKs in this python (%s): pip install e2b e2b-code-interpreter" % e
        ) from None
    from importlib import metadata

    versions: Dict[str, Optional[str]] = {}
    for dist in ("e2b", "e2b-code-interpreter"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return E2bSdk(sandbox=e2b.Sandbox, code_sandbox=e2b_code_interpreter.Sandbox, versions=versions)


@dataclass
class E2bConfig:
    """What ``bench e2b`` runs against (``daemon``/``token``: the CLI's daemon; ``e2b_url`` /
    ``e2b_api_key``: the same daemon's E2B endpoint and its token) and how long."""

    e2b_url: str = DEFAULT_E2B_URL
    e2b_api_key: Optional[str] = None
    daemon: Optional[str] = None
    token: Optional[str] = None
    #: The image (E2B's template id) of every sandbox.
    image: str = "base"
    #: Samples of create, run and run_code, per side.
    samples: int = 15
    fork_reps: int = 3

    @property
    def url(self) -> str:
        return self.e2b_url.rstrip("/")

    def e2b_params(self) -> Dict[str, Any]:
        """The E2B SDKs' connection parameters (``ApiParams``) for the endpoint."""
        return {"api_key": self.e2b_api_key, "api_url": self.url, "sandbox_url": self.url, "debug": False}

    def check(self) -> None:
        if not self.e2b_api_key:
            raise BenchError(
                "bench e2b: no API key for the E2B endpoint: pass the daemon's token as --e2b-api-key "
                "(or set BRANCHBOX_TOKEN)"
            )
        if not re.match(r"^https?://[^/]+", self.e2b_url or ""):
            raise BenchError("bench e2b: the E2B endpoint's URL must be http(s)://HOST:PORT, not %r" % self.e2b_url)
        if self.samples < 1 or self.fork_reps < 1:
            raise BenchError("bench e2b: samples and fork_reps must be at least 1")


@dataclass
class E2bResult:
    """The measurements of a run; :meth:`summary` is the JSON line."""

    cfg: E2bConfig
    #: Milliseconds per metric (:data:`METRICS`).
    samples: Dict[str, List[float]] = field(default_factory=dict)
    #: Warm-pool hits and misses of the create samples, by side ("e2b", "bb").
    pool: Dict[str, Dict[str, int]] = field(default_factory=dict)
    #: The SDK versions of the E2B side.
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    #: Sandboxes the final sweep found still running (killed then).
    swept: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, metric: str, ms: float) -> None:
        self.samples.setdefault(metric, []).append(ms)

    def p(self, metric: str, q: float = 50) -> Optional[float]:
        xs = self.samples.get(metric)
        return round(percentile(xs, q), 3) if xs else None

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for name, e2b_m, bb_m in PAIRS:
            suffix = "_ms" if name == "fork16" else "_ms_p50"
            out[e2b_m + suffix] = self.p(e2b_m)
            out[bb_m + suffix] = self.p(bb_m)
            out["e2b_overhead_ratio_" + name] = ratio(out[e2b_m + suffix], out[bb_m + suffix])
        out["e2b_cloud_create_ms"] = E2B_CLOUD_CREATE_MS
        out["e2b_vs_cloud_create_speedup"] = ratio(E2B_CLOUD_CREATE_MS, out["e2b_create_ms_p50"])
        out["e2b_cloud_create_source"] = E2B_CLOUD_CREATE_SOURCE
        cfg = self.cfg
        out["samples"] = cfg.samples
        out["fork_reps"] = cfg.fork_reps
        out["sample_counts"] = {m: len(self.samples.get(m) or []) for m in METRICS}
        # Details.
        for name, sdk_m, bare_m, bb_m, bb_bare_m in BARE:
            out[bare_m + "_ms_p50"] = self.p(bare_m)
            out["e2b_endpoint_overhead_ratio_" + name] = ratio(out[bare_m + "_ms_p50"], out[bb_m + "_ms_p50"])
            out["e2b_sdk_client_ms_" + name] = diff(out[sdk_m + "_ms_p50"], out[bare_m + "_ms_p50"])
            out[bb_bare_m + "_ms_p50"] = self.p(bb_bare_m)
            out["e2b_endpoint_server_ratio_" + name] = ratio(out[bare_m + "_ms_p50"], out[bb_bare_m + "_ms_p50"])
        out["bb_run_bash_login_true_ms_p50"] = self.p("bb_run_bash_login_true")
        out["e2b_overhead_ratio_run_same_argv"] = ratio(out["e2b_run_true_ms_p50"], out["bb_run_bash_login_true_ms_p50"])
        for _, e2b_m, bb_m in PAIRS[:3]:
            out[e2b_m + "_ms_p99"] = self.p(e2b_m, 99)
            out[bb_m + "_ms_p99"] = self.p(bb_m, 99)
        for name, e2b_m, bb_m in PAIRS:
            out["e2b_overhead_ms_" + name] = diff(self.p(e2b_m), self.p(bb_m))
        out["fork_n"] = FORK_N
        out["image"] = cfg.image
        out["e2b_url"] = cfg.url
        out["e2b_sdk"] = dict(self.versions)
        out["pool"] = {side: dict(v) for side, v in self.pool.items()}
        out["swept"] = list(self.swept)
        out["samples_ms"] = {k: [round(v, 3) for v in xs] for k, xs in self.samples.items()}
        out["notes"] = list(self.notes)
        return out

    def rows(self) -> List[List[str]]:
        return stats_rows(self.samples, METRICS, digits=3)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return "%s: %s" % (type(e).__name__, text[:800]) if text else type(e).__name__


def check_endpoint(url: str, api_key: str, transport: Optional[httpx.BaseTransport] = None) -> None:
    """That branchbox's E2B endpoint answers at ``url`` and takes ``api_key`` (``GET
    /sandboxes``); a clear :class:`BenchError` otherwise."""
    url = url.rstrip("/")
    try:
        with httpx.Client(transport=transport, timeout=10.0) as client:
            r = client.get(url + "/sandboxes", headers={"X-API-KEY": api_key})
    except httpx.HTTPError as e:
        raise BenchError(
            "bench e2b: nothing answers at %s (%s): start the daemon with --e2b-listen HOST:PORT and pass that "
            "address as --e2b-url (or $%s)" % (url, _why(e), E2B_URL_ENV)
        ) from None
    if r.status_code in (401, 403):
        raise BenchError(
            "bench e2b: the E2B endpoint at %s refused the API key (HTTP %d): pass the daemon's --token as "
            "--e2b-api-key" % (url, r.status_code)
        )
    if r.status_code != 200:
        raise BenchError(
            "bench e2b: %s answered HTTP %d to GET /sandboxes (%s): is it branchbox's E2B endpoint?"
            % (url, r.status_code, r.text[:300])
        )
    try:
        listed = r.json()
    except ValueError:
        listed = None
    if not isinstance(listed, list):
        raise BenchError(
            "bench e2b: %s answered GET /sandboxes with %r, not a list of sandboxes: is it branchbox's E2B endpoint?"
            % (url, r.text[:300])
        )


# ----------------------------------------------------------------------------- the parts


class _Run:
    """A run's connections and the sandboxes it must kill."""

    def __init__(
        self, cfg: E2bConfig, sdk: E2bSdk, res: E2bResult, stack: ExitStack, progress: Callable[[str], None]
    ) -> None:
        self.cfg = cfg
        self.sdk = sdk
        self.res = res
        self.progress = progress
        self.kw: Dict[str, Any] = {"daemon": cfg.daemon, "token": cfg.token}
        self.params = cfg.e2b_params()
        self.run_id = uuid.uuid4().hex[:12]
        self.metadata = {RUN_KEY: self.run_id}
        self.pool = stack.enter_context(Pool(**self.kw))
        #: The endpoint without the E2B SDK: one kept-alive HTTP/1.1 connection.
        self.http = stack.enter_context(
            httpx.Client(
                base_url=cfg.url,
                headers={"X-API-KEY": cfg.e2b_api_key or ""},
                timeout=60.0,
                transport=sdk.http_transport,
            )
        )
        self.http.headers["User-Agent"] = BARE_USER_AGENT
        #: branchbox's API without its SDK, through the same client library.
        self.bb_http = stack.enter_context(sandbox_sync.ConnectionConfig(cfg.daemon, cfg.token).sync_client())
        self.bb_http.headers["User-Agent"] = BARE_USER_AGENT
        self.threads = stack.enter_context(ThreadPoolExecutor(max_workers=FORK_N))
        #: Live sandboxes by id: the E2B SDK's (its ids) and branchbox's.
        self.e2b_live: Dict[str, Any] = {}
        self.bb_live: Dict[str, Sandbox] = {}
        self.has_pool = True
        stack.callback(self.kill_everything)

    # -- the E2B side

    def _e2b(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, an E2B SDK call; its failure is a :class:`BenchError` saying ``what``."""
        try:
            return fn()
        except BenchError:
            raise
        except Exception as e:  # noqa: BLE001 - the E2B SDK's exceptions, whatever their class
            raise BenchError(
                "bench e2b: %s through the E2B endpoint at %s failed (%s)" % (what, self.cfg.url, _why(e))
            ) from None

    def e2b_create(self, code: bool = False, ttl: int = TTL) -> Tuple[Any, float]:
        """A sandbox made by ``e2b.Sandbox`` (``code``: ``e2b_code_interpreter.Sandbox``), and
        the ms its create took."""
        cls = self.sdk.code_sandbox if code else self.sdk.sandbox
        name = "%s.create(template=%r)" % ("e2b_code_interpreter.Sandbox" if code else "e2b.Sandbox", self.cfg.image)

        def create() -> Tuple[Any, float]:
            t0 = time.perf_counter()
            sbx = cls.create(template=self.cfg.image, timeout=ttl, metadata=dict(self.metadata), **self.params)
            return sbx, _ms(t0)

        sbx, ms = self._e2b(name, create)
        self.e2b_live[sbx.sandbox_id] = sbx
        return sbx, ms

    def e2b_kill(self, sbx: Any) -> None:
        """Kill ``sbx`` through the E2B SDK, or (if that fails) through branchbox's."""
        sid = sbx.sandbox_id
        try:
            killed = sbx.kill()
        except Exception as e:  # noqa: BLE001
            self.res.notes.append(
                "the E2B SDK's kill of %s failed (%s); killed through branchbox's SDK" % (sid, _why(e))
            )
            self.bb_kill_id(bb_id(sid))
        else:
            if killed is False:
                self.res.notes.append("the E2B endpoint answered not found to the kill of %s, a live sandbox" % sid)
        self.e2b_live.pop(sid, None)

    # -- branchbox's side

    def bb_create(self, ttl: float = TTL) -> Tuple[Sandbox, float]:
        t0 = time.perf_counter()
        sbx = Sandbox.create(self.cfg.image, timeout=ttl, metadata=self.metadata, **self.kw)
        ms = _ms(t0)
        self.bb_live[sbx.id] = sbx
        return sbx, ms

    def bb_kill(self, sbx: Sandbox) -> None:
        try:
            sbx.kill()
        finally:
            sbx.close()
            self.bb_live.pop(sbx.id, None)

    def bb_kill_id(self, sid: str) -> bool:
        """Kill sandbox ``sid`` through branchbox's SDK; False if the daemon does not know it."""
        try:
            sbx = Sandbox.connect(sid, resume=False, **self.kw)
        except NotFoundError:
            return False
        try:
            return sbx.kill()
        finally:
            sbx.close()

    # -- clean-up

    def kill_all(self, e2b_sandboxes: Sequence[Any] = (), bb_sandboxes: Sequence[Sandbox] = ()) -> None:
        """Kill these, concurrently; the first failure (after all were tried) is raised."""
        jobs: List[Callable[[], None]] = [lambda s=s: self.e2b_kill(s) for s in e2b_sandboxes]
        jobs += [lambda s=s: self.bb_kill(s) for s in bb_sandboxes]
        errors: List[BaseException] = []

        def one(job: Callable[[], None]) -> None:
            try:
                job()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        list(self.threads.map(one, jobs))
        if errors:
            raise errors[0]

    def kill_everything(self) -> None:
        """At the end, on success or failure: every sandbox still live, then any the daemon still
        lists with the run's metadata (e.g. made by a request whose answer was lost)."""
        quiet(lambda: self.kill_all(list(self.e2b_live.values()), list(self.bb_live.values())))
        for sbx in list(self.e2b_live.values()):  # the E2B SDK's and branchbox's kill both failed
            quiet(lambda: self.bb_kill_id(bb_id(sbx.sandbox_id)))
        for sbx in list(self.bb_live.values()):
            quiet(sbx.close)

        def sweep() -> None:
            for info in Sandbox.list(metadata=self.metadata, **self.kw):
                try:
                    if self.bb_kill_id(info.id):
                        self.res.swept.append(info.id)
                except SandboxError:
                    pass

        quiet(sweep)
        if self.res.swept:
            self.res.notes.append(
                "%d sandboxes of the run were still running at its end and were killed then (swept)" % len(self.res.swept)
            )

    # -- the pool

    def pool_counts(self) -> Tuple[int, int]:
        st = self.pool.stats()
        return st.hits, st.misses

    def wait_for_pool(self) -> None:
        """Until the image's warm pool has a sandbox ready (at most :data:`POOL_WAIT` s)."""
        if not self.has_pool:
            return
        deadline = time.monotonic() + POOL_WAIT
        while True:
            img = self.pool.stats().images.get(self.cfg.image)
            if img is None or img.min == 0 or img.ready >= 1 or time.monotonic() > deadline:
                return
            time.sleep(0.005)

    # -- the parts

    def warm_up(self) -> None:
        """One create of each side; the endpoint's sandbox must be on the daemon of ``--daemon``."""
        self.progress("warming up")
        img = self.pool.stats().images.get(self.cfg.image)
        if img is None or img.min == 0:
            self.has_pool = False
            self.res.notes.append(
                "the daemon has no warm pool for image %s: both sides' creates start cold "
                "(`branchbox pool set %s --min 1` for pool creates)" % (self.cfg.image, self.cfg.image)
            )
        self.wait_for_pool()
        sbx, _ = self.e2b_create(ttl=SAMPLE_TTL)
        try:
            Sandbox.connect(bb_id(sbx.sandbox_id), resume=False, **self.kw).close()
        except NotFoundError:
            raise BenchError(
                "bench e2b: sandbox %s, created through the E2B endpoint at %s, is not on the daemon at %s: "
                "--e2b-url and --daemon must name the same daemon"
                % (sbx.sandbox_id, self.cfg.url, self.cfg.daemon or os.environ.get("BRANCHBOX_URL") or "(default)")
            ) from None
        self.e2b_kill(sbx)
        self.wait_for_pool()
        self.bb_kill(self.bb_create(SAMPLE_TTL)[0])

    def http_create(self) -> Tuple[str, float]:
        """``POST /sandboxes`` with the body the E2B SDK sends, on a kept-alive connection: the
        endpoint's own cost, without the SDK's. The new sandbox's id and the ms."""
        body = {"templateID": self.cfg.image, "timeout": SAMPLE_TTL, "metadata": dict(self.metadata)}
        t0 = time.perf_counter()
        r = self.http.post("/sandboxes", json=body)
        ms = _ms(t0)
        if r.status_code != 201:
            raise BenchError("bench e2b: POST /sandboxes answered %d: %s" % (r.status_code, r.text[:400]))
        return r.json()["sandboxID"], ms  # left over on failure: the final sweep (by metadata) kills it

    def http_kill(self, sid: str) -> None:
        r = self.http.delete("/sandboxes/" + sid)
        if r.status_code != 204:
            self.bb_kill_id(bb_id(sid))

    def bb_bare(self, what: str, path: str, body: Dict[str, Any]) -> Tuple[Dict[str, Any], float]:
        """``POST path`` with ``body`` to branchbox's API on the bare client: the answer and the ms."""
        t0 = time.perf_counter()
        r = self.bb_http.post(path, json=body)
        ms = _ms(t0)
        if r.status_code not in (200, 201):
            raise BenchError("bench e2b: %s (POST %s) answered %d: %s" % (what, path, r.status_code, r.text[:400]))
        return r.json(), ms

    def bb_http_create(self) -> Tuple[str, float]:
        """branchbox's create as a bare ``POST /v1/sandboxes``: the new sandbox's id and the ms."""
        body = {"image": self.cfg.image, "timeout": SAMPLE_TTL, "metadata": dict(self.metadata)}
        sbx, ms = self.bb_bare("a bare create", "/v1/sandboxes", body)
        return sbx["id"], ms  # left over on failure: the final sweep (by metadata) kills it

    def create_sample(self, side: str) -> None:
        self.wait_for_pool()
        hits, misses = self.pool_counts()
        if side == "e2b":
            sbx, ms = self.e2b_create(ttl=SAMPLE_TTL)
        elif side == "e2b_http":
            sbx, ms = self.http_create()
        elif side == "bb_http":
            sbx, ms = self.bb_http_create()
        else:
            sbx, ms = self.bb_create(SAMPLE_TTL)
        hits2, misses2 = self.pool_counts()
        if side == "e2b":
            self.e2b_kill(sbx)
        elif side == "e2b_http":
            self.http_kill(sbx)
        elif side == "bb_http":
            self.bb_kill_id(sbx)
        else:
            self.bb_kill(sbx)
        pool = self.res.pool.setdefault(side, {"hits": 0, "misses": 0})
        pool["hits"] += hits2 - hits
        pool["misses"] += misses2 - misses
        self.res.add(side + "_create", ms)

    def creates(self) -> None:
        n = self.cfg.samples
        for i in range(n):
            self.progress("create %d/%d (E2B endpoint, branchbox SDK)" % (i + 1, n))
            for side in _order(i, ("e2b", "e2b_http", "bb", "bb_http")):
                self.create_sample(side)
        if self.has_pool and any(v.get("misses") for v in self.res.pool.values()):
            self.res.notes.append(
                "some creates missed the warm pool (pool: hits and misses by side): they started cold"
            )

    def parents(self) -> Tuple[Any, Sandbox]:
        """The sandboxes of the run and fork parts, one of each side."""
        e, _ = self.e2b_create()
        b, _ = self.bb_create()
        return e, b

    def e2b_true(self, sbx: Any) -> float:
        def run() -> Tuple[Any, float]:
            t0 = time.perf_counter()
            r = sbx.commands.run("true")
            return r, _ms(t0)

        r, ms = self._e2b("commands.run(\"true\") in %s" % sbx.sandbox_id, run)
        if getattr(r, "exit_code", None) != 0:
            raise BenchError("bench e2b: `true` in E2B sandbox %s: %r" % (sbx.sandbox_id, r))
        return ms

    def bb_run(self, sbx: Sandbox, cmd: Any, user: Optional[str] = None) -> float:
        t0 = time.perf_counter()
        r = sbx.commands.run(cmd, user=user)
        ms = _ms(t0)
        if r.exit_code != 0 or r.timed_out:
            raise BenchError(
                "bench e2b: %r in sandbox %s failed (exit %s: %s)" % (cmd, sbx.id, r.exit_code, (r.stderr or "")[-300:])
            )
        return ms

    def http_true(self, headers: Dict[str, str]) -> float:
        """E2B's ``commands.run("true")`` as a bare Connect server-streaming call: ``Start`` of
        its argv as ``user``, every envelope read; the ms. The end event must say exit 0."""
        t0 = time.perf_counter()
        r = self.http.post("/process.Process/Start", content=_START_ENVELOPE, headers=headers)
        ms = _ms(t0)
        messages, tail = _envelopes(r.content)
        ends = [m["event"]["end"] for m in messages if isinstance(m.get("event"), dict) and "end" in m["event"]]
        if r.status_code != 200 or tail != {} or len(ends) != 1 or ends[0].get("exitCode", 0) != 0:
            raise BenchError(
                "bench e2b: Connect Start of %s in E2B sandbox %s answered %d: %r"
                % (" ".join(E2B_RUN_ARGV), headers["E2b-Sandbox-Id"], r.status_code, r.content[:400])
            )
        return ms

    def bb_http_true(self, sbx: Sandbox) -> float:
        """E2B's argv as its user, as a bare ``POST /v1/sandboxes/{id}/commands``; the ms."""
        what = "a bare run of %s in %s" % (" ".join(E2B_RUN_ARGV), sbx.id)
        r, ms = self.bb_bare(what, "/v1/sandboxes/%s/commands" % sbx.id, {"args": E2B_RUN_ARGV, "user": E2B_USER})
        if r.get("exit_code") != 0:
            raise BenchError("bench e2b: %s: %r" % (what, r))
        return ms

    def commands(self, e: Any, b: Sandbox) -> None:
        connect = dict(
            self.http_headers(e, E2B_ENVD_PORT),
            **{
                "Content-Type": "application/connect+json",
                "Connect-Protocol-Version": "1",
                "Authorization": "Basic " + base64.b64encode((E2B_USER + ":").encode()).decode(),
            },
        )
        runs = {
            "e2b_run_true": lambda: self.e2b_true(e),
            "e2b_http_run_true": lambda: self.http_true(connect),
            "bb_run_true": lambda: self.bb_run(b, "true"),
            "bb_run_bash_login_true": lambda: self.bb_run(b, E2B_RUN_ARGV, E2B_USER),
            "bb_http_run_true": lambda: self.bb_http_true(b),
        }
        for run in runs.values():  # warm-up
            run()
        n = self.cfg.samples
        for i in range(n):
            self.progress("commands.run(\"true\") %d/%d" % (i + 1, n))
            for metric in _order(i, tuple(runs)):
                self.res.add(metric, runs[metric]())

    def e2b_code(self, sbx: Any) -> float:
        def run() -> Tuple[Any, float]:
            t0 = time.perf_counter()
            x = sbx.run_code("1+1")
            return x, _ms(t0)

        x, ms = self._e2b("run_code(\"1+1\") in %s" % sbx.sandbox_id, run)
        if x.error is not None or x.text != "2":
            raise BenchError(
                "bench e2b: run_code('1+1') in E2B sandbox %s returned %r (error: %s)" % (sbx.sandbox_id, x.text, x.error)
            )
        return ms

    def http_headers(self, sbx: Any, port: int) -> Dict[str, str]:
        """The routing headers of a bare request to ``port`` of E2B sandbox ``sbx``, as its SDK
        sends them: the sandbox, the port and the sandbox's access token (its record's)."""
        sid = sbx.sandbox_id
        r = self.http.get("/sandboxes/" + sid)
        if r.status_code != 200:
            raise BenchError("bench e2b: GET /sandboxes/%s answered %d: %s" % (sid, r.status_code, r.text[:400]))
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}
        token = r.json().get("envdAccessToken")
        if token:
            headers["X-Access-Token"] = token
        return headers

    def http_code(self, headers: Dict[str, str]) -> float:
        """``POST /execute`` of ``1+1`` on the kept-alive connection, its stream read to the end."""
        t0 = time.perf_counter()
        r = self.http.post("/execute", json={"code": "1+1"}, headers=headers)
        ms = _ms(t0)
        try:
            events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
        except ValueError:
            events = []
        ok = any(e.get("type") == "result" and e.get("text") == "2" for e in events)
        if r.status_code != 200 or not ok or any(e.get("type") == "error" for e in events):
            raise BenchError(
                "bench e2b: POST /execute of 1+1 in E2B sandbox %s answered %d: %s"
                % (headers["E2b-Sandbox-Id"], r.status_code, r.text[:400])
            )
        return ms

    def bb_code(self, sbx: Sandbox) -> float:
        t0 = time.perf_counter()
        x = sbx.run_code("1+1")
        ms = _ms(t0)
        if x.error is not None or x.result != "2":
            raise BenchError(
                "bench e2b: run_code('1+1') in sandbox %s returned %r (error: %s)" % (sbx.id, x.result, x.error)
            )
        return ms

    def bb_http_code(self, sbx: Sandbox) -> float:
        """``1+1`` as a bare ``POST /v1/sandboxes/{id}/code``; the ms."""
        x, ms = self.bb_bare("a bare run_code in %s" % sbx.id, "/v1/sandboxes/%s/code" % sbx.id, {"code": "1+1"})
        if x.get("error") is not None or x.get("result") != "2":
            raise BenchError("bench e2b: a bare run_code('1+1') in sandbox %s returned %r" % (sbx.id, x))
        return ms

    def run_code(self) -> None:
        c, _ = self.e2b_create(code=True)
        d, _ = self.bb_create()
        self.progress("run_code: starting the python sessions")
        self.e2b_code(c)  # the first run starts the session
        self.bb_code(d)
        headers = self.http_headers(c, E2B_CODE_PORT)
        self.http_code(headers)
        self.bb_http_code(d)
        runs = {
            "e2b_run_code": lambda: self.e2b_code(c),
            "e2b_http_run_code": lambda: self.http_code(headers),
            "bb_run_code": lambda: self.bb_code(d),
            "bb_http_run_code": lambda: self.bb_http_code(d),
        }
        n = self.cfg.samples
        for i in range(n):
            self.progress("run_code(\"1+1\") %d/%d" % (i + 1, n))
            for metric in _order(i, tuple(runs)):
                self.res.add(metric, runs[metric]())
        self.kill_all([c], [d])  # on a failure: at the end (kill_everything)

    def e2b_fork16(self, parent: Any) -> None:
        def fork() -> Tuple[List[Any], float]:
            t0 = time.perf_counter()
            kids = parent.fork(count=FORK_N, timeout=SAMPLE_TTL)
            return kids, _ms(t0)

        kids, ms = self._e2b("fork(count=%d) of %s" % (FORK_N, parent.sandbox_id), fork)
        ok = [k for k in kids if not isinstance(k, BaseException)]
        failed = [k for k in kids if isinstance(k, BaseException)]
        for k in ok:
            self.e2b_live[k.sandbox_id] = k
        self.kill_all(ok)
        if failed or len(kids) != FORK_N:
            raise BenchError(
                "bench e2b: fork(count=%d) of E2B sandbox %s through %s gave %d sandboxes and %d errors%s"
                % (FORK_N, parent.sandbox_id, self.cfg.url, len(ok), len(failed),
                   " (first: %s)" % _why(failed[0]) if failed else "")
            )
        self.res.add("e2b_fork16", ms)

    def bb_fork16(self, parent: Sandbox) -> None:
        t0 = time.perf_counter()
        kids = parent.fork(FORK_N, timeout=SAMPLE_TTL)
        ms = _ms(t0)
        for k in kids:
            self.bb_live[k.id] = k
        self.kill_all((), kids)
        if len(kids) != FORK_N:
            raise BenchError("bench e2b: fork(%d) of sandbox %s returned %d sandboxes" % (FORK_N, parent.id, len(kids)))
        self.res.add("bb_fork16", ms)

    def forks(self, e: Any, b: Sandbox) -> None:
        forks = {"e2b": lambda: self.e2b_fork16(e), "bb": lambda: self.bb_fork16(b)}
        n = self.cfg.fork_reps
        for i in range(n):
            self.progress("fork(%d) %d/%d (E2B endpoint, branchbox SDK)" % (FORK_N, i + 1, n))
            for side in _order(i, tuple(forks)):
                forks[side]()


def _envelopes(data: bytes) -> Tuple[List[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """A Connect stream's JSON messages, and its end-of-stream message (None if it has none or
    the stream is malformed)."""
    messages: List[Dict[str, Any]] = []
    at = 0
    while at + 5 <= len(data):
        flags, size = data[at], int.from_bytes(data[at + 1:at + 5], "big")
        payload = data[at + 5:at + 5 + size]
        at += 5 + size
        if len(payload) != size:
            break
        try:
            msg = json.loads(payload)
        except ValueError:
            break
        if flags & 0x02:
            return messages, msg if at == len(data) else None
        messages.append(msg)
    return messages, None


def _order(i: int, items: Tuple[str, ...]) -> Tuple[str, ...]:
    """``items`` in sample ``i``'s order: as given in even samples, reversed in odd ones."""
    return items if i % 2 == 0 else tuple(reversed(items))


def run_e2b_bench(
    cfg: E2bConfig, progress: Callable[[str], None] = lambda m: None, sdk: Optional[E2bSdk] = None
) -> E2bResult:
    """Run the benchmark (see the module's docstring); what it needs is checked first. Every
    sandbox it creates is killed, also when it fails."""
    cfg.check()
    sdk = sdk or load_e2b_sdk()
    health(daemon=cfg.daemon, token=cfg.token)
    check_endpoint(cfg.url, cfg.e2b_api_key or "")
    res = E2bResult(cfg, versions=dict(sdk.versions))
    with sigterm_unwinds(), ExitStack() as stack:
        run = _Run(cfg, sdk, res, stack, progress)
        run.warm_up()
        run.creates()
        e, b = run.parents()
        run.commands(e, b)
        run.forks(e, b)
        run.kill_all([e], [b])  # on a failure: at the end (kill_everything)
        run.run_code()
    return res
