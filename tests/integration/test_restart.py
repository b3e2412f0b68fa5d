"""Daemon restarts: live sandboxes are re-attached (files, processes, settings intact); sandboxes
whose init died while the daemon was down are reaped with every host trace.

These tests stop and start the session's daemon (conftest.Daemon); they always leave it running.
"""
import os
import signal
import uuid

import pytest

from branchbox import NotFoundError, Sandbox
from helpers import (
    URL,
    assert_no_host_traces,
    cgroup_dirs_of,
    host_traces,
    proc_stat,
    sandbox_dir,
    state_mounts,
    wait_until,
)


def alive(pid):
    st = proc_stat(pid)
    return st is not None and st[0] != "Z"


def prepare_survivor(make_sandbox, t):
    """A sandbox with a file, env/metadata and a running background process."""
    s = make_sandbox(metadata={"restart": t}, env={"BB_R": "kept"}, timeout=600)
    s.files.write("/root/keep.txt", "kept across restart")
    bg = s.commands.run("sleep 4261", background=True)
    session = s.sessions.create("python")
    session.run("v = 1")
    return s, bg.pid, s.info()


def check_reattached(sid, bg_pid, before):
    """After a restart: listed with the same settings, exec/files/processes work."""
    listed = {i.id: i for i in Sandbox.list(daemon=URL)}
    assert sid in listed, "re-attachable sandbox %s is not listed after the restart" % sid
    s = Sandbox.connect(sid, daemon=URL)
    info = s.info()
    assert info.state == "running"
    for field in ("created_at", "expires_at", "init_pid", "env", "metadata", "cwd", "memory_mb", "cpu", "pids"):
        assert getattr(info, field) == getattr(before, field), (field, getattr(info, field), getattr(before, field))
    assert s.files.read("/root/keep.txt") == "kept across restart"
    r = s.commands.run(["sh", "-c", 'test "$(cat /root/keep.txt)" = "kept across restart" && test "$BB_R" = kept'])
    assert r.exit_code == 0, "exec after the restart does not see the file or the env: %r" % (r,)
    procs = {p.pid: p for p in s.commands.list()}
    assert bg_pid in procs and procs[bg_pid].running is True and procs[bg_pid].cmd == "sleep 4261", procs
    assert s.run_code("import os\nos.path.exists('/proc/%d')" % bg_pid).result == "True"
    assert s.run_code("21 * 2").result == "42"
    # The background process is still under control: kill and wait through the new daemon.
    assert s.commands.kill(bg_pid) is True
    r = s.commands.wait(bg_pid, timeout=30)
    assert r.signal == 9 and not r.timed_out, r
    return s


def test_sigkill_restart_reattaches_live_sandboxes_and_reaps_dead_ones(daemon, make_sandbox):
    t = uuid.uuid4().hex[:8]
    survivor, bg_pid, before = prepare_survivor(make_sandbox, t)
    victim = make_sandbox()
    victim_init = victim.info().init_pid
    victim_id = victim.id
    old_pid = daemon.pid
    try:
        daemon.stop(signal.SIGKILL)
        # The sandboxes outlive their daemon...
        assert alive(before.init_pid), "sandbox init died with the daemon"
        # ...and while it is down, one of them dies.
        os.kill(victim_init, signal.SIGKILL)
        wait_until(lambda: not alive(victim_init), timeout=10, what="the victim's init to die")
        assert os.path.isdir(sandbox_dir(victim_id)) and cgroup_dirs_of(victim_id), "nothing to reap?"
    finally:
        daemon.ensure_running()
    assert daemon.pid != old_pid
    listed = [i.id for i in Sandbox.list(daemon=URL)]
    assert victim_id not in listed, "a sandbox whose init died while the daemon was down is still listed"
    with pytest.raises(NotFoundError):
        Sandbox.connect(victim_id, daemon=URL)
    assert host_traces(victim_id) == {"dir": False, "cgroups": [], "mounts": []}, host_traces(victim_id)
    s = check_reattached(survivor.id, bg_pid, before)
    assert s.kill() is True
    assert_no_host_traces(survivor.id)


def test_sigterm_restart_reattaches_and_keeps_ttls(daemon, make_sandbox):
    t = uuid.uuid4().hex[:8]
    survivor, bg_pid, before = prepare_survivor(make_sandbox, t)
    short = make_sandbox(timeout=4)
    assert short.id in [i.id for i in Sandbox.list(daemon=URL)]
    try:
        daemon.stop(signal.SIGTERM)
        assert alive(before.init_pid), "a graceful daemon stop must not kill sandboxes"
    finally:
        daemon.ensure_running()
    s = check_reattached(survivor.id, bg_pid, before)
    # The TTL is persisted: the restarted daemon reaps the short-lived sandbox.
    wait_until(lambda: short.id not in [i.id for i in Sandbox.list(daemon=URL)], timeout=15,
               what="the restarted daemon to reap the expired sandbox")
    assert_no_host_traces(short.id)
    assert s.kill() is True
    assert_no_host_traces(survivor.id)


def test_no_mounts_remain_for_killed_sandboxes(daemon):
    """Every mount under the sandboxes dir belongs to a listed sandbox (nothing left by kills/restarts)."""
    live = {i.id for i in Sandbox.list(daemon=URL)}
    stray = [line for line in state_mounts(os.path.join("sandboxes", ""))
             if not any("/sandboxes/%s/" % sid in line for sid in live)]
    assert not stray, "mounts of killed sandboxes remain:\n" + "\n".join(stray)
