"""Resource leaks: creating, using and killing sandboxes in a loop leaves the host as it was.

Counted before and after 30 create+use+kill cycles: host mounts mentioning the state dir, cgroup
directories under every hierarchy's test parent, entries in <state>/sandboxes, the daemon's open
fds, and zombie processes.
"""
import collections

from branchbox import Sandbox
from helpers import (
    URL,
    cgroup_children,
    fd_targets,
    sandbox_entries,
    state_mounts,
    wait_until,
    zombies,
)

CYCLES = 30


def cycle(i):
    """One sandbox lifetime touching every kind of daemon-side resource."""
    s = Sandbox.create(daemon=URL, timeout=300)
    try:
        r = s.commands.run(["sh", "-c", "echo cycle-%d; echo err >&2" % i])
        assert r.exit_code == 0, r
        assert s.run_code("%d * 2" % i).result == str(i * 2)
        sh = s.sessions.create("shell")
        assert sh.run("cd /tmp && echo $PWD").stdout == "/tmp\n"
        s.commands.run("sleep 4271", background=True)
        done = s.commands.run("echo bg-%d" % i, background=True)
        assert done.wait(timeout=30).stdout == "bg-%d\n" % i
        streamed = s.commands.run(["true"], on_stdout=lambda _: None)
        assert streamed.exit_code == 0
        s.files.write("/root/f.bin", b"x" * 100_000)
        assert len(s.files.read("/root/f.bin", format="bytes")) == 100_000
        s.files.list("/root")
    finally:
        assert s.kill() is True
        s.close()


def snapshot():
    return {
        "mounts": len(state_mounts()),
        "cgroups": cgroup_children(),
        "sandboxes": sandbox_entries(),
    }


def settle(dpid):
    """Wait (bounded) until the daemon's fd count is the same on consecutive looks."""
    last = [None]

    def stable():
        n = len(fd_targets(dpid))
        same, last[0] = n == last[0], n
        return same

    wait_until(stable, timeout=5, interval=0.2, what="a stable daemon fd count")


def test_create_use_kill_loop_leaks_nothing(daemon):
    dpid = daemon.pid
    for i in range(3):  # warm-up: lazily opened daemon resources are not leaks
        cycle(i)
    settle(dpid)
    before = snapshot()
    fds_before = fd_targets(dpid)
    zombies_before = zombies()
    for i in range(CYCLES):
        cycle(i)

    assert snapshot() == before, "host state changed over %d cycles: %r -> %r" % (CYCLES, before, snapshot())

    def fds_back():
        return len(fd_targets(dpid)) <= len(fds_before)

    # Each blocking worker thread that mounted an overlay holds an O_PATH fd of its working
    # directory (bb-layers' layer naming) until tokio retires it, 10 s after its last job: a
    # cycle that ran on more threads than the baseline saw gives those fds back only then.
    try:
        wait_until(fds_back, timeout=15, what="the daemon's fd count to return to its baseline")
    except AssertionError:
        grown = collections.Counter(fd_targets(dpid)) - collections.Counter(fds_before)
        raise AssertionError("daemon fds grew from %d to %d over %d cycles; new: %r"
                             % (len(fds_before), len(fd_targets(dpid)), CYCLES, dict(grown))) from None

    def no_new_zombies():
        return not {p: z for p, z in zombies().items() if p not in zombies_before}

    try:
        wait_until(no_new_zombies, timeout=5, what="no new zombies")
    except AssertionError:
        new = {p: z for p, z in zombies().items() if p not in zombies_before}
        raise AssertionError("new zombie processes (pid: (ppid, comm)): %r" % new) from None
    assert not [p for p, (ppid, _) in zombies().items() if ppid == dpid], "zombie children of the daemon"
