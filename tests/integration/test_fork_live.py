"""Fork with live sessions: children nested in the parent's namespaces, sessions forked into
them from the parent's templates (crates/bb-runtime/src/sessionfork.rs)."""
import os
import time

import pytest

import helpers
from helpers import cgroup_dirs_of, cgroup_hierarchies, ckpt, sh, state_mounts, wait_until


def fork(raw, sid, n=1, snapshot=None):
    body = {"count": n}
    if snapshot:
        body["snapshot"] = snapshot
    r = raw.post("/v1/sandboxes/%s/fork" % sid, json=body)
    assert r.status_code == 201, r.text
    return r.json()


def py(raw, sid, code):
    return helpers.py(raw, sid, code).get("result")


def kill(raw, sid):
    r = raw.delete("/v1/sandboxes/%s" % sid)
    assert r.status_code in (200, 204), r.text


@pytest.fixture
def parent(daemon, raw):
    r = raw.post("/v1/sandboxes", json={"memory_mb": 1024, "timeout": 600})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    yield sid
    raw.delete("/v1/sandboxes/%s" % sid)


def test_children_get_live_copies_of_every_session(parent, raw):
    py(raw, parent, "import os, random; blob = bytearray(8 << 20); blob[123] = 7; x = 41; os.chdir('/tmp')")
    r = raw.post("/v1/sandboxes/%s/sessions" % parent, json={"kind": "shell"})
    assert r.status_code == 201, r.text
    shell = r.json()["id"]
    r = raw.post("/v1/sandboxes/%s/sessions/%s/run" % (parent, shell), json={"code": "cd /etc; export GREETING=hi; n=5"})
    assert r.status_code == 200, r.text
    res = fork(raw, parent, 2)
    assert res["sessions_restarted"] is False
    kids = [c["id"] for c in res["sandboxes"]]
    try:
        for k in kids:
            info = raw.get("/v1/sandboxes/%s" % k).json()
            assert info["nested_in"] == parent, info
            assert py(raw, k, "(x, blob[123], len(blob), os.getcwd())") == "(41, 7, 8388608, '/tmp')"
            r = raw.post("/v1/sandboxes/%s/sessions/%s/run" % (k, shell), json={"code": 'echo "$PWD $GREETING $n"'})
            assert r.json()["stdout"] == "/etc hi 5\n", r.json()
            # The copy runs in the child's own pid namespace (a low pid there).
            assert int(py(raw, k, "os.getpid()")) < 10
        # Each child reseeded its random generator (os.fork's at-fork hooks ran).
        draws = {py(raw, k, "random.random()") for k in kids}
        assert len(draws) == 2
        # Memory is private: changes do not cross between children or back to the parent.
        py(raw, kids[0], "x = 'a'; blob[123] = 1")
        assert py(raw, kids[1], "(x, blob[123])") == "(41, 7)"
        assert py(raw, parent, "(x, blob[123])") == "(41, 7)"
    finally:
        for k in kids:
            kill(raw, k)


def test_a_childs_first_session_request_can_be_a_checkpoint(parent, raw):
    """The copy of a session in a fork child finishes its restore at its first request, closing
    what it shared with the parent's sandbox. When that request is a checkpoint's fork, the fd
    that came with it must survive: the child's snapshot has a template of the session."""
    py(raw, parent, "x = 'kept'")
    kid = fork(raw, parent)["sandboxes"][0]["id"]
    try:
        snap = ckpt(raw, kid)
        assert [s["template"] for s in snap["sessions"]] == [True], snap
        py(raw, kid, "x = 'changed'")
        r = raw.post("/v1/sandboxes/%s/rollback" % kid, json={"snapshot": snap["id"]})
        assert r.status_code == 200, r.text
        assert r.json()["sessions_restarted"] is False, r.json()
        assert py(raw, kid, "x") == "'kept'"
    finally:
        kill(raw, kid)


def test_children_are_isolated_from_each_other_and_from_the_parent(parent, raw):
    py(raw, parent, "x = 1")
    sh(raw, parent, "echo parent > /root/f")
    a, b = [c["id"] for c in fork(raw, parent, 2)["sandboxes"]]
    try:
        # Files: private writable layers.
        sh(raw, a, "echo a > /root/f; echo a > /tmp/only-a; echo s > /dev/shm/s")
        assert sh(raw, b, "cat /root/f; ls /tmp /dev/shm") == "parent\n/dev/shm:\n\n/tmp:\n"
        assert sh(raw, parent, "cat /root/f; test ! -e /tmp/only-a && test ! -e /dev/shm/s && echo clean") == "parent\nclean\n"
        # Processes: a child sees only its own; the parent's are invisible to it.
        sh(raw, a, "sleep 300 >/dev/null 2>&1 &")
        ps_b = sh(raw, b, "ps -e -o comm= | sort | tr '\\n' ' '")
        assert "sleep" not in ps_b, ps_b
        sh(raw, parent, "sleep 301 >/dev/null 2>&1 &")
        assert "sleep" not in sh(raw, b, "ps -e -o comm="), "the parent's processes are not visible in a child"
        assert sh(raw, a, "ps -e -o pid= | wc -l").strip() != "", "sanity"
        # Network: each child has its own loopback.
        sh(raw, a, "python3 -c \"import socket,time; s=socket.socket(); s.bind(('127.0.0.1', 7777)); s.listen(); time.sleep(60)\" >/dev/null 2>&1 &")
        wait_until(lambda: ":1E61" in sh(raw, a, "cat /proc/net/tcp").upper(), what="a's listener")
        out = sh(raw, b, "python3 -c \"import socket; s=socket.socket(); print(s.connect_ex(('127.0.0.1', 7777)))\"")
        assert out.strip() != "0", "a sibling's listening socket must not be reachable"
        # Hostnames differ; capabilities are Docker's set; no setns without the daemon's key.
        assert sh(raw, a, "hostname").strip() == a and sh(raw, b, "hostname").strip() == b
        assert "00000000a80425fb" in sh(raw, a, "grep CapEff /proc/self/status")
        # setns(-1, ...) would fail with EBADF if the filter let it through: EPERM means seccomp
        # stopped it, whatever the other arguments (random keys included).
        res = py(raw, a, "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                         "[(libc.setns(-1, 0, ctypes.c_uint64(k), ctypes.c_uint64(k ^ 7)), ctypes.get_errno()) "
                         "for k in (0, 1, int.from_bytes(os.urandom(8), 'little'))]")
        assert res == "[(-1, 1), (-1, 1), (-1, 1)]", res
        # The init of a sandbox cannot be inspected by its processes.
        r = raw.post("/v1/sandboxes/%s/code" % a, json={"code": "open('/proc/1/ns/net')"})
        assert r.json()["error"]["name"] == "PermissionError"
    finally:
        kill(raw, a)
        kill(raw, b)


def test_children_outlive_a_killed_parent_and_its_init_goes_with_the_last(daemon, raw):
    r = raw.post("/v1/sandboxes", json={"timeout": 600})
    p = r.json()["id"]
    py(raw, p, "x = 'from parent'")
    kids = [c["id"] for c in fork(raw, p, 2)["sandboxes"]]
    kill(raw, p)
    assert raw.get("/v1/sandboxes/%s" % p).status_code == 404
    assert cgroup_dirs_of(p), "the parent's init stays (a husk) while children are nested in it"
    for k in kids:
        assert py(raw, k, "x") == "'from parent'"
        assert sh(raw, k, "echo ok") == "ok\n"
    # A grandchild, forked from a child whose parent is a husk.
    g = fork(raw, kids[0], 1)["sandboxes"][0]["id"]
    assert raw.get("/v1/sandboxes/%s" % g).json()["nested_in"] == kids[0]
    assert py(raw, g, "x") == "'from parent'"
    kill(raw, kids[0])
    assert py(raw, g, "x") == "'from parent'", "a grandchild survives its parent too"
    kill(raw, kids[1])
    kill(raw, g)
    wait_until(lambda: not cgroup_dirs_of(p) and not cgroup_dirs_of(kids[0]), what="husks torn down with their last child")
    assert not state_mounts(p)


def test_fork_of_an_older_snapshot_and_fallback_without_templates(parent, raw):
    py(raw, parent, "v = 1")
    s1 = ckpt(raw, parent)["id"]
    py(raw, parent, "v = 2")
    s2 = ckpt(raw, parent)["id"]
    c1 = fork(raw, parent, 1, snapshot=s1)["sandboxes"][0]["id"]
    c2 = fork(raw, parent, 1, snapshot=s2)["sandboxes"][0]["id"]
    try:
        assert py(raw, c1, "v") == "1" and py(raw, c2, "v") == "2"
    finally:
        kill(raw, c1)
        kill(raw, c2)
    # Once the snapshot's templates are gone (sandbox killed), a fork starts sessions fresh.
    other = raw.post("/v1/sandboxes", json={"timeout": 600}).json()["id"]
    py(raw, other, "w = 3")
    s = ckpt(raw, other)["id"]
    kill(raw, other)
    res = fork(raw, parent, 1, snapshot=s)
    assert res["sessions_restarted"] is True
    c = res["sandboxes"][0]["id"]
    try:
        assert raw.get("/v1/sandboxes/%s" % c).json().get("nested_in") is None
        r = raw.post("/v1/sandboxes/%s/code" % c, json={"code": "w"})
        assert r.json()["error"]["name"] == "NameError"
    finally:
        kill(raw, c)


#: "True" while the session's socket ``s`` is open.
SOCKET_PROBE = "import os, stat\ntry:\n    ok = stat.S_ISSOCK(os.fstat(s.fileno()).st_mode)\nexcept OSError:\n    ok = False\nok"


def test_open_files_and_sockets_of_a_copy(parent, raw):
    # A file open for appending is reopened by path in the child's own root; a socket (an
    # object shared with the parent's sandbox) is closed.
    py(raw, parent, "import socket; f = open('/root/log', 'a'); f.write('p1\\n'); f.flush(); s = socket.socket()")
    # A pipe too: no fd of the copy may hold it (not even a stray duplicate).
    pipe = py(raw, parent, "import os; pr, pw = os.pipe(); os.readlink('/proc/self/fd/%d' % pw)").strip("'")
    c = fork(raw, parent, 1)["sandboxes"][0]["id"]
    try:
        links = py(raw, c, "import os\n"
                           "def link(n):\n"
                           "    try:\n"
                           "        return os.readlink('/proc/self/fd/' + n)\n"
                           "    except OSError:  # listdir's own fd, gone\n"
                           "        return ''\n"
                           "sorted(link(n) for n in os.listdir('/proc/self/fd'))")
        assert pipe.startswith("pipe:[") and pipe not in links, (pipe, links)
        py(raw, c, "f.write('child\\n'); f.flush()")
        py(raw, parent, "f.write('p2\\n'); f.flush()")
        assert sh(raw, c, "cat /root/log") == "p1\nchild\n"
        assert sh(raw, parent, "cat /root/log") == "p1\np2\n"
        assert py(raw, c, SOCKET_PROBE) == "False", "the socket shared with the parent was closed in the copy"
        assert py(raw, parent, SOCKET_PROBE) == "True"
    finally:
        kill(raw, c)


def test_daemon_restart_keeps_nested_children_and_husks(daemon, raw):
    p = raw.post("/v1/sandboxes", json={"timeout": 600}).json()["id"]
    py(raw, p, "import socket; s = socket.socket(); z = 9")
    kids = [c["id"] for c in fork(raw, p, 2)["sandboxes"]]
    kill(raw, kids[1])
    kill(raw, p)  # -> husk, kept for kids[0]
    daemon.stop()
    daemon.start()
    assert raw.get("/v1/sandboxes/%s" % kids[0]).json()["nested_in"] == p
    # The copy was never used before the restart, so the daemon that forked it never finished
    # it: it finishes itself on its first request (the socket shared with the parent closed).
    assert py(raw, kids[0], "z") == "9"
    assert py(raw, kids[0], SOCKET_PROBE) == "False"
    assert cgroup_dirs_of(p), "the husk survived the restart"
    kill(raw, kids[0])
    wait_until(lambda: not cgroup_dirs_of(p), what="husk torn down after its last child")


def test_fork_cycles_leak_nothing(daemon, parent, raw):
    py(raw, parent, "data = bytearray(1 << 20)")

    def counts():
        # Processes of this daemon's sandboxes (every hierarchy has them all; take the first),
        # the daemon's own children (zombies included), its open fds.
        hier = cgroup_hierarchies()[0]
        procs = 0
        for d, _, files in os.walk(hier):
            if "cgroup.procs" in files:
                procs += len(open(os.path.join(d, "cgroup.procs")).read().split())
        children = open("/proc/%d/task/%d/children" % (daemon.pid, daemon.pid)).read().split()
        return len(state_mounts()), procs, len(children), len(os.listdir("/proc/%d/fd" % daemon.pid))

    def cycle():
        for c in fork(raw, parent, 3)["sandboxes"]:
            kill(raw, c["id"])

    for _ in range(2):  # warm-up: the fork-shell pool fills to 3
        cycle()
    time.sleep(1.5)
    before = counts()
    for _ in range(10):
        cycle()
    time.sleep(1.5)
    after = counts()
    assert after[0] == before[0], "mounts: %r -> %r" % (before, after)
    assert after[1] == before[1], "sandbox processes: %r -> %r" % (before, after)
    assert after[2] == before[2], "daemon children: %r -> %r" % (before, after)
    assert after[3] <= before[3] + 2, "daemon fds: %r -> %r" % (before, after)
