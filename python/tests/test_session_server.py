"""The in-sandbox session server, run exactly as the daemon runs it:
``python3 -I -S -c <source> python|shell`` with the channel on fd 3."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from session_helpers import SERVER_SOURCE, SessionClient, SessionProcess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd/SCM_RIGHTS need Linux")


@pytest.fixture
def py():
    s = SessionProcess("python")
    yield s
    s.stop()


@pytest.fixture
def sh(tmp_path):
    s = SessionProcess("shell", cwd=str(tmp_path), env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root", "START": "yes"})
    yield s
    s.stop()


def _fds(pid: int) -> set:
    return {int(n) for n in os.listdir("/proc/%d/fd" % pid)}


def _threads(pid: int) -> int:
    return len(os.listdir("/proc/%d/task" % pid))


# ----------------------------------------------------------------------------- the file itself


def test_source_is_self_contained_stdlib_py39() -> None:
    tree = ast.parse(SERVER_SOURCE, feature_version=(3, 9))
    stdlib = set(getattr(sys, "stdlib_module_names", ())) or None
    for node in ast.walk(tree):
        if isinstance(node, ast.Match if hasattr(ast, "Match") else ()):
            pytest.fail("match statement is not Python 3.9 compatible")
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            mod = node.module or ""
        elif isinstance(node, ast.Import):
            mod = node.names[0].name
        else:
            continue
        top = mod.split(".")[0]
        assert top != "branchbox"
        if stdlib is not None:
            assert top in stdlib, "non-stdlib import %s" % mod


# ----------------------------------------------------------------------------- protocol


def test_ping_and_idle_state(py: SessionProcess) -> None:
    r = py.request({"op": "ping"})
    assert r == {"ok": True, "pid": py.proc.pid}
    # idle: single-threaded, only stdio and the channel are open
    assert _threads(py.proc.pid) == 1
    assert _fds(py.proc.pid) == {0, 1, 2, 3}
    py.run("import os\nos.system('true')\nprint(1)")
    assert _fds(py.proc.pid) == {0, 1, 2, 3}


def test_request_id_is_echoed(py: SessionProcess) -> None:
    assert py.request({"op": "ping", "id": "abc"})["id"] == "abc"
    assert py.request({"op": "run", "code": "1", "id": 5})["id"] == 5


@pytest.mark.parametrize("kind", ["python", "shell"])
def test_protocol_errors_keep_serving(kind: str) -> None:
    s = SessionProcess(kind)
    try:
        for bad in (b"{nope", b"[1,2]", b'"str"', b"{}", b'{"op":"explode"}', b'{"op":"run"}', b'{"op":"run","code":1}'):
            r = s.request(bad)
            assert r["error"]["name"] == "ProtocolError", bad
            assert r["error"]["value"]
        assert s.request({"op": "ping"})["ok"] is True
    finally:
        assert s.stop() == 0


def test_eof_exits_zero(py: SessionProcess) -> None:
    py.run("x = 1")
    assert py.stop() == 0


def test_pipelined_requests(py: SessionProcess) -> None:
    py.sock.sendall(b'{"op":"run","code":"a=1"}\n{"op":"run","code":"a+1"}\n{"op":"ping"}\n')
    assert py.recv()["error"] is None
    assert py.recv()["result"] == "2"
    assert py.recv()["ok"] is True


# ----------------------------------------------------------------------------- python kind


def test_python_state_and_last_expression(py: SessionProcess) -> None:
    r = py.run("x = 1\ndef inc(v):\n    return v + 1\n")
    assert r == {"stdout": "", "stderr": "", "result": None, "error": None, "execution_count": 1}
    assert py.run("inc(x)")["result"] == "2"
    assert py.run("x = inc(x)\nx * 10")["result"] == "20"
    assert py.run("'s'")["result"] == "'s'"
    assert py.run("None")["result"] is None
    assert py.run("print('p')\n[1, 2]") == {
        "stdout": "p\n",
        "stderr": "",
        "result": "[1, 2]",
        "error": None,
        "execution_count": 6,
    }
    assert py.run("x = 5")["result"] is None  # an assignment is not an expression
    assert py.run("__name__")["result"] == "'__main__'"
    assert py.run("_")["result"] == "'__main__'"  # REPL-style last result


def test_python_classes_pickle_and_import_site(py: SessionProcess) -> None:
    r = py.run("import pickle\nclass P:\n    pass\nlen(pickle.dumps(P())) > 0")
    assert r["error"] is None and r["result"] == "True"
    assert py.run("import sys\n'' in sys.path")["result"] == "True"


def test_python_traceback_has_no_server_frames(py: SessionProcess) -> None:
    r = py.run("def f():\n    raise ValueError('bad value')\n\nf()")
    err = r["error"]
    assert err["name"] == "ValueError" and err["value"] == "bad value"
    tb = err["traceback"]
    assert tb.startswith("Traceback (most recent call last):")
    assert 'File "<cell-1>", line 4, in <module>' in tb and "line 2, in f" in tb
    assert "raise ValueError('bad value')" in tb  # source lines are shown
    assert "<string>" not in tb and "_session_server" not in tb and "exec(" not in tb
    assert r["result"] is None


def test_python_syntax_error(py: SessionProcess) -> None:
    err = py.run("x = (1,\nprint('never')")["error"]
    assert err["name"] == "SyntaxError"
    assert "<cell-1>" in err["traceback"] and "ast.py" not in err["traceback"]
    assert not err["traceback"].startswith("Traceback")
    assert py.run("1 + 1")["result"] == "2"  # still alive
    assert py.run("return 5")["error"]["name"] == "SyntaxError"


@pytest.mark.parametrize("code, name", [
    ("import sys\nsys.exit(3)", "SystemExit"),
    ("raise SystemExit('bye')", "SystemExit"),
    ("exit()", None),  # site's exit() may be missing under -S: NameError or SystemExit
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGINT)", "KeyboardInterrupt"),
])
def test_python_exits_and_interrupts_do_not_kill_server(py: SessionProcess, code: str, name) -> None:
    py.run("alive = 'yes'")
    err = py.run(code)["error"]
    assert err is not None
    if name:
        assert err["name"] == name
    assert py.run("alive")["result"] == "'yes'"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _block_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize("preexec", [_ignore_sigint, _block_sigint], ids=["ignored", "blocked"])
def test_python_sigint_even_when_inherited_ignored_or_blocked(preexec) -> None:
    """A daemon (or a test run) started in the background of a non-interactive shell hands its
    children SIGINT ignored: the server must not keep that for the user's code."""
    s = SessionProcess("python", preexec_fn=preexec)
    try:
        r = s.run("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n'not reached'")
        assert r["error"] is not None and r["error"]["name"] == "KeyboardInterrupt", r
        assert "<cell-1>" in r["error"]["traceback"] and r["result"] is None
        assert s.run("'alive'")["result"] == "'alive'"
    finally:
        assert s.stop() == 0


_KILL_ON_FLUSH = (
    "import os, signal, sys\n"
    "class KillOnFlush:\n"
    "    def write(self, s):\n"
    "        return len(s)\n"
    "    def flush(self):\n"
    "        os.kill(os.getpid(), signal.SIGINT)\n"
)


@pytest.mark.parametrize("last", ["6 * 7", "x = 1"])
def test_python_sigint_while_the_server_finishes_a_run_is_that_runs_error(py: SessionProcess, last: str) -> None:
    """The server flushes the user's sys.stdout after the user's code returned: a SIGINT
    that arrives then is the run's KeyboardInterrupt, and the server's own clean-up
    (restoring fds 1 and 2, reading the captured output) still happens."""
    py.run(_KILL_ON_FLUSH)
    r = py.run("os.write(1, b'before\\n')\nsys.stdout = KillOnFlush()\n" + last)
    assert r == {
        "stdout": "before\n",
        "stderr": "",
        "result": None,
        "error": {"name": "KeyboardInterrupt", "value": "", "traceback": "KeyboardInterrupt\n"},
        "execution_count": 2,
    }
    assert _fds(py.proc.pid) == {0, 1, 2, 3}
    assert py.run("print('next')")["stdout"] == "next\n"  # sys.stdout and fd 1 are the server's again


def test_python_rich_outputs_come_as_displays(py: SessionProcess) -> None:
    r = py.run(
        "class H:\n"
        "    def _repr_html_(self): return '<b>h</b>'\n"
        "    def _repr_png_(self): return b'PNG'\n"
        "    def __repr__(self): return 'H()'\n"
        "display(1, H())\n"
        "H()"
    )
    assert r["result"] == "H()" and r["execution_count"] == 1
    assert r["displays"] == [
        {"text": "1"},
        {"text": "H()", "html": "<b>h</b>", "png": "UE5H"},
        {"html": "<b>h</b>", "png": "UE5H", "is_main_result": True},
    ]
    # A plain value, or a class (its _repr_*_ are unbound), has no displays: its text is the result.
    assert "displays" not in py.run("42")
    assert "displays" not in py.run("H")


def test_python_sigint_while_idle_is_dropped(py: SessionProcess) -> None:
    py.run("x = 1")
    os.kill(py.proc.pid, signal.SIGINT)  # the answer was sent: the server idles (or is about to)
    assert py.run("x + 1") == {"stdout": "", "stderr": "", "result": "2", "error": None, "execution_count": 2}
    assert py.request({"op": "ping"})["ok"] is True


def test_shell_sigint_reaches_the_command_not_the_server(tmp_path) -> None:
    sh = SessionProcess("shell", cwd=str(tmp_path), preexec_fn=os.setsid)  # a group of its own, as in a sandbox
    try:
        r = sh.run("kill -INT $PPID; echo still running")  # $PPID: the session server
        assert r == {"stdout": "still running\n", "stderr": "", "exit_code": 0}
        r = sh.run("kill -INT 0; echo never")  # the process group: the server and bash
        assert r["exit_code"] == 128 + signal.SIGINT and "never" not in r["stdout"]
        assert sh.run("echo ok") == {"stdout": "ok\n", "stderr": "", "exit_code": 0}
    finally:
        assert sh.stop() == 0


@pytest.fixture
def cpu_load():
    """A busy loop on every CPU: the server is preempted at arbitrary points."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


SIGINT_ITERATIONS = int(os.environ.get("BRANCHBOX_TEST_SIGINT_ITERATIONS", "50"))
_CHUNK = 64 * 1024
# About as long in the user's code (4 MiB written, some work between writes) as in the
# server's reading, encoding and sending them: the SIGINTs below land on both sides.
_LOUD = "for _ in range(64):\n    sys.stdout.write(chunk)\n    sum(range(10000))\n42"


def _describe(r: dict) -> str:
    """A short account of an answer (its stdout is megabytes)."""
    return repr({k: (len(v) if k == "stdout" else v) for k, v in r.items()})


def test_python_sigint_around_the_end_of_user_code_under_load(py: SessionProcess, cpu_load) -> None:
    """SIGINTs sent from outside at times spread over a whole run (user code writing 4 MiB,
    then the server reading, encoding and sending them) under CPU load. Whenever it lands,
    the answer is well formed: a KeyboardInterrupt in the user's code, or the run's own
    error with none of its output (it arrived before the code started) or all of it
    (after the code ended), or no error (after the answer); and the server lives on with
    only fds 0-3 open."""
    full = "x" * (64 * _CHUNK)
    py.run("import sys\nchunk = 'x' * %d" % _CHUNK)
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        assert py.run(_LOUD)["result"] == "42"
        took.append(time.monotonic() - t0)
    span = 0.8 * sorted(took)[1]
    seen = {"before code": 0, "in code": 0, "after code": 0, "after answer": 0}
    for i in range(SIGINT_ITERATIONS):
        py.send({"op": "run", "code": _LOUD})
        time.sleep(span * (i % 25) / 24)
        os.kill(py.proc.pid, signal.SIGINT)
        r = py.recv()
        assert {"stdout", "stderr", "result", "error"} <= set(r), _describe(r)
        err = r["error"]
        if err is None:
            assert r["result"] == "42" and r["stdout"] == full, _describe(r)
            seen["after answer"] += 1
        else:
            assert err["name"] == "KeyboardInterrupt" and r["result"] is None, _describe(r)
            if "<cell-" in err["traceback"]:
                assert full.startswith(r["stdout"]), _describe(r)
                seen["in code"] += 1
            else:  # arrived before the code started (it did not run) or after it ended
                assert err["traceback"] == "KeyboardInterrupt\n", _describe(r)
                complete = r["stdout"] == full
                assert complete or r["stdout"] == "", _describe(r)
                seen["after code" if complete else "before code"] += 1
        assert py.request({"op": "ping"})["ok"] is True, (i, seen)
        assert _fds(py.proc.pid) == {0, 1, 2, 3}, (i, seen)
    assert py.run("print('ok')")["stdout"] == "ok\n", seen


def test_python_fd_level_capture(py: SessionProcess) -> None:
    r = py.run(
        "import os, subprocess, sys\n"
        "print('one')\n"
        "os.system('echo hi')\n"
        "subprocess.run(['sh', '-c', 'echo sub; echo suberr >&2'])\n"
        "os.write(1, b'raw\\n')\n"
        "os.write(2, b'rawerr\\n')\n"
        "print('two', file=sys.stderr)\n"
        "print('three')"
    )
    assert r["error"] is None
    assert r["stdout"] == "one\nhi\nsub\nraw\nthree\n"
    assert r["stderr"] == "suberr\nrawerr\ntwo\n"
    # nothing leaks into the next run
    assert py.run("print('next')")["stdout"] == "next\n"


def test_python_output_without_newline_and_unicode(py: SessionProcess) -> None:
    r = py.run("import sys\nsys.stdout.write('no newline \u00e9\u2603')\nsys.stderr.write('\\udcff')")
    assert r["stdout"] == "no newline \u00e9\u2603"
    assert r["stderr"]  # lone surrogate escaped, not a crash


def test_python_ctypes_stdio_flushed(py: SessionProcess) -> None:
    r = py.run("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.printf(b'from C\\n')\nNone")
    assert r["error"] is None and r["stdout"] == "from C\n"


def test_python_stdin_is_devnull(py: SessionProcess) -> None:
    assert py.run("input()")["error"]["name"] == "EOFError"


def test_python_top_level_await(py: SessionProcess) -> None:
    r = py.run("import asyncio\nawait asyncio.sleep(0)\nasync def f():\n    return 42\nawait f()")
    assert r["error"] is None and r["result"] == "42"
    assert _fds(py.proc.pid) == {0, 1, 2, 3}  # the event loop was closed


def test_python_bad_repr(py: SessionProcess) -> None:
    err = py.run("class B:\n    def __repr__(self):\n        raise RuntimeError('no repr')\nB()")["error"]
    assert err["name"] == "RuntimeError" and "__repr__" in err["traceback"]


def test_output_is_capped_to_fit_a_response_line(py: SessionProcess) -> None:
    r = py.run("import os\nos.write(1, bytes(range(32)) * (600 * 1024))\nNone")  # ~19 MiB of control chars
    line_len = len(json.dumps(r, ensure_ascii=False).encode())
    assert r["stdout_truncated"] is True and line_len <= 25 * 1024 * 1024
    r = py.run("print('ok')")
    assert r["stdout"] == "ok\n" and "stdout_truncated" not in r
    r = py.run("'\\x00' * (8 * 1024 * 1024)")  # a huge repr is cut too
    assert len(json.dumps(r, ensure_ascii=False).encode()) <= 5 * 1024 * 1024
    assert r["result"].startswith("'\\x00")


def test_python_large_output_and_code(py: SessionProcess) -> None:
    r = py.run("print('x' * 3_000_000)")
    assert len(r["stdout"]) == 3_000_001
    code = "y = " + repr("z" * 400_000) + "\nlen(y)"
    assert py.run(code)["result"] == "400000"


def test_python_initial_env_and_cwd(tmp_path) -> None:
    s = SessionProcess("python", cwd=str(tmp_path), env={"FOO": "bar", "PATH": os.environ["PATH"]})
    try:
        assert s.run("import os\n(os.getcwd(), os.environ['FOO'])")["result"] == repr((str(tmp_path), "bar"))
        assert not os.listdir(tmp_path)  # nothing written to the filesystem
    finally:
        s.stop()


def test_python_numeric_thread_pools_default_to_one_thread_unless_set(tmp_path) -> None:
    # A copy of a session is a raw clone of one thread: a BLAS pool started in the original
    # would be missing in every copy (the copy hangs on its first matrix product).
    s = SessionProcess("python", cwd=str(tmp_path), env={"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "4"})
    try:
        got = s.run("import os\n[os.environ.get(k) for k in ('OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS')]")
        assert got["result"] == repr(["1", "1", "4"])
    finally:
        s.stop()


# ----------------------------------------------------------------------------- shell kind


def test_shell_persistence(sh: SessionProcess, tmp_path) -> None:
    assert sh.run("pwd; echo $START") == {"stdout": "%s\nyes\n" % tmp_path, "stderr": "", "exit_code": 0}
    r = sh.run("mkdir -p sub && cd sub\nX=1\nexport Y='two words'\ngreet() { echo \"hello $1\"; }")
    assert r == {"stdout": "", "stderr": "", "exit_code": 0}
    r = sh.run("pwd\necho \"$X|$Y\"\ngreet you\nsh -c 'echo child:$Y:$X'")
    assert r["stdout"] == "%s/sub\n1|two words\nhello you\nchild:two words:\n" % tmp_path
    assert r["stderr"] == "" and r["exit_code"] == 0
    r = sh.run("cd ..; unset Y; unset -f greet; export START=no")
    r = sh.run("pwd; echo \"[$Y]\"; type greet >/dev/null 2>&1 || echo nofunc; env | grep -c '^Y=' ; echo $START")
    assert r["stdout"] == "%s\n[]\nnofunc\n0\nno\n" % tmp_path


def test_shell_rich_state_restores_silently(sh: SessionProcess) -> None:
    setup = (
        "declare -a arr=(a 'b c' $'d\\ne')\n"
        "declare -A map=([k]=v [sp ace]=\"q'uote\")\n"
        "declare -i n=41\n"
        "declare -l lower=ABC\n"
        "readonly RO=fixed\n"
        "ml=$'line1\\nline2'\n"
        "target=t; declare -n ref=target\n"
        "export -f f 2>/dev/null; f() { echo exported-f; }; export -f f\n"
        "IFS=:\n"
    )
    assert sh.run(setup) == {"stdout": "", "stderr": "", "exit_code": 0}
    for _ in range(2):  # restoring twice must be as clean as once
        r = sh.run(
            "n+=1; echo $n; echo \"${arr[1]}|${arr[2]}\"; echo \"${map[sp ace]}\"; echo $lower; echo $RO;"
            " echo \"$ml\"; echo $ref; bash -c f; printf '%q\\n' \"$IFS\"; n=41"
        )
        assert r["stderr"] == ""
        assert r["exit_code"] == 0
        assert r["stdout"] == "42\nb c|d\ne\nq'uote\nabc\nfixed\nline1\nline2\nt\nexported-f\n:\n"


def test_shell_no_noise_from_special_variables(sh: SessionProcess) -> None:
    r = sh.run("RANDOM=4; SECONDS=10; BASH_XTRACEFD=2; set -u; set -e; set -x; set -o pipefail; true")
    assert r["exit_code"] == 0
    assert r["stderr"] == "+ set -o pipefail\n+ true\n"  # only the user's own trace, nothing from the state dump
    r = sh.run("echo ok")
    assert r == {"stdout": "ok\n", "stderr": "", "exit_code": 0}  # options do not persist


def test_shell_exit_codes(sh: SessionProcess) -> None:
    assert sh.run("false")["exit_code"] == 1
    assert sh.run("true")["exit_code"] == 0
    assert sh.run("(exit 7)")["exit_code"] == 7
    r = sh.run("K=before_exit; exit 3; echo never")
    assert r["exit_code"] == 3 and r["stdout"] == ""
    assert sh.run("echo $K")["stdout"] == "before_exit\n"  # state dumped even on exit
    assert sh.run("nosuchcommand_xyz")["exit_code"] == 127
    assert sh.run("kill -TERM $$")["exit_code"] == 128 + 15
    r = sh.run("set -e; E=1; false; E=2")
    assert r["exit_code"] == 1
    assert sh.run("echo $E")["stdout"] == "1\n"


def test_shell_syntax_error(sh: SessionProcess) -> None:
    r = sh.run("if true; then")
    assert r["exit_code"] == 2 and "syntax error" in r["stderr"]
    assert sh.run("echo fine")["stdout"] == "fine\n"


def test_shell_user_exit_trap_and_exec(sh: SessionProcess) -> None:
    r = sh.run("trap 'echo bye' EXIT; T=1")
    assert r["stdout"] == "bye\n" and r["exit_code"] == 0
    assert sh.run("echo $T")["stdout"] == "1\n"  # state kept although the trap was replaced
    sh.run("V=old")
    r = sh.run("V=new; exec echo replaced")
    assert r["stdout"] == "replaced\n"
    assert sh.run("echo $V")["stdout"] == "old\n"  # an exec'd run cannot dump: previous state kept


def test_shell_output_capture_and_background(sh: SessionProcess) -> None:
    r = sh.run("echo out; echo err >&2; printf 'no-nl'")
    assert (r["stdout"], r["stderr"]) == ("out\nno-nl", "err\n")
    t0 = time.monotonic()
    r = sh.run("sleep 30 & echo started $!")
    assert r["stdout"].startswith("started ") and time.monotonic() - t0 < 10  # no wait for bg jobs
    os.kill(int(r["stdout"].split()[1]), 9)
    assert sh.run("read line; echo \"[$line] $?\"")["stdout"] == "[] 1\n"  # stdin is /dev/null


def test_shell_lineno_matches_user_code(sh: SessionProcess) -> None:
    r = sh.run("echo $LINENO\necho $LINENO\nnosuch_cmd_here")
    assert r["stdout"] == "1\n2\n"
    assert "line 3: nosuch_cmd_here" in r["stderr"]


def test_shell_large_code_goes_through_memfd(sh: SessionProcess) -> None:
    code = "BIG=%s\necho ${#BIG}\n" % ("a" * 200_000)
    r = sh.run(code)
    assert r["stdout"] == "200000\n" and r["exit_code"] == 0 and r["stderr"] == ""
    assert sh.run("echo ${#BIG}")["stdout"] == "200000\n"


def test_shell_deleted_cwd(sh: SessionProcess, tmp_path) -> None:
    sh.run("mkdir gone && cd gone")
    os.rmdir(tmp_path / "gone")
    r = sh.run("pwd")
    assert r["exit_code"] == 0 and r["stdout"] == "/\n"


def test_shell_idle_state(sh: SessionProcess) -> None:
    sh.run("X=1; cd /")
    assert _fds(sh.proc.pid) == {0, 1, 2, 3}
    assert _threads(sh.proc.pid) == 1


def test_sh_fallback(tmp_path) -> None:
    """Without bash, /bin/sh keeps exported variables and cwd (degraded persistence)."""
    driver = (
        "import json, sys\n"
        "ns = {'__name__': 'bb_session_server'}\n"
        "exec(compile(sys.stdin.read(), 'srv', 'exec'), ns)\n"
        "k = ns['ShellKernel']()\n"
        "k.shell, k.bash = '/bin/sh', False\n"
        "out = [k.run(\"mkdir d; cd d; export A='x y'; unset KEEP; echo hi\"),\n"
        "       k.run('pwd; echo \"$A|${KEEP:-unset}\"; exit 4'),\n"
        "       k.run('echo $A; echo err >&2')]\n"
        "print(json.dumps(out))\n"
    )
    env = {"PATH": os.environ["PATH"], "KEEP": "k"}
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", driver], input=SERVER_SOURCE, cwd=str(tmp_path),
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    r1, r2, r3 = json.loads(proc.stdout)
    assert r1 == {"stdout": "hi\n", "stderr": "", "exit_code": 0}
    assert r2 == {"stdout": "%s/d\nx y|unset\n" % tmp_path, "stderr": "", "exit_code": 4}
    assert r3 == {"stdout": "x y\n", "stderr": "err\n", "exit_code": 0}


# ----------------------------------------------------------------------------- fork


def _fork(s: SessionProcess):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        parent_resp = s.request({"op": "fork", "id": 1}, fds=[theirs.fileno()])
    finally:
        theirs.close()
    child = SessionClient(ours)
    child_resp = child.recv()
    return parent_resp, child, child_resp


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """Exited: reaped, or a zombie. Templates and restored sessions are children of the
    server's parent (init in a sandbox, this test process here), which reaps them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    os.waitpid(pid, os.WNOHANG)
                    return True
        except FileNotFoundError:
            return True
        except ChildProcessError:
            return True
        time.sleep(0.02)
    return False


def test_fork_python(py: SessionProcess) -> None:
    py.run("state = ['base']\nimport os")
    parent_resp, child, child_resp = _fork(py)
    pid = parent_resp["child"]
    assert parent_resp == {"ok": True, "child": pid, "id": 1}
    assert child_resp == {"ok": True, "pid": pid, "id": 1}
    assert pid != py.proc.pid
    # both serve, with independent state
    assert child.run("state.append('child')\nstate")["result"] == "['base', 'child']"
    assert py.run("state.append('parent')\nstate")["result"] == "['base', 'parent']"
    assert child.run("os.getpid()")["result"] == str(pid)
    assert child.run("print('c')")["stdout"] == "c\n"
    assert _fds(pid) == {0, 1, 2, 3} and _fds(py.proc.pid) == {0, 1, 2, 3}
    # closing the child's channel ends it; the parent reaps it on its next request
    child.close()
    py.request({"op": "ping"})
    assert _gone(pid)
    assert py.run("state")["result"] == "['base', 'parent']"


def test_fork_shell_and_nested(sh: SessionProcess) -> None:
    sh.run("S=base; cd /tmp")
    parent_resp, child, child_resp = _fork(sh)
    assert child_resp["pid"] == parent_resp["child"]
    assert child.run("S=child; cd /; echo $S")["stdout"] == "child\n"
    assert sh.run("echo $S; pwd")["stdout"] == "base\n/tmp\n"
    assert child.run("echo $S; pwd")["stdout"] == "child\n/\n"
    # the child can fork again
    ours, theirs = socket.socketpair()
    r = child.request({"op": "fork"}, fds=[theirs.fileno()])
    theirs.close()
    grandchild = SessionClient(ours)
    assert grandchild.recv()["pid"] == r["child"]
    assert grandchild.run("echo $S")["stdout"] == "child\n"
    grandchild.close()
    child.close()
    assert sh.request({"op": "ping"})["ok"]


def test_fork_fd_handling(py: SessionProcess) -> None:
    r = py.request({"op": "fork"})
    assert r["error"]["name"] == "ProtocolError"
    # extra fds are closed, fds sent with other ops are closed too
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    r = py.request({"op": "fork"}, fds=[b.fileno(), d.fileno()])
    b.close(), d.close()
    child = SessionClient(a)
    assert child.recv()["pid"] == r["child"]
    e, f = socket.socketpair()
    assert py.request({"op": "ping"}, fds=[f.fileno()])["ok"]
    f.close()
    assert _fds(py.proc.pid) == {0, 1, 2, 3}
    assert _fds(r["child"]) == {0, 1, 2, 3}
    for s in (child, c, e):
        s.close()


# ----------------------------------------------------------------------------- checkpoint / rollback roles


@pytest.fixture
def forks():
    """fork(session, role=None) -> (parent response, child client, child response); every
    forked process is killed at teardown (templates call setsid: they outlive their parent)."""
    clients, pids = [], []

    def fork(s: SessionClient, role=None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        req = {"op": "fork", "id": 1}
        if role is not None:
            req["role"] = role
        try:
            parent_resp = s.request(req, fds=[theirs.fileno()])
        finally:
            theirs.close()
        child = SessionClient(ours)
        clients.append(child)
        assert parent_resp.get("ok") is True, parent_resp
        pids.append(parent_resp["child"])
        child_resp = child.recv()
        if role == "restore":
            # A restored session re-resolves its cwd and files before its next request.
            ping = child.request({"op": "ping"})
            child_resp["reopened"] = ping.get("reopened", 0)
        return parent_resp, child, child_resp

    yield fork
    for c in clients:
        c.close()
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.fixture
def rootfs_tmp(tmp_path):
    """A tmp dir on the filesystem of "/" (only such files are reopened on restore)."""
    if os.stat(str(tmp_path)).st_dev != os.stat("/").st_dev:
        pytest.skip("the tmp dir is not on the root filesystem")
    return tmp_path


_DUMPABLE = "import ctypes\nctypes.CDLL(None).prctl(3, 0, 0, 0, 0)"  # PR_GET_DUMPABLE


def test_template_stays_frozen_while_parent_changes(py: SessionProcess, forks) -> None:
    py.run("import os\nstate = ['base']\nx = 1")
    parent_resp, tmpl, tmpl_resp = forks(py, "template")
    pid = parent_resp["child"]
    assert parent_resp == {"ok": True, "child": pid, "id": 1}
    assert tmpl_resp == {"ok": True, "pid": pid, "role": "template", "id": 1}
    py.run("state.append('parent')\nx = 2")
    assert py.run("(state, x)")["result"] == "(['base', 'parent'], 2)"
    assert tmpl.run("(state, x, os.getpid())")["result"] == "(['base'], 1, %d)" % pid
    assert _fds(pid) == {0, 1, 2, 3} and _fds(py.proc.pid) == {0, 1, 2, 3}
    assert _threads(pid) == 1


def test_restore_twice_gives_independent_sessions(py: SessionProcess, forks) -> None:
    py.run("import os\nstate = ['base']")
    _, tmpl, _ = forks(py, "template")
    py.run("state.append('parent')")
    children = []
    for _ in range(2):
        parent_resp, child, child_resp = forks(tmpl, "restore")
        pid = parent_resp["child"]
        assert parent_resp == {"ok": True, "child": pid, "id": 1}  # the template's answer
        assert child_resp == {"ok": True, "pid": pid, "role": "restore", "reopened": 0, "id": 1}
        assert child.run("os.getpid()")["result"] == str(pid)
        children.append(child)
    a, b = children
    assert a.run("state.append('a')\nstate")["result"] == "['base', 'a']"
    assert b.run("state")["result"] == "['base']"
    assert b.run("state.append('b')\nstate")["result"] == "['base', 'b']"
    assert a.run("state")["result"] == "['base', 'a']"
    assert py.run("state")["result"] == "['base', 'parent']"
    # the template is unchanged and forks again; a restored session forks like any session
    _, c, _ = forks(tmpl, "restore")
    assert c.run("state")["result"] == "['base']"
    _, grandchild, resp = forks(a, None)
    assert set(resp) == {"ok", "pid", "id"}
    assert grandchild.run("state")["result"] == "['base', 'a']"


def test_template_and_restored_sessions_are_children_of_the_servers_parent(py: SessionProcess, forks) -> None:
    # A session process never has another session process below it: a process image of a
    # template then holds the template alone, and never a live session forked from it.
    _, tmpl, _ = forks(py, "template")
    tmpl_pid = tmpl.request({"op": "ping"})["pid"]
    parent_resp, child, _ = forks(tmpl, "restore")
    for pid in (tmpl_pid, parent_resp["child"]):
        with open("/proc/%d/stat" % pid) as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        assert ppid == os.getpid(), (pid, ppid)
    assert child.run("1 + 1")["result"] == "2"


def test_rechannel_moves_the_channel_into_an_internal_pair(py: SessionProcess) -> None:
    py.run("x = 41")
    resp = py.request({"op": "rechannel"})
    peer = resp["peer_fd"]
    assert resp["ok"] is True and peer > 3
    # The old channel is gone; the held end is the way in (what the daemon takes after a restore).
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(py.proc.pid) if hasattr(os, "pidfd_open") else libc.syscall(434, py.proc.pid, 0)
    fd = libc.syscall(438, pidfd, peer, 0)
    assert fd >= 0, ctypes.get_errno()
    client = SessionClient(socket.socket(fileno=fd))
    assert client.request({"op": "run", "code": "x + 1"})["result"] == "42"
    # the held end was closed at that request: only our copy keeps the channel open
    assert not os.path.exists("/proc/%d/fd/%d" % (py.proc.pid, peer))
    client.close()


def test_template_and_restored_sessions_have_own_process_groups(py: SessionProcess, forks) -> None:
    # The next fork child sleeps in an at-fork hook before any of the server's own code runs.
    py.run("import os, time\nslow = [1]\nos.register_at_fork(after_in_child=lambda: slow and (slow.pop(), time.sleep(0.5)))")
    ours, theirs = socket.socketpair()
    parent_resp = py.request({"op": "fork", "role": "template"}, fds=[theirs.fileno()])
    theirs.close()
    tmpl_pid = parent_resp["child"]
    tmpl = SessionClient(ours)
    try:
        # In a process group of its own as soon as the parent answered, before the child ran:
        # the daemon may kill the live session's group right after that answer.
        assert os.getpgid(tmpl_pid) == tmpl_pid
        assert os.getpgid(py.proc.pid) != tmpl_pid
        py.run("slow.clear()")
        # frozen once the template answered on its own channel (the daemon swaps the root
        # filesystem only after that answer)
        assert tmpl.recv()["role"] == "template"
        assert os.getpgid(tmpl_pid) == tmpl_pid
        _, child, resp = forks(tmpl, "restore")
        pid = resp["pid"]
        assert os.getpgid(pid) == pid
        # killing a live session's process group (with its user processes) spares the template
        sleeper = int(child.run("import subprocess\np = subprocess.Popen(['sleep', '60'])\np.pid")["result"])
        assert os.getpgid(sleeper) == pid
        os.killpg(pid, 9)
        assert _gone(pid) and _gone(sleeper)
        assert tmpl.request({"op": "ping"})["pid"] == tmpl_pid
        _, again, resp = forks(tmpl, "restore")
        assert again.run("os.getpid()")["result"] == str(resp["pid"])
        # a plain fork stays in its parent's session and process group
        _, plain, resp = forks(py)
        assert os.getsid(resp["pid"]) == os.getsid(py.proc.pid)
        assert os.getpgid(resp["pid"]) == os.getpgid(py.proc.pid)
    finally:
        tmpl.close()
        try:
            os.kill(tmpl_pid, 9)
        except ProcessLookupError:
            pass


def test_dumpable_flag(py: SessionProcess, forks) -> None:
    _, tmpl, _ = forks(py, "template")
    _, child, _ = forks(tmpl, "restore")
    assert py.run(_DUMPABLE)["result"] == "1"
    assert tmpl.run(_DUMPABLE)["result"] == "0"
    assert child.run(_DUMPABLE)["result"] == "1"


def test_restore_reopens_files_by_path(rootfs_tmp, forks) -> None:
    log, data, gone = rootfs_tmp / "log.txt", rootfs_tmp / "data.bin", rootfs_tmp / "unlinked"
    log.write_text("start\n")
    data.write_bytes(b"hello world!")
    py = SessionProcess("python", cwd=str(rootfs_tmp), env={"PATH": os.environ["PATH"]})
    try:
        py.run(
            "import os, socket\n"
            "f = open('log.txt', 'a')\n"
            "f.write('parent-before\\n'); f.flush()\n"
            "g = os.open('data.bin', os.O_RDWR)\n"
            "os.lseek(g, 6, os.SEEK_SET)\n"
            "os.set_inheritable(g, True)\n"
            "h = open('unlinked', 'w'); os.unlink('unlinked')\n"  # deleted: not recorded
            "v = open('/proc/version')\n"  # another filesystem: not recorded
            "s = socket.socket()\n"
        )
        fds = _fds(py.proc.pid)
        assert len(fds) == 9
        tmpl_resp, tmpl, _ = forks(py, "template")
        tmpl_pid = tmpl_resp["child"]
        assert _fds(tmpl_pid) == fds
        py.run("f.write('parent-after\\n'); f.flush()")

        _, a, resp = forks(tmpl, "restore")
        assert resp["reopened"] == 2
        assert _fds(resp["pid"]) == fds  # same fd numbers
        r = a.run(
            "import fcntl\n"
            "fl = [fcntl.fcntl(n, fcntl.F_GETFL) for n in (f.fileno(), g)]\n"
            "f.write('restored-a\\n'); f.flush()\n"
            "os.write(g, b'WORLD')\n"
            "(os.get_inheritable(f.fileno()), os.get_inheritable(g), os.lseek(g, 0, os.SEEK_CUR), v.read()[:5],\n"
            " [(x & (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK)) for x in fl])"
        )
        assert r["result"] == "(False, True, 11, 'Linux', [%d, %d])" % (os.O_WRONLY | os.O_APPEND, os.O_RDWR), r
        assert log.read_text() == "start\nparent-before\nparent-after\nrestored-a\n"
        assert data.read_bytes() == b"hello WORLD!"

        # the files are replaced by new inodes at the same paths (what a rollback's new
        # root filesystem looks like): a restored session writes into the new ones
        for path, content in ((log, b"new\n"), (data, b"0123456789ab")):
            tmp = path.with_name(path.name + ".new")
            tmp.write_bytes(content)
            os.replace(tmp, path)
        _, b, resp = forks(tmpl, "restore")
        assert resp["reopened"] == 2
        b.run("f.write('restored-b\\n'); f.flush()\nos.write(g, b'WORLD')")
        assert log.read_text() == "new\nrestored-b\n"
        assert data.read_bytes() == b"012345WORLDb"
        # the live session and the template keep the old (now unlinked) inode
        py.run("f.write('parent-late\\n'); f.flush()")
        assert log.read_text() == "new\nrestored-b\n"
        f_fd = int(py.run("f.fileno()")["result"])
        assert os.readlink("/proc/%d/fd/%d" % (tmpl_pid, f_fd)) == str(log) + " (deleted)"

        # a path that is gone keeps the old open file
        os.unlink(log)
        _, c, resp = forks(tmpl, "restore")
        assert resp["reopened"] == 1
        r = c.run("f.write('into-the-void\\n'); f.flush()\nos.lseek(g, 0, os.SEEK_CUR)")
        assert r["error"] is None and r["result"] == "6"
        assert not log.exists()
    finally:
        py.stop()


def test_template_rebases_parent_cwd(rootfs_tmp, forks) -> None:
    work, old = rootfs_tmp / "work", rootfs_tmp / "old"
    work.mkdir()
    py = SessionProcess("python", cwd=str(rootfs_tmp), env={"PATH": os.environ["PATH"]})
    try:
        py.run("import os\nos.chdir('work')")
        _, tmpl, _ = forks(py, "template")
        # the rootfs swap, simulated: the directory moves away, a new one takes its path
        os.rename(work, old)
        work.mkdir()
        # a second checkpoint before any run records the path, not the moved directory
        _, tmpl2, _ = forks(py, "template")
        r = py.run("open('here.txt', 'w').close()\nos.getcwd()")
        assert r["result"] == repr(str(work))
        assert (work / "here.txt").exists() and not (old / "here.txt").exists()
        # the template stays where it was; restored sessions chdir by path
        assert os.readlink("/proc/%d/cwd" % int(tmpl.run("os.getpid()")["result"])) == str(old)
        for t in (tmpl, tmpl2):
            _, child, _ = forks(t, "restore")
            assert child.run("os.getcwd()")["result"] == repr(str(work))
        # a plain fork does not rebase (control)
        forks(py)
        os.rename(work, rootfs_tmp / "old2")
        work.mkdir()
        assert py.run("os.getcwd()")["result"] == repr(str(rootfs_tmp / "old2"))
    finally:
        py.stop()


def test_template_rebase_cwd_fallback(tmp_path, forks) -> None:
    work = tmp_path / "work"
    work.mkdir()
    py = SessionProcess("python", cwd=str(work), env={"PATH": os.environ["PATH"]})
    try:
        _, tmpl, _ = forks(py, "template")
        os.rmdir(work)
        assert py.run("import os\nos.getcwd()")["result"] == "'/'"
        _, child, _ = forks(tmpl, "restore")
        assert child.run("import os\nos.getcwd()")["result"] == "'/'"
    finally:
        py.stop()


def test_template_restore_shell(sh: SessionProcess, tmp_path, forks) -> None:
    (tmp_path / "work").mkdir()
    sh.run("S=base; cd work")
    _, tmpl, _ = forks(sh, "template")
    os.rename(tmp_path / "work", tmp_path / "old")
    (tmp_path / "work").mkdir()
    assert sh.run("S=parent; pwd; echo x > here")["stdout"] == "%s/work\n" % tmp_path
    assert (tmp_path / "work" / "here").exists()
    for _ in range(2):
        _, child, resp = forks(tmpl, "restore")
        assert resp["reopened"] == 0
        assert child.run("echo $S; pwd; S=child")["stdout"] == "base\n%s/work\n" % tmp_path
    assert sh.run("echo $S")["stdout"] == "parent\n"


def test_restore_on_a_plain_session(py: SessionProcess, forks) -> None:
    py.run("import os\nx = 7")
    parent_resp, child, resp = forks(py, "restore")
    assert resp == {"ok": True, "pid": parent_resp["child"], "role": "restore", "reopened": 0, "id": 1}
    assert os.getpgid(resp["pid"]) == resp["pid"]
    assert child.run("x")["result"] == "7"
    assert child.run(_DUMPABLE)["result"] == "1"


def test_plain_fork_response_unchanged(py: SessionProcess, forks) -> None:
    parent_resp, child, resp = forks(py)
    assert resp == {"ok": True, "pid": parent_resp["child"], "id": 1}
    ours, theirs = socket.socketpair()
    r = py.request({"op": "fork", "role": None}, fds=[theirs.fileno()])  # null role: plain fork
    theirs.close()
    c = SessionClient(ours)
    try:
        assert c.recv() == {"ok": True, "pid": r["child"]}
    finally:
        c.close()


@pytest.mark.parametrize("role", ["bogus", "", 1, ["template"]])
def test_unknown_fork_role_rejected(py: SessionProcess, role) -> None:
    ours, theirs = socket.socketpair()
    r = py.request({"op": "fork", "role": role, "id": 9}, fds=[theirs.fileno()])
    theirs.close()
    assert r["error"]["name"] == "ProtocolError" and r["id"] == 9
    ours.settimeout(10)
    assert ours.recv(1) == b""  # the fd was closed, no child
    ours.close()
    assert _fds(py.proc.pid) == {0, 1, 2, 3}
    assert py.request({"op": "fork", "role": "template"})["error"]["name"] == "ProtocolError"  # no fd
    assert py.request({"op": "ping"})["ok"] is True


# ----------------------------------------------------------------------------- javascript kind


@pytest.fixture
def js(tmp_path):
    # A group of its own, as in a sandbox (a SIGINT to the session reaches node too).
    s = SessionProcess("javascript", cwd=str(tmp_path), env={"PATH": os.environ["PATH"]}, preexec_fn=os.setsid)
    yield s
    s.stop()


def _children(server_pid):
    with open("/proc/%d/task/%d/children" % (server_pid, server_pid)) as f:
        return [int(p) for p in f.read().split()]


def test_javascript_state_output_results_and_errors(js: SessionProcess, tmp_path) -> None:
    assert js.run("let x = 40; function twice(n) { return 2 * n }\nx + 2") == {
        "stdout": "", "stderr": "", "result": "42", "error": None, "displays": [], "execution_count": 1,
    }
    r = js.run("console.log('hi', {a: [1]}); console.error('oops'); process.stdout.write('raw'); twice(x)")
    assert (r["stdout"], r["stderr"], r["result"], r["execution_count"]) == ("hi { a: [ 1 ] }\nraw", "oops\n", "80", 2)
    assert js.run("'text'")["result"] == "'text'" and js.run("undefined")["result"] is None
    err = js.run("function bad() { null.x }\nbad()")["error"]
    assert err["name"] == "TypeError" and "reading 'x'" in err["value"]
    # The traceback is the cell's, without the server's frames.
    assert "at bad (<cell 5>:1:" in err["traceback"] and "[eval]" not in err["traceback"] and "node:vm" not in err["traceback"]
    thrown = js.run("throw 'plain'")["error"]
    assert thrown["name"] == "Error" and "plain" in thrown["value"]
    # An error does not lose the scope; require works; the cwd is the session's.
    assert js.run("x")["result"] == "40"
    assert js.run("require('path').join(process.cwd(), 'x')")["result"] == repr(str(tmp_path / "x"))


def test_javascript_runs_may_declare_the_names_the_runner_uses(js: SessionProcess) -> None:
    # The runner's own names (fs, util, vm, count, handle...) are not in the global scope.
    r = js.run("const fs = require('fs'); let count = 3; var util = 1; function handle() { return 'mine' }\ntypeof fs.readFileSync")
    assert (r["result"], r["error"]) == ("'function'", None), r
    assert js.run("[count, util, handle()]")["result"] == "[ 3, 1, 'mine' ]"  # and the runner still works


def test_javascript_top_level_await_and_run_env(js: SessionProcess) -> None:
    assert js.run("await new Promise((r) => setTimeout(() => r(7), 5))")["result"] == "7"
    assert js.run("const v = await Promise.resolve(5)\nv * 2;")["result"] == "10"
    r = js.run("for (const i of [1, 2]) {\n  await null\n}")
    assert r["error"] is None and r["result"] is None
    assert js.run("await Promise.reject(new RangeError('no'))")["error"]["name"] == "RangeError"
    assert js.request({"op": "run", "code": "process.env.ONLY_NOW", "env": {"ONLY_NOW": "yes"}})["result"] == "'yes'"
    assert js.run("process.env.ONLY_NOW")["result"] is None


def test_javascript_sigint_interrupts_the_run_not_the_kernel(js: SessionProcess) -> None:
    js.run("let kept = 'still here'")
    for code in ("while (true) {}", "await new Promise(() => {})"):
        js.send({"op": "run", "code": code})
        time.sleep(0.5)
        os.killpg(js.proc.pid, signal.SIGINT)  # what the daemon sends to interrupt a session
        r = js.recv(timeout=10)
        assert r["error"] is not None and "interrupted" in r["error"]["value"].lower(), r
        assert js.run("kept")["result"] == "'still here'"
    # A SIGINT while idle is dropped by both.
    os.killpg(js.proc.pid, signal.SIGINT)
    time.sleep(0.2)
    assert js.run("kept")["result"] == "'still here'"


def test_javascript_copies_carry_the_global_scope(js: SessionProcess, tmp_path) -> None:
    (tmp_path / "mod.js").write_text("exports.twice = (x) => 2 * x;\n")
    r = js.run(
        "let n = 1; const cfg = {deep: [1, {x: new Map([['k', new Date(0)]])}]}; var shared = cfg.deep;\n"
        "class Point { constructor(x) { this.x = x } norm() { return Math.abs(this.x) } }\n"
        "class Point3 extends Point { z() { return 3 } }\n"
        "function add(a) { return a + n }\n"
        "const fs = require('fs'); const {readFileSync} = require('fs'); const mod = require('./mod.js');\n"
        "const p = new Point(-4); const bytes = new Uint8Array([1, 2, 3]);\n"
        "const counter = (() => { let i = 0; return () => ++i })(); const big = 10n; var util = 'mine';"
    )
    assert r["error"] is None, r
    (node,) = _children(js.proc.pid)
    parent_resp, child, _ = _fork(js)
    try:
        # The copy holds nothing of the original's node (no fds but 0-3) and starts its own.
        assert _fds(parent_resp["child"]) == {0, 1, 2, 3}
        r = child.run(
            "JSON.stringify([n, add(2), cfg.deep[1].x.get('k').getTime(), shared === cfg.deep, p instanceof Point,"
            " p.norm(), new Point3(1).z(), typeof fs.statSync, readFileSync === fs.readFileSync, mod.twice(4),"
            " bytes[2], String(big)])"
        )
        assert r["error"] is None and r["stderr"] == "", r
        assert json.loads(eval(r["result"])) == [1, 3, 0, True, True, 4, 3, "function", True, 8, 3, "10"], r
        assert r["execution_count"] == 2  # counting on from the original's
        # Functions are made again from their source: a closure over a non-global is not.
        assert child.run("counter()")["error"]["name"] == "ReferenceError"
        # A built-in module's global (`node -e` has them) a run replaced is carried as replaced.
        assert child.run("util")["result"] == "'mine'"
        # Bindings keep their kind: let stays let, const stays const.
        assert child.run("n = 5; n")["result"] == "5"
        assert child.run("cfg = 1")["error"]["name"] == "TypeError"
        assert _children(parent_resp["child"]) and _children(parent_resp["child"]) != [node]
        assert js.run("n + 1")["result"] == "2"  # the original keeps its state and its node
        assert js.run("counter()")["result"] == "1"
        assert set(_children(js.proc.pid)) == {node, parent_resp["child"]}  # a plain fork is its child
    finally:
        child.close()
    # node ends with its server.
    js.stop()
    assert _gone(node)


def test_javascript_copies_say_what_they_could_not_carry(js: SessionProcess) -> None:
    r = js.run("const ok = 1; const sock = new (require('net').Socket)(); const bound = Math.max.bind(null); const addr = new URL('http://x/')")
    assert r["error"] is None, r
    assert js.run("const huge = 'x'.repeat(20 << 20); 1")["error"] is None
    assert js.run("let tdz = (() => { throw new Error('no') })()")["error"]["value"] == "no"  # tdz is never set
    parent_resp, child, _ = _fork(js)
    try:
        r = child.run("[ok, typeof sock, typeof bound, typeof huge, typeof addr]")
        assert r["result"] == "[ 1, 'undefined', 'undefined', 'undefined', 'undefined' ]", r
        err = r["stderr"]
        assert err.startswith("[branchbox] this javascript context is a copy") and err.count("\n") == 1, err
        assert "sock (cannot be copied" in err and "bound (a function without source" in err, err
        assert "addr (cannot be copied: a URL (node's own object))" in err, err
        assert "huge (too large to copy" in err and "tdz (never initialised)" in err and "ok (" not in err, err
        assert child.run("1")["stderr"] == ""  # said once
        # A copy of the copy, before it ran anything, carries the same.
        _, grandchild, _ = _fork(child)
        try:
            assert grandchild.run("ok")["result"] == "1"
        finally:
            grandchild.close()
    finally:
        child.close()


def test_javascript_copy_of_a_session_that_never_ran_says_nothing(js: SessionProcess) -> None:
    parent_resp, child, _ = _fork(js)
    try:
        r = child.run("1 + 1")
        assert (r["result"], r["stderr"]) == ("2", ""), r
    finally:
        child.close()


def test_javascript_without_node_says_what_to_install(tmp_path) -> None:
    s = SessionProcess("javascript", cwd=str(tmp_path), env={"PATH": str(tmp_path)})
    try:
        with pytest.raises((EOFError, ConnectionResetError)):
            s.request({"op": "ping"}, timeout=10)
        assert "javascript sessions need node in the image" in s.proc.stderr.read().decode()
    finally:
        s.stop()


# ----------------------------------------------------------------------------- typescript kind

# Where the session server's node runner looks for the `typescript` package after `require`'s
# own lookup (`make` installs Debian's node-typescript on the host).
TS_PLACES = ("/usr/share/nodejs", "/usr/local/lib/node_modules", "/usr/lib/node_modules")


@pytest.fixture
def ts(tmp_path):
    if not any(os.path.isfile(os.path.join(d, "typescript", "package.json")) for d in TS_PLACES):
        pytest.skip("no typescript package in %s: apt-get install node-typescript" % (TS_PLACES,))
    s = SessionProcess("typescript", cwd=str(tmp_path), env={"PATH": os.environ["PATH"]}, preexec_fn=os.setsid)
    yield s
    s.stop()


def test_typescript_types_are_stripped_and_declarations_kept(ts: SessionProcess) -> None:
    r = ts.run("interface P { x: number }\nenum Color { Red, Green }\nconst p: P = { x: 40 }\nfunction twice<T extends number>(n: T): number { return 2 * n }\np.x + Color.Green")
    assert (r["result"], r["error"], r["execution_count"]) == ("41", None, 1), r
    assert ts.run("twice(p.x as number)")["result"] == "80"
    assert ts.run("type Only = string")["result"] is None  # types alone run nothing
    # Top-level await, as in the javascript kind; console output is the run's.
    r = ts.run("const v: number = await Promise.resolve(5)\nconsole.log('got', v)\nv * 2")
    assert (r["stdout"], r["result"]) == ("got 5\n", "10"), r
    # Not type-checked (as a transpiler): a type error runs.
    assert ts.run("const s: string = 3 as any as string; s")["result"] == "3"


def test_typescript_imports_stay_for_later_runs(ts: SessionProcess, tmp_path) -> None:
    r = ts.run("import path from 'path'\nimport * as fs from 'fs'\nimport { join as j, type ParsedPath } from 'path'\nimport type { Stats } from 'fs'\nj('a', 'b')")
    assert (r["result"], r["error"]) == ("'a/b'", None), r
    (tmp_path / "f.txt").write_text("data")
    assert ts.run("fs.readFileSync(path.join(process.cwd(), 'f.txt'), 'utf8')")["result"] == "'data'"
    assert ts.run("export const e = 1; e")["result"] == "1"  # a cell with an export still runs


def test_typescript_syntax_errors_name_the_cell_and_keep_the_scope(ts: SessionProcess) -> None:
    ts.run("let kept: string = 'here'")
    err = ts.run("const x: = 1")["error"]
    assert err["name"] == "SyntaxError" and "<cell 2>:1:10" in err["value"], err
    assert "[eval]" not in err["traceback"]
    assert ts.run("kept")["result"] == "'here'"
    err = ts.run("function bad(): void { (null as any).x }\nbad()")["error"]
    assert err["name"] == "TypeError" and "at bad (<cell 4>:" in err["traceback"], err


def test_typescript_without_the_package_says_what_to_install(tmp_path) -> None:
    # The server in a user and mount namespace of its own where the places node would find the
    # package are empty tmpfs mounts.
    wrapper = tmp_path / "python-without-typescript"
    wrapper.write_text(
        "#!/bin/sh\nexec unshare --user --map-root-user --mount sh -c '"
        'for d in %s; do [ -d "$d" ] && mount -t tmpfs none "$d"; done; exec "$0" "$@"\' %s "$@"\n'
        % (" ".join(TS_PLACES), sys.executable)
    )
    wrapper.chmod(0o755)
    s = SessionProcess("typescript", cwd=str(tmp_path), env={"PATH": os.environ["PATH"]}, python=str(wrapper))
    try:
        err = s.run("const n: number = 1; n")["error"]
        assert err["name"] == "KernelError" and "need the 'typescript' package" in err["value"], err
        assert s.run("1")["error"]["name"] == "KernelError"  # the kernel stays up and says it again
    finally:
        s.stop()
    # A javascript run with top-level await still runs there, its declarations local to it.
    js = SessionProcess("javascript", cwd=str(tmp_path), env={"PATH": os.environ["PATH"]}, python=str(wrapper))
    try:
        assert js.run("const v = await Promise.resolve(5)\nv * 2;")["result"] == "10"
        assert js.run("typeof v")["result"] == "'undefined'"
    finally:
        js.stop()


def test_javascript_await_runs_survive_a_typescript_of_another_api(tmp_path) -> None:
    # `require('typescript')` finds the cwd's node_modules first: one without the compiler API
    # (e.g. a native-only release) leaves await runs to the plain wrapping.
    pkg = tmp_path / "node_modules" / "typescript"
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text('{"name": "typescript", "main": "index.js"}')
    (pkg / "index.js").write_text("module.exports = {};")
    js = SessionProcess("javascript", cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    try:
        assert js.run("const v = await Promise.resolve(5)\nv * 2;") == {
            "stdout": "", "stderr": "", "result": "10", "error": None, "displays": [], "execution_count": 1,
        }
    finally:
        js.stop()


def test_top_level_await_runs_keep_their_declarations(ts: SessionProcess, tmp_path) -> None:
    # With the typescript package at hand, for both kinds (as the node REPL does it).
    js = SessionProcess("javascript", cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    try:
        for s in (ts, js):
            r = s.run("const v = await Promise.resolve(5)\nlet [a, b] = [1, 2], {c} = {c: 3}\nfunction f() { return v + a }\nclass K { m() { return 'k' } }")
            assert (r["result"], r["error"]) == (None, None), r  # declarations have no value
            assert s.run("[v, a, b, c, f(), new K().m()]")["result"] == "[ 5, 1, 2, 3, 6, 'k' ]"
            assert s.run("await null; v * 2;")["result"] == "10"  # the last expression's value
            assert s.run("for (const i of [1]) { await null }\ntypeof i")["result"] == "'undefined'"  # blocks stay blocks
            # `var` without a value keeps what the name has, or makes it; `let` without one is undefined.
            assert s.run("var v, fresh; let c; await null; [v, typeof fresh, c]")["result"] == "[ 5, 'undefined', undefined ]"
    finally:
        js.stop()


def test_typescript_copies_carry_the_global_scope(ts: SessionProcess) -> None:
    r = ts.run("import * as path from 'path';\nlet n: number = 1; function f(x: number): number { return x + n }")
    assert r["error"] is None, r
    parent_resp, child, _ = _fork(ts)
    try:
        r = child.run("[typeof n, f(1), path.basename('/a/b')]")
        assert r["result"] == "[ 'number', 2, 'b' ]" and r["stderr"] == "", r
        assert child.run("const m: number = 2; m")["result"] == "2"  # the new node compiles too
        assert ts.run("n + 1")["result"] == "2"
    finally:
        child.close()
