"""Unit tests of the volume bench's pure parts, and of its in-sandbox scripts run here on two
plain directories (the measurements need daemons, MinIO and root)."""

import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List

import httpx
import pytest

import branchbox.sandbox_sync as sync_mod
from branchbox_bench import volume as bv
from branchbox_cli import app as cli
from branchbox_cli import bench as bench_cli
from conftest import ENTRY, RESULT, SANDBOX, cli_runner
from test_volumes_sdk import VOLUME

MIB = 1 << 20


def test_set_labels() -> None:
    assert [bv.set_label(n, size) for n, size in bv.FILE_SETS] == ["1000x4KiB", "500x256B"]
    assert (bv.LARGE_SET, bv.SMALL_SET) == ("1000x4KiB", "500x256B")


def test_sync_layout_is_the_store_bench_layout() -> None:
    layout = bv.sync_layout(64)
    assert sum(size for _, size in layout) == 64 * MIB
    big = [size for name, size in layout if name.startswith("big-")]
    small = [size for name, size in layout if name.startswith("small/")]
    assert len(big) == 4 and sum(big) == 64 * MIB * 9 // 10 // 4 * 4
    assert all(16 << 10 <= s < 128 << 10 for s in small[:-1]) and 0 < small[-1] < 128 << 10
    assert len({name for name, _ in layout}) == len(layout)
    assert sum(size for _, size in bv.sync_layout(1)) == MIB


def test_the_file_benchmark_script_measures_both_targets_and_cleans_up(tmp_path) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    out = tmp_path / "out.json"
    cfg = {
        "targets": [["local", str(local)], ["volume", str(volume)]],
        "sets": [[20, 4096], [10, 256]],
        "rounds": 3,
        "per_dir": 8,
        "parallelism": 4,
        "out": str(out),
    }
    subprocess.run([sys.executable, "-c", bv.FILES_SCRIPT, json.dumps(cfg)], check=True, timeout=120)
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 * 3 * 2
    assert [(r["files"], r["target"]) for r in runs[:4]] == [(20, "local"), (20, "volume"), (20, "volume"), (20, "local")]
    for r in runs:
        assert len(r["write"]["op_ms"]) == len(r["read"]["op_ms"]) == len(r["liststat"]["op_ms"]) == r["files"]
    assert not os.listdir(local) and not os.listdir(volume)  # each tree deleted after its run
    stats = bv.file_stats(runs)
    assert set(stats) == {"20x4KiB", "10x256B"}
    for label in stats:
        assert set(stats[label]) == {"local", "volume"}
        for target in stats[label].values():
            assert set(target) == set(bv.PHASES)
            for phase in target.values():
                assert phase["ops_s"] > 0 and phase["p95_ms"] >= 0 and len(phase["ops_s_rounds"]) == 3


def test_the_file_benchmark_checks_what_it_reads(tmp_path) -> None:
    # Files that read back other than the payload (here: written reversed) fail the run.
    cfg = {
        "targets": [["local", str(tmp_path / "a")], ["volume", str(tmp_path / "b")]],
        "sets": [[5, 16]],
        "rounds": 1,
        "per_dir": 2,
        "parallelism": 2,
        "out": str(tmp_path / "out.json"),
    }
    bad = bv.FILES_SCRIPT.replace("f.write(payload)", "f.write(payload[::-1])")
    r = subprocess.run([sys.executable, "-c", bad, json.dumps(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "differ" in r.stderr and not (tmp_path / "out.json").exists()


def test_the_fill_script(tmp_path) -> None:
    root = tmp_path / "fill"
    subprocess.run([sys.executable, "-c", bv.FILL_SCRIPT, str(root), "300", "256", "128"], check=True, timeout=60)
    assert sorted(os.listdir(root)) == ["d0000", "d0001", "d0002"]
    assert [len(os.listdir(root / d)) for d in sorted(os.listdir(root))] == [128, 128, 44]
    assert (root / "d0002" / "f000299.bin").read_bytes() == bytes(i % 251 for i in range(256))


def run(files: int, size: int, target: str, seconds: float, op_ms) -> dict:
    phase = {"seconds": seconds, "op_ms": list(op_ms)}
    return {"files": files, "size": size, "target": target, "write": phase, "read": phase, "liststat": phase}


def test_file_stats_are_medians_of_rounds_and_p95_of_all_ops() -> None:
    runs = [
        run(100, 4096, "local", 0.1, [1.0] * 100),  # 1000 ops/s
        run(100, 4096, "local", 0.05, [2.0] * 100),  # 2000
        run(100, 4096, "local", 0.2, [3.0] * 100),  # 500
        run(100, 4096, "volume", 0.4, range(100)),  # 250
    ]
    s = bv.file_stats(runs)["100x4KiB"]
    assert s["local"]["write"] == {"ops_s": 1000.0, "p95_ms": 3.0, "ops_s_rounds": [1000.0, 2000.0, 500.0]}
    assert s["volume"]["liststat"]["ops_s"] == 250.0 and s["volume"]["read"]["p95_ms"] == pytest.approx(94.05)


def fake_result() -> bv.VolumeResult:
    res = bv.VolumeResult(bv.VolumeConfig(rounds=3, samples=2, sync_mb=64))
    phases = lambda ops: {p: {"ops_s": ops, "p95_ms": 1.0, "ops_s_rounds": [ops]} for p in bv.PHASES}  # noqa: E731
    res.files["local_store"] = {
        "1000x4KiB": {"local": phases(1000.0), "volume": phases(800.0)},
        "500x256B": {"local": phases(2000.0), "volume": phases(3000.0)},
    }
    res.files["s3_store"] = {"1000x4KiB": {"local": phases(1000.0), "volume": phases(500.0)}}
    for ms in (2.0, 4.0, 3.0):
        res.add("snapshot_1k", ms)
        res.add("fork_1k", ms * 2)
        res.add("snapshot_100k", ms * 10)
        res.add("fork_100k", ms * 3)
        res.add("shared_snapshot_1", ms)
        res.add("shared_snapshot_4", ms * 1.5)
    for ms in (1000.0, 500.0):
        res.add("sync", ms)
        res.sync_bytes.append(100_000_000)
        res.sync_backlog_bytes.append(100_000_000)
    res.raw = {"raw_put_mb_s": 250.0, "raw_put_mb_s_samples": [240.0, 250.0]}
    res.local_store = "file:///var/lib/branchbox/store"
    res.notes.append("n")
    return res


def test_summary_shape_and_ratios() -> None:
    s = fake_result().summary()
    assert tuple(s)[: len(bv.SUMMARY_KEYS)] == bv.SUMMARY_KEYS
    assert json.loads(json.dumps(s)) == s
    assert (s["write_ratio"], s["read_ratio"], s["liststat_ratio"]) == (0.8, 0.8, 0.8)
    assert (s["small_write_ratio"], s["s3_read_ratio"]) == (1.5, 0.5)
    assert s["small_s3_write_ratio"] is None  # not measured
    assert (s["snapshot_ms_p50_1k"], s["fork_ms_p50_1k"], s["snapshot_ms_p50_100k"], s["fork_ms_p50_100k"]) == (
        3.0, 6.0, 30.0, 9.0)
    assert s["fork_size_ratio"] == 1.5
    assert (s["shared_snapshot_ms_p50_1"], s["shared_snapshot_ms_p50_4"], s["shared_snapshot_ratio"]) == (3.0, 4.5, 1.5)
    # 100 MB in 1 s and in 0.5 s: median 150 MB/s, against 250 MB/s raw
    assert (s["sync_mb_s"], s["raw_mb_s"], s["sync_vs_raw_ratio"]) == (150.0, 250.0, 0.6)
    assert s["sync_mb_s_samples"] == [100.0, 200.0] and s["raw_mb_s_samples"] == [240.0, 250.0]
    assert s["files"]["local_store"]["1000x4KiB"]["volume"]["write"]["ops_s"] == 800.0
    assert s["samples_ms"]["fork_1k"] == [4.0, 8.0, 6.0]
    assert (s["rounds"], s["samples"], s["sync_mb"], s["notes"]) == (3, 2, 64, ["n"])
    assert [row[0] for row in fake_result().rows()] == list(bv.METRICS)


def test_nothing_measured_is_none_not_an_error() -> None:
    s = bv.VolumeResult(bv.VolumeConfig(s3=False)).summary()
    assert all(s[k] is None for k in bv.SUMMARY_KEYS if k.endswith(("ratio", "_1k", "_100k", "mb_s")))
    assert s["files"] == {} and s["sync_mb_s_samples"] == [] and s["raw_mb_s_samples"] == []
    lines = bench_cli.volume_report_lines(s)
    assert any("fork size ratio -" in line for line in lines)
    assert any("by 4 -: ratio -" in line for line in lines)


def test_the_minio_part_needs_root_and_says_how_to_skip_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bv.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(bv, "health", lambda **kw: pytest.fail("no daemon call before the check"))
    with pytest.raises(bv.BenchError, match="--no-s3"):
        bv.run_volume_bench(bv.VolumeConfig())


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(cfg, progress=None):
        seen["cfg"] = cfg
        progress("x")
        return fake_result()

    monkeypatch.setattr(bv, "run_volume_bench", fake_run)
    r = cli_runner().invoke(
        cli.app, ["--daemon", "unix:///x.sock", "bench", "volume", "--rounds", "3", "--samples", "2", "--no-s3",
                  "--image", "img"]
    )
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    s = json.loads(lines[-1])
    assert s["write_ratio"] == 0.8 and s["fork_size_ratio"] == 1.5
    text = r.stdout
    assert "snapshot_1k" in text and "fork size ratio 1.50" in text and "sync 150 MB/s vs raw" in text
    assert "local_store, 1000x4KiB, volume vs sandbox disk: write 800 vs 1000 ops/s" in text
    cfg = seen["cfg"]
    assert (cfg.rounds, cfg.samples, cfg.s3, cfg.image, cfg.sync_mb, cfg.daemon) == (3, 2, False, "img", 64, "unix:///x.sock")
    r = cli_runner().invoke(cli.app, ["bench", "volume", "--json"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1 and seen["cfg"].s3 is True


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg, progress=None):
        raise bv.BenchError("bench volume: the fill in sandbox sb-1 failed (exit 1): boom")

    monkeypatch.setattr(bv, "run_volume_bench", broken)
    r = cli_runner().invoke(cli.app, ["bench", "volume"])
    assert r.exit_code == 1 and "bench volume: the fill" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- a whole run on a fake daemon


class VolumeDaemon:
    """Just enough of branchboxd for ``bench volume --no-s3``: volumes, sandboxes mounting them,
    snapshots, forks. The file benchmark's script really runs, here, on two temporary
    directories standing for the sandbox's /tmp and its volume; the fill is only recorded."""

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.volumes: Dict[str, Dict[str, Any]] = {}
        self.sandboxes: Dict[str, Dict[str, Any]] = {}
        self.created_volumes: List[str] = []
        #: Every volume made, by id (deleted ones too).
        self.volumes_made: Dict[str, Dict[str, Any]] = {}
        self.mount_bodies: List[Any] = []
        self.fills: List[List[str]] = []
        #: (volume, sandboxes mounting it, files written through the file API) at each snapshot.
        self.snapshots: List[Any] = []
        self.fail_fill = False
        self.n = 0

    def _id(self, prefix: str) -> str:
        self.n += 1
        return "%s-%016x" % (prefix, self.n)

    def _volume(self, **kw: Any) -> Dict[str, Any]:
        vid = self._id("vol")
        self.volumes[vid] = dict(VOLUME, id=vid, name=None, mounts=[], snapshots=0, **kw)
        self.volumes_made[vid] = self.volumes[vid]
        self.created_volumes.append(vid)
        return self.volumes[vid]

    def _run(self, sid: str, argv: List[str]) -> Dict[str, Any]:
        if argv[2] == bv.FILL_SCRIPT:
            self.fills.append(argv[3:])
            return dict(RESULT, exit_code=1 if self.fail_fill else 0, stderr="disk full" if self.fail_fill else "")
        assert argv[:3] == ["python3", "-c", bv.FILES_SCRIPT]
        cfg = json.loads(argv[3])
        assert [name for name, _ in cfg["targets"]] == ["local", "volume"] and cfg["out"] == bv.RESULT_PATH
        cfg["targets"] = [[name, str(self.tmp / sid / name)] for name, _ in cfg["targets"]]
        cfg["out"] = str(self.tmp / sid / "out.json")
        subprocess.run([sys.executable, "-c", bv.FILES_SCRIPT, json.dumps(cfg)], check=True, timeout=300)
        return dict(RESULT, stdout="")

    def __call__(self, request: httpx.Request) -> httpx.Response:
        m, path = request.method, request.url.path
        json_body = request.headers.get("content-type", "").startswith("application/json")
        body = json.loads(request.content) if request.content and json_body else None
        ok = lambda data, status=200: httpx.Response(status, json=data)  # noqa: E731
        if (m, path) == ("GET", "/v1/health"):
            return ok({"ok": True, "store": "file:///var/lib/branchbox/store"})
        if (m, path) == ("POST", "/v1/volumes"):
            return ok(self._volume(access=body["access"]))
        mv = re.match(r"^/v1/volumes/(vol-[0-9a-f]+)(/.*)?$", path)
        if mv and mv.group(1) in self.volumes:
            vol, rest = self.volumes[mv.group(1)], mv.group(2) or ""
            if (m, rest) == ("GET", ""):
                return ok(vol)
            if (m, rest) == ("DELETE", ""):
                if vol["mounts"]:
                    return ok({"error": {"code": "conflict", "message": "mounted"}}, 409)
                del self.volumes[vol["id"]]
                return ok({"removed": True})
            if (m, rest) == ("PUT", "/files"):
                vol.setdefault("files", []).append(request.url.params["path"])
                return ok(dict(ENTRY, path=request.url.params["path"]))
            if (m, rest) == ("POST", "/snapshots"):
                vol["snapshots"] += 1
                self.snapshots.append((vol["id"], len(vol["mounts"]), len(vol.get("files", []))))
                return ok({"id": self._id("vs"), "volume": vol["id"], "created_at": 1.0, "layers": 1, "label": body.get("label")})
            if (m, rest) == ("POST", "/fork"):
                assert body == {}
                return ok(self._volume(source=vol["id"]))
        if (m, path) == ("POST", "/v1/sandboxes"):
            self.mount_bodies.append(body.get("volumes"))
            sid = self._id("sb")
            for mount in body.get("volumes") or []:
                assert set(mount) == {"volume", "path", "read_only", "branch"}
                self.volumes[mount["volume"]]["mounts"].append(dict(mount, sandbox=sid))
            self.sandboxes[sid] = dict(SANDBOX, id=sid, volumes=body.get("volumes") or [])
            return ok(self.sandboxes[sid], 201)
        ms = re.match(r"^/v1/sandboxes/(sb-[0-9a-f]+)(/.*)?$", path)
        if ms and ms.group(1) in self.sandboxes:
            sid, rest = ms.group(1), ms.group(2) or ""
            if (m, rest) == ("DELETE", ""):
                del self.sandboxes[sid]
                for vol in self.volumes.values():
                    vol["mounts"] = [x for x in vol["mounts"] if x["sandbox"] != sid]
                return ok({"killed": True})
            if (m, rest) == ("POST", "/commands"):
                return ok(self._run(sid, body["args"]))
            if (m, rest) == ("GET", "/files") and request.url.params["path"] == bv.RESULT_PATH:
                return httpx.Response(200, content=(self.tmp / sid / "out.json").read_bytes())
        return ok({"error": {"code": "not_found", "message": "no route %s %s" % (m, path)}}, 404)


@pytest.fixture
def volume_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path) -> VolumeDaemon:
    d = VolumeDaemon(tmp_path)
    real = sync_mod.ConnectionConfig
    transport = httpx.MockTransport(d)

    class Patched(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.transport = transport

    monkeypatch.setattr(sync_mod, "ConnectionConfig", Patched)
    return d


def test_whole_run_on_a_fake_daemon(volume_daemon: VolumeDaemon) -> None:
    d = volume_daemon
    res = bv.run_volume_bench(bv.VolumeConfig(rounds=2, samples=3, s3=False))
    s = res.summary()
    for key in ("write_ratio", "read_ratio", "liststat_ratio", "small_write_ratio", "small_read_ratio", "small_liststat_ratio"):
        assert s[key] > 0, key
    assert s["s3_write_ratio"] is None and s["sync_mb_s"] is None and s["local_store"].startswith("file://")
    assert all(len(t[p]["ops_s_rounds"]) == 2 for t in s["files"]["local_store"]["1000x4KiB"].values() for p in bv.PHASES)
    assert [len(s["samples_ms"][k]) for k in bv.METRICS[:4]] == [3, 3, 3, 3] and s["fork_size_ratio"] > 0
    # One sandbox per part, each mounting its new volume at /workspace; then one and four
    # sandboxes mounting the two rwx volumes of the shared-snapshot part.
    mount = lambda v: [{"volume": v, "path": "/workspace", "read_only": False, "branch": True}]  # noqa: E731
    shared1, shared4 = d.created_volumes[9], d.created_volumes[10]
    assert d.mount_bodies == [mount(d.created_volumes[i]) for i in (0, 1, 5)] + [mount(shared1)] + [mount(shared4)] * 4
    assert [d.volumes_made[v]["access"] for v in (shared1, shared4)] == ["rwx", "rwx"]
    # Each snapshot of theirs after one more file, with every sandbox mounting; the order flips.
    assert [x for x in d.snapshots if x[0] in (shared1, shared4)] == [
        (shared1, 1, 1), (shared4, 4, 1), (shared4, 4, 2), (shared1, 1, 2), (shared1, 1, 3), (shared4, 4, 3)]
    assert [len(s["samples_ms"][k]) for k in ("shared_snapshot_1", "shared_snapshot_4")] == [3, 3]
    assert s["shared_snapshot_ratio"] > 0
    assert [f[:2] for f in d.fills] == [["/workspace/fill", "1000"], ["/workspace/fill", "100000"]]
    assert d.volumes == {} and d.sandboxes == {}, "every volume (forks too) and sandbox removed"
    assert any("--no-s3" in n for n in s["notes"])


def test_a_failing_part_cleans_up(volume_daemon: VolumeDaemon) -> None:
    volume_daemon.fail_fill = True
    with pytest.raises(bv.BenchError, match="the fill in sandbox sb-.* failed \\(exit 1\\): disk full"):
        bv.run_volume_bench(bv.VolumeConfig(rounds=1, s3=False))
    assert volume_daemon.volumes == {} and volume_daemon.sandboxes == {}
