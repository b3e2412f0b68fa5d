"""Unit tests of the volume-designs bench's pure parts (the measurement itself needs root, an
overlayfs and the FUSE probe)."""

import json
import os
import stat
from typing import Any, Dict, List

import pytest

from branchbox_bench import volume as bv
from branchbox_bench import volume_designs as vd
from branchbox_cli import app as cli
from conftest import cli_runner

#: Seconds of each phase per target: ops/s = files / seconds.
SECONDS = {"local": 0.5, "overlay": 0.625, "fuse": 1.0, "fuse-passthrough": 0.8}


def fake_runs(rounds: int = 3) -> List[Dict[str, Any]]:
    """Runs as the file benchmark writes them, every target taking SECONDS[target] per phase."""
    runs = []
    for n, size in bv.FILE_SETS:
        for _ in range(rounds):
            for target in vd.TARGETS:
                run: Dict[str, Any] = {"files": n, "size": size, "target": target}
                for ph in bv.PHASES:
                    run[ph] = {"seconds": SECONDS[target], "op_ms": [1.0] * n}
                runs.append(run)
    return runs


def probe_events(mode: str, opens: int, cached: int, why: Any = None) -> Dict[str, Dict[str, Any]]:
    text = "\n".join(
        [
            "some noise on stderr",
            json.dumps({"event": "mounted", "mode": mode, "writeback_cache": mode == "cached", "why_not_passthrough": why}),
            "{not json",
            json.dumps({"event": "unmounted", "passthrough_opens": opens, "cached_opens": cached, "why_not_passthrough": why}),
        ]
    )
    return vd.probe_events(text)


def fake_result(**probes: Dict[str, Dict[str, Any]]) -> vd.DesignsResult:
    res = vd.DesignsResult(vd.DesignsConfig(rounds=3), probe="/x/branchbox-fuse-probe", state_fs="ext4", kernel="6.18")
    res.files = bv.file_stats(fake_runs())
    res.probes = {"fuse": probe_events("cached", 0, 3000), "fuse-passthrough": probe_events("passthrough", 3000, 0)}
    res.probes.update(probes)
    return res


def test_ratios_are_target_ops_over_local_ops() -> None:
    s = fake_result().summary()
    for small in ("", "small_"):
        for ph in bv.PHASES:
            assert s["%soverlay_%s_ratio" % (small, ph)] == 0.8
            assert s["%sfuse_%s_ratio" % (small, ph)] == 0.5
            assert s["%sfuse_passthrough_%s_ratio" % (small, ph)] == 0.625
    stats = fake_result().files
    assert vd.ratio(stats, bv.LARGE_SET, "fuse", "write") == 0.5
    assert vd.ratio(stats, bv.LARGE_SET, "missing", "write") is None
    assert vd.ratio(stats, "no such set", "fuse", "write") is None
    assert vd.ratio({"s": {"local": {"read": {"ops_s": 0.0}}, "fuse": {"read": {"ops_s": 5.0}}}}, "s", "fuse", "read") is None


def test_summary_shape() -> None:
    s = fake_result().summary()
    assert [k for k in vd.SUMMARY_KEYS if k not in s] == []
    assert list(s)[:18] == list(vd.SUMMARY_KEYS[:18])  # the ratios come first
    assert {"overlay_write_ratio", "fuse_write_ratio", "fuse_passthrough_write_ratio", "small_fuse_liststat_ratio",
            "small_fuse_passthrough_read_ratio"} <= set(s)
    again = json.loads(json.dumps(s))
    assert again == s
    assert set(s["files"]) == {"1000x4KiB", "500x256B"}
    assert set(s["files"]["1000x4KiB"]) == set(vd.TARGETS)
    local_write = s["files"]["1000x4KiB"]["local"]["write"]
    assert local_write["ops_s"] == 2000.0 and local_write["p95_ms"] == 1.0 and local_write["ops_s_rounds"] == [2000.0] * 3
    assert (s["passthrough_active"], s["passthrough_opens"], s["passthrough_cached_opens"]) == (True, 3000, 0)
    assert s["why_not_passthrough"] is None and s["fuse_writeback_cache"] is True
    assert (s["rounds"], s["state_fs"], s["kernel"], s["notes"]) == (3, "ext4", "6.18", [])


def test_nothing_measured_is_none_not_an_error() -> None:
    s = vd.DesignsResult(vd.DesignsConfig()).summary()
    assert all(s[k] is None for k in vd.SUMMARY_KEYS if k.endswith("_ratio"))
    assert s["passthrough_active"] is None and s["rounds"] == 5
    json.dumps(s)
    assert vd.DesignsResult(vd.DesignsConfig()).rows() == []
    assert any("passthrough unknown" in line for line in vd.report_lines(s))


def test_passthrough_that_fell_back_is_not_active_and_says_why() -> None:
    why = "the kernel does not offer FUSE_PASSTHROUGH"
    s = fake_result(**{"fuse-passthrough": probe_events("cached", 0, 3000, why)}).summary()
    assert (s["passthrough_active"], s["passthrough_opens"], s["why_not_passthrough"]) == (False, 0, why)
    partly = "registering a backing file failed: Operation not permitted (os error 1)"
    s = fake_result(**{"fuse-passthrough": probe_events("passthrough", 10, 2990, partly)}).summary()
    assert s["passthrough_active"] is False and s["why_not_passthrough"] == partly
    lines = vd.report_lines(s)
    assert any("passthrough NOT active (10 opens passthrough, 2990 served by the probe): registering" in x for x in lines)


def test_probe_events_keep_the_last_line_of_each_event() -> None:
    ev = vd.probe_events('{"event": "mounted", "mode": "cached"}\n[1]\n{"event": "mounted", "mode": "passthrough"}\n')
    assert ev == {"mounted": {"event": "mounted", "mode": "passthrough"}}
    assert vd.probe_events("") == {}


def test_rows_and_report_lines() -> None:
    res = fake_result()
    rows = res.rows()
    assert len(rows) == 2 * 3 * 4
    assert rows[0] == ["4KiB write local", "3", "2000", "2000", "2000", "2000"]
    assert rows[3][0] == "4KiB write fuse-passthrough" and rows[-1][0] == "256B liststat fuse-passthrough"
    lines = vd.report_lines(res.summary())
    assert lines[0].startswith("1000x4KiB write: local 2000 ops/s (p95 1.000 ms); overlay 1600 ops/s (p95 1.000 ms, 0.80x)")
    assert "fuse-passthrough 1250 ops/s (p95 1.000 ms, 0.62x)" in lines[0]
    assert any(x.startswith("fuse-passthrough: passthrough active (3000 opens passthrough, 0 served") for x in lines)


def _exe(path: Any) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_find_probe_order(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, bindir = tmp_path / "repo", tmp_path / "bin"
    (repo / "target" / "release").mkdir(parents=True)
    bindir.mkdir()
    monkeypatch.setattr(vd, "REPO", str(repo))
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.delenv(vd.PROBE_ENV, raising=False)
    with pytest.raises(vd.BenchError, match="cargo build --release -p bb-fuse-probe"):
        vd.find_probe()
    on_path = _exe(bindir / vd.PROBE)
    assert vd.find_probe() == on_path
    daemon_dir = tmp_path / "daemon"
    daemon_dir.mkdir()
    _exe(daemon_dir / "branchboxd")
    os.symlink(daemon_dir / "branchboxd", bindir / "branchboxd")
    near_daemon = _exe(daemon_dir / vd.PROBE)
    assert vd.find_probe() == near_daemon
    in_repo = _exe(repo / "target" / "release" / vd.PROBE)
    assert vd.find_probe() == in_repo
    from_env = _exe(tmp_path / "probe-from-env")
    monkeypatch.setenv(vd.PROBE_ENV, from_env)
    assert vd.find_probe() == from_env
    monkeypatch.setenv(vd.PROBE_ENV, str(tmp_path / "missing"))
    with pytest.raises(vd.BenchError, match="BRANCHBOX_FUSE_PROBE=.*missing is not an executable file"):
        vd.find_probe()


def test_needs_root_before_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vd.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(vd, "find_probe", lambda: pytest.fail("nothing is looked up before the check"))
    with pytest.raises(vd.BenchError, match="run it as root"):
        vd.run_designs_bench(vd.DesignsConfig())


def test_fs_type_of_a_path() -> None:
    assert vd._fs_type("/proc/self") == "proc"
    assert vd._fs_type("/") is not None


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(cfg, progress=None):
        seen["cfg"] = cfg
        progress("x")
        return fake_result()

    monkeypatch.setattr(vd, "run_designs_bench", fake_run)
    r = cli_runner().invoke(cli.app, ["bench", "volume-designs", "--rounds", "2", "--work-dir", "/srv/tmp"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    s = json.loads(lines[-1])
    assert s["fuse_write_ratio"] == 0.5 and s["passthrough_active"] is True
    assert "4KiB write local" in r.stdout and "1000x4KiB write: local" in r.stdout and "passthrough active" in r.stdout
    assert (seen["cfg"].rounds, seen["cfg"].work_dir) == (2, "/srv/tmp")
    r = cli_runner().invoke(cli.app, ["bench", "volume-designs", "--json"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1
    assert (seen["cfg"].rounds, seen["cfg"].work_dir) == (5, "/var/tmp")


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg, progress=None):
        raise vd.BenchError("bench volume-designs: branchbox-fuse-probe not found")

    monkeypatch.setattr(vd, "run_designs_bench", broken)
    r = cli_runner().invoke(cli.app, ["bench", "volume-designs"])
    assert r.exit_code == 1 and "branchbox-fuse-probe not found" in r.stderr and "Traceback" not in r.stderr
