"""A five-minute tour of branchbox: create a sandbox, run commands and Python, move files, kill it.

Run by `make demo` against the daemon it started (BRANCHBOX_URL overrides the address).
"""
import time

from branchbox import Sandbox


def step(title: str) -> None:
    print(f"\n== {title}")


t0 = time.perf_counter()
with Sandbox.create(image="base", memory_mb=512, timeout=120, metadata={"demo": "tour"}) as sbx:
    print(f"created {sbx.id} in {(time.perf_counter() - t0) * 1000:.1f} ms")

    step("commands")
    r = sbx.commands.run("echo hello from $(hostname); uname -sr; id -u")
    print(r.stdout.strip(), f"(exit {r.exit_code}, {r.duration * 1000:.1f} ms)")
    r = sbx.commands.run("exit 3")
    print("exit code of `exit 3`:", r.exit_code)
    r = sbx.commands.run("sleep 5", timeout=0.5)
    print("a 5 s sleep with a 0.5 s timeout: timed_out =", r.timed_out)
    sbx.commands.run("seq 3", on_stdout=lambda chunk: print("streamed:", chunk.strip()))
    bg = sbx.commands.run("sleep 0.3; echo background done", background=True)
    print("background pid", bg.pid, "->", bg.wait().stdout.strip())

    step("python")
    print(sbx.run_code("import sys; x = 21; sys.version.split()[0]").result)
    print("x * 2 =", sbx.run_code("x * 2").result, "(variables persist)")
    err = sbx.run_code("1 / 0").error
    print("errors come back typed:", err.name, "-", err.value)

    step("shell session")
    sh = sbx.sessions.create(kind="shell")
    sh.run("cd /tmp && export GREETING=hi")
    print(sh.run('echo "$GREETING from $(pwd)"').stdout.strip(), "(cwd and env persist)")

    step("files")
    sbx.files.write("/root/project/notes.txt", "written through the API\n")
    print(sbx.commands.run("cat /root/project/notes.txt").stdout.strip())
    sbx.commands.run("python3 -c \"open('/root/project/out.csv','w').write('a,b\\n1,2\\n')\"")
    print([e.name for e in sbx.files.list("/root/project")])
    print("out.csv:", sbx.files.read("/root/project/out.csv").splitlines())
    try:
        sbx.files.read("/../../etc/shadow")
    except Exception as e:  # PathEscapeError
        print("escaping the root is refused:", type(e).__name__)

    step("isolation")
    print(sbx.commands.run("ls /proc | grep -c '^[0-9]'").stdout.strip(), "processes visible inside")
    print(sbx.commands.run("mount -t tmpfs x /mnt 2>&1 || true").stdout.strip())
    info = sbx.info()
    print(f"memory {info.memory_bytes / 1e6:.1f} MB, {info.pids_current} pids, limit {info.memory_mb} MB")

print("\nsandbox killed; tour done in %.2f s" % (time.perf_counter() - t0))
