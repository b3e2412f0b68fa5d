"""Unit tests of the e2b bench: its pure parts, its endpoint check, its use of the pinned E2B
SDKs (signatures and connection parameters, no network), and whole runs on a fake daemon that
branchbox's SDK reaches through ``httpx.MockTransport`` and fake E2B SDK classes share (the
measurements need a daemon with ``--e2b-listen``)."""

import json
import re
import sys
import threading
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import pytest

import branchbox.sandbox_sync as sync_mod
from branchbox_bench import e2b as be
from branchbox_cli import app as cli
from branchbox_cli import bench as bench_cli
from conftest import RESULT, SANDBOX, cli_runner


@pytest.fixture(autouse=True)
def _no_e2b_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("BRANCHBOX_E2B_URL", "E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG", "E2B_DOMAIN"):
        monkeypatch.delenv(var, raising=False)


# ----------------------------------------------------------------------------- pure parts


def test_ids_of_the_endpoint_are_branchbox_ids_without_the_dash() -> None:
    assert be.bb_id("sb0123456789ab") == "sb-0123456789ab"
    assert be.bb_id("sb-0123456789ab") == "sb-0123456789ab"
    assert be.bb_id("sbxyz") == "sbxyz" and be.bb_id("sb0123456789abc") == "sb0123456789abc"


def test_config_checks_and_params() -> None:
    cfg = be.E2bConfig(e2b_url="http://127.0.0.1:5000/", e2b_api_key="k")
    cfg.check()
    assert cfg.url == "http://127.0.0.1:5000"
    assert cfg.e2b_params() == {
        "api_key": "k", "api_url": "http://127.0.0.1:5000", "sandbox_url": "http://127.0.0.1:5000", "debug": False
    }
    with pytest.raises(be.BenchError, match="no API key for the E2B endpoint: pass the daemon's token as --e2b-api-key"):
        be.E2bConfig().check()
    with pytest.raises(be.BenchError, match="must be http"):
        be.E2bConfig(e2b_url="127.0.0.1:5000", e2b_api_key="k").check()
    with pytest.raises(be.BenchError, match="at least 1"):
        be.E2bConfig(e2b_api_key="k", fork_reps=0).check()
    assert be.DEFAULT_E2B_URL == "http://127.0.0.1:49999"


def fake_result() -> be.E2bResult:
    res = be.E2bResult(be.E2bConfig(samples=3, fork_reps=1, e2b_api_key="k"), versions={"e2b": "2.63.0"})
    for e2b_ms, bb_ms in ((4.0, 2.0), (6.0, 1.0), (3.0, 3.0)):
        res.add("e2b_create", e2b_ms)
        res.add("e2b_http_create", bb_ms * 1.5)
        res.add("bb_create", bb_ms)
        res.add("bb_http_create", bb_ms * 1.25)
        res.add("e2b_run_true", e2b_ms * 3)
        res.add("bb_run_true", bb_ms * 3)
        res.add("bb_run_bash_login_true", bb_ms * 6)
        res.add("e2b_http_run_true", bb_ms * 4)
        res.add("bb_http_run_true", bb_ms * 5)
        res.add("e2b_run_code", e2b_ms / 2)
        res.add("e2b_http_run_code", bb_ms * 0.6)
        res.add("bb_run_code", bb_ms / 2)
        res.add("bb_http_run_code", bb_ms * 0.8)
    res.add("e2b_fork16", 120.0)
    res.add("bb_fork16", 100.0)
    res.pool = {"e2b": {"hits": 3, "misses": 0}, "bb": {"hits": 2, "misses": 1}}
    return res


def test_summary_shape_and_ratios() -> None:
    s = fake_result().summary()
    assert tuple(s)[: len(be.SUMMARY_KEYS)] == be.SUMMARY_KEYS
    assert json.loads(json.dumps(s)) == s
    assert (s["e2b_create_ms_p50"], s["bb_create_ms_p50"], s["e2b_overhead_ratio_create"]) == (4.0, 2.0, 2.0)
    assert (s["e2b_http_create_ms_p50"], s["e2b_endpoint_overhead_ratio_create"]) == (3.0, 1.5)
    assert (s["e2b_run_true_ms_p50"], s["bb_run_true_ms_p50"], s["e2b_overhead_ratio_run"]) == (12.0, 6.0, 2.0)
    assert (s["bb_run_bash_login_true_ms_p50"], s["e2b_overhead_ratio_run_same_argv"]) == (12.0, 1.0)
    assert (s["e2b_http_run_true_ms_p50"], s["e2b_endpoint_overhead_ratio_run"], s["e2b_sdk_client_ms_run"]) == (8.0, 1.333, 4.0)
    assert (s["e2b_run_code_ms_p50"], s["bb_run_code_ms_p50"], s["e2b_overhead_ratio_run_code"]) == (2.0, 1.0, 2.0)
    assert (s["e2b_http_run_code_ms_p50"], s["e2b_endpoint_overhead_ratio_run_code"]) == (1.2, 1.2)
    assert (s["e2b_sdk_client_ms_create"], s["e2b_sdk_client_ms_run_code"]) == (1.0, 0.8)
    # The servers compared with the clients alike.
    assert (s["bb_http_create_ms_p50"], s["e2b_endpoint_server_ratio_create"]) == (2.5, 1.2)
    assert (s["bb_http_run_true_ms_p50"], s["e2b_endpoint_server_ratio_run"]) == (10.0, 0.8)
    assert (s["bb_http_run_code_ms_p50"], s["e2b_endpoint_server_ratio_run_code"]) == (1.6, 0.75)
    assert (s["e2b_fork16_ms"], s["bb_fork16_ms"], s["e2b_overhead_ratio_fork16"]) == (120.0, 100.0, 1.2)
    assert (s["e2b_cloud_create_ms"], s["e2b_vs_cloud_create_speedup"]) == (150.0, 37.5)
    assert "not measured" in s["e2b_cloud_create_source"]
    assert (s["samples"], s["fork_reps"], s["fork_n"]) == (3, 1, 16)
    assert s["sample_counts"] == dict({m: 3 for m in be.METRICS}, e2b_fork16=1, bb_fork16=1)
    assert (s["e2b_overhead_ms_create"], s["e2b_overhead_ms_fork16"]) == (2.0, 20.0)
    assert s["e2b_create_ms_p99"] == pytest.approx(5.96)
    assert s["pool"]["bb"] == {"hits": 2, "misses": 1} and s["e2b_sdk"] == {"e2b": "2.63.0"}
    assert s["e2b_url"] == "http://127.0.0.1:49999" and s["image"] == "base" and s["notes"] == []
    assert s["samples_ms"]["e2b_create"] == [4.0, 6.0, 3.0]
    assert [row[0] for row in fake_result().rows()] == list(be.METRICS)


def test_nothing_measured_is_none_not_an_error() -> None:
    s = be.E2bResult(be.E2bConfig()).summary()
    assert all(s[k] is None for k in be.SUMMARY_KEYS if k.endswith(("_p50", "16_ms", "ratio_create", "speedup")))
    assert s["e2b_cloud_create_ms"] == 150.0 and set(s["sample_counts"].values()) == {0}
    lines = bench_cli.e2b_report_lines(s)
    assert any("create p50: E2B - vs branchbox - (ratio -)" in line for line in lines)
    res = be.E2bResult(be.E2bConfig())
    res.add("e2b_run_code", 1.0)
    res.add("bb_run_code", 0.0)
    assert res.summary()["e2b_overhead_ratio_run_code"] is None


# ----------------------------------------------------------------------------- the endpoint check


def endpoint(status: int = 200, body: Any = (), error: Optional[Exception] = None) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/sandboxes")
        if error is not None:
            raise error
        if request.headers.get("x-api-key") != "good":
            return httpx.Response(401, json={"code": 401, "message": "Invalid API key"})
        return httpx.Response(status, json=list(body) if isinstance(body, tuple) else body)

    return httpx.MockTransport(handle)


def test_the_endpoint_check_says_what_is_wrong() -> None:
    url = "http://127.0.0.1:49999/"
    be.check_endpoint(url, "good", transport=endpoint())
    with pytest.raises(be.BenchError, match=r"refused the API key \(HTTP 401\): pass the daemon's --token as --e2b-api-key"):
        be.check_endpoint(url, "bad", transport=endpoint())
    with pytest.raises(be.BenchError, match=r"nothing answers at http://127.0.0.1:49999 \(ConnectError: refused\): "
                                            r"start the daemon with --e2b-listen"):
        be.check_endpoint(url, "good", transport=endpoint(error=httpx.ConnectError("refused")))
    with pytest.raises(be.BenchError, match=r"answered HTTP 404 to GET /sandboxes .*is it branchbox's E2B endpoint"):
        be.check_endpoint(url, "good", transport=endpoint(404, {"error": "no"}))
    with pytest.raises(be.BenchError, match=r"not a list of sandboxes"):
        be.check_endpoint(url, "good", transport=endpoint(200, {"ok": True}))


# ----------------------------------------------------------------------------- the pinned E2B SDKs


def test_the_calls_match_the_installed_e2b_sdks(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the bench calls exists with these names in the E2B SDKs installed here, and its
    connection parameters point them at the endpoint (even with $E2B_DEBUG set)."""
    e2b = pytest.importorskip("e2b")
    ci = pytest.importorskip("e2b_code_interpreter")
    import inspect

    from e2b.connection_config import ApiParams, ConnectionConfig

    cfg = be.E2bConfig(e2b_url="http://127.0.0.1:49999", e2b_api_key="tok")
    assert set(cfg.e2b_params()) <= set(ApiParams.__annotations__)
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_API_URL", "https://elsewhere.invalid")
    conn = ConnectionConfig(**cfg.e2b_params())
    assert (conn.api_key, conn.api_url, conn.debug) == ("tok", "http://127.0.0.1:49999", False)
    assert conn.get_sandbox_url("sb0123456789ab", "e2b.app") == "http://127.0.0.1:49999"
    assert conn.get_sandbox_url("sb0123456789ab", "e2b.app", port=49999) == "http://127.0.0.1:49999"
    create = inspect.signature(e2b.Sandbox.create).parameters
    assert {"template", "timeout", "metadata"} <= set(create)
    fork = inspect.signature(e2b.Sandbox.fork).parameters
    assert {"count", "timeout"} <= set(fork)
    assert issubclass(ci.Sandbox, e2b.Sandbox) and "code" in inspect.signature(ci.Sandbox.run_code).parameters
    sdk = be.load_e2b_sdk()
    assert sdk.sandbox is e2b.Sandbox and sdk.code_sandbox is ci.Sandbox
    assert set(sdk.versions) == {"e2b", "e2b-code-interpreter"} and all(sdk.versions.values())


def test_without_the_e2b_sdks_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b", None)  # import e2b raises ImportError
    with pytest.raises(be.BenchError, match="pip install e2b e2b-code-interpreter"):
        be.load_e2b_sdk()


# ----------------------------------------------------------------------------- a fake daemon


def canonical(sid: str) -> str:
    return be.bb_id(sid)


class Daemon:
    """Just enough of branchboxd for ``bench e2b``, for branchbox's SDK (through an
    ``httpx.MockTransport``) and for the fake E2B SDK (:class:`FakeE2b`, directly): health, the
    pool's counters, creates, list by metadata, get (either id form), kill, commands, run_code
    and forks. ``events`` records (side, what) in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sandboxes: Dict[str, Dict[str, Any]] = {}
        self.events: List[Tuple[str, str]] = []
        self.killed: List[Tuple[str, str]] = []  # (side, id)
        self.bodies: List[Tuple[str, Dict[str, Any]]] = []  # branchbox's create/commands/fork bodies
        self.hits = 0
        self.misses = 0
        self.n = 0
        self.pool: Optional[Dict[str, Any]] = {"min": 1, "max": 1, "ready": 1, "wired": 0}
        #: Ready counts to answer, in turn, before ``pool["ready"]`` (a pool refilling).
        self.ready_script: List[int] = []
        self.miss_every = 0  # every n-th create misses the pool
        self.bad_run_code = False
        self.start_exit_code = 0  # what the bare Connect Start's end event says

    def new(self, side: str, metadata: Optional[Dict[str, str]], parent: Optional[str] = None) -> Dict[str, Any]:
        with self.lock:
            self.n += 1
            sid = "sb-%012x" % self.n
            if parent is None:
                if self.miss_every and self.n % self.miss_every == 0:
                    self.misses += 1
                else:
                    self.hits += 1
            self.sandboxes[sid] = dict(SANDBOX, id=sid, metadata=dict(metadata or {}), side=side)
            return self.sandboxes[sid]

    def kill(self, side: str, sid: str) -> bool:
        with self.lock:
            self.killed.append((side, canonical(sid)))
            return self.sandboxes.pop(canonical(sid), None) is not None

    def connect_start(self, request: httpx.Request) -> httpx.Response:
        raw = request.content
        size = int.from_bytes(raw[1:5], "big")
        assert raw[0] == 0 and len(raw) == 5 + size
        msg = json.loads(raw[5:])
        argv = [msg["process"]["cmd"]] + msg["process"]["args"]
        self.events.append(("e2b_http", "run " + " ".join(argv)))
        self.bodies.append(("start", dict(msg, headers={k: request.headers.get(k) for k in (
            "E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Access-Token", "Authorization", "Content-Type")})))
        end = {"exitCode": self.start_exit_code, "exited": True}
        frames = [(0, {"event": {"start": {"pid": 7}}}), (0, {"event": {"end": end}}), (2, {})]
        out = b"".join(bytes([f]) + len(json.dumps(x)).to_bytes(4, "big") + json.dumps(x).encode() for f, x in frames)
        return httpx.Response(200, content=out, headers={"Content-Type": "application/connect+json"})

    def __call__(self, request: httpx.Request) -> httpx.Response:
        m, path = request.method, request.url.path
        if path == "/process.Process/Start":  # the bench's bare Connect run, on the E2B endpoint
            return self.connect_start(request)
        body = json.loads(request.content) if request.content else None
        ok = lambda data, status=200: httpx.Response(status, json=data)  # noqa: E731
        if (m, path) == ("GET", "/v1/health"):
            return ok({"ok": True})
        if (m, path) == ("GET", "/v1/pool"):
            images = {}
            if self.pool is not None:
                ready = self.ready_script.pop(0) if self.ready_script else self.pool["ready"]
                images["base"] = dict(self.pool, ready=ready)
            return ok({"images": images, "hits": self.hits, "misses": self.misses})
        if (m, path) == ("POST", "/sandboxes"):  # the bench's bare-HTTP create, on the E2B endpoint
            self.events.append(("e2b_http", "create"))
            sid = self.new("e2b_http", body.get("metadata"))["id"]
            return ok({"sandboxID": sid.replace("-", ""), "templateID": body["templateID"]}, 201)
        mk = re.match(r"^/sandboxes/(sb[0-9a-f]+)$", path)
        if m == "DELETE" and mk:
            return httpx.Response(204 if self.kill("e2b_http", mk.group(1)) else 404)
        if m == "GET" and mk and canonical(mk.group(1)) in self.sandboxes:
            return ok({"sandboxID": mk.group(1), "envdAccessToken": "tok-" + mk.group(1)})
        if (m, path) == ("POST", "/execute"):  # the bench's bare-HTTP run_code, on the E2B endpoint
            sid = request.headers.get("E2b-Sandbox-Id", "")
            self.events.append(("e2b_http", "run_code"))
            self.bodies.append(("execute", dict(body, headers={k: request.headers.get(k) for k in (
                "E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Access-Token")})))
            if canonical(sid) not in self.sandboxes:
                return ok({"code": 502, "message": "sandbox not found"}, 502)
            text = "2" if body["code"] == "1+1" and not self.bad_run_code else "3"
            lines = [{"type": "result", "text": text, "is_main_result": True}, {"type": "end_of_execution"}]
            return httpx.Response(200, text="".join(json.dumps(x) + "\n" for x in lines))
        # The bench's bare requests to branchbox's API, or its SDK's.
        side = "bb_http" if request.headers.get("User-Agent") == be.BARE_USER_AGENT else "bb"
        if (m, path) == ("POST", "/v1/sandboxes"):
            self.bodies.append(("create", body))
            self.events.append((side, "create"))
            return ok(self.new(side, body.get("metadata")), 201)
        if (m, path) == ("GET", "/v1/sandboxes"):
            want = {k[len("metadata."):]: v for k, v in request.url.params.items() if k.startswith("metadata.")}
            listed = [s for s in self.sandboxes.values() if all(s["metadata"].get(k) == v for k, v in want.items())]
            return ok({"sandboxes": listed})
        ms = re.match(r"^/v1/sandboxes/(sb-?[0-9a-f]+)(/.*)?$", path)
        if ms and canonical(ms.group(1)) in self.sandboxes:
            sid, rest = canonical(ms.group(1)), ms.group(2) or ""
            sbx = self.sandboxes[sid]
            if (m, rest) == ("GET", ""):
                return ok(sbx)
            if (m, rest) == ("DELETE", ""):
                return ok({"killed": self.kill("bb", sid)})
            if (m, rest) == ("POST", "/commands"):
                self.bodies.append(("commands", body))
                self.events.append((side, "run " + " ".join(body.get("args") or [body.get("cmd")])))
                return ok(dict(RESULT, stdout=""))
            if (m, rest) == ("POST", "/code"):
                self.events.append((side, "run_code"))
                if self.bad_run_code:
                    return ok({"stdout": "", "result": None, "error": {"name": "NameError", "value": "x"}})
                return ok({"stdout": "", "result": "2" if body["code"] == "1+1" else None})
            if (m, rest) == ("POST", "/fork"):
                self.bodies.append(("fork", body))
                self.events.append(("bb", "fork"))
                kids = [self.new("bb", sbx["metadata"], parent=sid) for _ in range(body["count"])]
                return ok({"snapshot": "sn-f", "sandboxes": kids, "took_ms": 9.0}, 201)
        return ok({"error": {"code": "not_found", "message": "no route %s %s" % (m, path)}}, 404)


class FakeE2b:
    """E2B's SDK classes (``e2b.Sandbox`` and the code interpreter's) on :class:`Daemon`:
    sandboxes named without the dash. ``other_daemon``: its sandboxes are not the daemon's.
    Failure switches: ``fork_errors`` (children that fail), ``kill_fails`` (its kills raise),
    ``lost_create`` (the n-th create is made but its answer lost)."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.creates: List[Dict[str, Any]] = []
        self.forks: List[Dict[str, Any]] = []
        self.fork_errors = 0
        self.kill_fails = False
        self.lost_create = 0
        self.other: Dict[str, Dict[str, Any]] = {}
        self.other_daemon = False
        world = self

        class Commands:
            def __init__(self, sbx: Any) -> None:
                self.sbx = sbx

            def run(self, cmd: str) -> Any:
                world.d.events.append(("e2b", "run " + cmd))
                return SimpleNamespace(exit_code=0, stdout="", stderr="", error=None)

        class Sandbox:
            kind = "e2b"

            def __init__(self, sandbox_id: str) -> None:
                self.sandbox_id = sandbox_id
                self.commands = Commands(self)

            @classmethod
            def create(cls, template: Optional[str] = None, timeout: Optional[int] = None,
                       metadata: Optional[Dict[str, str]] = None, **params: Any) -> Any:
                world.creates.append(dict(kind=cls.kind, template=template, timeout=timeout, metadata=metadata,
                                          params=params))
                world.d.events.append(("e2b", "create " + cls.kind))
                if world.other_daemon:
                    sid = "sb-%012x" % (0xF00 + len(world.creates))
                    world.other[sid] = {"id": sid}
                else:
                    sid = world.d.new("e2b", metadata)["id"]
                if world.lost_create and len(world.creates) == world.lost_create:
                    raise TimeoutError("the answer was lost")
                return cls(sid.replace("-", ""))

            def kill(self) -> bool:
                if world.kill_fails:
                    raise RuntimeError("502 Bad Gateway")
                if world.other_daemon:
                    return world.other.pop(be.bb_id(self.sandbox_id), None) is not None
                return world.d.kill("e2b", self.sandbox_id)

            def fork(self, timeout: Optional[int] = None, count: Optional[int] = None) -> List[Any]:
                world.forks.append({"timeout": timeout, "count": count})
                world.d.events.append(("e2b", "fork"))
                parent = world.d.sandboxes[be.bb_id(self.sandbox_id)]
                kids: List[Any] = []
                for i in range(count or 1):
                    if i < world.fork_errors:
                        kids.append(RuntimeError("fork %d failed to start" % i))
                    else:
                        kids.append(type(self)(world.d.new("e2b", parent["metadata"], parent=parent["id"])["id"].replace("-", "")))
                return kids

        class CodeSandbox(Sandbox):
            kind = "code"

            def run_code(self, code: str) -> Any:
                world.d.events.append(("e2b", "run_code"))
                return SimpleNamespace(text="2" if code == "1+1" else None, error=None)

        self.sdk = be.E2bSdk(sandbox=Sandbox, code_sandbox=CodeSandbox, versions={"e2b": "fake"},
                             http_transport=httpx.MockTransport(d))


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeE2b]:
    d = Daemon()
    real = sync_mod.ConnectionConfig
    transport = httpx.MockTransport(d)

    class Patched(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.transport = transport

    monkeypatch.setattr(sync_mod, "ConnectionConfig", Patched)
    checked = []
    monkeypatch.setattr(be, "check_endpoint", lambda url, key: checked.append((url, key)))
    w = FakeE2b(d)
    w.checked = checked  # type: ignore[attr-defined]
    yield w


def cfg(**kw: Any) -> be.E2bConfig:
    return be.E2bConfig(**dict(dict(e2b_api_key="tok", e2b_url="http://127.0.0.1:5999/", samples=3, fork_reps=2), **kw))


def test_whole_run_on_a_fake_daemon(world: FakeE2b) -> None:
    d = world.d
    seen: List[str] = []
    res = be.run_e2b_bench(cfg(), seen.append, sdk=world.sdk)
    s = res.summary()
    assert world.checked == [("http://127.0.0.1:5999", "tok")]  # type: ignore[attr-defined]
    for key in be.SUMMARY_KEYS[:14]:
        assert s[key] is not None and s[key] > 0, key
    assert s["sample_counts"] == dict({m: 3 for m in be.METRICS}, e2b_fork16=2, bb_fork16=2)
    assert s["e2b_sdk"] == {"e2b": "fake"} and s["notes"] == [] and s["swept"] == []
    # Every sandbox killed, each through its own SDK.
    assert d.sandboxes == {}
    assert {side for side, _ in d.killed if d.killed.count((side, _)) > 1} == set(), "killed once each"
    e2b_made = [e for e in d.events if e[0] == "e2b" and e[1].startswith("create")]
    assert len([k for k in d.killed if k[0] == "e2b"]) == len(e2b_made) + 2 * 16
    # The E2B SDK pointed at the endpoint; every sandbox of the run tagged with its id.
    params = {"api_key": "tok", "api_url": "http://127.0.0.1:5999", "sandbox_url": "http://127.0.0.1:5999", "debug": False}
    assert all(c["params"] == params and c["template"] == "base" for c in world.creates)
    run_ids = {c["metadata"][be.RUN_KEY] for c in world.creates}
    run_ids |= {b["metadata"][be.RUN_KEY] for what, b in d.bodies if what == "create"}
    assert len(run_ids) == 1
    assert [c["kind"] for c in world.creates] == ["e2b"] * 5 + ["code"]
    assert [c["timeout"] for c in world.creates] == [be.SAMPLE_TTL] * 4 + [be.TTL] * 2
    # Warm-up, then creates alternating with the order flipped each sample.
    creates = [side for side, what in d.events if what.startswith("create") or what == "create"]
    sides = ["e2b", "e2b_http", "bb", "bb_http"]
    assert creates[:10] == ["e2b", "bb"] + sides + sides[::-1]
    assert s["pool"] == {side: {"hits": 3, "misses": 0} for side in sides}
    assert s["e2b_http_create_ms_p50"] > 0 and s["e2b_endpoint_overhead_ratio_create"] > 0
    assert s["bb_http_create_ms_p50"] > 0 and s["e2b_endpoint_server_ratio_create"] > 0
    bare = [b for what, b in d.bodies if what == "create" and be.RUN_KEY in b["metadata"]]
    assert {"image": "base", "timeout": be.SAMPLE_TTL, "metadata": bare[0]["metadata"]} in bare
    # Commands: one warm-up of each, then rounds of the three, the order reversed each round;
    # branchbox runs "true" (sh -c) and E2B's own argv.
    runs = [(side, what) for side, what in d.events if what.startswith("run ")]
    e2b_true, bb_true, bb_bash = ("e2b", "run true"), ("bb", "run true"), ("bb", "run /bin/bash -l -c true")
    http_true, bb_http_bash = ("e2b_http", "run /bin/bash -l -c true"), ("bb_http", "run /bin/bash -l -c true")
    one = [e2b_true, http_true, bb_true, bb_bash, bb_http_bash]
    assert runs == one * 2 + one[::-1] + one
    starts = [b for what, b in d.bodies if what == "start"]
    e2b_parent = starts[0]["headers"]["E2b-Sandbox-Id"]
    assert len(starts) == 4 and all(b == starts[0] for b in starts)
    assert starts[0] == {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"], "envs": {}}, "stdin": False,
                         "headers": {"E2b-Sandbox-Id": e2b_parent, "E2b-Sandbox-Port": "49983",
                                     "X-Access-Token": "tok-" + e2b_parent, "Authorization": "Basic dXNlcjo=",
                                     "Content-Type": "application/connect+json"}}
    assert s["e2b_http_run_true_ms_p50"] > 0 and s["e2b_endpoint_overhead_ratio_run"] > 0
    assert s["e2b_sdk_client_ms_run"] is not None
    commands = [b for what, b in d.bodies if what == "commands"]
    assert commands[0] == {"cmd": "true", "timeout": 60}
    assert (commands[1]["args"], commands[1]["user"]) == (be.E2B_RUN_ARGV, "user")
    assert commands[2] == {"args": be.E2B_RUN_ARGV, "user": "user"}
    assert s["bb_http_run_true_ms_p50"] > 0 and s["e2b_endpoint_server_ratio_run"] > 0
    # run_code: one run of each first, then alternating.
    code = [side for side, what in d.events if what == "run_code"]
    rnd = ["e2b", "e2b_http", "bb", "bb_http"]
    assert code == ["e2b", "bb", "e2b_http", "bb_http"] + rnd + rnd[::-1] + rnd
    code_sid = [c for c in d.killed if c[0] == "e2b"][-1][1].replace("-", "")  # the code sandbox: killed last
    assert {tuple(sorted(b["headers"].items())) for what, b in d.bodies if what == "execute"} == {
        (("E2b-Sandbox-Id", code_sid), ("E2b-Sandbox-Port", "49999"), ("X-Access-Token", "tok-" + code_sid))}
    assert s["e2b_http_run_code_ms_p50"] > 0 and s["e2b_endpoint_overhead_ratio_run_code"] > 0
    assert s["e2b_sdk_client_ms_run_code"] is not None and s["e2b_sdk_client_ms_create"] is not None
    assert s["bb_http_run_code_ms_p50"] > 0 and s["e2b_endpoint_server_ratio_run_code"] > 0
    # fork(16) of each side's parent, alternating, with the children's TTL.
    assert world.forks == [{"timeout": be.SAMPLE_TTL, "count": 16}] * 2
    assert [b for what, b in d.bodies if what == "fork"] == [{"count": 16, "timeout": be.SAMPLE_TTL}] * 2
    assert [side for side, what in d.events if what == "fork"] == ["e2b", "bb", "bb", "e2b"]
    assert any(m.startswith("fork(16) 2/2") for m in seen) and any(m.startswith("create 3/3") for m in seen)


def test_creates_wait_for_the_pool_and_misses_are_counted(world: FakeE2b, monkeypatch: pytest.MonkeyPatch) -> None:
    d = world.d
    d.ready_script = [1, 0, 0, 1]  # warm-up check, then the first wait sees the pool refill
    d.miss_every = 4
    s = be.run_e2b_bench(cfg(samples=2, fork_reps=1), sdk=world.sdk).summary()
    assert d.ready_script == []
    assert sum(v["misses"] for v in s["pool"].values()) >= 1
    assert any("missed the warm pool" in n for n in s["notes"])
    # A pool that never gets ready: each create waits POOL_WAIT, then goes ahead (cold).
    monkeypatch.setattr(be, "POOL_WAIT", 0.05)
    d.pool = dict(d.pool, ready=0)
    s = be.run_e2b_bench(cfg(samples=1, fork_reps=1), sdk=world.sdk).summary()
    assert s["e2b_create_ms_p50"] is not None and d.sandboxes == {}


def test_without_a_pool_creates_do_not_wait(world: FakeE2b) -> None:
    world.d.pool = None
    s = be.run_e2b_bench(cfg(samples=1, fork_reps=1), sdk=world.sdk).summary()
    assert any("no warm pool for image base" in n and "pool set base --min 1" in n for n in s["notes"])
    assert world.d.sandboxes == {}


def test_an_endpoint_of_another_daemon_fails_the_run(world: FakeE2b) -> None:
    world.other_daemon = True
    with pytest.raises(be.BenchError, match=r"sandbox sb000000000f01, created through the E2B endpoint at "
                                            r"http://127.0.0.1:5999, is not on the daemon at unix:///x.sock: "
                                            r"--e2b-url and --daemon must name the same daemon"):
        be.run_e2b_bench(cfg(daemon="unix:///x.sock"), sdk=world.sdk)
    assert world.other == {}, "killed through the E2B SDK"


def test_a_failed_fork_child_fails_the_run_and_everything_is_killed(world: FakeE2b) -> None:
    world.fork_errors = 1
    with pytest.raises(be.BenchError, match=r"fork\(count=16\) of E2B sandbox sb\w+ through http://127.0.0.1:5999 "
                                            r"gave 15 sandboxes and 1 errors \(first: RuntimeError: fork 0 failed"):
        be.run_e2b_bench(cfg(), sdk=world.sdk)
    assert world.d.sandboxes == {}


def test_a_kill_the_e2b_sdk_fails_goes_through_branchbox(world: FakeE2b) -> None:
    world.kill_fails = True
    s = be.run_e2b_bench(cfg(samples=1, fork_reps=1), sdk=world.sdk).summary()
    assert world.d.sandboxes == {} and all(side in ("bb", "e2b_http") for side, _ in world.d.killed)
    assert any("the E2B SDK's kill of sb" in n and "killed through branchbox's SDK" in n for n in s["notes"])


def test_a_create_whose_answer_is_lost_is_swept(world: FakeE2b) -> None:
    world.lost_create = 3
    with pytest.raises(be.BenchError, match=r"e2b.Sandbox.create\(template='base'\) through the E2B endpoint at "
                                            r"http://127.0.0.1:5999 failed \(TimeoutError: the answer was lost\)"):
        be.run_e2b_bench(cfg(), sdk=world.sdk)
    assert world.d.sandboxes == {}


def test_a_wrong_run_code_answer_fails_the_run(world: FakeE2b) -> None:
    world.d.bad_run_code = True
    with pytest.raises(be.BenchError, match=r"run_code\('1\+1'\) in sandbox sb-\w+ returned None \(error: NameError: x\)"):
        be.run_e2b_bench(cfg(), sdk=world.sdk)
    assert world.d.sandboxes == {}


def test_a_failed_bare_connect_run_fails_the_run(world: FakeE2b) -> None:
    world.d.start_exit_code = 1
    with pytest.raises(be.BenchError, match=r"Connect Start of /bin/bash -l -c true in E2B sandbox sb\w+ answered 200"):
        be.run_e2b_bench(cfg(), sdk=world.sdk)
    assert world.d.sandboxes == {}


def test_connect_envelopes_are_split_and_bad_streams_have_no_end() -> None:
    def frame(flags: int, msg: Any) -> bytes:
        raw = json.dumps(msg).encode()
        return bytes([flags]) + len(raw).to_bytes(4, "big") + raw

    ok = frame(0, {"a": 1}) + frame(0, {"b": 2}) + frame(2, {})
    assert be._envelopes(ok) == ([{"a": 1}, {"b": 2}], {})
    assert be._envelopes(frame(0, {"a": 1}) + frame(2, {"error": {"code": "internal"}})) == (
        [{"a": 1}], {"error": {"code": "internal"}})
    assert be._envelopes(ok[:-3]) == ([{"a": 1}, {"b": 2}], None), "truncated end"
    assert be._envelopes(ok + b"x") == ([{"a": 1}, {"b": 2}], None), "bytes after the end"
    assert be._envelopes(frame(0, {"a": 1})) == ([{"a": 1}], None), "no end"
    assert be._envelopes(b"\x00\x00\x00\x00\x02{x") == ([], None), "not JSON"


def test_an_interrupt_kills_everything(world: FakeE2b, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(self: Any, e: Any, b: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(be._Run, "forks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        be.run_e2b_bench(cfg(), sdk=world.sdk)
    assert world.d.sandboxes == {} and len(world.d.killed) >= 2


def test_no_key_fails_before_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(be, "load_e2b_sdk", lambda: pytest.fail("nothing before the check"))
    with pytest.raises(be.BenchError, match="no API key"):
        be.run_e2b_bench(be.E2bConfig())


# ----------------------------------------------------------------------------- the CLI


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(cfg, progress=None):
        seen["cfg"] = cfg
        progress("x")
        return fake_result()

    monkeypatch.setattr(be, "run_e2b_bench", fake_run)
    r = cli_runner().invoke(cli.app, [
        "--daemon", "unix:///x.sock", "bench", "e2b", "--samples", "4", "--fork-reps", "2",
        "--e2b-url", "http://127.0.0.1:5999", "--e2b-api-key", "k1",
    ])
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["e2b_overhead_ratio_create"] == 2.0 and s["e2b_vs_cloud_create_speedup"] == 37.5
    text = r.stdout
    assert "e2b_create" in text and "bb_run_bash_login_true" in text and "bb_fork16" in text
    assert "create p50: E2B 4.00 ms vs branchbox 2.00 ms (ratio 2.00); warm pool hits: E2B 3/3, branchbox 2/3" in text
    assert "branchbox running E2B's argv (/bin/bash -l -c true) 12.00 ms (ratio 1.00)" in text
    assert "fork(16), median of 1: E2B 120.00 ms vs branchbox 100.00 ms (ratio 1.20)" in text
    assert "E2B cloud create 150 ms (documented by E2B, not measured) / E2B endpoint create p50 4.00 ms: 37.5x" in text
    c = seen["cfg"]
    assert (c.samples, c.fork_reps, c.e2b_url, c.e2b_api_key, c.daemon, c.image) == (
        4, 2, "http://127.0.0.1:5999", "k1", "unix:///x.sock", "base"
    )
    # Defaults: $BRANCHBOX_E2B_URL, else port 49999; the key from $BRANCHBOX_TOKEN, else --token.
    r = cli_runner().invoke(cli.app, ["bench", "e2b", "--json"], env={"BRANCHBOX_TOKEN": "k2"})
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1
    c = seen["cfg"]
    assert (c.samples, c.fork_reps, c.e2b_url, c.e2b_api_key) == (15, 3, "http://127.0.0.1:49999", "k2")
    r = cli_runner().invoke(cli.app, ["--token", "k3", "bench", "e2b", "--json"],
                            env={"BRANCHBOX_E2B_URL": "http://10.0.0.1:7000"})
    assert r.exit_code == 0, r.stderr
    assert (seen["cfg"].e2b_url, seen["cfg"].e2b_api_key, seen["cfg"].token) == ("http://10.0.0.1:7000", "k3", "k3")


def test_cli_without_a_key_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(be, "run_e2b_bench", lambda cfg, progress=None: pytest.fail("no run without a key"))
    r = cli_runner().invoke(cli.app, ["bench", "e2b"])
    assert r.exit_code == 1
    assert "no API key for the E2B endpoint: pass the daemon's token as --e2b-api-key" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg, progress=None):
        raise be.BenchError("bench e2b: the E2B endpoint at http://127.0.0.1:49999 refused the API key (HTTP 401)")

    monkeypatch.setattr(be, "run_e2b_bench", broken)
    r = cli_runner().invoke(cli.app, ["bench", "e2b", "--e2b-api-key", "x"])
    assert r.exit_code == 1 and "refused the API key" in r.stderr and "Traceback" not in r.stderr
