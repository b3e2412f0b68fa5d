"""A checkpoint must not be changed by processes that keep running across it: files they hold
open for writing are moved to the live layer (pinned), and processes whose working directory was
in the old root are moved to the same directory in the new root (crates/bb-runtime/src/checkpoint.rs,
`rebase_cwd`)."""
import time

from helpers import wait_until


def sh(raw, sid, cmd):
    r = raw.post("/v1/sandboxes/%s/commands" % sid, json={"cmd": cmd, "timeout": 30})
    assert r.status_code == 200, r.text
    return r.json()["stdout"]


def lines(raw, sid, path):
    return int(sh(raw, sid, "cat %s 2>/dev/null | wc -l" % path).strip())


def test_background_writers_cannot_change_a_snapshot(sbx, raw):
    sid = sbx.sandbox_id
    # Three writers: one appending through a relative path (its cwd), one through an fd it keeps
    # open, one creating new files in its cwd.
    sh(raw, sid, "mkdir -p /work/new")
    sh(raw, sid, "(cd /work && while true; do echo tick >> rel.log; sleep 0.02; done) >/dev/null 2>&1 & "
                 "(exec 9>>/work/fd.log; while true; do echo tick >&9; sleep 0.02; done) >/dev/null 2>&1 & "
                 "(cd /work/new && i=0; while true; do i=$((i+1)); echo x > f$i; sleep 0.02; done) >/dev/null 2>&1 &")
    wait_until(lambda: lines(raw, sid, "/work/rel.log") > 3 and lines(raw, sid, "/work/fd.log") > 3
               and int(sh(raw, sid, "ls /work/new | wc -l").strip()) > 3, what="writers running")
    r = raw.post("/v1/sandboxes/%s/checkpoint" % sid, json={})
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    at = {p: lines(raw, sid, p) for p in ("/work/rel.log", "/work/fd.log")}
    files_at = int(sh(raw, sid, "ls /work/new | wc -l").strip())
    # The writers go on, in the live layer.
    wait_until(lambda: lines(raw, sid, "/work/rel.log") > at["/work/rel.log"] + 10, what="relative writes after the checkpoint")
    wait_until(lambda: lines(raw, sid, "/work/fd.log") > at["/work/fd.log"] + 10, what="fd writes after the checkpoint")
    assert int(sh(raw, sid, "ls /work/new | wc -l").strip()) > files_at + 5
    # The snapshot holds what was there at the checkpoint (give or take the writes that raced
    # the freeze: the counts above were read just after it).
    r = raw.post("/v1/sandboxes/%s/rollback" % sid, json={"snapshot": snap})
    assert r.status_code == 200, r.text
    for p, n in at.items():
        assert lines(raw, sid, p) <= n, "%s changed after the checkpoint" % p
    assert int(sh(raw, sid, "ls /work/new | wc -l").strip()) <= files_at
    time.sleep(0.2)
    # Rollback killed the writers: nothing changes any more.
    assert lines(raw, sid, "/work/rel.log") <= at["/work/rel.log"]
