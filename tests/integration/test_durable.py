"""Durable sandboxes with real CRIU: evicted session templates restored from process images,
pause/resume (manual, at the timeout, across daemon restarts and crashes), and what happens
when CRIU is missing or an image is broken.

Tests that restart the daemon with other flags put it back as the suite runs it.
"""
import glob
import hashlib
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from branchbox import ConflictError, NotFoundError, Sandbox, Snapshots, Volume
from branchbox.sandbox_sync import health
from helpers import SOCKET, STATE, URL, e2b_sdk_env, wait_until


@pytest.fixture(scope="module", autouse=True)
def criu_present(daemon):
    pi = health(daemon=URL).get("process_images") or {}
    if not pi.get("criu"):
        if os.environ.get("MUST_WORK"):
            pytest.fail("CRIU is not available to the daemon (make deps installs it): %r" % pi)
        pytest.skip("CRIU is not available: %r" % pi)


@pytest.fixture
def restarted(daemon):
    """``restarted(extra_flags)``: the suite's daemon restarted with these flags; put back after."""
    changed = []

    def restart(extra=()):
        daemon.stop()
        daemon.start(extra=list(extra))
        changed.append(True)

    yield restart
    if changed:
        daemon.stop()
        daemon.start()


def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


def tree_search(sbx, nodes, seed):
    """An MCTS-shaped search: one checkpoint per node, a rollback to a random node before each
    expansion; every rollback must bring back the node's exact session variables and files."""
    rng = random.Random(seed)
    sbx.files.write("/root/work/log.txt", "")
    sbx.run_code("import hashlib\npath = []\nblob = bytes(range(256)) * 4096")
    root = sbx.checkpoint()
    expected = {root: ([], "")}
    restarted = []
    for i in range(nodes):
        target = rng.choice(list(expected))
        r = sbx.rollback(target)
        if r.sessions_restarted:
            restarted.append((i, target, r.raw.get("restarted")))
        path, log = expected[target]
        got = sbx.run_code("path, hashlib.sha256(blob).hexdigest()[:8]").result
        assert got == repr((path, hashlib.sha256(bytes(range(256)) * 4096).hexdigest()[:8])), (i, target, got)
        assert sha(sbx.files.read("/root/work/log.txt")) == sha(log), (i, target)
        step = rng.randrange(10_000)
        sbx.run_code("path.append(%d)" % step)
        log = log + "%d\n" % step
        sbx.files.write("/root/work/log.txt", log)
        expected[sbx.checkpoint()] = (path + [step], log)
    assert not restarted, "sessions restarted on %d of %d rollbacks: %r" % (len(restarted), nodes, restarted[:5])


def test_tree_search_with_8_templates_keeps_every_session(restarted, make_sandbox):
    restarted(["--max-templates", "8"])
    sbx = make_sandbox(timeout=0)
    tree_search(sbx, 300, seed=15)
    stats = health(daemon=URL)["process_images"]
    assert stats["images"] > 0 and stats["bytes"] > 0, stats


def test_tree_search_at_the_default_cap_keeps_every_session(make_sandbox):
    sbx = make_sandbox(timeout=0)
    tree_search(sbx, 300, seed=16)


HTTP_CHECK = (
    "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8765/hello.txt').read().decode())\""
)


def start_server(sbx):
    sbx.files.write("/srv/hello.txt", "hello from inside")
    h = sbx.commands.run("cd /srv && exec python3 -m http.server 8765 --bind 127.0.0.1", background=True)
    wait_until(lambda: sbx.commands.run(HTTP_CHECK).stdout.strip() == "hello from inside", timeout=20, what="server")
    # A session with state and a kept-alive connection to the server.
    sbx.run_code(
        "import http.client\nconn = http.client.HTTPConnection('127.0.0.1', 8765)\n"
        "conn.request('GET', '/hello.txt'); first = conn.getresponse().read().decode()\ncounter = 41"
    )
    return h.pid


def check_server(sbx, pid):
    assert sbx.commands.run(HTTP_CHECK).stdout.strip() == "hello from inside"
    procs = {p.pid: p for p in sbx.commands.list()}
    assert pid in procs and procs[pid].running, procs
    assert "http.server" in sbx.commands.run("tr '\\0' ' ' < /proc/%d/cmdline" % pid).stdout
    # The session's state, and its connection to the server, are as they were.
    assert sbx.run_code("counter += 1\ncounter").result == "42"
    assert sbx.run_code("conn.request('GET', '/hello.txt'); conn.getresponse().read().decode()").result == repr(
        "hello from inside"
    )


def test_pause_frees_the_sandbox_and_resume_brings_back_a_server_with_its_pid(make_sandbox, raw):
    sbx = make_sandbox(timeout=0)
    pid = start_server(sbx)
    before = sbx.info()
    r = sbx.pause()
    assert r.processes >= 2 and r.sessions == 1 and r.image_bytes > 0, r.raw
    info = sbx.info()
    assert info.state == "paused" and info.paused_at and info.init_pid == before.init_pid
    assert info.memory_bytes < 4 << 20, "a paused sandbox still holds %d bytes" % info.memory_bytes
    assert info.pids_current == 1, "only init runs while paused"
    assert sbx.id in {i.id: i for i in Sandbox.list(daemon=URL)} and Sandbox.list(daemon=URL)
    # Requests to a paused sandbox are refused, saying how to resume.
    resp = raw.post("/v1/sandboxes/%s/commands" % sbx.id, json={"cmd": "true"})
    assert resp.status_code == 409 and "resume" in resp.json()["error"]["message"], resp.text
    with pytest.raises(ConflictError, match="already paused"):
        sbx.pause()
    r = sbx.resume()
    assert r.processes >= 2 and r.sessions == 1 and r.sandbox.state == "running", r.raw
    check_server(sbx, pid)
    with pytest.raises(ConflictError, match="not paused"):
        sbx.resume()


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def tree_images():
    """Process images of paused sandboxes' trees (not of evicted session templates)."""
    found = set()
    for d in glob.glob(os.path.join(STATE, "images", "pi-*", "manifest.json")):
        try:
            with open(d) as f:  # written whole (renamed into place); it may be deleted since
                kind = json.load(f).get("kind")
        except FileNotFoundError:
            continue
        if kind == "sandbox-tree":
            found.add(os.path.dirname(d))
    return found


def boot_id(sbx):
    # /proc is the sandbox's own, not in its files (the files API reads its root).
    return sbx.commands.run(["cat", BOOT_ID]).stdout


def test_files_only_pause_ends_every_process_and_resumes_as_a_cold_boot(make_sandbox):
    sbx = make_sandbox(timeout=0)
    sbx.run_code("x = 'in memory'")
    bg = sbx.commands.run(["sleep", "600"], background=True)
    sbx.files.write("/root/note.txt", "on disk")
    boot = boot_id(sbx)
    r = sbx.pause(mode="filesystem")
    assert (r.mode, r.processes, r.image_bytes, r.sessions) == ("filesystem", 0, 0, 1), r.raw
    info = sbx.info()
    assert info.state == "paused" and info.pids_current == 1, info
    r = sbx.resume()
    assert r.rebooted and r.processes == 0 and r.sessions == 0, r.raw
    assert sbx.files.read("/root/note.txt") == "on disk"
    assert boot_id(sbx) != boot
    gone = sbx.run_code("x")
    assert gone.error is not None and gone.error.name == "NameError", gone
    procs = {p.pid: p for p in sbx.commands.list()}
    assert bg.pid not in procs or not procs[bg.pid].running, procs
    # A full pause resumed with reboot=True: the same cold boot, and its images are deleted
    # (after a checkpoint: the root it swaps in carries the boot id along).
    sbx.run_code("y = 1")
    sbx.checkpoint()
    boot = boot_id(sbx)
    others = tree_images()
    assert sbx.pause().image_bytes > 0
    images = tree_images() - others
    assert images
    r = sbx.resume(reboot=True)
    assert r.rebooted and r.sessions == 0, r.raw
    assert boot_id(sbx) != boot
    assert not images & tree_images(), "the images were kept"
    # A full pause and a plain resume keep the boot id.
    sbx.run_code("z = 1")
    boot = boot_id(sbx)
    sbx.pause()
    r = sbx.resume()
    assert not r.rebooted and boot_id(sbx) == boot and sbx.run_code("z").result == "1"


def test_files_only_pause_at_the_timeout_survives_a_daemon_crash(daemon, make_sandbox):
    sbx = make_sandbox(timeout=1, lifecycle={"on_timeout": "pause", "pause_mode": "filesystem"})
    sbx.files.write("/root/note.txt", "kept")
    boot = boot_id(sbx)
    wait_until(lambda: sbx.info().state == "paused", timeout=30, what="pause at the timeout")
    daemon.stop(signal.SIGKILL)
    daemon.start()
    assert Sandbox.connect(sbx.id, resume=False, daemon=URL).info().state == "paused"
    again = Sandbox.connect(sbx.id, daemon=URL)  # resumes: a cold boot
    assert again.files.read("/root/note.txt") == "kept" and boot_id(again) != boot
    assert again.run_code("1 + 1").result == "2"


def test_a_command_of_the_e2b_endpoint_ends_with_its_daemon_across_a_pause(daemon, make_sandbox):
    """A full pause keeps a command started through the E2B endpoint (its output pipes go to the
    daemon, which gives it new ones at the resume); a daemon restarted while the sandbox is paused
    has lost those pipes: the resume leaves that command out (it ended with its owner, as it would
    have had the sandbox run on) and brings back the rest."""
    import e2b

    sbx = make_sandbox(timeout=0)
    pid = start_server(sbx)
    with e2b_sdk_env(daemon):
        s = e2b.Sandbox.connect(sbx.id.replace("-", ""))
        h = s.commands.run("sleep 1000", background=True)
        assert s.pause() is True
        daemon.stop()
        daemon.start()
        s.connect()
        assert h.pid not in {p.pid for p in s.commands.list()}
        assert s.commands.run("pgrep -x sleep || true").stdout == ""
    check_server(Sandbox.connect(sbx.id, daemon=URL), pid)


def test_pause_at_the_timeout_refused_past_the_grace_keeps_the_files(restarted, make_sandbox):
    """A full pause at the timeout that stays refused (a foreground command that outlives it)
    does not let the sandbox run on forever: after --timeout-pause-grace it is paused with its
    files only (the command ends), and its resume is a cold boot with the files."""
    restarted(["--timeout-pause-grace", "2"])
    sbx = make_sandbox(timeout=0, lifecycle={"on_timeout": "pause"})
    sbx.files.write("/root/note.txt", "kept")
    boot = boot_id(sbx)
    results = {}

    def run():
        try:
            results["r"] = sbx.commands.run("sleep 600", timeout=900)
        except Exception as e:  # the command's end may break its request: either is fine
            results["e"] = e

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: "sleep 600" in sbx.commands.run("ps -eo args").stdout, what="the foreground command")
    t0 = time.monotonic()
    sbx.set_timeout(1)
    # Refused at the timeout (the command runs), tried again 2 s later and then paused so.
    wait_until(lambda: sbx.info().state == "paused", timeout=30, what="the files-only pause after the grace")
    assert time.monotonic() - t0 >= 2.5, "paused before the grace ran out"
    t.join(timeout=30)
    assert not t.is_alive()
    assert "e" in results or results["r"].exit_code != 0, results
    r = sbx.resume(timeout=0)
    assert r.rebooted, r.raw
    assert sbx.files.read("/root/note.txt") == "kept" and boot_id(sbx) != boot
    assert "sleep 600" not in sbx.commands.run("ps -eo args").stdout


def test_resume_names_an_open_file_that_is_gone(make_sandbox):
    """A file a paused process held open, deleted meanwhile by another sandbox mounting the same
    rwx volume: the resume is refused naming the file and what to do; with the file back it
    resumes, the process with it."""
    vol = Volume.create(access="rwx", daemon=URL)
    mounts = [{"volume": vol.id, "path": "/data"}]
    a, b = make_sandbox(volumes=mounts), make_sandbox(volumes=mounts)
    try:
        hold = "import time; f = open('/data/log', 'a'); f.write('a\\n'); f.flush(); time.sleep(10000)"
        pid = a.commands.run("python3 -c \"%s\"" % hold, background=True).pid
        wait_until(lambda: b.files.exists("/data/log"), what="the log file")
        a.pause()
        b.commands.run("rm /data/log")
        with pytest.raises(ConflictError) as ei:
            a.resume()
        msg = str(ei.value)
        assert "had file /data/log open" in msg and "is gone" in msg and "reboot" in msg, msg
        assert a.info().state == "paused"
        b.files.write("/data/log", "put back\n")
        r = a.resume(timeout=0)
        assert not r.rebooted and {p.pid: p for p in a.commands.list()}[pid].running
    finally:
        a.kill()
        b.kill()
        wait_until(lambda: not vol.info().mounts, what="the volume's mounts to go")
        vol.delete()


def test_paused_sandbox_survives_a_daemon_crash(daemon, make_sandbox):
    sbx = make_sandbox(timeout=0)
    pid = start_server(sbx)
    sbx.files.write("/root/note.txt", "written before the pause")
    sbx.pause()
    daemon.stop(signal.SIGKILL)
    daemon.start()
    listed = {i.id: i for i in Sandbox.list(daemon=URL)}
    assert listed[sbx.id].state == "paused", listed.get(sbx.id)
    again = Sandbox.connect(sbx.id, daemon=URL)  # resumes
    assert again.info().state == "running"
    check_server(again, pid)
    assert again.files.read("/root/note.txt") == "written before the pause"


def test_twenty_pause_resume_cycles_lose_nothing(make_sandbox):
    """Manual pauses and pauses at the timeout alternate; between them files and session
    variables change; after every resume everything written before is there."""
    sbx = make_sandbox(timeout=0, lifecycle={"on_timeout": "pause"})
    sbx.run_code("seen = []")
    # Each tick replaces the file whole (a rename), so a read never sees it half-written.
    tick = "i=0; while true; do i=$((i+1)); echo $i > /root/ticks.new; mv /root/ticks.new /root/ticks; sleep 0.05; done"
    bg = sbx.commands.run(tick, background=True)
    wait_until(lambda: sbx.files.exists("/root/ticks"), what="the first tick")
    for cycle in range(20):
        sbx.files.write("/root/cycle-%02d.txt" % cycle, "cycle %d" % cycle)
        sbx.run_code("seen.append(%d)" % cycle)
        if cycle % 2:
            sbx.pause()
        else:
            sbx.set_timeout(0.5)
            wait_until(lambda: sbx.info().state == "paused", timeout=30, what="pause at the timeout")
        assert sbx.info().pids_current == 1
        ticks = int(sbx_ticks_after_resume(sbx))
        assert ticks > 0
        assert sbx.run_code("seen").result == repr(list(range(cycle + 1)))
        for c in range(cycle + 1):
            assert sbx.files.read("/root/cycle-%02d.txt" % c) == "cycle %d" % c, (cycle, c)
        procs = {p.pid: p for p in sbx.commands.list()}
        assert procs[bg.pid].running, (cycle, procs)
    sbx.set_timeout(0)
    # The background loop kept ticking from where it was.
    first = int(sbx.files.read("/root/ticks"))
    wait_until(lambda: int(sbx.files.read("/root/ticks")) > first, timeout=10, what="ticks after resume")


def sbx_ticks_after_resume(sbx):
    r = sbx.resume(timeout=0)
    assert r.sandbox.state == "running" and r.sandbox.expires_at is None, r.raw
    return sbx.files.read("/root/ticks").strip()


def test_auto_resume_wakes_a_paused_sandbox_on_use(make_sandbox):
    sbx = make_sandbox(timeout=1, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sbx.run_code("x = 'kept'")
    wait_until(lambda: sbx.info().state == "paused", timeout=30, what="pause at the timeout")
    assert sbx.run_code("x").result == "'kept'"
    assert sbx.info().state == "running"


def test_pause_is_refused_cleanly_while_work_is_in_flight(make_sandbox):
    sbx = make_sandbox(timeout=0)
    sbx.run_code("v = 7")
    # A foreground command: its output goes to a daemon connection a dump cannot keep.
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("r", sbx.commands.run("sleep 2; echo done", timeout=30)))
    t.start()
    time.sleep(0.5)
    with pytest.raises(ConflictError, match="foreground"):
        sbx.pause()
    t.join()
    assert results["r"].stdout.strip() == "done" and results["r"].exit_code == 0
    # A session running code.
    t = threading.Thread(target=lambda: results.setdefault("c", sbx.run_code("import time; time.sleep(2); v + 1")))
    t.start()
    time.sleep(0.5)
    with pytest.raises(ConflictError, match="running code"):
        sbx.pause()
    t.join()
    assert results["c"].result == "8"
    # Nothing was disturbed: the sandbox runs on and can be paused now.
    assert sbx.info().state == "running" and sbx.run_code("v").result == "7"
    sbx.pause()
    sbx.resume()
    assert sbx.run_code("v").result == "7"


def test_lifecycle_input_is_checked(daemon, raw):
    resp = raw.post("/v1/sandboxes", json={"lifecycle": {"on_timeout": "kill", "auto_resume": True}})
    assert resp.status_code == 400 and "on_timeout" in resp.text, resp.text
    resp = raw.post("/v1/sandboxes", json={"lifecycle": {"on_timeout": "sleep"}})
    assert resp.status_code == 400 and "on_timeout" in resp.text, resp.text
    resp = raw.post("/v1/sandboxes/sb-nope/pause")
    assert resp.status_code == 404, resp.text
    resp = raw.post("/v1/sandboxes/sb-nope/resume", json={"timeout": -1})
    assert resp.status_code in (400, 404), resp.text


def big_sandbox(make_sandbox, mib, memory_mb=None):
    sbx = make_sandbox(timeout=0, memory_mb=memory_mb or mib + 256)
    sbx.run_code("import os\nblob = bytearray(os.urandom(1 << 20)) * %d\nmark = 'kept'" % mib)
    return sbx


def no_leftovers():
    tmp = glob.glob(os.path.join(STATE, "images", ".tmp-*"))
    assert not tmp, "half-written images remain: %r" % tmp
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmd = open(p, "rb").read().split(b"\0")
        except OSError:
            continue
        assert not any(a.startswith(os.path.join(STATE, "images").encode()) for a in cmd), \
            "a CRIU process of this daemon survived its restart: %r" % cmd


@pytest.mark.parametrize("when", [0.15, 0.6])
def test_daemon_killed_during_a_pause_loses_nothing(daemon, make_sandbox, when):
    sbx = big_sandbox(make_sandbox, 200)
    sbx.files.write("/root/kept.txt", "kept")
    errors = []
    t = threading.Thread(target=lambda: _try(lambda: sbx.pause(), errors))
    t.start()
    time.sleep(when)
    daemon.stop(signal.SIGKILL)
    t.join()
    daemon.start()
    no_leftovers()
    s = Sandbox.connect(sbx.id, daemon=URL)  # resumes it if the pause was committed
    assert s.info().state == "running"
    assert s.run_code("mark, len(blob)").result == repr(("kept", 200 << 20))
    assert s.files.read("/root/kept.txt") == "kept"
    s.pause()
    s.resume()
    assert s.run_code("mark").result == "'kept'"


def test_daemon_killed_during_a_resume_loses_nothing(daemon, make_sandbox):
    sbx = big_sandbox(make_sandbox, 200)
    sbx.pause()
    errors = []
    t = threading.Thread(target=lambda: _try(lambda: sbx.resume(), errors))
    t.start()
    time.sleep(0.1)
    daemon.stop(signal.SIGKILL)
    t.join()
    daemon.start()
    no_leftovers()
    s = Sandbox.connect(sbx.id, daemon=URL, resume=False)
    if s.info().state == "paused":
        assert s.info().pids_current == 1, "a resume cut short left processes behind"
        s.resume()
    assert s.run_code("mark, len(blob)").result == repr(("kept", 200 << 20))


def _try(fn, errors):
    try:
        fn()
    except Exception as e:  # the daemon died under the request
        errors.append(e)


def test_offload_moves_a_snapshots_sessions_to_disk_and_a_rollback_brings_them_back(make_sandbox):
    sbx = make_sandbox(timeout=0)
    sbx.run_code("x = 41\nblob = bytes(range(256)) * 8192")
    snap = sbx.checkpoint()
    sbx.run_code("x = 0")
    with Snapshots(daemon=URL) as snaps:
        r = snaps.offload(snap)
        assert r.offloaded == 1 and r.images == 1 and r.image_bytes > 2 << 20 and not r.lost, r.raw
        again = snaps.offload(snap)  # nothing left in memory: the image stays
        assert again.offloaded == 0 and again.images == 1, again.raw
        with pytest.raises(NotFoundError, match="snapshot"):
            snaps.offload("sn-000000000000")
    back = sbx.rollback(snap)
    assert not back.sessions_restarted, back.raw
    assert sbx.run_code("x, len(blob)").result == "(41, 2097152)"


def test_a_broken_image_fails_the_resume_clearly_and_keeps_the_sandbox_paused(make_sandbox):
    sbx = make_sandbox(timeout=0)
    sbx.run_code("x = 1")
    sbx.pause()
    image = sorted(glob.glob(os.path.join(STATE, "images", "pi-*")), key=os.path.getmtime)[-1]
    pages = glob.glob(os.path.join(image, "pages-*.img"))
    cores = glob.glob(os.path.join(image, "core-*.img"))
    assert pages and cores
    saved = {p: open(p, "rb").read() for p in pages + cores}

    def resume_fails(match):
        with pytest.raises(ConflictError, match=match):
            sbx.resume()
        info = sbx.info()
        assert info.state == "paused" and info.pids_current == 1, "a half-restored sandbox was left running"

    # Truncated: the manifest's file lengths refuse it before CRIU runs.
    for p in pages:
        os.truncate(p, 100)
    resume_fails("cannot be resumed.*pages-.*the dump wrote.*stays paused")
    # Same length, wrong bytes: CRIU itself fails, and says so.
    for p, data in saved.items():
        open(p, "wb").write(data)
    for p in cores:
        open(p, "wb").write(bytes(len(saved[p])))
    resume_fails("cannot be resumed.*criu restore failed.*stays paused")
    for p, data in saved.items():
        open(p, "wb").write(data)
    sbx.resume()
    assert sbx.run_code("x").result == "1"


def test_without_criu_the_daemon_runs_degraded_and_says_why(restarted, make_sandbox, raw):
    # Made while CRIU was there, to be paused at its timeout (fully) by a daemon without it.
    pausing = make_sandbox(timeout=0, lifecycle={"on_timeout": "pause"})
    pausing.files.write("/root/kept.txt", "kept")
    restarted(["--criu", "/nonexistent/criu", "--max-templates", "1"])
    pi = health(daemon=URL)["process_images"]
    assert pi["criu"] is None and "install-criu.sh" in pi["unavailable"], pi
    # Its pause at the timeout cannot be full: it is made with the files only, at once (not
    # after the grace, 300 s here).
    pausing.set_timeout(1)
    wait_until(lambda: pausing.info().state == "paused", timeout=30, what="the files-only pause at the timeout")
    assert pausing.resume().rebooted and pausing.files.read("/root/kept.txt") == "kept"
    sbx = make_sandbox(timeout=0)
    sbx.run_code("x = 1")
    first = sbx.checkpoint()
    sbx.run_code("x = 2")
    sbx.checkpoint()  # evicts the first snapshot's template (behind the answer): no image is kept
    time.sleep(0.5)
    r = sbx.rollback(first)
    assert r.sessions_restarted
    why = " ".join(x["reason"] for x in r.raw["restarted"])
    assert "no process image" in why and "criu" in why.lower(), r.raw
    resp = raw.post("/v1/sandboxes/%s/pause" % sbx.id)
    assert resp.status_code == 503 and "CRIU" in resp.text and "filesystem" in resp.text, resp.text
    resp = raw.post("/v1/sandboxes", json={"lifecycle": {"on_timeout": "pause"}})
    assert resp.status_code == 503 and "CRIU" in resp.text, resp.text
    # A files-only pause needs no CRIU, nor does a lifecycle that pauses so.
    sbx.files.write("/root/kept.txt", "kept")
    assert sbx.pause(mode="filesystem").mode == "filesystem"
    assert sbx.resume().rebooted and sbx.files.read("/root/kept.txt") == "kept"
    resp = raw.post("/v1/sandboxes", json={"lifecycle": {"on_timeout": "pause", "pause_mode": "filesystem"}})
    assert resp.status_code == 201, resp.text
    raw.delete("/v1/sandboxes/%s" % resp.json()["id"])
    resp = raw.post("/v1/sandboxes/%s/checkpoint" % sbx.id, json={"processes": "all"})
    assert resp.status_code == 503 and "CRIU" in resp.text and "sessions" in resp.text, resp.text
    resp = raw.post("/v1/sandboxes/%s/checkpoint" % sbx.id, json={"processes": "some"})
    assert resp.status_code == 400 and "processes" in resp.text, resp.text


def test_rollback_with_processes_all_brings_back_a_writer_holding_its_file(make_sandbox):
    # A background process counts into a file it holds open; a checkpoint with
    # processes="all" keeps it; after a rollback the same pid counts on from where the
    # snapshot was (its counter and file offset both), and the file holds exactly the
    # snapshot's lines followed by the new ones.
    sbx = make_sandbox(timeout=0)
    sbx.run_code("x = 7")
    writer = "exec 3>/root/count.txt; i=0; while :; do echo $i >&3; i=$((i+1)); sleep 0.02; done"
    h = sbx.commands.run(["sh", "-c", writer], background=True)

    def counted():
        # Whole lines only: the writer may be halfway through one (or not have made the file).
        try:
            text = sbx.files.read("/root/count.txt")
        except NotFoundError:
            return []
        return [int(v) for v in text.split("\n")[:-1]]

    wait_until(lambda: len(counted()) > 5, what="the writer to start")
    info = sbx.checkpoint_info(processes="all")
    assert [p["pid"] for p in info.processes] == [h.pid], info.raw
    time.sleep(0.3)
    sbx.run_code("x = 8")
    r = sbx.rollback(info.id)
    assert r.restored_processes == [h.pid] and not r.processes_not_restored, r.raw
    assert not r.sessions_restarted and sbx.run_code("x").result == "7"
    n0 = len(counted())
    wait_until(lambda: len(counted()) > n0 + 5, what="the restored writer to go on")
    lines = counted()
    assert lines == list(range(len(lines))), "the count restarted or skipped: %r" % lines
    procs = {p.pid: p for p in sbx.commands.list()}
    assert procs[h.pid].running, procs
    # A plain checkpoint keeps no processes: a rollback to it kills the writer.
    plain = sbx.checkpoint()
    r2 = sbx.rollback(plain)
    assert h.pid in r2.killed and not r2.restored_processes, r2.raw
    # Right after that rollback (its victims may not be reaped yet) a processes="all"
    # checkpoint keeps what lives and nothing that died.
    other = sbx.commands.run(["sleep", "600"], background=True)
    kept = sbx.checkpoint_info(processes="all")
    assert [p["pid"] for p in kept.processes] == [other.pid], kept.raw
    # Rolling back to the processes="all" snapshot again brings it back again.
    r3 = sbx.rollback(info.id)
    assert r3.restored_processes == [h.pid], r3.raw


def test_rollback_restores_a_group_leader_once_the_members_of_its_group_are_reaped(make_sandbox):
    """A background command leads its process group, and the kernel hands its pid out again only
    once the last member of the group is reaped, not when the leader's own /proc entry goes. A
    rollback restores the leader under its pid after the members it started since the snapshot
    are gone: here one whose memory takes a while to free after the leader is reaped. (Restored
    as soon as /proc/<pid> was gone, CRIU met "Can't fork for <pid>: File exists".)"""
    sbx = make_sandbox(timeout=0, memory_mb=1024)
    leader = (
        "while [ ! -e /root/go ]; do sleep 0.02; done; "
        "python3 -c 'import time; big = b\"x\" * (400 << 20); open(\"/root/big\", \"w\").close(); time.sleep(600)' & "
        "wait"
    )
    h = sbx.commands.run(["sh", "-c", leader], background=True)
    info = sbx.checkpoint_info(processes="all")
    assert [p["pid"] for p in info.processes] == [h.pid], info.raw
    for _ in range(4):
        sbx.files.write("/root/go", "")
        wait_until(lambda: sbx.files.exists("/root/big"), timeout=30, what="the member to fill its memory")
        r = sbx.rollback(info.id)
        assert r.restored_processes == [h.pid] and not r.processes_not_restored, r.raw
        assert not sbx.files.exists("/root/go") and not sbx.files.exists("/root/big")
        procs = {p.pid: p for p in sbx.commands.list()}
        assert procs[h.pid].running, procs


def test_concurrent_checkpoint_fork_rollback_gc_rounds(make_sandbox):
    """Threads taking checkpoints of each kind, forking with processes, rolling back, deleting
    and collecting snapshots and creating sandboxes from them, all at once: every copy has its
    files, its session's state and its background command. (Collecting unused process images,
    run by each delete and gc, once deleted an image whose snapshot was being recorded
    meanwhile.)"""
    ticker = "i=0; while true; do i=$((i+1)); echo $i > /tmp/t.n; mv /tmp/t.n /tmp/tick; sleep 0.05; done"
    errors = []

    def tick(s):
        return int(s.files.read("/tmp/tick").strip() or 0) if s.files.exists("/tmp/tick") else 0

    def ticking(s):
        t0 = tick(s)
        wait_until(lambda: tick(s) > t0, timeout=20, what="the ticker of %s to count on" % s.sandbox_id)

    def rounds(w, snaps):
        for it in range(2):
            s = make_sandbox()
            s.commands.run(ticker, background=True)
            s.run_code("x = %d" % (w * 100 + it))
            s.files.write("/root/f", "a")
            ticking(s)
            a = s.checkpoint(processes="all")
            s.files.write("/root/f", "b")
            s.run_code("x += 1")
            b = s.checkpoint(processes=("sessions", "none", "keepable")[(w + it) % 3])
            kids = s.fork(2, processes="all")
            try:
                for k in kids:
                    assert k.files.read("/root/f") == "b"
                    assert k.run_code("x").result == str(w * 100 + it + 1)
                    ticking(k)
            finally:
                for k in kids:
                    k.kill()
            r = s.rollback(a)
            assert len(r.restored_processes) == 1 and not r.processes_not_restored, r.raw
            assert s.files.read("/root/f") == "a"
            assert s.run_code("x").result == str(w * 100 + it)
            ticking(s)
            snaps.delete(b)
            snaps.gc(keep=[a], sandbox=s.sandbox_id)
            c = make_sandbox(snapshot=a)
            assert c.files.read("/root/f") == "a"
            assert c.run_code("x").result == str(w * 100 + it)
            ticking(c)

    def guarded(w):
        try:
            with Snapshots(daemon=URL) as snaps:
                rounds(w, snaps)
        except Exception as e:  # every thread finishes; the first failure is reported
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def serves(sbx):
    r = sbx.commands.run(HTTP_CHECK + " 2>&1; true")
    return r.stdout.strip()


def test_fork_with_processes_gives_each_child_the_server_under_its_pid(make_sandbox, raw):
    # A server started in the background, and a session with state. fork(processes="all")
    # restores the server into each child under the same pid, before the child's session
    # copies take pids of their own; each child's server serves the child's files.
    sbx = make_sandbox(timeout=0)
    sbx.files.write("/srv/hello.txt", "hello from inside")
    h = sbx.commands.run("cd /srv && exec python3 -m http.server 8765 --bind 127.0.0.1", background=True)
    wait_until(lambda: serves(sbx) == "hello from inside", timeout=20, what="server")
    sbx.run_code("x = 5")
    children, r = sbx.fork_info(2, processes="all")
    assert not r.processes_not_restored and not r.sessions_restarted, r.raw
    for c in children:
        procs = {p.pid: p for p in c.commands.list()}
        assert h.pid in procs and procs[h.pid].running, procs
        c.files.write("/srv/hello.txt", "child " + c.id)
        assert serves(c) == "child " + c.id
        assert c.run_code("x").result == "5"
    assert serves(sbx) == "hello from inside"
    children[0].commands.kill(h.pid)
    assert serves(children[1]) == "child " + children[1].id and serves(sbx) == "hello from inside"
    # A snapshot that kept it gives it to a fork of it and to a sandbox created from it, also
    # isolated children (own namespaces, fresh sessions).
    # (The pre-built shells of the next fork, nested in it, are not among its processes.)
    info = sbx.checkpoint_info(processes="all")
    assert [p["pid"] for p in info.processes] == [h.pid], info.raw
    snap = info.id
    (named,) = sbx.fork(1, snapshot=snap)
    (isolated,) = sbx.fork(1, isolated=True, processes="keepable")
    made = make_sandbox(snapshot=snap, timeout=0)
    for c in (named, isolated, made):
        assert serves(c) == "hello from inside", c.id
        assert {p.pid: p for p in c.commands.list()}[h.pid].running
    # A plain fork (sessions only) has no server; processes with a named snapshot is refused.
    (plain,) = sbx.fork(1)
    assert h.pid not in {p.pid for p in plain.commands.list()} and "refused" in serves(plain)
    resp = raw.post("/v1/sandboxes/%s/fork" % sbx.id, json={"snapshot": snap, "processes": "all"})
    assert resp.status_code == 400 and "leave snapshot or processes out" in resp.text, resp.text
    # Its log has grown since (each request is logged to stderr): a rollback still restores it.
    assert serves(sbx) == "hello from inside"
    r = sbx.rollback(snap)
    assert r.restored_processes == [h.pid] and not r.processes_not_restored, r.raw
    assert serves(sbx) == "hello from inside"
    for c in children + [named, isolated, plain, made]:
        c.kill()
    # Its sandbox gone, a sandbox created from the snapshot adopts it: the server is restored
    # before the session's template (kept in a process image) and its copy, and serves; the
    # session's state is there.
    with Snapshots(daemon=URL) as snaps:
        assert snaps.offload(snap).images >= 1
    sbx.kill()
    adopted = make_sandbox(snapshot=snap, timeout=0)
    assert serves(adopted) == "hello from inside"
    assert {p.pid: p for p in adopted.commands.list()}[h.pid].running
    assert adopted.run_code("x").result == "5"


def test_keepable_leaves_out_what_cannot_be_kept(make_sandbox, raw):
    # CRIU cannot dump a vsock socket: processes="all" fails naming the process, "keepable"
    # keeps the others and leaves it running; a fork of that snapshot gets the others.
    sbx = make_sandbox(timeout=0)
    sleeper = sbx.commands.run(["sleep", "600"], background=True)
    vsock = "import socket, time\ns = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\nopen('/tmp/held', 'w')\ntime.sleep(600)"
    held = sbx.commands.run(["python3", "-c", vsock], background=True)
    wait_until(lambda: sbx.files.exists("/tmp/held"), what="the vsock holder")
    resp = raw.post("/v1/sandboxes/%s/checkpoint" % sbx.id, json={"processes": "all"})
    assert resp.status_code == 409 and "process %d" % held.pid in resp.text, resp.text
    info = sbx.checkpoint_info(processes="keepable")
    assert [p["pid"] for p in info.processes] == [sleeper.pid], info.raw
    procs = {p.pid: p for p in sbx.commands.list()}
    assert procs[held.pid].running and procs[sleeper.pid].running, procs
    (child,) = sbx.fork(1, snapshot=info.id)
    assert [p.pid for p in child.commands.list() if p.running] == [sleeper.pid]
    child.kill()


def test_pause_of_a_sandbox_busy_starting_commands(make_sandbox):
    # A shell starting commands in a tight loop (vfork + exec, hundreds a second) while the CPU
    # is contended: a pause must neither meet a shell in vfork (CRIU hung 10 s on it) nor a
    # session whose channel switch has not run yet (its dump found the daemon's socket).
    sbx = make_sandbox(timeout=0)
    loop = sbx.commands.run(["sh", "-c", "while :; do /bin/true; done"], background=True)
    sbx.run_code("x = 5")
    for _ in range(6):
        sbx.pause()
        sbx.resume()
        assert sbx.run_code("x").result == "5"
    assert {p.pid: p for p in sbx.commands.list()}[loop.pid].running


FORK_AND_HASH = """
import hashlib
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, hashlib.sha256(blob).hexdigest().encode())
    os._exit(0)
mine = hashlib.sha256(blob).hexdigest()
os.waitpid(pid, 0)
(mine, os.read(r, 64).decode())
"""

HELD_USERFAULTFDS = """
held = []
for p in os.listdir('/proc'):
    if p.isdigit():
        try:
            fds = os.listdir('/proc/%s/fd' % p)
        except OSError:
            continue
        for f in fds:
            try:
                link = os.readlink('/proc/%s/fd/%s' % (p, f))
            except OSError:
                continue
            if 'userfaultfd' in link:
                held.append((p, f, link))
held
"""


def test_a_lazy_resume_gives_the_process_and_a_child_it_forks_at_once_all_their_memory(make_sandbox):
    # Resumed lazily, the session runs before its 300 MiB are copied in. Its first act is a
    # fork: the child must get the pages the parent has not received yet from the image
    # (UFFD_FEATURE_EVENT_FORK), not zeroes. No process of the sandbox keeps a userfaultfd or
    # the /dev/userfaultfd CRIU used to make one.
    pi = health(daemon=URL)["process_images"]
    assert pi["lazy_pages"] and pi["lazy_unavailable"] is None, pi
    sbx = big_sandbox(make_sandbox, 300, memory_mb=1024)
    want = sbx.run_code("import hashlib\nhashlib.sha256(blob).hexdigest()").result.strip("'")
    for _ in range(2):
        sbx.pause()
        assert sbx.resume().lazy_pages
        assert sbx.run_code(FORK_AND_HASH, timeout=120).result == repr((want, want))
        assert sbx.run_code(HELD_USERFAULTFDS).result == "[]"
    assert sbx.run_code("mark").result == "'kept'"


SUMMER = """
import os, time
b = bytes(range(256)) * (200 << 12)
n = 0
while True:
    n += 1
    with open("/tmp/sum.new", "w") as f:
        f.write("%d %d" % (n, sum(b[::4099])))
    os.rename("/tmp/sum.new", "/tmp/sum")
    time.sleep(0.05)
"""


def test_forks_restore_an_image_in_full_while_a_lazy_rollback_copies_it_in(make_sandbox):
    # A rollback restores the background process lazily (its 200 MiB copied in after it runs);
    # forks of the same snapshot right after read that image in full at the same time (they do
    # not wait for the copy). Each copy has all its memory: a sum over a byte of nearly every page.
    want = sum(i % 256 for i in range(0, 200 << 20, 4099))
    sbx = make_sandbox(timeout=0, memory_mb=1024)
    sbx.commands.run(["python3", "-c", SUMMER], background=True)

    def counted(s):
        try:
            n, total = s.files.read("/tmp/sum").split()
        except NotFoundError:
            return 0, None
        return int(n), int(total)

    wait_until(lambda: counted(sbx)[0] > 0, what="the summer to start")
    snap = sbx.checkpoint(processes="all")
    at_snapshot = counted(sbx)[0]

    def went_on(s):
        n, total = counted(s)
        return (n, total) if n > at_snapshot + 2 else None
    for _ in range(2):
        r = sbx.rollback(snap)
        assert len(r.restored_processes) == 1 and not r.processes_not_restored, r.raw
        kids = sbx.fork(2, snapshot=snap)
        try:
            for s in [sbx] + kids:
                n, total = wait_until(lambda: went_on(s), timeout=30, what="the summer of %s to go on" % s.sandbox_id)
                assert total == want, (s.sandbox_id, n, total, want)
        finally:
            for k in kids:
                k.kill()


def test_a_resume_without_room_for_a_second_copy_reads_all_memory_first(make_sandbox):
    # 300 MiB under a 556 MiB limit: a fork during a lazy copy could need 600.
    sbx = big_sandbox(make_sandbox, 300)
    sbx.pause()
    r = sbx.resume()
    assert not r.lazy_pages, r.raw
    assert sbx.run_code("mark, len(blob)").result == repr(("kept", 300 << 20))


def test_a_rollback_may_read_all_memory_first(make_sandbox, raw):
    sbx = make_sandbox(timeout=0)
    sbx.run_code("import hashlib\nx = 41\nblob = bytes(range(256)) * 65536\nd = hashlib.sha256(blob).hexdigest()")
    snap = sbx.checkpoint()
    with Snapshots(daemon=URL) as snaps:
        for lazy in (False, True, None):
            sbx.run_code("x = 0")
            assert snaps.offload(snap).images == 1
            r = sbx.rollback(snap, lazy_pages=lazy)
            assert not r.sessions_restarted, r.raw
            assert sbx.run_code("x, hashlib.sha256(blob).hexdigest() == d").result == "(41, True)"
    resp = raw.post("/v1/sandboxes/%s/rollback" % sbx.id, json={"snapshot": snap, "lazy_pages": "yes"})
    assert resp.status_code == 400 and "lazy_pages" in resp.text, resp.text


def test_daemon_killed_right_after_a_lazy_resume_loses_no_memory(daemon, make_sandbox):
    # The lazy-pages server is outside the daemon's process group: killing the daemon while it
    # still copies 400 MiB in leaves it finishing, and the next start waits for it.
    sbx = big_sandbox(make_sandbox, 400, memory_mb=1200)
    want = sbx.run_code("import hashlib\nhashlib.sha256(blob).hexdigest()").result
    sbx.pause()
    assert sbx.resume().lazy_pages
    daemon.stop(signal.SIGKILL)
    daemon.start()
    no_leftovers()
    s = Sandbox.connect(sbx.id, daemon=URL)
    assert s.run_code("hashlib.sha256(blob).hexdigest()", timeout=120).result == want
    assert s.run_code("mark").result == "'kept'"
