"""Bad input: every mistake answers a precise HTTP error with a JSON body, and harms nothing.

Raw requests go through the ``raw`` httpx client on the daemon's socket (conftest.py).
"""
import hashlib
import json
import os
import time
import uuid

import pytest

from branchbox import (
    InvalidArgumentError,
    NotFoundError,
    PathEscapeError,
    Sandbox,
)
from branchbox.exceptions import TimeoutError as BBTimeoutError
from helpers import (
    URL,
    api_error,
    cgroup_children,
    cgroup_file,
    expect_in,
    sandbox_dir,
    sandbox_entries,
    state_mounts,
    wait_until,
)

MISSING_SB = "sb-0000deadbeef"


# ============================================================================ unknown ids


def test_unknown_sandbox_is_404_naming_the_id(raw, daemon):
    """Every sandbox route answers 404 not_found naming the unknown id."""
    for method, path, body in [
        ("GET", "/v1/sandboxes/%s" % MISSING_SB, None),
        ("DELETE", "/v1/sandboxes/%s" % MISSING_SB, None),
        ("POST", "/v1/sandboxes/%s/timeout" % MISSING_SB, {"timeout": 5}),
        ("POST", "/v1/sandboxes/%s/commands" % MISSING_SB, {"cmd": "true"}),
        ("POST", "/v1/sandboxes/%s/commands/stream" % MISSING_SB, {"cmd": "true"}),
        ("GET", "/v1/sandboxes/%s/commands" % MISSING_SB, None),
        ("POST", "/v1/sandboxes/%s/sessions" % MISSING_SB, {"kind": "python"}),
        ("POST", "/v1/sandboxes/%s/code" % MISSING_SB, {"code": "1"}),
        ("GET", "/v1/sandboxes/%s/files?path=/etc/hostname" % MISSING_SB, None),
        ("GET", "/v1/sandboxes/%s/files/stat?path=/" % MISSING_SB, None),
    ]:
        r = raw.request(method, path, json=body)
        err = api_error(r, 404, "not_found")
        assert MISSING_SB in err["message"], (method, path, err)
    with pytest.raises(NotFoundError) as ei:
        Sandbox.connect(MISSING_SB, daemon=URL)
    assert MISSING_SB in str(ei.value) and ei.value.status_code == 404


def test_unknown_session_is_404_naming_it(raw, sbx):
    for method, path, body in [
        ("POST", "/v1/sandboxes/%s/sessions/ss-00000000/run" % sbx.id, {"code": "1"}),
        ("DELETE", "/v1/sandboxes/%s/sessions/ss-00000000" % sbx.id, None),
    ]:
        err = api_error(raw.request(method, path, json=body), 404, "not_found")
        assert "ss-00000000" in err["message"], err


def test_unknown_pid_wait_and_kill_are_404_naming_the_pid(raw, sbx):
    err = api_error(raw.post("/v1/sandboxes/%s/commands/99999/wait" % sbx.id, json={}), 404, "not_found")
    assert "99999" in err["message"]
    err = api_error(raw.post("/v1/sandboxes/%s/commands/99999/kill" % sbx.id, json={}), 404, "not_found")
    assert "99999" in err["message"]
    with pytest.raises(NotFoundError):
        sbx.commands.wait(99999, timeout=5)
    with pytest.raises(NotFoundError):
        sbx.commands.kill(99999)
    for bad in ("abc", "0", "-1"):
        err = api_error(raw.post("/v1/sandboxes/%s/commands/%s/kill" % (sbx.id, bad), json={}), 400, "bad_request")
        assert bad in err["message"]


def test_killing_pid_1_is_refused_and_harms_nothing(sbx):
    """pid 1 is the sandbox's init, not an API process: kill(1) must be refused and kill nothing."""
    bg = sbx.commands.run("sleep 4251", background=True)
    session = sbx.sessions.create("python")
    session.run("alive = 'yes'")
    try:
        refused = False
        try:
            sbx.commands.kill(1, signal=15)
        except (NotFoundError, InvalidArgumentError):
            refused = True
        time.sleep(0.2)  # let a wrongly delivered signal take effect before looking
        running = {p.pid: p.running for p in sbx.commands.list()}
        assert running.get(bg.pid) is True, "the background process was killed by kill(pid=1)"
        assert session.run("alive").result == "'yes'", "the session was killed by kill(pid=1)"
        assert refused, "kill(pid=1) was accepted"
    finally:
        bg.kill()


# ============================================================================ malformed bodies


def test_invalid_json_body_is_400_with_json_error(raw, sbx):
    for path in ["/v1/sandboxes", "/v1/sandboxes/%s/commands" % sbx.id, "/v1/sandboxes/%s/files/mkdir" % sbx.id,
                 "/v1/sandboxes/%s/timeout" % sbx.id, "/v1/sandboxes/%s/code" % sbx.id]:
        for content in (b"{bad json", b'{"cmd": ', b"[1, 2]", b'"just a string"'):
            r = raw.post(path, content=content, headers={"content-type": "application/json"})
            err = api_error(r, 400, "bad_request")
            assert "invalid JSON" in err["message"], (path, content, err)


def test_unknown_fields_are_rejected_naming_them(raw, sbx):
    count = len(Sandbox.list(daemon=URL))
    for path, body, field in [
        ("/v1/sandboxes", {"memroy_mb": 256}, "memroy_mb"),
        ("/v1/sandboxes/%s/commands" % sbx.id, {"cmd": "true", "command": "x"}, "command"),
        ("/v1/sandboxes/%s/sessions" % sbx.id, {"kind": "python", "lang": "x"}, "lang"),
        ("/v1/sandboxes/%s/files/mkdir" % sbx.id, {"path": "/root/x", "parent": True}, "parent"),
        ("/v1/sandboxes/%s/timeout" % sbx.id, {"timeout": 5, "ttl": 5}, "ttl"),
    ]:
        err = api_error(raw.post(path, json=body), 400, "bad_request")
        assert field in err["message"] and "unknown field" in err["message"], err
    assert len(Sandbox.list(daemon=URL)) == count
    assert not sbx.files.exists("/root/x")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"memory_mb": 1}, "memory_mb"),
        ({"memory_mb": 0}, "memory_mb"),
        ({"cpu": 0}, "cpu"),
        ({"cpu": -1}, "cpu"),
        ({"cpu": 1e9}, "cpu"),
        ({"pids": 1}, "pids"),
        ({"network": "host"}, "network"),
        ({"network": "bridge"}, "network"),
        ({"timeout": -1}, "timeout"),
        ({"cwd": "relative/dir"}, "cwd"),
        ({"env": {"A=B": "x"}}, "env"),
    ],
)
def test_bad_create_parameters_are_400_naming_the_field(raw, daemon, body, field):
    """Invalid limits/settings are refused with a message naming the field; nothing is created."""
    before = (sandbox_entries(), cgroup_children(), len(state_mounts()))
    err = api_error(raw.post("/v1/sandboxes", json=body), 400, "bad_request")
    assert field in err["message"], err
    assert (sandbox_entries(), cgroup_children(), len(state_mounts())) == before


def test_unknown_image_is_404_naming_it(raw, daemon):
    err = api_error(raw.post("/v1/sandboxes", json={"image": "no-such-image"}), 404, "not_found")
    assert "no-such-image" in err["message"]


def test_cpu_below_the_kernel_minimum_is_a_client_error(raw, daemon):
    before = (sandbox_entries(), cgroup_children(), len(state_mounts()))
    r = raw.post("/v1/sandboxes", json={"cpu": 0.005, "timeout": 60})
    if r.status_code == 201:
        raw.delete("/v1/sandboxes/" + r.json()["id"])
    # Whatever the answer, a failed create leaves nothing behind.
    wait_until(lambda: (sandbox_entries(), cgroup_children(), len(state_mounts())) == before, timeout=10,
               what="no leftovers of the failed create")
    assert r.status_code in (201, 400), "cpu=0.005 answered %d: %s" % (r.status_code, r.text)
    if r.status_code == 400:
        assert "cpu" in api_error(r, 400, "bad_request")["message"]


def test_json_body_over_16mib_is_413(raw, sbx):
    big = b'{"cmd": "echo ' + b"a" * (16 << 20) + b'"}'
    err = api_error(raw.post("/v1/sandboxes/%s/commands" % sbx.id, content=big,
                             headers={"content-type": "application/json"}), 413, "payload_too_large")
    assert "16 MiB" in err["message"]
    # Just under the limit is accepted (the limit is on the body, not on a field).
    ok = raw.post("/v1/sandboxes/%s/commands" % sbx.id, json={"cmd": "true", "stdin": "x" * (15 << 20)})
    assert ok.status_code == 200 and ok.json()["exit_code"] == 0, ok.text[:300]


# ============================================================================ paths


@pytest.fixture
def host_marker(tmp_path_factory):
    """A host file in /tmp that path escapes would target; its content and mtime are checked."""
    name = "bb-escape-%s" % uuid.uuid4().hex[:10]
    path = os.path.join("/tmp", name)
    with open(path, "w") as f:
        f.write("host-only")
    st = os.stat(path)
    yield name, path
    assert open(path).read() == "host-only", "the host file was modified through the API"
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns, "the host file was touched through the API"
    os.unlink(path)
    assert not os.path.exists("/tmp/%s-dir" % name), "a host directory was created through the API"


def test_path_escapes_are_refused_and_host_is_untouched(raw, sbx, host_marker):
    name, _ = host_marker
    passwd = hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest()
    hostname = sbx.files.read("/etc/hostname")
    base = "/v1/sandboxes/%s" % sbx.id
    escapes = ["/../tmp/" + name, "../../tmp/" + name, "/root/../../tmp/" + name, "/../../../../../tmp/" + name,
               "a/b/../../../tmp/" + name]
    for p in escapes:
        for method, path, params, body in [
            ("GET", "/files", {"path": p}, None),
            ("PUT", "/files", {"path": p}, b"pwned"),
            ("DELETE", "/files", {"path": p, "recursive": "true"}, None),
            ("GET", "/files/stat", {"path": p}, None),
            ("GET", "/files/list", {"path": p}, None),
        ]:
            r = raw.request(method, base + path, params=params, content=body)
            err = api_error(r, 400, "path_escape")
            assert p in err["message"], err
            if body is not None:
                # Refused before its body was read: the daemon closes the connection and says so.
                assert r.headers.get("connection") == "close", r.headers
        for path, body in [("/files/mkdir", {"path": p + "-dir"}),
                           ("/files/rename", {"from": "/etc/hostname", "to": p}),
                           ("/files/rename", {"from": p, "to": "/root/stolen"})]:
            api_error(raw.post(base + path, json=body), 400, "path_escape")
    err = api_error(raw.get(base + "/files", params={"path": "/../etc/passwd"}), 400, "path_escape")
    assert "/../etc/passwd" in err["message"]
    with pytest.raises(PathEscapeError):
        sbx.files.read("/../etc/passwd")
    with pytest.raises(PathEscapeError):
        sbx.files.write("../../tmp/" + name, "pwned")
    assert hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest() == passwd
    assert not sbx.files.exists("/root/stolen")
    assert sbx.files.read("/etc/hostname") == hostname, "the refused rename moved the sandbox's file"
    # '..' that stays inside the root is fine and normalised.
    assert sbx.files.stat("/root/../etc/./hostname").path == "/etc/hostname"


def test_bad_paths_and_file_parameters(raw, sbx):
    base = "/v1/sandboxes/%s" % sbx.id
    api_error(raw.get(base + "/files"), 400, "bad_request")  # no path
    api_error(raw.get(base + "/files", params={"path": ""}), 400, "bad_request")
    err = api_error(raw.get(base + "/files", params={"path": "/etc"}), 400, "bad_request")
    assert "directory" in err["message"]
    with pytest.raises(InvalidArgumentError):
        sbx.files.read("/etc")
    err = api_error(raw.put(base + "/files", params={"path": "/etc"}, content=b"x"), 400, "bad_request")
    assert "directory" in err["message"]
    err = api_error(raw.put(base + "/files", params={"path": "/root/m", "mode": "999"}, content=b"x"), 400, "bad_request")
    assert "mode" in err["message"]
    err = api_error(raw.get(base + "/files/list", params={"path": "/", "depth": 65}), 400, "bad_request")
    assert "depth" in err["message"]
    api_error(raw.get(base + "/files/list", params={"path": "/etc/hostname"}), 400, "bad_request")
    api_error(raw.get(base + "/files/stat", params={"path": "/root/nope"}), 404, "not_found")
    api_error(raw.post(base + "/files/mkdir", json={"path": "/tmp", "parents": False}), 409, "conflict")
    api_error(raw.delete(base + "/files", params={"path": "/"}), 400, "bad_request")
    assert not sbx.files.exists("/root/m")


def test_reading_a_fifo_is_refused_not_hung(make_sandbox):
    sbx = make_sandbox()
    assert sbx.commands.run("mkfifo /tmp/fifo").exit_code == 0
    assert sbx.files.stat("/tmp/fifo").type == "other"
    slow = Sandbox.connect(sbx.id, daemon=URL, request_timeout=5)
    try:
        with pytest.raises(InvalidArgumentError):
            slow.files.read("/tmp/fifo")
    except BBTimeoutError:
        pytest.fail("reading a FIFO through the files API hung (client timeout after 5 s)")
    finally:
        slow.close()
        # Release a daemon thread stuck opening the FIFO: open it for writing from the host.
        host_fifo = os.path.join(sandbox_dir(sbx.id), "rootfs", "tmp", "fifo")
        try:
            fd = os.open(host_fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass  # ENXIO: nobody is blocked reading it


# ============================================================================ commands


def test_empty_or_ambiguous_commands_are_rejected(raw, sbx):
    for cmd in ("", "   ", []):
        with pytest.raises(InvalidArgumentError):
            sbx.commands.run(cmd)
    base = "/v1/sandboxes/%s/commands" % sbx.id
    err = api_error(raw.post(base, json={"args": []}), 400, "bad_request")
    assert "args" in err["message"]
    err = api_error(raw.post(base, json={}), 400, "bad_request")
    assert "cmd" in err["message"] and "args" in err["message"]
    err = api_error(raw.post(base, json={"cmd": "echo a", "args": ["echo", "b"]}), 400, "bad_request")
    assert "either cmd or args" in err["message"]
    api_error(raw.post(base, json={"args": [], "background": True}), 400, "bad_request")
    assert [p for p in sbx.commands.list() if p.cmd in ("echo a", "echo b")] == []


def test_daemon_rejects_an_empty_cmd_string(raw, sbx):
    for cmd in ("", "   "):
        api_error(raw.post("/v1/sandboxes/%s/commands" % sbx.id, json={"cmd": cmd}), 400, "bad_request")


def test_missing_program(raw, sbx):
    """cmd runs through /bin/sh -c: a missing program is exit 127; an argv names it in a 400."""
    r = sbx.commands.run("no-such-program-xyz --flag")
    assert r.exit_code == 127 and r.signal is None, r
    expect_in(r, "stderr", "no-such-program-xyz: not found")
    base = "/v1/sandboxes/%s/commands" % sbx.id
    for body in ({"args": ["no-such-program-xyz"]}, {"args": ["no-such-program-xyz"], "background": True},
                 {"args": ["/no/such/path/prog"]}):
        err = api_error(raw.post(base, json=body), 400, "bad_request")
        assert body["args"][0] in err["message"] and "No such file" in err["message"], err
    with pytest.raises(InvalidArgumentError) as ei:
        sbx.commands.run(["no-such-program-xyz"])
    assert "no-such-program-xyz" in str(ei.value)
    err = api_error(raw.post(base, json={"args": ["/etc/hostname"]}), 400, "bad_request")
    assert "Permission denied" in err["message"], err


def test_other_bad_command_and_session_parameters(raw, sbx):
    base = "/v1/sandboxes/%s" % sbx.id
    cases = [
        ("/commands", {"cmd": "cat", "stdin": "a", "stdin_b64": "YQ=="}, "stdin"),
        ("/commands", {"cmd": "cat", "stdin_b64": "!!!"}, "stdin_b64"),
        ("/commands", {"cmd": "true", "timeout": -1}, "timeout"),
        ("/commands", {"cmd": "pwd", "cwd": "/no/such/dir"}, "/no/such/dir"),
        ("/sessions", {"kind": "ruby"}, "ruby"),
        ("/code", {"code": "1", "language": "ruby"}, "ruby"),
        ("/code", {"code": "1", "timeout": -2}, "timeout"),
        ("/timeout", {"timeout": -5}, "timeout"),
    ]
    for path, body, needle in cases:
        err = api_error(raw.post(base + path, json=body), 400, "bad_request")
        assert needle in err["message"], (path, body, err)
    # A streamed command fails after the stream started: an NDJSON error event, which the SDK raises.
    r = raw.post(base + "/commands/stream", json={"cmd": "pwd", "cwd": "/no/such/dir"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson", r
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "bad_request", events
    assert "/no/such/dir" in events[-1]["error"]["message"]
    with pytest.raises(InvalidArgumentError) as ei:
        sbx.commands.run("pwd", cwd="/no/such/dir", on_stdout=lambda _: None)
    assert "/no/such/dir" in str(ei.value)
    h = sbx.commands.run("sleep 4252", background=True)
    for sig in (0, 65, 99, -9):
        err = api_error(raw.post(base + "/commands/%d/kill" % h.pid, json={"signal": sig}), 400, "bad_request")
        assert str(sig) in err["message"]
    assert {p.pid: p.running for p in sbx.commands.list()}[h.pid] is True
    h.kill()
    with pytest.raises(InvalidArgumentError):
        sbx.sessions.create("ruby")


def test_spawning_at_the_pids_limit_is_a_clear_client_error(make_sandbox, raw):
    sbx = make_sandbox(pids=16)
    # A filler that forks until the kernel refuses, then stays: every pid of the sandbox is taken.
    filler = ("import os, time\n"
              "while True:\n"
              "    try:\n"
              "        pid = os.fork()\n"
              "    except OSError:\n"
              "        break\n"
              "    if pid == 0:\n"
              "        time.sleep(4253)\n"
              "        os._exit(0)\n"
              "time.sleep(4253)\n")
    sbx.commands.run(["python3", "-c", filler], background=True)
    wait_until(lambda: cgroup_file("pids", sbx.id, "pids.current") == "16", timeout=10,
               what="the sandbox to reach pids.max")
    r = raw.post("/v1/sandboxes/%s/commands" % sbx.id, json={"cmd": "true"})
    assert r.status_code != 500, "at the pids limit: HTTP %d %s" % (r.status_code, r.text)
    err = api_error(r, r.status_code)
    assert "pids" in err["message"], err


# ============================================================================ routes


def test_unknown_route_is_404_json(raw, daemon):
    for path in ("/v1/nope", "/v2/sandboxes", "/v1/sandboxes/%s/nope" % MISSING_SB, "/"):
        err = api_error(raw.get(path), 404, "not_found")
        assert path in err["message"]


def test_wrong_method_answers_a_json_error(raw, daemon):
    for method, path in (("PUT", "/v1/health"), ("DELETE", "/v1/sandboxes"), ("PATCH", "/v1/images")):
        r = raw.request(method, path)
        assert r.status_code == 405, r
        api_error(r, 405)
