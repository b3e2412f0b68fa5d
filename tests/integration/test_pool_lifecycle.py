"""Warm pool limits and lifetime against a live daemon: kills racing each other never recycle
past a pool's max (nor does lowering max leave more ready), the shells nobody owns (ready pool
shells, nested fork shells) do not outlive a clean shutdown while user sandboxes do, and a state
dir refuses a daemon started with another ``--uid-base`` than the one its files belong to.

Every test puts the pool of base back to 0 (the suite's daemon runs with ``--pool-size 0``).
"""
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from branchbox import Pool, Sandbox
from conftest import daemon_bin
from helpers import (
    CGROUP_PARENT,
    SOCKET,
    STATE,
    UID_BASE,
    URL,
    cgroup_dirs_of,
    expect_output,
    host_traces,
    proc_stat,
    sandbox_entries,
    wait_until,
)

POOL_TIMEOUT = 60.0


@pytest.fixture
def pool(daemon):
    p = Pool(daemon=URL)
    p.set("base", 0, 0)
    yield p
    daemon.ensure_running()
    p = Pool(daemon=URL)
    p.set("base", 0, 0)
    wait_until(lambda: p.stats().ready("base") == 0, timeout=POOL_TIMEOUT, what="the pool of base to drain")
    p.close()


def alive(pid):
    st = proc_stat(pid)
    return st is not None and st[0] != "Z"


def members(sandbox_id):
    """Pids in a sandbox's cgroups (its init and whatever it runs), read on the host."""
    pids = set()
    for d in cgroup_dirs_of(sandbox_id):
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


def unrecorded():
    """Sandbox dirs on the host that no listed sandbox owns: pooled and nested fork shells."""
    listed = {i.id for i in Sandbox.list(daemon=URL)}
    return set(sandbox_entries()) - listed


# ----------------------------------------------------------------------------- the pool's cap


def test_concurrent_kills_never_recycle_past_max(pool):
    n, cap = 16, 4
    with ThreadPoolExecutor(8) as ex:
        sandboxes = list(ex.map(lambda _: Sandbox.create(daemon=URL, timeout=300), range(n)))
    before = pool.set("base", 0, cap)  # no background refill: only recycling fills it
    assert before.ready("base") == 0, before.raw
    seen, done = [0], threading.Event()

    def watch():
        with Pool(daemon=URL) as p:
            while not done.is_set():
                seen[0] = max(seen[0], p.stats().ready("base"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(n) as ex:
            assert all(ex.map(lambda s: s.kill(), sandboxes))
    finally:
        done.set()
        watcher.join()
    after = pool.stats()
    assert after.ready("base") <= cap and seen[0] <= cap, "%d ready (at most %d seen) with max %d: %r" % (after.ready("base"), seen[0], cap, after.raw)
    assert after.recycled - before.recycled == after.ready("base") >= 1, (before.raw, after.raw)
    # Lowering max tears the ready shells beyond it down at once.
    st = pool.set("base", 0, 1)
    assert st.ready("base") <= 1, st.raw
    s = Sandbox.create(daemon=URL, timeout=300)
    try:
        assert pool.stats().ready("base") == 0, "the one left was claimed"
        expect_output(s.commands.run("echo ok"), stdout="ok\n")
    finally:
        s.kill()
    assert pool.stats().ready("base") <= 1


# ----------------------------------------------------------------------------- shutdown


def test_a_clean_shutdown_tears_down_the_shells_nobody_owns(pool, daemon, make_sandbox):
    parent = make_sandbox()
    parent.run_code("x = 41")
    user = [parent]
    for _ in range(5):
        # After a live fork the daemon builds a nested shell for the parent's next one. A fork
        # falls back to fresh sessions (not nested) when the session template is busy: retry.
        kids = parent.fork(1)
        user += kids
        if kids[0].info().nested_in == parent.id:
            break
    assert kids[0].info().nested_in == parent.id
    pool.set("base", 2, 2)
    wait_until(lambda: pool.stats().ready("base") >= 2, timeout=POOL_TIMEOUT, what="2 ready shells of base")
    # Pooled shells' inits are the daemon's children; a nested shell's is its parent init's.
    def shells():
        found = {sid: members(sid) for sid in unrecorded()}
        nested = [sid for sid, ps in found.items() if any(proc_stat(p) and proc_stat(p)[1] != daemon.pid for p in ps)]
        return found if len(found) >= 3 and nested and all(found.values()) else None

    pids = wait_until(shells, timeout=POOL_TIMEOUT, what="2 pooled shells and a nested fork shell (unrecorded: %r)" % (unrecorded(),))
    user_inits = {s.id: s.info().init_pid for s in user}
    daemon.stop()  # SIGTERM, as `branchbox daemon stop` sends
    try:
        left = {sid: (sorted(p for p in ps if alive(p)), host_traces(sid)) for sid, ps in pids.items()}
        left = {sid: v for sid, v in left.items() if v[0] or any(v[1].values())}
        assert not left, "shells outlived the daemon: %r" % left
        assert all(alive(p) for p in user_inits.values()), "user sandboxes must survive a restart: %r" % user_inits
    finally:
        daemon.ensure_running()
    try:
        assert {s.id for s in user} <= {i.id for i in Sandbox.list(daemon=URL)}
        assert Sandbox.connect(parent.id, daemon=URL).run_code("x + 1").result == "42"
        expect_output(Sandbox.connect(kids[0].id, daemon=URL).commands.run("echo kid"), stdout="kid\n")
    finally:
        for s in user[1:]:
            Sandbox.connect(s.id, daemon=URL).kill()


# ----------------------------------------------------------------------------- uid base


def healthy():
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://d", timeout=2) as c:
            return c.get("/v1/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_a_daemon_with_another_uid_base_is_refused(daemon):
    daemon.stop()
    try:
        argv = [daemon_bin(), "--state-dir", STATE, "--socket", SOCKET, "--cgroup-parent", CGROUP_PARENT,
                "--pool-size", "0", "--uid-base", str(UID_BASE + 2_000_000)]
        if os.environ.get("BRANCHBOX_INIT_BIN"):
            argv += ["--init-bin", os.environ["BRANCHBOX_INIT_BIN"]]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            # It must exit; one that answers its health check started on the wrong ids.
            wait_until(lambda: proc.poll() is not None or healthy(), timeout=60, what="branchboxd to exit or serve")
            if proc.poll() is None:
                pytest.fail("branchboxd started with --uid-base %d on a state dir made with %d" % (UID_BASE + 2_000_000, UID_BASE))
        finally:
            if proc.poll() is None:
                proc.terminate()
            stderr = proc.communicate(timeout=30)[1]
        assert proc.returncode != 0
        assert "--uid-base %d" % UID_BASE in stderr, stderr[-2000:]
    finally:
        daemon.ensure_running()
    s = Sandbox.create(daemon=URL, timeout=60)
    try:
        expect_output(s.commands.run("pwd"), stdout="/root\n")
    finally:
        s.kill()
