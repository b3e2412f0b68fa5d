"""Escape battery: from inside a sandbox, every attempt to reach the host must fail, precisely.

Most probes run as python in the sandbox (``run_code``), which reports errno names exactly; shell
tools are run as subprocesses of that python. The host-side facts (a marker file, a TCP listener, our own pid)
are set up by the test on the host.
"""
import os
import platform
import socket
import threading
import uuid

import pytest

from branchbox import NotFoundError, PathEscapeError, Pool
from branchbox.sandbox_sync import health
from helpers import (
    CGROUP_PARENT,
    CGROUP_ROOT,
    STATE,
    URL,
    assert_no_host_traces,
    cgroup_file,
    wait_until,
)

# Syscall numbers of the calls probed with ctypes.
SYSCALLS = {
    "x86_64": dict(init_module=175, finit_module=313, delete_module=176, keyctl=250, add_key=248, bpf=321,
                   ptrace=101, mount=165, unshare=272, setns=308, open_by_handle_at=304, kexec_load=246,
                   perf_event_open=298),
    "aarch64": dict(init_module=105, finit_module=273, delete_module=106, keyctl=219, add_key=217, bpf=280,
                    ptrace=117, mount=40, unshare=97, setns=268, open_by_handle_at=265, kexec_load=104,
                    perf_event_open=241),
}
NR = SYSCALLS.get(platform.machine())

CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_SYS_ADMIN = 16, 19, 21

# Python prelude run in the sandbox: `attempt(fn)` -> "ok" or the errno name of the OSError.
PRELUDE = r'''
import ctypes, errno, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def read(path):
    with open(path, "rb") as f:
        return f.read()
def write(path, data=b"1"):
    with open(path, "wb") as f:
        f.write(data)
def sys_call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def sh(*argv):
    p = subprocess.run(list(argv), capture_output=True, text=True)
    return (p.returncode, p.stdout, p.stderr)
'''


def probe(sbx, code):
    """Run PRELUDE + code with run_code; the last expression's value, evaluated back here."""
    ex = sbx.run_code(PRELUDE + code, timeout=60)
    assert ex.error is None, "probe raised %s: %s\n%s" % (ex.error.name, ex.error.value, ex.error.traceback)
    assert ex.result is not None, "probe returned nothing (stdout %r, stderr %r)" % (ex.stdout, ex.stderr)
    return eval(ex.result)


@pytest.fixture
def marker():
    """A host-only file in /etc with a secret; it must stay unreadable and unmodified."""
    name = "branchbox-escape-marker-%s" % uuid.uuid4().hex[:12]
    path = "/etc/" + name
    secret = "host-secret-%s" % uuid.uuid4().hex
    with open(path, "w") as f:
        f.write(secret)
    try:
        yield name, path, secret
        with open(path) as f:
            assert f.read() == secret, "the host marker was modified from inside a sandbox"
    finally:
        os.unlink(path)


# ============================================================================ filesystem


def test_host_file_unreadable_by_path_symlink_proc_root_dotdot_or_chroot(sbx, marker):
    """cat, symlinks, /proc/1/root, /proc/self/root, '..' walks and a chroot breakout all miss it."""
    name, path, secret = marker
    res = probe(sbx, r'''
P = %r
os.symlink(P, "/tmp/abs-link")
os.symlink("../../../../../../../.." + P, "/tmp/rel-link")
os.chdir("/")
for _ in range(40):
    os.chdir("..")
breakout = """
import os
os.makedirs("/tmp/jail", exist_ok=True)
os.chroot("/tmp/jail")
for _ in range(64):
    os.chdir("..")
os.chroot(".")
print(sorted(os.listdir("/")))
print(os.path.exists(%%r))
""" %% P
{
    "cat": sh("cat", P),
    "abs-link": attempt(lambda: read("/tmp/abs-link")),
    "rel-link": attempt(lambda: read("/tmp/rel-link")),
    "proc1-root": attempt(lambda: read("/proc/1/root" + P)),
    "self-root": attempt(lambda: read("/proc/self/root" + P)),
    "dotdot": attempt(lambda: read("/../../../../.." + P)),
    "root-dotdot": attempt(lambda: read("/root/../../../../../.." + P)),
    "cwd-after-walk": os.getcwd(),
    "dotdot-is-root": os.stat("/..").st_ino == os.stat("/").st_ino,
    "relative-walk": attempt(lambda: read("../../../../../../.." + P)),
    "chroot-breakout": sh("python3", "-c", breakout),
    "listed": os.path.basename(P) in os.listdir("/etc"),
}
''' % path)
    assert res["cat"][0] == 1 and "No such file or directory" in res["cat"][2], res["cat"]
    assert res["abs-link"] == "ENOENT"
    assert res["rel-link"] == "ENOENT"
    assert res["proc1-root"] == "EACCES", "init's root must be closed to sandbox processes"
    assert res["self-root"] == "ENOENT"
    assert res["dotdot"] == "ENOENT" and res["root-dotdot"] == "ENOENT" and res["relative-walk"] == "ENOENT"
    assert res["cwd-after-walk"] == "/" and res["dotdot-is-root"] is True
    rc, out, err = res["chroot-breakout"]
    assert rc == 0, err
    assert out.splitlines()[-1] == "False", "the chroot breakout reached a root holding the host marker: " + out
    assert res["listed"] is False
    assert secret not in repr(res)
    r = sbx.commands.run(["cat", path])
    assert r.exit_code == 1 and secret not in r.stdout, r


def test_files_api_never_follows_symlinks_out_of_the_root(sbx, marker):
    """The files API resolves in-sandbox symlinks inside the sandbox root: the host file is never read or written."""
    name, path, secret = marker
    setup = probe(sbx, r'''
P = %r
os.symlink(P, "/tmp/abs-link")
os.symlink("../../../../../../../.." + P, "/tmp/rel-link")
os.symlink("/proc/1/root" + P, "/tmp/proc-link")
os.symlink("/etc", "/tmp/etc-link")
os.symlink("../../../../../../..", "/tmp/up-link")
"ok"
''' % path)
    assert setup == "ok"
    for p in ("/tmp/abs-link", "/tmp/rel-link", "/tmp/proc-link", "/tmp/etc-link/" + name, "/tmp/up-link" + path,
              "/proc/1/root" + path, "/proc/self/root" + path, path):
        with pytest.raises((NotFoundError, PathEscapeError)):
            data = sbx.files.read(p)
            pytest.fail("files.read(%r) returned %r" % (p, data))
    assert name not in [e.name for e in sbx.files.list("/tmp/etc-link")]
    up = {e.name for e in sbx.files.list("/tmp/up-link")}
    assert {"root", "etc", "tmp"} <= up and name not in up
    # Writes through the symlinks land inside the sandbox; the host file is untouched (marker fixture).
    sbx.files.write("/tmp/abs-link", "pwned-1")
    sbx.files.write("/tmp/etc-link/" + name, "pwned-2")
    with open(path) as f:
        assert f.read() == secret
    inside = probe(sbx, "(read('/etc/%s'), os.path.islink('/tmp/abs-link'), read('/tmp/abs-link'))" % name)
    assert inside == (b"pwned-2", False, b"pwned-1")
    # Removing or renaming through symlinks only ever touches the sandbox's own files.
    with pytest.raises((NotFoundError, PathEscapeError)):
        sbx.files.rename("/tmp/up-link/etc/%s-nope" % name, "/root/stolen")
    assert sbx.files.remove("/tmp/etc-link/" + name) is True
    with pytest.raises((NotFoundError, PathEscapeError)):
        sbx.files.remove("/tmp/up-link" + path)
    with pytest.raises((NotFoundError, PathEscapeError)):
        sbx.files.remove("/tmp/rel-link/x", recursive=True)
    assert os.path.exists(path)


def assert_mountinfo_hides_the_state_dir(s, where):
    """The sandbox's /proc/self/mountinfo (its root overlay's options included) names nothing
    of the host's state dir."""
    r = s.commands.run("cat /proc/self/mountinfo")
    assert r.exit_code == 0, r
    lines = r.stdout.splitlines()
    # The root is the last mount at "/": an overlay whose options list its layers (so this
    # really is the text that used to carry lowerdir=<state>/layers/...).
    root = [line for line in lines if line.split(" ")[4] == "/"]
    assert root and " - overlay " in root[-1] and "lowerdir" in root[-1] and "upperdir=" in root[-1], \
        "%s: no overlay root in\n%s" % (where, r.stdout)
    needles = {STATE, os.path.realpath(STATE), "/var/lib/"}
    leaks = [line for line in lines if any(n in line for n in needles)]
    assert not leaks, "%s: mountinfo shows host paths:\n%s" % (where, "\n".join(leaks))


def test_mountinfo_shows_no_host_path_across_checkpoint_rollback_fork_and_recycle(make_sandbox, daemon):
    """The root overlay is mounted anew by a create, a checkpoint and a rollback (root swaps), a
    fork (a nested fork shell's root, or a cold start) and a pool recycle: none of them names
    host paths."""
    s = make_sandbox()
    assert_mountinfo_hides_the_state_dir(s, "a new sandbox")
    s.run_code("x = 41")  # a live session: its fork children are nested
    s.commands.run("echo one > /root/f")
    snap = s.checkpoint()
    assert_mountinfo_hides_the_state_dir(s, "after a checkpoint")
    s.commands.run("echo two > /root/f")
    s.rollback(snap)
    assert s.files.read("/root/f") == "one\n"
    assert_mountinfo_hides_the_state_dir(s, "after a rollback")
    for isolated in (False, True):
        (child,) = s.fork(1, isolated=isolated)
        try:
            assert child.info().nested_in == (None if isolated else s.id)
            assert child.files.read("/root/f") == "one\n"
            assert_mountinfo_hides_the_state_dir(child, "in an isolated fork child" if isolated else "in a fork child")
        finally:
            child.kill()

    pool = Pool(daemon=URL)
    try:
        pool.set("base", 0, 1)  # no refill: a kill recycles into the one slot
        a = make_sandbox()
        init_pid = a.info().init_pid
        recycled = pool.stats().recycled
        assert a.kill() is True
        assert pool.stats().recycled == recycled + 1
        b = make_sandbox()
        assert b.info().init_pid == init_pid, "b must be a's recycled shell"
        assert_mountinfo_hides_the_state_dir(b, "in a recycled pool sandbox")
    finally:
        pool.set("base", 0, 0)
        wait_until(lambda: pool.stats().ready("base") == 0, timeout=30, what="the pool of base to drain")
        pool.close()


# ============================================================================ processes


def test_host_processes_are_invisible(sbx, daemon):
    """Our own host pid and the daemon's are not visible; ps shows init as pid 1 and little else."""
    me, dpid = os.getpid(), daemon.pid
    res = probe(sbx, r'''
res = {}
for pid in (%d, %d):
    res[pid] = (os.path.exists("/proc/%%d" %% pid), attempt(lambda: os.kill(pid, 0)), sh("kill", "-0", str(pid))[0])
res["ps"] = sh("ps", "-eo", "pid=,comm=")
res["comm1"] = read("/proc/1/comm").decode().strip()
res
''' % (me, dpid))
    for pid in (me, dpid):
        exists, kill0, kill_rc = res[pid]
        assert exists is False, "/proc/%d (a host process) is visible" % pid
        assert kill0 == "ESRCH" and kill_rc != 0, (pid, res[pid])
    rc, out, _ = res["ps"]
    rows = [line.split(None, 1) for line in out.strip().splitlines()]
    assert rc == 0 and rows[0] == ["1", "branchbox-init"], out
    assert len(rows) <= 6, "too many processes visible:\n" + out
    assert all(int(pid) < 1000 for pid, _ in rows), out
    assert res["comm1"] == "branchbox-init"


def test_ptrace_of_init_and_its_secrets_are_denied(sbx):
    """PTRACE_ATTACH/SEIZE of pid 1 fail with EPERM; /proc/1/environ, exe, mem, root are closed."""
    if NR is None:
        pytest.skip("no syscall table for %s" % platform.machine())
    res = probe(sbx, r'''
{
    "attach": sys_call(%d, 16, 1, 0, 0),
    "seize": sys_call(%d, 0x4206, 1, 0, 0),
    "environ": attempt(lambda: read("/proc/1/environ")),
    "exe": attempt(lambda: os.readlink("/proc/1/exe")),
    "root": attempt(lambda: os.readlink("/proc/1/root")),
    "mem": attempt(lambda: read("/proc/1/mem")),
    "exe-open": attempt(lambda: read("/proc/1/exe")),
}
''' % (NR["ptrace"], NR["ptrace"]))
    assert res == {"attach": "EPERM", "seize": "EPERM", "environ": "EACCES", "exe": "EACCES", "root": "EACCES",
                   "mem": "EACCES", "exe-open": "EACCES"}


# ============================================================================ mounts, namespaces, kernel


def test_mounting_and_new_namespaces_are_denied(sbx):
    """mount(8) of tmpfs/proc/bind fails, the mount and unshare syscalls answer EPERM, unshare -Urm fails."""
    if NR is None:
        pytest.skip("no syscall table for %s" % platform.machine())
    res = probe(sbx, r'''
{
    "tmpfs": sh("mount", "-t", "tmpfs", "none", "/mnt"),
    "proc": sh("mount", "-t", "proc", "proc", "/mnt"),
    "bind": sh("mount", "--bind", "/etc", "/mnt"),
    "unshare-Urm": sh("unshare", "-Urm", "true"),
    "sys-mount": sys_call(%d, b"none", b"/mnt", b"tmpfs", 0, None),
    "sys-unshare-user": sys_call(%d, 0x10000000),
    "sys-unshare-ns": sys_call(%d, 0x00020000),
    "sys-setns": sys_call(%d, 0, 0),
    "mnt-empty": os.listdir("/mnt"),
}
''' % (NR["mount"], NR["unshare"], NR["unshare"], NR["setns"]))
    for k in ("tmpfs", "proc", "bind"):
        rc, _, err = res[k]
        assert rc == 32 and "permission denied" in err, (k, res[k])
    rc, _, err = res["unshare-Urm"]
    assert rc != 0 and "Operation not permitted" in err, res["unshare-Urm"]
    assert (res["sys-mount"], res["sys-unshare-user"], res["sys-unshare-ns"], res["sys-setns"]) == ("EPERM",) * 4
    assert res["mnt-empty"] == []


def test_kernel_tunables_are_read_only(sbx):
    """/proc/sys, /proc/sysrq-trigger and /sys refuse writes (read-only file system)."""
    sysrq_on_host = os.path.exists("/proc/sysrq-trigger")
    host_panic = open("/proc/sys/kernel/panic").read()
    res = probe(sbx, r'''
import glob
sys_kernel = [p for p in sorted(glob.glob("/sys/kernel/*")) if os.path.isfile(p)][:5]
{
    "panic": attempt(lambda: write("/proc/sys/kernel/panic", b"1")),
    "core_pattern": attempt(lambda: write("/proc/sys/kernel/core_pattern", b"|/tmp/x")),
    "drop_caches": attempt(lambda: write("/proc/sys/vm/drop_caches", b"3")),
    "sysrq": attempt(lambda: write("/proc/sysrq-trigger", b"h")),
    "uevent_helper": attempt(lambda: write("/sys/kernel/uevent_helper", b"/tmp/x")),
    "sys_kernel_files": {p: attempt(lambda: write(p, b"1")) for p in sys_kernel},
    "sys-debug": attempt(lambda: write("/sys/kernel/debug/x", b"1")),
    "sys-cgroup": attempt(lambda: write("/sys/fs/cgroup/x", b"1")),
}
''')
    assert res["panic"] == "EROFS" and res["core_pattern"] == "EROFS" and res["drop_caches"] == "EROFS", res
    assert res["sysrq"] == ("EROFS" if sysrq_on_host else "ENOENT"), res
    assert res["uevent_helper"] == "EROFS", res
    assert res["sys_kernel_files"] and set(res["sys_kernel_files"].values()) == {"EROFS"}, res
    assert res["sys-debug"] == "EROFS" and res["sys-cgroup"] == "EROFS", res
    assert open("/proc/sys/kernel/panic").read() == host_panic


def test_module_keyring_bpf_and_other_privileged_syscalls_are_eperm(sbx):
    if NR is None:
        pytest.skip("no syscall table for %s" % platform.machine())
    res = probe(sbx, r'''
{
    "init_module": sys_call(%(init_module)d, None, 0, b""),
    "finit_module": sys_call(%(finit_module)d, os.open("/etc/hostname", os.O_RDONLY), b"", 0),
    "delete_module": sys_call(%(delete_module)d, b"ext4", 0),
    "keyctl": sys_call(%(keyctl)d, 0, 0, 0, 0, 0),
    "add_key": sys_call(%(add_key)d, b"user", b"k", b"v", 1, -2),
    "bpf": sys_call(%(bpf)d, 0, None, 0),
    "open_by_handle_at": sys_call(%(open_by_handle_at)d, -100, None, 0),
    "kexec_load": sys_call(%(kexec_load)d, 0, 0, None, 0),
    "perf_event_open": sys_call(%(perf_event_open)d, None, 0, -1, -1, 0),
}
''' % NR)
    assert res == {k: "EPERM" for k in res}, res


def test_devices_are_absent_and_mknod_is_denied(sbx):
    res = probe(sbx, r'''
import stat
{
    "kvm": attempt(lambda: os.open("/dev/kvm", os.O_RDWR)),
    "sda": attempt(lambda: os.open("/dev/sda", os.O_RDONLY)),
    "mem": attempt(lambda: os.open("/dev/mem", os.O_RDONLY)),
    "kmsg": attempt(lambda: os.open("/dev/kmsg", os.O_RDONLY)),
    "mknod-block": attempt(lambda: os.mknod("/tmp/sda", stat.S_IFBLK | 0o600, os.makedev(8, 0))),
    "mknod-char": attempt(lambda: os.mknod("/tmp/mem", stat.S_IFCHR | 0o600, os.makedev(1, 1))),
    "mknod-sh": sh("mknod", "/tmp/sda2", "b", "8", "0"),
    "dev": sorted(os.listdir("/dev")),
    "leftovers": [p for p in ("/tmp/sda", "/tmp/mem", "/tmp/sda2") if os.path.exists(p)],
}
''')
    assert (res["kvm"], res["sda"], res["mem"], res["kmsg"]) == ("ENOENT",) * 4, res
    assert res["mknod-block"] == "EPERM" and res["mknod-char"] == "EPERM", res
    assert res["mknod-sh"][0] != 0 and "Operation not permitted" in res["mknod-sh"][2], res["mknod-sh"]
    # .bb-boot-id: the regular file init shows at /proc/sys/kernel/random/boot_id.
    assert res["dev"] == sorted([".bb-boot-id", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr",
                                 "stdin", "stdout", "tty", "urandom", "zero"]), res["dev"]
    assert res["leftovers"] == []


def test_capabilities_no_new_privs_and_seccomp(sbx):
    """Sandbox processes lack CAP_SYS_ADMIN/PTRACE/MODULE (even in the bounding set), NoNewPrivs=1, Seccomp=2."""
    def parse(status):
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        return {k: fields[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb", "NoNewPrivs", "Seccomp")}

    statuses = probe(sbx, 'dict(session=read("/proc/self/status").decode(), child=sh("cat", "/proc/self/status")[1])')
    r = sbx.commands.run("cat /proc/self/status > /tmp/status-of-command")
    assert r.exit_code == 0, r
    statuses["command"] = sbx.files.read("/tmp/status-of-command")
    h = sbx.commands.run("cat /proc/self/status", background=True)
    statuses["background"] = h.wait(timeout=30).stdout
    for who, status in statuses.items():
        f = parse(status)
        for key in ("CapEff", "CapPrm", "CapBnd", "CapInh"):
            mask = int(f[key], 16)
            for bit, cap in ((CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"),
                             (CAP_SYS_MODULE, "CAP_SYS_MODULE")):
                assert not mask & (1 << bit), "%s of the %s process has %s: %s" % (key, who, cap, f)
        assert int(f["CapAmb"], 16) == 0, (who, f)
        assert f["NoNewPrivs"] == "1" and f["Seccomp"] == "2", (who, f)


def status_fields(text):
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return {k: fields[k].strip() for k in ("Uid", "CapEff", "CapBnd", "NoNewPrivs", "Seccomp")}


def test_sudo_makes_root_of_the_sandbox_only_and_only_when_asked(make_sandbox):
    """`sudo=True`: `user`'s processes start without no_new_privs, so sudo works; what it gives
    is root of the sandbox's user namespace with the same filter and capability set (no
    CAP_SYS_ADMIN, mounts and new namespaces still refused). Root's processes keep
    no_new_privs; without `sudo`, sudo is refused; fork children inherit the setting."""
    plain = make_sandbox()
    r = plain.commands.run("sudo -n true", user="user")
    assert r.exit_code != 0 and "no new privileges" in r.stderr, r
    assert status_fields(plain.commands.run("cat /proc/self/status", user="user").stdout)["NoNewPrivs"] == "1"
    assert plain.info().sudo is False

    s = make_sandbox(sudo=True)
    assert s.info().sudo is True
    r = s.commands.run("sudo -n whoami", user="user")
    # The hostname (the sandbox's id) resolves: sudo does not warn about it.
    assert (r.exit_code, r.stdout, r.stderr) == (0, "root\n", ""), r
    assert s.commands.run("getent hosts $(hostname)").exit_code == 0
    mine = status_fields(s.commands.run("cat /proc/self/status", user="user").stdout)
    assert (mine["NoNewPrivs"], mine["Seccomp"]) == ("0", "2"), mine
    as_root = status_fields(s.commands.run("sudo -n cat /proc/self/status", user="user").stdout)
    assert as_root["Uid"].split()[0] == "0" and as_root["Seccomp"] == "2", as_root
    for key in ("CapEff", "CapBnd"):
        assert not int(as_root[key], 16) & (1 << CAP_SYS_ADMIN), as_root
    # Root of the namespace maps to the unprivileged range on the host, not to root.
    inside, outside, _ = s.commands.run("sudo -n cat /proc/self/uid_map", user="user").stdout.split()
    assert inside == "0" and int(outside) > 0, (inside, outside)
    # EPERM from each: unshare says so, mount(8) calls it "permission denied".
    for cmd, says in (("sudo -n unshare -m true", "Operation not permitted"),
                      ("sudo -n mount -t tmpfs t /mnt", "permission denied")):
        r = s.commands.run(cmd, user="user")
        assert r.exit_code != 0 and says in r.stderr, (cmd, r)
    assert s.commands.run("grep -c ' /mnt ' /proc/mounts").stdout.strip() == "0"
    # Commands as root keep no_new_privs.
    assert status_fields(s.commands.run("cat /proc/self/status").stdout)["NoNewPrivs"] == "1"

    child = s.fork(1)[0]
    try:
        assert child.info().sudo is True
        r = child.commands.run("sudo -n whoami", user="user")
        assert (r.exit_code, r.stdout) == (0, "root\n"), r
    finally:
        child.kill()


# ============================================================================ network


def test_network_is_loopback_only_and_host_loopback_unreachable(sbx):
    """The sandbox has only its own lo: a host listener on 127.0.0.1 is unreachable (ECONNREFUSED)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        res = probe(sbx, r'''
import socket
def connect():
    s = socket.create_connection(("127.0.0.1", %d), timeout=5)
    s.close()
lines = read("/proc/net/dev").decode().splitlines()[2:]
{
    "connect": attempt(connect),
    "ifaces": sorted(l.split(":")[0].strip() for l in lines),
    "if_nameindex": [name for _, name in socket.if_nameindex()],
    "routes": read("/proc/net/route").decode().splitlines()[1:],
}
''' % port)
        assert res["connect"] == "ECONNREFUSED", res
        assert res["ifaces"] == ["lo"] and res["if_nameindex"] == ["lo"], res
        assert res["routes"] == [], "the sandbox has routes: %r" % res["routes"]
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            conn, addr = listener.accept()
            pytest.fail("the host listener accepted a connection from %r" % (addr,))
    finally:
        listener.close()


# ============================================================================ resource bombs


def test_memory_bomb_is_oom_killed_while_others_keep_working(make_sandbox, daemon):
    """A 512 MiB allocation in a 64 MiB sandbox is OOM-killed; another sandbox and the daemon are unaffected."""
    bomb = make_sandbox(memory_mb=64, timeout=120)
    other = make_sandbox(timeout=120)
    other.run_code("n = 0")
    out = {}

    def explode():
        out["r"] = bomb.commands.run(["python3", "-c", "b = b'x' * (512 << 20); print(len(b))"], timeout=60)

    t = threading.Thread(target=explode)
    t.start()
    answers = 0
    while t.is_alive() or answers < 3:
        assert other.run_code("n += 1\nn").result == str(answers + 1)
        assert other.commands.run(["true"]).exit_code == 0
        answers += 1
    t.join()
    r = out["r"]
    assert not r.timed_out and r.exit_code is None and r.signal == 9, r
    assert "536870912" not in r.stdout
    info = bomb.info()
    assert r.oom_killed is True or info.oom_killed is True, (r, info)
    assert info.oom_killed is True
    assert info.memory_mb == 64 and info.state == "running", "init must survive the OOM kill: %r" % info
    assert bomb.commands.run(["true"]).exit_code == 0, "the bombed sandbox is unusable after the OOM kill"
    assert health(daemon=URL)["ok"] is True
    assert other.info().oom_killed is False


def test_fork_bomb_is_contained_by_the_pids_limit(make_sandbox, daemon):
    """A fork bomb under pids=64 hits the limit; others keep working; killing it leaves no cgroup."""
    bombed = make_sandbox(pids=64, timeout=120)
    other = make_sandbox(timeout=120)
    sid = bombed.id
    try:
        r = bombed.commands.run("timeout 5 bash -c ':(){ :|:& };:'", timeout=30)
        assert not r.timed_out, r
        # The bomb really ran into the limit...
        wait_until(lambda: int(cgroup_file("pids", sid, "pids.events").split()[1]) > 0, timeout=10,
                   what="the fork bomb to hit pids.max")
        assert cgroup_file("pids", sid, "pids.max") == "64"
        assert int(cgroup_file("pids", sid, "pids.current")) <= 64
        assert bombed.info().pids_current <= 64
        # ...while the rest of the machine is fine.
        assert other.run_code("sum(range(10))").result == "45"
        assert other.commands.run(["true"]).exit_code == 0
        assert health(daemon=URL)["ok"] is True
        assert other.id in [i.id for i in type(other).list(daemon=URL)]
    finally:
        assert bombed.kill() is True
    assert_no_host_traces(sid)
    assert not os.path.exists(os.path.join(CGROUP_ROOT, "pids", CGROUP_PARENT, sid))
    assert other.commands.run(["true"]).exit_code == 0
