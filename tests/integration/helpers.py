"""Plain helpers shared by the live-daemon tests (constants, host-side probes, assertions).

Fixtures live in conftest.py; everything here is importable with ``from helpers import ...``.
"""
import glob
import os
import time

import pytest

STATE = os.environ.get("BRANCHBOX_TEST_STATE", "/var/lib/branchbox-test")
RUN = os.environ.get("BRANCHBOX_TEST_RUN", "/run/branchbox-test")
SOCKET = os.path.join(RUN, "d.sock")
URL = "unix://" + SOCKET
CGROUP_PARENT = os.environ.get("BRANCHBOX_TEST_CGROUP", "branchbox-test")
CGROUP_ROOT = "/sys/fs/cgroup"
# Host uid the sandbox's root maps to (branchboxd --uid-base default).
UID_BASE = 1_000_000
# The suite's daemon compacts snapshot chains deeper than this (--max-chain): small, so that
# every test that checkpoints a few times runs over compacted chains.
MAX_CHAIN = int(os.environ.get("BRANCHBOX_TEST_MAX_CHAIN", "6"))

# ----------------------------------------------------------------------------- waiting


def wait_until(predicate, timeout=10.0, interval=0.05, what="condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1fs waiting for %s (last value: %r)" % (timeout, what, last))
        time.sleep(interval)


# ----------------------------------------------------------------------------- host-side probes


def state_mounts(needle=None):
    """Lines of the host's /proc/self/mountinfo that mention the test state dir (and ``needle``)."""
    with open("/proc/self/mountinfo") as f:
        lines = [line.rstrip("\n") for line in f if STATE in line]
    if needle is not None:
        lines = [line for line in lines if needle in line]
    return lines


def cgroup_hierarchies():
    """Distinct cgroup v1 hierarchy roots that hold the test parent group."""
    seen = {}
    for d in sorted(glob.glob(os.path.join(CGROUP_ROOT, "*", CGROUP_PARENT))):
        seen.setdefault(os.path.realpath(d), d)
    return sorted(seen.values())


def cgroup_children():
    """{hierarchy dir: sorted child group names} under the test cgroup parent."""
    out = {}
    for d in cgroup_hierarchies():
        out[d] = sorted(e.name for e in os.scandir(d) if e.is_dir())
    return out


def cgroup_dirs_of(sandbox_id):
    """Every cgroup directory of one sandbox that still exists on the host."""
    return [p for p in (os.path.join(d, sandbox_id) for d in cgroup_hierarchies()) if os.path.isdir(p)]


def cgroup_file(controller, sandbox_id, name):
    with open(os.path.join(CGROUP_ROOT, controller, CGROUP_PARENT, sandbox_id, name)) as f:
        return f.read().strip()


def sandbox_dir(sandbox_id):
    return os.path.join(STATE, "sandboxes", sandbox_id)


def sandbox_entries():
    return sorted(os.listdir(os.path.join(STATE, "sandboxes")))


def host_traces(sandbox_id):
    """What the host still holds for a sandbox: its dir, cgroups and mounts (all empty when gone)."""
    return {
        "dir": os.path.exists(sandbox_dir(sandbox_id)),
        "cgroups": cgroup_dirs_of(sandbox_id),
        "mounts": state_mounts(sandbox_id),
    }


def assert_no_host_traces(sandbox_id, timeout=10.0):
    """Wait (bounded) until a killed/reaped sandbox left nothing on the host."""
    def gone():
        t = host_traces(sandbox_id)
        return not t["dir"] and not t["cgroups"] and not t["mounts"]

    try:
        wait_until(gone, timeout=timeout, what="host traces of %s to disappear" % sandbox_id)
    except AssertionError:
        raise AssertionError("sandbox %s left host traces: %r" % (sandbox_id, host_traces(sandbox_id))) from None


def proc_stat(pid):
    """(state, ppid, comm) of a host process, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            s = f.read()
    except OSError:
        return None
    comm = s[s.index("(") + 1 : s.rindex(")")]
    rest = s[s.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), comm


def zombies():
    """{pid: (ppid, comm)} of every zombie on the host."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st and st[0] == "Z":
                out[int(name)] = (st[1], st[2])
    return out


def fd_targets(pid):
    """Sorted readlink targets of a process's open fds."""
    out = []
    for p in glob.glob("/proc/%d/fd/*" % pid):
        try:
            out.append(os.readlink(p))
        except OSError:
            pass
    return sorted(out)


# ----------------------------------------------------------------------------- assertions


def expect_output(result, stdout=None, stderr=None, exit_code=0):
    """Assert a foreground CommandResult exactly (streams given as None are not checked)."""
    assert result.exit_code == exit_code, "exit code %r != %r: %r" % (result.exit_code, exit_code, result)
    assert not result.timed_out, "unexpected timeout: %r" % (result,)
    if stdout is not None:
        assert result.stdout == stdout, "stdout is %r, expected %r (result: %r)" % (result.stdout, stdout, result)
    if stderr is not None:
        assert result.stderr == stderr, "stderr is %r, expected %r (result: %r)" % (result.stderr, stderr, result)


def expect_in(result, stream, needle, exit_code=None):
    """Assert ``needle`` occurs in ``result.<stream>`` (and the exit code, if given)."""
    if exit_code is not None:
        assert result.exit_code == exit_code, "exit code %r != %r: %r" % (result.exit_code, exit_code, result)
    got = getattr(result, stream)
    assert needle in got, "%r not in %s %r (result: %r)" % (needle, stream, got, result)


def api_error(response, status, code=None):
    """Assert an HTTP error answer: status, JSON body {"error": {"code", "message"}}; returns it."""
    assert response.status_code == status, "HTTP %d != %d: %s" % (response.status_code, status, response.text[:500])
    assert response.headers.get("content-type", "").startswith("application/json"), (
        "error body is not JSON (content-type %r): %r" % (response.headers.get("content-type"), response.text[:200])
    )
    body = response.json()
    assert set(body) == {"error"}, "unexpected error body %r" % (body,)
    err = body["error"]
    assert isinstance(err.get("code"), str) and isinstance(err.get("message"), str) and err["message"], body
    if code is not None:
        assert err["code"] == code, "error code %r != %r: %r" % (err["code"], code, body)
    return err


# ----------------------------------------------------------------------------- raw API calls
# For tests that pin the mechanism through plain HTTP (``raw``: an httpx client on the socket).


def ckpt(raw, sid, label=None):
    r = raw.post("/v1/sandboxes/%s/checkpoint" % sid, json={"label": label} if label else {})
    assert r.status_code == 201, r.text
    return r.json()


def rollback(raw, sid, snap):
    r = raw.post("/v1/sandboxes/%s/rollback" % sid, json={"snapshot": snap})
    assert r.status_code == 200, r.text
    return r.json()


def sh(raw, sid, cmd, code=0):
    """stdout of ``cmd``; its exit code must be ``code`` (None: any)."""
    r = raw.post("/v1/sandboxes/%s/commands" % sid, json={"cmd": cmd, "timeout": 30})
    assert r.status_code == 200, r.text
    res = r.json()
    if code is not None:
        assert res["exit_code"] == code, res
    return res["stdout"]


def py(raw, sid, code):
    """The result of ``code`` in the default python session (it must not raise)."""
    r = raw.post("/v1/sandboxes/%s/code" % sid, json={"code": code})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res.get("error") is None, res
    return res
