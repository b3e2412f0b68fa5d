"""Every API verb through the synchronous SDK, against a live branchboxd.

Foreground command results are asserted exactly with ``expect_output`` (helpers.py), which
prints the whole result on a mismatch. ``test_fast_commands_never_lose_output`` is the regression
test for the output-loss race fixed in 88bc98f (exec.rs drained pipes with tokio try_read).
"""
import hashlib
import os
import re
import signal
import threading
import time
import uuid

import httpx
import pytest

from branchbox import (
    CommandExitError,
    CommandHandle,
    ConflictError,
    Images,
    InvalidArgumentError,
    NotFoundError,
    Sandbox,
)
from branchbox.sandbox_sync import health
from helpers import (
    SOCKET,
    UID_BASE,
    URL,
    assert_no_host_traces,
    cgroup_file,
    expect_output,
    sandbox_dir,
    wait_until,
)


@pytest.fixture
def raw_short(daemon):
    """A bare client that gives up after 1 s (to play a client that goes away)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://d", timeout=1) as c:
        yield c


def tag():
    return uuid.uuid4().hex[:10]


def sandbox_pids_with(sbx, needle):
    """pids of processes inside the sandbox whose command line contains ``needle``."""
    code = (
        "import os\n"
        "found = []\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try:\n"
        "            cmd = open('/proc/' + p + '/cmdline', 'rb').read().replace(b'\\0', b' ').decode()\n"
        "        except OSError:\n"
        "            continue\n"
        "        if NEEDLE in cmd:\n"
        "            found.append(int(p))\n"
        "sorted(found)"
    ).replace("NEEDLE", repr(needle))
    ex = sbx.run_code(code)
    assert ex.error is None, ex.error
    return eval(ex.result)


# ============================================================================ sandboxes


def test_create_applies_env_cwd_metadata_and_limits(make_sandbox):
    """create() stores env/cwd/metadata/limits, info() reports them, and the cgroup enforces them."""
    t = tag()
    sbx = make_sandbox(
        env={"BB_A": "1", "BB_B": "two words"},
        cwd="/tmp",
        metadata={"suite": t, "role": "main"},
        memory_mb=256,
        cpu=0.5,
        pids=100,
    )
    assert re.fullmatch(r"sb-[0-9a-f]{12}", sbx.id), sbx.id
    info = sbx.info()
    assert info.id == sbx.id and info.image == "base" and info.state == "running"
    assert info.env == {"BB_A": "1", "BB_B": "two words"}
    assert info.cwd == "/tmp"
    assert info.metadata == {"suite": t, "role": "main"}
    assert (info.memory_mb, info.cpu, info.pids, info.network) == (256, 0.5, 100, "none")
    assert info.init_pid and info.init_pid > 1 and not info.oom_killed
    assert info.expires_at is not None and info.expires_at > info.created_at
    # The limits are really applied to the sandbox's cgroup on the host.
    assert int(cgroup_file("memory", sbx.id, "memory.limit_in_bytes")) == 256 << 20
    quota = int(cgroup_file("cpu", sbx.id, "cpu.cfs_quota_us"))
    period = int(cgroup_file("cpu", sbx.id, "cpu.cfs_period_us"))
    assert quota * 2 == period, "cpu=0.5 must give half a period of quota, got %d/%d" % (quota, period)
    assert cgroup_file("pids", sbx.id, "pids.max") == "100"
    # And the defaults reach processes: a python session (race-free capture) and a command.
    ex = sbx.run_code("import os, socket\n(os.getcwd(), os.environ['BB_A'], os.environ['BB_B'], socket.gethostname())")
    assert ex.error is None and ex.result == repr(("/tmp", "1", "two words", sbx.id))
    expect_output(sbx.commands.run('pwd; echo "$BB_B"'), stdout="/tmp\ntwo words\n")


def test_list_filters_by_metadata(make_sandbox):
    """list(metadata=...) returns exactly the sandboxes whose metadata contain every pair."""
    t = tag()
    a = make_sandbox(metadata={"suite": t, "role": "a"})
    b = make_sandbox(metadata={"suite": t, "role": "b"})
    ids = lambda infos: sorted(i.id for i in infos)  # noqa: E731
    assert ids(Sandbox.list(metadata={"suite": t})) == sorted([a.id, b.id])
    assert ids(Sandbox.list(metadata={"suite": t, "role": "b"})) == [b.id]
    assert ids(Sandbox.list(metadata={"suite": t, "role": "c"})) == []
    assert ids(Sandbox.list(metadata={"suite": "other-" + t})) == []
    everything = ids(Sandbox.list())
    assert a.id in everything and b.id in everything


def test_set_timeout_restarts_ttl_and_zero_disables_it(sbx):
    """set_timeout(n) moves expires_at to now+n; set_timeout(0) removes the TTL."""
    before = time.time()
    info = sbx.set_timeout(1234)
    after = time.time()
    assert info.expires_at is not None
    assert before + 1234 - 5 <= info.expires_at <= after + 1234 + 5, (before, info.expires_at, after)
    assert sbx.info().expires_at == info.expires_at
    info = sbx.set_timeout(0)
    assert info.expires_at is None and sbx.info().expires_at is None
    assert sbx.info().state == "running"


def test_ttl_reaps_expired_sandbox(make_sandbox):
    """A sandbox created with timeout=1 is killed by the daemon and leaves nothing behind."""
    sbx = make_sandbox(timeout=1)
    sid = sbx.id
    wait_until(lambda: sid not in [i.id for i in Sandbox.list()], timeout=10, what="TTL reaping of " + sid)
    with pytest.raises(NotFoundError) as ei:
        Sandbox.connect(sid)
    assert sid in str(ei.value)
    assert_no_host_traces(sid)


def test_kill_then_every_call_is_404_naming_the_id(make_sandbox):
    """After kill(): info/commands/files answer NotFoundError naming the id; kill() again is False."""
    sbx = make_sandbox()
    sid = sbx.id
    assert sbx.kill() is True
    for call in (sbx.info, lambda: sbx.commands.run("true"), lambda: sbx.files.read("/etc/hostname"),
                 lambda: sbx.run_code("1"), lambda: sbx.set_timeout(5)):
        with pytest.raises(NotFoundError) as ei:
            call()
        assert sid in str(ei.value), str(ei.value)
        assert ei.value.status_code == 404
    assert sbx.kill() is False
    assert sid not in [i.id for i in Sandbox.list()]
    assert not os.path.exists(sandbox_dir(sid))


def test_health_and_image_list_contains_base(daemon):
    """GET /v1/health is ok on cgroup v1; the image list has the debootstrap 'base' image."""
    h = health(daemon=URL)
    assert h["ok"] is True and h["cgroup"] == "v1" and isinstance(h["sandboxes"], int)
    with Images(daemon=URL) as images:
        listed = {i.name: i for i in images.list()}
    assert "base" in listed, sorted(listed)
    base = listed["base"]
    assert base.layers and all(l for l in base.layers) and base.size_bytes > 0 and base.id


# ============================================================================ commands


def test_command_stdout_stderr_and_exit_code(sbx):
    """A shell command's stdout, stderr and exit code are reported separately."""
    r = sbx.commands.run("echo out; echo err >&2; exit 3")
    assert r.signal is None and not r.timed_out and not r.oom_killed and r.pid > 1
    assert r.ok is False
    with pytest.raises(CommandExitError) as ei:
        r.check()
    assert ei.value.exit_code == 3
    expect_output(r, stdout="out\n", stderr="err\n", exit_code=3)


def test_args_list_form_passes_arguments_verbatim(sbx):
    """An argv list is executed without a shell: no expansion, empty arguments kept."""
    r = sbx.commands.run(["printf", "[%s]\\n", "a b", "$HOME", "*", ""])
    expect_output(r, stdout="[a b]\n[$HOME]\n[*]\n[]\n", stderr="")


def test_cwd_and_env_per_command_override_sandbox_defaults(make_sandbox):
    """Commands inherit the sandbox cwd/env; per-command cwd/env override them."""
    sbx = make_sandbox(env={"BB_X": "sandbox"}, cwd="/tmp")
    expect_output(sbx.commands.run('pwd; echo "$BB_X"; echo "$HOSTNAME"'), stdout="/tmp\nsandbox\n%s\n" % sbx.id)
    r = sbx.commands.run('pwd; echo "$BB_X $BB_Y"', cwd="/etc", env={"BB_X": "command", "BB_Y": "y"})
    expect_output(r, stdout="/etc\ncommand y\n")
    r = sbx.commands.run(["/bin/sh", "-c", 'pwd; echo "$BB_X"'], cwd="/usr")
    expect_output(r, stdout="/usr\nsandbox\n")


def test_stdin_text_is_fed_to_the_command(sbx):
    """stdin as str reaches the command, UTF-8 intact."""
    text = "héllo\nwörld\n" * 100
    expect_output(sbx.commands.run("cat", stdin=text), stdout=text, stderr="")


def test_stdin_bytes_are_fed_verbatim(sbx):
    """stdin as bytes (NULs, invalid UTF-8, 256 KiB) reaches the command byte for byte."""
    data = bytes(range(256)) + b"\x00\xff\xfe" + os.urandom(256 * 1024)
    r = sbx.commands.run("cat > /tmp/in.bin; sha256sum < /tmp/in.bin; wc -c < /tmp/in.bin", stdin=data)
    expect_output(r, stdout="%s  -\n%d\n" % (hashlib.sha256(data).hexdigest(), len(data)))


def test_timeout_kills_the_command_and_its_children(sbx):
    """A command over its timeout answers timed_out/signal 9, and its whole group is gone."""
    r = sbx.commands.run("sleep 4241 & sleep 4242; echo never", timeout=1)
    assert r.timed_out is True, r
    assert r.exit_code is None and r.signal == 9, r
    assert "never" not in r.stdout
    left = wait_until(lambda: sandbox_pids_with(sbx, "sleep 424") == [] or None, timeout=10,
                      what="the timed-out command's processes to disappear")
    assert left is True
    # The sandbox is still fine afterwards.
    expect_output(sbx.commands.run("echo ok"), stdout="ok\n")


def test_streaming_callbacks_receive_all_output_in_order(sbx):
    """on_stdout/on_stderr get every chunk, in order, while the command runs."""
    script = (
        "import sys, time\n"
        "for i in range(300):\n"
        "    print('line %03d' % i, flush=True)\n"
        "    if i % 60 == 59:\n"
        "        print('err %d' % i, file=sys.stderr, flush=True)\n"
        "        time.sleep(0.05)\n"
    )
    out, err = [], []
    r = sbx.commands.run(["python3", "-c", script], on_stdout=out.append, on_stderr=err.append)
    want_out = "".join("line %03d\n" % i for i in range(300))
    want_err = "".join("err %d\n" % i for i in range(59, 300, 60))
    assert r.exit_code == 0, r
    # What the callbacks got is exactly what the result reports...
    assert "".join(out) == r.stdout and "".join(err) == r.stderr
    # ...and it arrived in several chunks (streamed, not one blob at the end).
    assert len(out) >= 2, "stdout arrived in %d chunk(s)" % len(out)
    expect_output(r, stdout=want_out, stderr=want_err)


def test_background_process_is_listed_waited_and_killed(sbx):
    """background=True returns a handle; the process is listed, outlives wait(timeout), dies on kill."""
    h = sbx.commands.run("sleep 4244", background=True)
    assert isinstance(h, CommandHandle) and h.pid > 1
    procs = {p.pid: p for p in sbx.commands.list()}
    assert h.pid in procs and procs[h.pid].running is True and procs[h.pid].cmd == "sleep 4244"
    r = h.wait(timeout=0.5)
    assert r.timed_out is True and r.exit_code is None and r.signal is None, r
    assert {p.pid: p for p in sbx.commands.list()}[h.pid].running is True, "wait(timeout) must not kill"
    assert h.kill() is True
    r = h.wait(timeout=30)
    assert not r.timed_out and r.exit_code is None and r.signal == 9, r
    p = {p.pid: p for p in sbx.commands.list()}[h.pid]
    assert (p.running, p.signal, p.exit_code) == (False, 9, None)
    with pytest.raises(NotFoundError):
        h.kill()
    # Foreground commands are not listed as background processes.
    fg = sbx.commands.run("true")
    assert fg.pid not in {p.pid for p in sbx.commands.list()}


def test_background_output_is_returned_by_wait(sbx):
    """wait() returns a background process's whole stdout/stderr and exit code."""
    h = sbx.commands.run("for i in 1 2 3; do echo out$i; done; echo err >&2; exit 5", background=True)
    r = h.wait(timeout=30)
    assert (r.stdout, r.stderr, r.exit_code, r.signal, r.timed_out) == ("out1\nout2\nout3\n", "err\n", 5, None, False)
    # Waiting again for an exited process gives the same answer at once.
    r2 = sbx.commands.wait(h.pid, timeout=30)
    assert (r2.stdout, r2.stderr, r2.exit_code) == (r.stdout, r.stderr, r.exit_code)
    p = {p.pid: p for p in sbx.commands.list()}[h.pid]
    assert (p.running, p.exit_code) == (False, 5)


def test_fast_commands_never_lose_output(make_sandbox):
    """Quick commands, sequential and concurrent across sandboxes, always return their output."""
    boxes = [make_sandbox() for _ in range(4)]
    bad = []
    lock = threading.Lock()

    def work(sbx, n):
        for i in range(n):
            r = sbx.commands.run(["echo", "%s-%d" % (sbx.id, i)])
            if r.stdout != "%s-%d\n" % (sbx.id, i) or r.exit_code != 0:
                with lock:
                    bad.append(r)

    threads = [threading.Thread(target=work, args=(b, 60)) for b in boxes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    work(boxes[0], 150)
    assert not bad, "%d of 390 commands lost output, e.g. %r" % (len(bad), bad[:3])


def test_output_over_16mib_is_truncated_and_flagged(sbx):
    """stdout is capped at 16 MiB and flagged stdout_truncated; the command still completes."""
    r = sbx.commands.run("head -c 17000000 /dev/zero | tr '\\0' a", timeout=60)
    assert r.exit_code == 0 and r.stdout_truncated is True and r.stderr_truncated is False, \
        (r.exit_code, r.stdout_truncated, r.stderr_truncated, len(r.stdout))
    assert len(r.stdout) == 16 << 20 and set(r.stdout) == {"a"}


def test_foreground_command_dies_with_its_client(sbx, raw_short):
    """A foreground command whose HTTP client goes away is killed, not left running."""
    with pytest.raises(httpx.ReadTimeout):
        raw_short.post("/v1/sandboxes/%s/commands" % sbx.id, json={"cmd": "sleep 4293", "timeout": 60})
    wait_until(lambda: sandbox_pids_with(sbx, "sleep 4293") == [], timeout=10,
               what="the abandoned command to be killed")


def test_streamed_command_dies_with_its_client(sbx, raw_short):
    """Same for a streamed command, even one without a timeout of its own."""
    with pytest.raises(httpx.ReadTimeout):
        with raw_short.stream("POST", "/v1/sandboxes/%s/commands/stream" % sbx.id,
                              json={"cmd": "sleep 4294", "timeout": 0}) as r:
            for _ in r.iter_lines():
                pass
    wait_until(lambda: sandbox_pids_with(sbx, "sleep 4294") == [], timeout=5,
               what="the abandoned streamed command to be killed")


def test_dead_sandbox_is_listed_dead_refuses_work_and_can_be_killed(make_sandbox):
    """If init dies (killed from the host), the sandbox shows state dead, answers 409, and kill() cleans up."""
    sbx = make_sandbox()
    os.kill(sbx.info().init_pid, signal.SIGKILL)
    wait_until(lambda: sbx.info().state == "dead", timeout=10, what="state dead")
    assert {i.id: i.state for i in Sandbox.list()}[sbx.id] == "dead"
    for call in (lambda: sbx.commands.run("true"), lambda: sbx.run_code("1"),
                 lambda: sbx.files.read("/etc/hostname"), lambda: sbx.sessions.create("python")):
        with pytest.raises(ConflictError) as ei:
            call()
        assert sbx.id in str(ei.value) and "dead" in str(ei.value)
    assert sbx.kill() is True
    assert_no_host_traces(sbx.id)


# ============================================================================ sessions


def test_python_session_state_persists_and_last_expression_is_repr(sbx):
    """Variables persist between runs; the last expression's repr is the result."""
    s = sbx.sessions.create("python")
    assert s.id.startswith("ss-") and s.kind == "python"
    ex = s.run("x = 41\nprint('side effect')")
    assert (ex.stdout, ex.result, ex.error) == ("side effect\n", None, None)
    assert s.run("x + 1").result == "42"
    assert s.run("'a' * 2").text == "'aa'"
    assert s.run("None").result is None
    ex = s.run("import sys\nprint('to err', file=sys.stderr)\n[x, {'k': x}]")
    assert ex.stderr == "to err\n" and ex.result == "[41, {'k': 41}]"
    listed = {i.id: i for i in sbx.sessions.list()}
    assert listed[s.id].kind == "python" and listed[s.id].alive is True


def test_python_session_errors_have_name_value_traceback(sbx):
    """A raised exception comes back as error{name,value,traceback}; the session survives it."""
    s = sbx.sessions.create("python")
    s.run("keep = 'kept'")
    ex = s.run("def f():\n    return 1 / 0\nf()")
    assert ex.result is None and ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert "ZeroDivisionError" in ex.error.traceback and "in f" in ex.error.traceback, ex.error.traceback
    ex = s.run("raise ValueError('boom')")
    assert (ex.error.name, ex.error.value) == ("ValueError", "boom")
    ex = s.run("def broken(:\n    pass")
    assert ex.error is not None and ex.error.name == "SyntaxError", ex.error
    assert s.run("keep").result == "'kept'"


def test_run_code_uses_a_default_session(sbx):
    """run_code() keeps state between calls in the sandbox's default python session."""
    assert sbx.run_code("y = 5").error is None
    assert sbx.run_code("y * 2").text == "10"
    ex = sbx.run_code("undefined_name")
    assert ex.error is not None and ex.error.name == "NameError"
    assert sbx.run_code("y").text == "5"


def test_a_runs_env_holds_for_that_run_only(sbx):
    code = "import os, subprocess\n(os.environ.get('RUN_ENV'), subprocess.check_output('echo $RUN_ENV', shell=True, text=True))"
    assert sbx.run_code(code, env={"RUN_ENV": "x y"}).text == "('x y', 'x y\\n')"
    assert sbx.run_code(code).text == "(None, '\\n')"
    sh = sbx.sessions.create("shell", env={"KEPT": "session"})
    assert sh.run('echo "$KEPT $ONCE"', env={"KEPT": "run's", "ONCE": "1"}).stdout == "run's 1\n"
    # What the run did to those names goes with it; other changes stay.
    sh.run("KEPT=changed; ONCE=2; OTHER=3", env={"KEPT": "x", "ONCE": "y"})
    assert sh.run('echo "$KEPT [$ONCE] $OTHER"').stdout == "session [] 3\n"
    with pytest.raises(InvalidArgumentError, match="BAD-NAME"):
        sbx.run_code("1", env={"BAD-NAME": "x"})


def test_shell_session_persists_cwd_env_functions_and_reports_exit_code(sbx):
    """A shell session keeps cwd, exported and plain variables and functions; exit codes reported."""
    sh = sbx.sessions.create("shell")
    assert sh.kind == "shell"
    r = sh.run('cd /tmp; export BB_S=exported; BB_V=plain; greet() { echo "hi $1"; }')
    assert r.exit_code == 0, r
    r = sh.run('pwd; echo "$BB_S $BB_V"; greet bob; sh -c \'echo "child sees $BB_S"\'')
    assert (r.stdout, r.stderr, r.exit_code) == ("/tmp\nexported plain\nhi bob\nchild sees exported\n", "", 0)
    assert sh.run("false").exit_code == 1
    assert sh.run("(exit 7)").exit_code == 7
    r = sh.run("echo to-err >&2; ls /nonexistent-dir")
    assert r.exit_code == 2 and r.stderr.startswith("to-err\n") and "nonexistent-dir" in r.stderr
    assert sh.run("pwd").stdout == "/tmp\n"
    sh2 = sbx.sessions.create("shell", cwd="/etc", env={"BB_E": "given"})
    assert sh2.run('pwd; echo "$BB_E"').stdout == "/etc\ngiven\n"


def test_killed_session_cannot_run(sbx):
    """After Session.kill(), running in it is refused (409 or 404) and it leaves the list."""
    s = sbx.sessions.create("python")
    s.run("a = 1")
    assert s.kill() is True
    with pytest.raises((ConflictError, NotFoundError)) as ei:
        s.run("a")
    assert s.id in str(ei.value)
    assert s.id not in {i.id for i in sbx.sessions.list()}
    assert s.kill() is False


def test_session_timeout_kills_only_that_session(sbx):
    """A run over its timeout kills its own session (409 afterwards) and no other session."""
    s1 = sbx.sessions.create("python")
    s2 = sbx.sessions.create("python")
    sh = sbx.sessions.create("shell")
    s1.run("a = 1")
    s2.run("b = 2")
    sh.run("export KEEP=yes")
    ex = s1.run("import time\ntime.sleep(120)", timeout=1)
    assert ex.timed_out is True, ex
    assert s2.run("b").result == "2"
    assert sh.run('echo "$KEEP"').stdout == "yes\n"
    with pytest.raises(ConflictError) as ei:
        s1.run("a")
    assert s1.id in str(ei.value)
    alive = {i.id: i.alive for i in sbx.sessions.list()}
    assert alive.get(s2.id) is True and alive.get(sh.id) is True
    assert alive.get(s1.id) in (False, None)
    wait_until(lambda: sbx.run_code("import os\nos.path.exists('/proc/%d')" % s1.pid).result == "False",
               timeout=10, what="the timed-out session process to exit")


# ============================================================================ files


def test_write_and_read_text_and_bytes(sbx):
    """files.write/read round-trip str and bytes; EntryInfo describes what was written."""
    e = sbx.files.write("/root/t.txt", "héllo\n")
    assert (e.name, e.path, e.type, e.size) == ("t.txt", "/root/t.txt", "file", len("héllo\n".encode()))
    assert sbx.files.read("/root/t.txt") == "héllo\n"
    blob = b"\x00\x01\xff\xfe" + os.urandom(1000)
    sbx.files.write("/root/b.bin", blob)
    assert sbx.files.read("/root/b.bin", format="bytes") == blob
    # Overwriting replaces the content (no leftovers of a longer previous file).
    sbx.files.write("/root/b.bin", b"short")
    assert sbx.files.read("/root/b.bin", format="bytes") == b"short"
    # A given mode is applied and kept by later writes that give none; executables run.
    sbx.files.write("/root/m.txt", "a", mode=0o600)
    sbx.files.write("/root/m.txt", "b")
    assert sbx.files.stat("/root/m.txt").mode == 0o600
    sbx.files.write("/root/run.sh", "#!/bin/sh\necho ran\n", mode="0755")
    assert sbx.commands.run("/root/run.sh", background=True).wait(timeout=30).stdout == "ran\n"
    # A parent that is a file is a client error.
    with pytest.raises(InvalidArgumentError):
        sbx.files.write("/root/m.txt/child", "x")
    # Text reads decode invalid UTF-8 with replacement.
    sbx.files.write("/root/bad.txt", b"a\xffb")
    assert sbx.files.read("/root/bad.txt") == "a\ufffdb"


def test_upload_download_3mib_random_roundtrip(sbx, tmp_path):
    """3 MiB of random bytes survive upload and download (streamed) byte for byte."""
    data = os.urandom(3 << 20)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    e = sbx.files.upload(src, "/root/big/blob.bin")
    assert e.size == len(data) and e.type == "file"
    ex = sbx.run_code("import hashlib\nhashlib.sha256(open('/root/big/blob.bin','rb').read()).hexdigest()")
    assert ex.result == repr(hashlib.sha256(data).hexdigest())
    dst = tmp_path / "dst.bin"
    assert sbx.files.download("/root/big/blob.bin", dst) == str(dst)
    assert dst.read_bytes() == data
    # Streaming an iterable of chunks (no Content-Length) works as well.
    chunks = [data[i : i + 700_000] for i in range(0, len(data), 700_000)]
    sbx.files.write("/root/big/chunked.bin", iter(chunks))
    with sbx.files.read("/root/big/chunked.bin", format="stream") as stream:
        got = b"".join(stream)
    assert got == data


def test_list_respects_depth(sbx):
    """files.list(depth=n) descends n levels, with correct types and paths."""
    sbx.files.make_dir("/root/tree/a/b")
    sbx.files.write("/root/tree/a/b/c.txt", "c")
    sbx.files.write("/root/tree/top.txt", "t")
    paths = lambda d: {e.path: e.type for e in sbx.files.list("/root/tree", depth=d)}  # noqa: E731
    assert paths(1) == {"/root/tree/a": "dir", "/root/tree/top.txt": "file"}
    assert paths(2) == {"/root/tree/a": "dir", "/root/tree/a/b": "dir", "/root/tree/top.txt": "file"}
    assert paths(3) == {"/root/tree/a": "dir", "/root/tree/a/b": "dir", "/root/tree/a/b/c.txt": "file",
                        "/root/tree/top.txt": "file"}
    top = {e.name: e for e in sbx.files.list("/")}
    assert top["etc"].type == "dir" and top["root"].type == "dir"


def test_stat_fields(sbx):
    """stat() reports name, path, type, size, mode, mtime and symlink targets."""
    sbx.files.write("/root/s.txt", "12345", mode=0o640)
    st = sbx.files.stat("/root/s.txt")
    assert (st.name, st.path, st.type, st.size, st.mode, st.symlink_target) == ("s.txt", "/root/s.txt", "file", 5, 0o640, None)
    assert isinstance(st.mtime, float) and st.mtime > 0
    r = sbx.commands.run("ln -s /root/s.txt /root/link && mkdir -p /root/d")
    assert r.exit_code == 0, r
    ln = sbx.files.stat("/root/link")
    assert (ln.type, ln.symlink_target) == ("symlink", "/root/s.txt")
    assert sbx.files.stat("/root/d").type == "dir"
    assert sbx.files.stat("/").type == "dir"


def test_exists(sbx):
    assert sbx.files.exists("/etc/hostname") is True
    assert sbx.files.exists("/etc") is True
    assert sbx.files.exists("/root/definitely-not-here") is False
    assert sbx.files.exists("/no/such/dir/file") is False


def test_make_dir_with_parents_and_conflicts(sbx):
    """make_dir creates parents by default; parents=False refuses an existing or orphan path."""
    e = sbx.files.make_dir("/root/p/q/r")
    assert (e.type, e.path) == ("dir", "/root/p/q/r")
    assert sbx.files.stat("/root/p/q").type == "dir"
    assert sbx.files.make_dir("/root/p/q/r").type == "dir", "parents=True on an existing dir is fine"
    with pytest.raises(ConflictError):
        sbx.files.make_dir("/root/p", parents=False)
    with pytest.raises(NotFoundError):
        sbx.files.make_dir("/root/missing/x", parents=False)
    assert sbx.files.make_dir("/root/p/single", parents=False).type == "dir"


def test_rename_moves_and_creates_parents(sbx):
    sbx.files.write("/root/r1.txt", "moved")
    e = sbx.files.rename("/root/r1.txt", "/root/sub/dir/r2.txt")
    assert (e.path, e.type, e.size) == ("/root/sub/dir/r2.txt", "file", 5)
    assert not sbx.files.exists("/root/r1.txt")
    assert sbx.files.read("/root/sub/dir/r2.txt") == "moved"
    with pytest.raises(NotFoundError):
        sbx.files.rename("/root/r1.txt", "/root/r3.txt")


def test_remove_files_and_directories(sbx):
    """remove: files go; a non-empty dir needs recursive=True (409 otherwise); missing is 404."""
    sbx.files.write("/root/rm/f.txt", "x")
    sbx.files.write("/root/rm/sub/g.txt", "y")
    assert sbx.files.remove("/root/rm/f.txt") is True
    assert not sbx.files.exists("/root/rm/f.txt")
    with pytest.raises(ConflictError):
        sbx.files.remove("/root/rm")
    assert sbx.files.exists("/root/rm/sub/g.txt"), "a refused remove must not delete anything"
    assert sbx.files.remove("/root/rm", recursive=True) is True
    assert not sbx.files.exists("/root/rm")
    with pytest.raises(NotFoundError):
        sbx.files.remove("/root/rm")


def test_api_created_files_are_owned_by_sandbox_root(sbx):
    """Files/dirs made through the API belong to uid/gid 0 inside (the mapped uid on the host)."""
    sbx.files.write("/root/own/deep/f.txt", "x")
    sbx.files.make_dir("/root/own2/sub")
    sbx.files.write("/root/tomove.txt", "m")
    sbx.files.rename("/root/tomove.txt", "/root/own3/moved.txt")
    paths = ["/root/own", "/root/own/deep", "/root/own/deep/f.txt", "/root/own2", "/root/own2/sub",
             "/root/own3", "/root/own3/moved.txt"]
    ex = sbx.run_code("import os\n[(os.stat(p).st_uid, os.stat(p).st_gid) for p in %r]" % (paths,))
    assert ex.result == repr([(0, 0)] * len(paths)), ex
    expect_output(sbx.commands.run("stat -c %u:%g /root/own/deep/f.txt /root/own2/sub"), stdout="0:0\n0:0\n")
    # On the host the same file belongs to the sandbox's mapped root, never to host root.
    host = os.path.join(sandbox_dir(sbx.id), "rootfs", "root/own/deep/f.txt")
    st = os.stat(host)
    assert (st.st_uid, st.st_gid) == (UID_BASE, UID_BASE)


def test_files_are_visible_both_ways(sbx):
    """What a process writes is read by the API, and what the API writes is seen by processes."""
    r = sbx.commands.run("printf inside > /root/in.txt && mkdir -p /root/indir && touch /root/indir/x")
    assert r.exit_code == 0, r
    assert sbx.files.read("/root/in.txt") == "inside"
    assert [e.name for e in sbx.files.list("/root/indir")] == ["x"]
    sbx.files.write("/root/out.txt", "outside")
    assert sbx.run_code("open('/root/out.txt').read()").result == "'outside'"
    expect_output(sbx.commands.run("cat /root/out.txt"), stdout="outside")
    sbx.files.remove("/root/in.txt")
    assert sbx.commands.run("test -e /root/in.txt").exit_code == 1


def test_missing_cwd_is_created_at_create(make_sandbox):
    """A sandbox cwd that the image lacks is created (like WORKDIR), owned by the sandbox's root."""
    sbx = make_sandbox(cwd="/work/app/src")
    r = sbx.commands.run("pwd; stat -c %u .")
    assert (r.stdout, r.exit_code) == ("/work/app/src\n0\n", 0), r
