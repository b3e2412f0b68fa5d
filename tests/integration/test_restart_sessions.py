"""Sessions outlive a daemon restart: init keeps each session's channel and hands it back."""
import signal

from branchbox import Sandbox
from branchbox.sandbox_sync import Session
from conftest import URL


def test_sessions_survive_a_sigkill_restart(daemon, make_sandbox):
    s = make_sandbox(timeout=600)
    py = s.sessions.create("python")
    py.run("v = 41")
    sh = s.sessions.create("shell")
    sh.run("cd /tmp && export Z=9 && f() { echo fn$1; }")
    s.run_code("d = 'default session'")
    before = {x.id: x.kind for x in s.sessions.list()}
    try:
        daemon.stop(signal.SIGKILL)
    finally:
        daemon.start()
    s = Sandbox.connect(s.id, daemon=URL)
    after = {x.id: x.kind for x in s.sessions.list()}
    assert after == before, "sessions after the restart: %r, before: %r" % (after, before)
    sessions = {x.id: Session(s, x) for x in s.sessions.list()}
    assert sessions[py.id].run("v + 1").result == "42"
    r = sessions[sh.id].run("pwd; echo $Z; f 1")
    assert (r.stdout, r.exit_code) == ("/tmp\n9\nfn1\n", 0), r
    # /code keeps using the same default session (no new one appears).
    assert s.run_code("d").result == "'default session'"
    assert {x.id for x in s.sessions.list()} == set(before)
    # A killed session is gone for good (init drops its channel when the process exits).
    sessions[py.id].kill()
    assert py.id not in {x.id for x in s.sessions.list()}
