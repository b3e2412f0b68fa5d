"""Unit tests of the store bench's pure parts (the measurements start MinIO and daemons, as root)."""

import json

from branchbox_bench.store import MIB, SUMMARY_KEYS, StoreResult, find_tool, met, pulled_from_log

THROUGHPUT = {
    "push_mb_s": 150.0, "raw_put_mb_s": 200.0, "pull_mb_s": 100.0, "raw_get_mb_s": 250.0,
    "push_vs_raw_ratio": 0.75, "pull_vs_raw_ratio": 0.4,
    "push_mb_s_samples": [150.0], "raw_put_mb_s_samples": [200.0],
}


def test_summary_has_every_key_and_judges_the_targets():
    r = StoreResult(n=3, throughput_mb=64, session_mb=50, throughput=THROUGHPUT)
    for ms in (0.5, 80.0, 1.0):
        r.add("push_again", ms)
    r.delta_bytes = [3 * MIB, 4 * MIB, 5 * MIB]
    for ms in (900.0, 1000.0, 1100.0):
        r.add("cross_daemon_restore", ms)
        r.add("local_restore", ms / 10)
    s = r.summary()
    assert set(SUMMARY_KEYS) <= set(s) and json.loads(json.dumps(s)) == s
    assert s["push_vs_raw_ratio"] == 0.75 and s["raw_get_mb_s"] == 250.0
    # The worst unchanged push is judged, the median reported beside it.
    assert s["push_again_ms"] == 80.0 and s["push_again_ms_p50"] == 1.0
    assert s["delta_push_ratio"] == 2.0 and s["delta_push_bytes_p50"] == 4 * MIB
    assert s["cross_daemon_restore_ms_p50"] == 1000.0 and s["cross_vs_local_restore_ratio"] == 10.0
    assert s["targets_met"] == {"push_vs_raw": True, "pull_vs_raw": False, "push_again": False, "delta_push": True}
    assert s["throughput_samples_mb_s"] == {"push": [150.0], "raw_put": [200.0]}
    assert [row[0] for row in r.rows()] == ["push_again", "local_restore", "cross_daemon_restore"]


def test_nothing_measured_is_none_not_an_error():
    s = StoreResult(n=1, throughput_mb=8, session_mb=10, metadata="sqlite").summary()
    assert s["push_mb_s"] is None and s["delta_push_ratio"] is None and s["cross_vs_local_restore_ratio"] is None
    assert set(s["targets_met"].values()) == {None} and s["metadata"] == "sqlite"


def test_targets_are_bounds_met_inclusive_and_tools_are_found_by_env_then_path(monkeypatch, tmp_path):
    assert met(0.7, "min", 0.7) and not met(0.69, "min", 0.7) and met(2.0, "max", 2.0) and not met(50, "below", 50)
    assert met(None, "max", 1) is None
    tool = tmp_path / "tool"
    tool.write_text("")
    monkeypatch.setenv("BB_TEST_TOOL", "/from/env")
    assert find_tool("nope", "BB_TEST_TOOL", [str(tool)]) == "/from/env"
    monkeypatch.delenv("BB_TEST_TOOL")
    assert find_tool("nope", "BB_TEST_TOOL", ["/missing", str(tool)]) == str(tool)
    assert find_tool("nope-not-on-path", "BB_TEST_TOOL", ["/missing"]) is None


def test_the_pull_time_is_read_from_the_daemons_last_pull_line():
    log = (
        "\x1b[2m2026-11-26T07:29:06Z\x1b[0m \x1b[32m INFO\x1b[0m bb_runtime::remote: snapshot pulled "
        "\x1b[3msnapshot\x1b[0m\x1b[2m=\x1b[0msn-1 \x1b[3mdownloaded\x1b[0m\x1b[2m=\x1b[0m100 took_ms=5.5\n"
        "INFO bb_runtime::remote: snapshot pulled snapshot=sn-2 layers_pulled=2 downloaded=165370877 took_ms=12578.43\n"
        "INFO other line took_ms=1\n"
    )
    assert pulled_from_log(log) == {"took_ms": 12578.43, "downloaded": 165370877.0}
    assert pulled_from_log("no pull here") is None
