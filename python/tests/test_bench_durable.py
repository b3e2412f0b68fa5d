"""Unit tests of the durable bench's pure parts (the measurements need a daemon with CRIU)."""

from branchbox_bench.durable import DurableResult, restore_log_ms


def test_criu_elapsed_time_is_the_last_timestamp_of_its_log():
    log = "(00.000012) Version: 4.1.1\n(00.031000) pie: restoring\nno stamp here\n(01.061500) Restore finished\n"
    assert restore_log_ms(log) == 1061.5
    assert restore_log_ms("nothing") is None


def test_summary_reports_how_much_slower_requests_are_during_a_dump_never_negative():
    r = DurableResult(n=3, heap_mb=50)
    for v in (2.0, 2.0, 2.0):
        r.add("run_code_idle", v)
        r.add("rollback_idle", 10.0)
    for v in (1.0, 1.5, 1.0):
        r.add("run_code_during_dump", v)
    for v in (210.0, 200.0, 190.0):
        r.add("rollback_during_dump", v)
    r.add("restore_evicted", 60.0)
    r.add("template_rollback", 6.0)
    s = r.summary()
    assert s["evict_blocking_ms_p50"] == 0.0
    assert s["evict_blocking_rollback_ms_p50"] == 190.0
    assert s["restore_evicted_vs_template_ratio"] == 10.0
    assert s["pause_500mib_ms_p50"] is None and s["n"] == 3
