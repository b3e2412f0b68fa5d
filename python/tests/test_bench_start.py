"""``bench start``: host-side memory helpers, the summary, the CLI wiring, and whole runs
against a stateful fake daemon (pool claims, restore of the pool settings even on error)."""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Dict, List, Optional
from urllib.parse import parse_qs

import httpx
import pytest

import branchbox.sandbox_sync as sync_mod
from branchbox_bench import start as bs
from branchbox_cli import app as cli
from conftest import IMAGE, RESULT, SANDBOX, cli_runner

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "BENCHMARKS.md")

SMAPS = """55d0c0a00000-7ffd5b5fe000 ---p 00000000 00:00 0                          [rollup]
Rss:                3072 kB
Pss:                1536 kB
Pss_Anon:            512 kB
Shared_Clean:       2048 kB
Shared_Dirty:          0 kB
Private_Clean:       256 kB
Private_Dirty:       768 kB
Referenced:         3072 kB
"""


# ----------------------------------------------------------------------------- memory helpers


def test_smaps_kib() -> None:
    assert bs.smaps_kib(SMAPS, bs.PRIVATE_KEYS) == 1024
    assert bs.smaps_kib(SMAPS, bs.PSS_KEYS) == 1536, "Pss_Anon is not Pss"
    assert bs.smaps_kib("", bs.PSS_KEYS) == 0


def _procs(root, parts, pids) -> None:
    d = root.joinpath(*parts)
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text("".join("%d\n" % p for p in pids))


def test_cgroup_pids_v1_and_v2(tmp_path) -> None:
    v1 = tmp_path / "v1"
    _procs(v1, ["memory", "branchbox", "sb-1"], [10, 11])
    _procs(v1, ["pids", "branchbox", "sb-1"], [10, 11, 12])
    _procs(v1, ["pids", "branchbox", "sb-2"], [20])
    assert bs.cgroup_pids("sb-1", str(v1)) == {10, 11, 12}
    v2 = tmp_path / "v2"
    _procs(v2, ["branchbox", "sb-1"], [30])
    _procs(v2, ["system.slice", "branchbox", "sb-1"], [31])
    assert bs.cgroup_pids("sb-1", str(v2)) == {30, 31}
    assert bs.cgroup_pids("sb-nope", str(v2)) == set()


def test_sandbox_memory_mb(tmp_path) -> None:
    _procs(tmp_path / "cg", ["memory", "bb", "sb-1"], [5, 6, 7])
    proc = tmp_path / "proc"
    for pid in (5, 6):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "smaps_rollup").write_text(SMAPS)
    # pid 7 exited meanwhile: skipped
    private, pss = bs.sandbox_memory_mb("sb-1", str(tmp_path / "cg"), str(proc))
    assert (private, pss) == (2.0, 3.0)
    assert bs.sandbox_memory_mb("sb-2", str(tmp_path / "cg"), str(proc)) == (None, None)


# ----------------------------------------------------------------------------- summary


def _fake_result(**values: Any) -> bs.StartResult:
    res = bs.StartResult(bs.StartConfig())
    res.samples["pool_start"] = [4.0, 5.0, 6.0]
    res.samples["pool_concurrent16"] = [10.0] * 15 + [40.0]
    res.samples["cold_start"] = [20.0, 20.0]
    res.samples["template_start"] = [10.0]
    res.samples["import_numpy_cold"] = [120.0, 120.0]
    res.samples["exec_true"] = [2.0]
    res.values.update(
        idle_private_mb=0.25, idle_pss_mb=0.3, sandboxes_n=200, sandboxes_ok=True, sandboxes_create_s=3.5,
        cgroup_placement="migrate", cgroup_placement_ms_p50=0.2, pool_hits=40, ignored_key=1,
    )
    res.values.update(values)
    res.notes.append("n")
    return res


def test_summary_shape_ratios_and_targets() -> None:
    s = _fake_result().summary()
    assert tuple(s)[: len(bs.SUMMARY_KEYS)] == bs.SUMMARY_KEYS
    assert list(s)[-2:] == ["targets_met", "notes"] and "ignored_key" not in s
    assert s["pool_start_ms_p50"] == 5.0 and s["cold_start_ms_p50"] == 20.0
    assert s["pool_speedup_vs_cold"] == 4.0 and s["template_speedup_vs_import_numpy"] == 12.0
    assert s["pool_concurrent16_ms_p99"] > 30 and s["sandboxes_200_ok"] is True
    assert (s["n_pool"], s["n_concurrent"], s["n_cold"], s["n_template"], s["n_import_numpy"]) == (3, 16, 2, 1, 2)
    assert s["targets_met"] == {
        "pool_p50_le_10ms": True,
        "pool_concurrent16_p99_le_30ms": False,
        "template_speedup_ge_10x": True,
    }
    assert s["notes"] == ["n"]
    json.dumps(s)  # serialisable


def test_summary_with_missing_parts() -> None:
    res = bs.StartResult(bs.StartConfig.make(True))
    res.samples["pool_start"] = [3.0]
    res.values.update(sandboxes_n=20, sandboxes_ok=True)
    s = res.summary()
    assert s["cold_start_ms_p50"] is None and s["pool_speedup_vs_cold"] is None
    assert s["sandboxes_200_ok"] is None, "fewer than 200 sandboxes say nothing about 200"
    assert s["targets_met"] == {"pool_p50_le_10ms": True, "pool_concurrent16_p99_le_30ms": None, "template_speedup_ge_10x": None}
    assert s["quick"] is True
    assert any("targets:" in line for line in bs.report_lines(s))


def test_config_make() -> None:
    full, quick = bs.StartConfig.make(), bs.StartConfig.make(True)
    assert full.sandboxes == 200 and quick.sandboxes < 200 and quick.n_pool < full.n_pool
    assert quick.concurrent_rounds >= 1
    assert bs.StartConfig.make(True, n_pool=3, sandboxes=None).n_pool == 3
    assert bs.StartConfig.make(True, sandboxes=None).sandboxes == quick.sandboxes


def test_every_summary_key_is_documented() -> None:
    if not os.path.isfile(DOCS):
        pytest.skip("docs/BENCHMARKS.md is not next to the package")
    with open(DOCS) as f:
        text = f.read()
    start = text.index("## `bench start`")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    documented = set(re.findall(r"`([a-z0-9_]+)`", section))
    s = _fake_result().summary()
    missing = sorted(k for k in set(s) | set(s["targets_met"]) if k not in documented)
    assert not missing, "keys of the bench start JSON missing from docs/BENCHMARKS.md: %s" % missing


# ----------------------------------------------------------------------------- CLI


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Dict[str, Any] = {}

    def fake_run(cfg, progress=None):
        seen["cfg"] = cfg
        progress("x")
        return _fake_result()

    monkeypatch.setattr(bs, "run_start_bench", fake_run)
    r = cli_runner().invoke(cli.app, ["--daemon", "unix:///x.sock", "bench", "start", "--quick", "--sandboxes", "7"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    s = json.loads(lines[-1])
    assert s["pool_start_ms_p50"] == 5.0
    assert "pool_start" in r.stdout and "targets:" in r.stdout
    cfg = seen["cfg"]
    assert cfg.quick and cfg.sandboxes == 7 and cfg.daemon == "unix:///x.sock" and cfg.n_pool == 10
    r = cli_runner().invoke(cli.app, ["bench", "start", "--json", "--numpy-image", "np2", "--n", "3"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1
    assert seen["cfg"].numpy_image == "np2" and seen["cfg"].n_pool == 3 and not seen["cfg"].quick


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg, progress=None):
        raise bs.BenchError("bench: the pool of base has 0 ready sandboxes")

    monkeypatch.setattr(bs, "run_start_bench", broken)
    r = cli_runner().invoke(cli.app, ["bench", "start", "--quick"])
    assert r.exit_code == 1 and "error: bench: the pool of base" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- whole runs on a fake daemon


class StatefulDaemon:
    """Just enough of branchboxd for a bench run: a pool that refills at once and recycles,
    sandboxes, exec, run_code, templates. ``fail_create_after`` breaks creates."""

    def __init__(self, pool: Optional[Dict[str, Dict[str, int]]] = None) -> None:
        self.lock = threading.Lock()
        self.pool = {k: dict(v) for k, v in (pool or {}).items()}
        self.counters = {"hits": 0, "misses": 0, "recycled": 0, "created": 0, "failures": 0}
        self.live: Dict[str, Dict[str, Any]] = {}
        self.templates: Dict[str, Dict[str, Any]] = {}
        self.puts: List[tuple] = []
        self.next_id = 0
        self.fail_create_after: Optional[int] = None
        self.creates = 0
        self.template_removed: List[str] = []
        self.images = ["base", "py-numpy"]
        self.built_images: List[str] = []

    def _pool_json(self) -> Dict[str, Any]:
        return dict(self.counters, images={k: dict(v) for k, v in self.pool.items()}, last_error=None,
                    refill_ms_p50=9.0, refill_ms_p99=12.0, cgroup_placement="migrate", cgroup_placement_ms_p50=0.2)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            return self.handle(request)

    def handle(self, request: httpx.Request) -> httpx.Response:
        m, path = request.method, request.url.path
        body = json.loads(request.content) if request.content else None
        if (m, path) == ("GET", "/v1/images"):
            return httpx.Response(200, json={"images": [dict(IMAGE, name=n) for n in self.images]})
        if (m, path) == ("POST", "/v1/images/build"):
            self.images.append(body["name"])
            self.built_images.append(body["name"])
            events = [{"type": "progress", "stage": "x", "message": "", "done": 1, "total": 1}, {"type": "done", "image": dict(IMAGE, name=body["name"])}]
            return httpx.Response(200, content=b"".join(json.dumps(e).encode() + b"\n" for e in events))
        if (m, path) == ("GET", "/v1/pool"):
            return httpx.Response(200, json=self._pool_json())
        if m == "PUT" and path.startswith("/v1/pool/"):
            image = path.rsplit("/", 1)[1]
            lo, hi = body["min"], body.get("max", body["min"])
            self.puts.append((image, lo, hi))
            self.pool[image] = {"min": lo, "max": hi, "ready": lo}  # instant refill
            return httpx.Response(200, json=self._pool_json())
        if (m, path) == ("POST", "/v1/sandboxes"):
            self.creates += 1
            if self.fail_create_after is not None and self.creates > self.fail_create_after:
                return httpx.Response(500, json={"error": {"code": "internal", "message": "create broke"}})
            image = body.get("image") or "base"
            if body.get("template"):
                if body["template"] not in self.templates:
                    return httpx.Response(404, json={"error": {"code": "not_found", "message": "template"}})
                image = self.templates[body["template"]]["image"]
            p = self.pool.get(image)
            if not body.get("template"):
                if p and p["ready"] > 0:
                    p["ready"] -= 1
                    self.counters["hits"] += 1
                    if p["ready"] < p["min"]:
                        p["ready"] += 1  # the background refill, instantly
                else:
                    self.counters["misses"] += 1
            self.next_id += 1
            sid = "sb-%012x" % self.next_id
            info = dict(SANDBOX, id=sid, image=image, metadata=body.get("metadata") or {})
            self.live[sid] = info
            return httpx.Response(201, json=info)
        if (m, path) == ("GET", "/v1/sandboxes"):
            want = {k[len("metadata."):]: v[0] for k, v in parse_qs(request.url.query.decode()).items()}
            infos = [i for i in self.live.values() if all(i["metadata"].get(k) == v for k, v in want.items())]
            return httpx.Response(200, json={"sandboxes": infos})
        mm = re.match(r"^/v1/sandboxes/(sb-[0-9a-f]+)(/.*)?$", path)
        if mm:
            sid, rest = mm.group(1), mm.group(2) or ""
            if sid not in self.live:
                return httpx.Response(404, json={"error": {"code": "not_found", "message": "sandbox %s" % sid}})
            if m == "DELETE" and rest == "":
                info = self.live.pop(sid)
                p = self.pool.get(info["image"])
                if p and p["ready"] < p["max"]:
                    p["ready"] += 1
                    self.counters["recycled"] += 1
                return httpx.Response(200, json={"killed": True})
            if m == "GET" and rest == "":
                return httpx.Response(200, json=self.live[sid])
            if m == "POST" and rest == "/commands":
                return httpx.Response(200, json=RESULT)
            if m == "POST" and rest == "/code":
                return httpx.Response(200, json={"stdout": "", "stderr": "", "result": "45", "error": None, "timed_out": False})
        mt = re.match(r"^/v1/templates(?:/([^/]+))?$", path)
        if mt:
            name = mt.group(1)
            if m == "POST" and name is None:
                t = {"name": body["name"], "image": body.get("image", "base"), "snapshot": "sn-1", "sandbox_id": "sb-t",
                     "created_at": 1.0, "shells": 4, "ready_shells": 4, "alive": True, "memory_bytes": 1}
                self.templates[body["name"]] = t
                return httpx.Response(200, content=(json.dumps({"type": "done", "template": t}) + "\n").encode())
            if name not in self.templates:
                return httpx.Response(404, json={"error": {"code": "not_found", "message": "template %s" % name}})
            if m == "GET":
                return httpx.Response(200, json=self.templates[name])
            if m == "DELETE":
                del self.templates[name]
                self.template_removed.append(name)
                return httpx.Response(200, json={"removed": True})
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no route %s %s" % (m, path)}})


@pytest.fixture
def stateful(monkeypatch: pytest.MonkeyPatch):
    def make(**kw) -> StatefulDaemon:
        d = StatefulDaemon(**kw)
        real = sync_mod.ConnectionConfig
        transport = httpx.MockTransport(d)

        class Patched(real):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.transport = transport

        monkeypatch.setattr(sync_mod, "ConnectionConfig", Patched)
        monkeypatch.setattr(bs.time, "sleep", lambda _s: None)
        return d

    return make


def _tiny(**kw) -> bs.StartConfig:
    base = dict(n_pool=3, concurrent_rounds=1, n_cold=2, n_template=2, n_import_numpy=2, n_memory=1, sandboxes=5, workers=4, ready_timeout=5)
    base.update(kw)
    return bs.StartConfig.make(True, **base)


def test_whole_run_on_a_fake_daemon(stateful) -> None:
    d = stateful(pool={"base": {"min": 2, "max": 4, "ready": 2}})
    res = bs.run_start_bench(_tiny())
    s = res.summary()
    assert s["n_pool"] == 3 and s["n_concurrent"] == 16 and s["n_cold"] == 2 and s["n_template"] == 2
    assert s["pool_misses"] == 0 and s["pool_hits"] >= 3 + 16, "every pool sample is a claim"
    assert s["sandboxes_n"] == 5 and s["sandboxes_ok"] is True and s["sandboxes_200_ok"] is None
    assert s["cgroup_placement"] == "migrate" and s["pool_refill_ms_p50"] == 9.0
    assert s["template_start_ms_p50"] is not None and s["import_numpy_cold_ms_p50"] is not None
    # pool filled for the claims, drained for the cold part, then restored
    assert d.puts[0] == ("base", 16, 16) and ("base", 0, 0) in d.puts and d.puts[-1] == ("base", 2, 4)
    assert d.pool["base"]["min"] == 2 and d.pool["base"]["max"] == 4
    assert d.live == {}, "every sandbox was killed"
    assert d.template_removed == ["bench-start-numpy"] and d.templates == {}
    assert any("restored" in n for n in s["notes"]) and any("built for this run" in n for n in s["notes"])


def test_existing_template_is_kept_and_numpy_image_built(stateful) -> None:
    d = stateful()
    d.images = ["base"]
    d.templates["bench-start-numpy"] = {"name": "bench-start-numpy", "image": "py-numpy", "snapshot": "sn-1", "sandbox_id": "sb-t",
                                         "created_at": 1.0, "shells": 2, "ready_shells": 2, "alive": True, "memory_bytes": 1}
    res = bs.run_start_bench(_tiny(sandboxes=0))
    assert d.built_images == ["py-numpy"]
    assert d.template_removed == [] and "bench-start-numpy" in d.templates
    assert d.puts[-1] == ("base", 0, 0), "no pool before: none after"
    assert any("reused" in n for n in res.notes) and any("skipped" in n for n in res.notes)


def test_pool_settings_are_restored_on_error(stateful) -> None:
    d = stateful(pool={"base": {"min": 3, "max": 6, "ready": 3}, "py-numpy": {"min": 1, "max": 1, "ready": 1}})
    d.fail_create_after = 4
    with pytest.raises(bs.SandboxError, match="create broke"):
        bs.run_start_bench(_tiny())
    assert d.puts[-1] == ("base", 3, 6) and d.pool["base"] == {"min": 3, "max": 6, "ready": 3}
    assert d.live == {}


def test_numpy_pool_is_drained_for_the_baseline_and_restored(stateful) -> None:
    d = stateful(pool={"py-numpy": {"min": 1, "max": 2, "ready": 1}})
    bs.run_start_bench(_tiny(sandboxes=0))
    assert ("py-numpy", 0, 0) in d.puts and d.pool["py-numpy"]["max"] == 2 and d.pool["py-numpy"]["min"] == 1


def test_a_failing_exec_is_an_error(stateful, monkeypatch: pytest.MonkeyPatch) -> None:
    d = stateful()
    real = d.handle

    def handle(request):
        if request.url.path.endswith("/commands"):
            return httpx.Response(200, json=dict(RESULT, exit_code=1, stderr="boom"))
        return real(request)

    d.handle = handle  # type: ignore[method-assign]
    with pytest.raises(bs.BenchError, match="boom"):
        bs.run_start_bench(_tiny())
    assert d.live == {} and d.puts[-1] == ("base", 0, 0)


@pytest.mark.skipif(not os.environ.get("BRANCHBOX_BENCH_START_DAEMON"), reason="set BRANCHBOX_BENCH_START_DAEMON=unix:///... to run")
def test_quick_bench_against_a_live_daemon() -> None:
    """CI smoke test (opt-in): ``bench start --quick --json`` against a real daemon."""
    import time

    t0 = time.monotonic()
    r = cli_runner().invoke(cli.app, ["--daemon", os.environ["BRANCHBOX_BENCH_START_DAEMON"], "bench", "start", "--json", "--quick"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert tuple(s)[: len(bs.SUMMARY_KEYS)] == bs.SUMMARY_KEYS and s["quick"] is True
    assert s["pool_start_ms_p50"] is not None and s["pool_misses"] == 0 and s["sandboxes_ok"] is True
    assert time.monotonic() - t0 < 120
