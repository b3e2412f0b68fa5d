"""A tour of branchbox: the operations a branching agent uses, on a live daemon, in a few seconds.

1. a sandbox: commands, a live Python session, files
2. checkpoint, change files and variables, roll back: both come back
3. fork 4 children from a snapshot; each tries a different fix of a buggy function and runs
   the tests; the best fix wins
4. evaluate a command without keeping its side effects
5. the snapshot tree the steps above made
6. the warm pool: a create that claims a ready sandbox against a cold one
7. a template: a recipe run once, its live Python session forked into each new sandbox

Run by `make demo` against the daemon it started (BRANCHBOX_URL overrides the address). Safe to
re-run: everything it makes (sandboxes, snapshots, the template) is removed at the end, even on
error or Ctrl-C, and the base image's pool setting is put back as it was.
"""
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from branchbox import Pool, Sandbox, SandboxError, Snapshots, Templates

TAG = {"demo": "tour"}  # metadata on every sandbox the tour makes (fork children inherit it)
TEMPLATE = "tour-stats"
ROOT_LABEL = "tour: clean"  # the tour's first snapshot; every other one descends from it
# The pool setting the tour found, kept here while it changes it: a tour killed before restoring
# it (SIGKILL) leaves the file, and the next tour restores from it.
POOL_FILE = os.path.join(tempfile.gettempdir(), "branchbox-tour-pool.json")
IMAGE = "base"

BUGGY = '''\
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]          # wrong for lists of even length
'''
TESTS = '''\
from stats import median

cases = [([1, 2, 3], 2), ([3, 1, 2], 2), ([1, 2, 3, 4], 2.5), ([5], 5), ([1, 1, 10], 1)]
passed = 0
for xs, want in cases:
    try:
        passed += median(xs) == want
    except Exception:
        pass
print(f"{passed}/{len(cases)} passed")
raise SystemExit(passed != len(cases))
'''
# Four candidate edits of the return line, one per fork child.
FIXES = {
    "mean": "return sum(xs) / len(xs)",
    "lower middle": "return xs[(len(xs) - 1) // 2]",
    "two middles": "return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2",
    "off by one": "return (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2",
}


def step(title: str) -> None:
    print(f"\n== {title}")


def ms(t0: float) -> str:
    return f"{(time.perf_counter() - t0) * 1000:.1f} ms"


def patched(fix: str) -> str:
    return BUGGY.replace("return xs[len(xs) // 2]          # wrong for lists of even length", fix)


def tree_lines(snapshots):
    """The snapshot tree, indented (what `branchbox snapshot ls` draws)."""
    by_id = {s.id: s for s in snapshots}
    kids = {s.id: [] for s in snapshots}
    for s in sorted(snapshots, key=lambda s: s.created_at or 0):
        if s.parent in by_id:
            kids[s.parent].append(s.id)
    lines = []

    def add(sid: str, depth: int) -> None:
        s = by_id[sid]
        lines.append(f"{'   ' * depth}{s.id}  {s.label or '-':<30} {s.size_bytes / 1024:6.0f} KiB  ({s.sandbox_id})")
        for k in kids[sid]:
            add(k, depth + 1)

    for s in snapshots:
        if s.parent not in by_id:
            add(s.id, 0)
    return lines


def remove_template() -> None:
    """Remove the tour's template (its snapshot goes with it)."""
    with Templates() as templates:
        try:
            templates.remove(TEMPLATE)
        except SandboxError:
            pass  # not there


def restore_pool(pool: Pool, before) -> None:
    if before is None:
        pool.drain(IMAGE)
    else:
        pool.set(IMAGE, before["min"], before["max"])
    os.unlink(POOL_FILE)


def cleanup_leftovers(pool: Pool) -> None:
    """What an earlier tour left if it was killed before its clean-up: sandboxes, snapshots,
    the template, its pool setting."""
    remove_template()
    if os.path.exists(POOL_FILE):
        with open(POOL_FILE) as f:
            restore_pool(pool, json.load(f))
        print("(restored the pool setting an earlier tour changed)")
    old = Sandbox.list(metadata=TAG)
    for info in old:
        try:
            old_sbx = Sandbox.connect(info.id)
            old_sbx.kill()
            old_sbx.close()
        except SandboxError:
            pass  # gone meanwhile
    with Snapshots() as snaps:
        stale = [s.id for s in snaps.list() if s.label == ROOT_LABEL]
        for sid in stale:
            snaps.delete(sid, subtree=True)
    if old or stale:
        print(f"(removed {len(old)} sandboxes and {len(stale)} snapshot trees left by an earlier tour)")


def main() -> None:
    t_start = time.perf_counter()
    pool = Pool()
    cleanup_leftovers(pool)
    made = []  # every Sandbox object the tour opened: killed in the finally below
    root_snapshot = None
    before = pool.stats().images.get(IMAGE)
    before = before and {"min": before.min, "max": before.max}
    pool_changed = False
    try:
        # ---------------------------------------------------------------- 1. basics
        step("1. a sandbox: commands, a live Python session, files")
        t0 = time.perf_counter()
        sbx = Sandbox.create(IMAGE, memory_mb=512, timeout=300, metadata=TAG)
        made.append(sbx)
        print(f"created {sbx.id} in {ms(t0)}")
        r = sbx.commands.run("uname -sr; id -u")
        print("commands.run:", " | ".join(r.stdout.split("\n")[:2]), f"(exit {r.exit_code})")
        sbx.files.write("/root/proj/stats.py", BUGGY)
        sbx.files.write("/root/proj/NOTES.md", "median() is wrong for even lengths\n")
        sbx.run_code("import sys; sys.path.insert(0, '/root/proj'); history = ['created']")
        print("files:", [e.name for e in sbx.files.list("/root/proj")],
              "| python variable history =", sbx.run_code("history").result)

        # ---------------------------------------------------------------- 2. checkpoint / rollback
        step("2. checkpoint, change files and variables, roll back")
        t0 = time.perf_counter()
        clean = sbx.checkpoint(ROOT_LABEL)
        root_snapshot = clean
        print(f"checkpoint {clean} in {ms(t0)} (files and the live session)")
        sbx.run_code("history.append('a bad idea'); scratch = list(range(10**6))")
        sbx.commands.run("rm /root/proj/stats.py; echo junk > /root/proj/junk.txt")
        print("changed:  history =", sbx.run_code("history").result,
              "| files:", [e.name for e in sbx.files.list("/root/proj")])
        t0 = time.perf_counter()
        rb = sbx.rollback(clean)
        print(f"rollback in {ms(t0)} (daemon: took_ms {rb.took_ms:.1f}, sessions restarted: {rb.sessions_restarted})")
        print("restored: history =", sbx.run_code("history").result,
              "| 'scratch' defined:", sbx.run_code("'scratch' in dir()").result,
              "| files:", [e.name for e in sbx.files.list("/root/proj")])
        assert sbx.run_code("history").result == "['created']"
        assert sbx.files.read("/root/proj/stats.py") == BUGGY and not sbx.files.exists("/root/proj/junk.txt")

        # ---------------------------------------------------------------- 3. fork N
        step("3. fork 4 children; each tries one fix and runs the tests")
        sbx.files.write("/root/proj/test_stats.py", TESTS)
        r = sbx.commands.run("cd /root/proj && python3 test_stats.py")
        print("parent, buggy median():", r.stdout.strip())
        tests_added = sbx.checkpoint("tests added")
        t0 = time.perf_counter()
        children = sbx.fork(4, snapshot=tests_added, timeout=300)
        made.extend(children)
        print(f"fork(4) of {tests_added} in {ms(t0)}: {[c.id for c in children]}")

        def try_fix(child, name, fix):
            child.files.write("/root/proj/stats.py", patched(fix))
            child.run_code(f"history.append({name!r})")  # each child's own copy of the session
            r = child.commands.run("cd /root/proj && python3 test_stats.py")
            score = int(r.stdout.split("/")[0])
            child.checkpoint(f"fix '{name}': {r.stdout.strip()}")
            return name, score, r.stdout.strip(), child.run_code("history").result

        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(try_fix, children, FIXES, FIXES.values()))
        for name, _, out, hist in results:
            print(f"  {name:<13} {out:<10} child's history = {hist}")
        best = max(results, key=lambda r: r[1])[0]
        print(f"best: '{best}'; parent's history is still", sbx.run_code("history").result)
        sbx.files.write("/root/proj/stats.py", patched(FIXES[best]))
        sbx.checkpoint(f"fixed ({best})")
        tree = {s.id: s for c in [sbx, *children] for s in c.snapshots()}  # the parent's and each child's
        for c in children:
            c.kill()

        # ---------------------------------------------------------------- 4. evaluate
        step("4. evaluate: run the tests without keeping their side effects")
        t0 = time.perf_counter()
        r = sbx.evaluate("cd /root/proj && python3 test_stats.py | tee report.txt")
        print(f"evaluate -> {r.stdout.strip()} (exit {r.exit_code}) in {ms(t0)}, in a throw-away copy")
        print("report.txt in the sandbox afterwards:", sbx.files.exists("/root/proj/report.txt"))

        # ---------------------------------------------------------------- 5. the tree
        step("5. the snapshot tree: the parent's snapshots and its children's (`branchbox snapshot ls`)")
        with Snapshots() as snaps:  # read again: a snapshot's size is measured just after its checkpoint
            for line in tree_lines([snaps.get(sid) for sid in tree]):
                print("  " + line)

        # ---------------------------------------------------------------- 6. warm pool
        step("6. warm pool: create + first command, claimed vs cold (median of 5)")

        def timed_create():
            t0 = time.perf_counter()
            s = Sandbox.create(IMAGE, timeout=60, metadata=TAG)
            made.append(s)
            s.commands.run("true")
            took = (time.perf_counter() - t0) * 1000
            s.kill()
            return took

        with open(POOL_FILE, "w") as f:
            json.dump(before, f)
        pool_changed = True
        pool.drain(IMAGE)
        cold = statistics.median(timed_create() for _ in range(5))
        pool.set(IMAGE, 2, 2)
        warm, hits = [], 0
        for _ in range(5):
            deadline = time.monotonic() + 30
            while pool.stats().ready(IMAGE) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # let the background refill catch up
            before_hits = pool.stats().hits
            warm.append(timed_create())
            hits += pool.stats().hits > before_hits
        print(f"cold {cold:.1f} ms, from the pool {statistics.median(warm):.1f} ms ({hits} of 5 were pool hits)")

        # ---------------------------------------------------------------- 7. template
        step("7. template: a recipe run once, its live session forked into each sandbox")
        recipe_code = "import decimal, fractions, json, statistics\nnumbers = [int(l) for l in open('/root/data/numbers.txt')]"
        t0 = time.perf_counter()
        with Templates() as templates:
            info = templates.build(TEMPLATE, image=IMAGE, run=["mkdir -p /root/data && seq 1 200000 > /root/data/numbers.txt"],
                                   code=recipe_code, shells=2, metadata=TAG)
        print(f"built template {info.name} ({info.snapshot}) in {ms(t0)}")
        t0 = time.perf_counter()
        fresh = Sandbox.create(IMAGE, timeout=60, metadata=TAG)
        made.append(fresh)
        fresh.commands.run("mkdir -p /root/data && seq 1 200000 > /root/data/numbers.txt")
        t1 = time.perf_counter()
        ex = fresh.run_code(recipe_code + "\nstatistics.median(numbers)")
        print(f"plain sandbox: imports + load + median() = {ex.result} in {ms(t1)} (create {(t1 - t0) * 1000:.1f} ms)")
        t0 = time.perf_counter()
        tsbx = Sandbox.create(template=TEMPLATE, timeout=60, metadata=TAG)
        made.append(tsbx)
        t1 = time.perf_counter()
        ex = tsbx.run_code("statistics.median(numbers)")  # no import, no file read: the recipe did both
        print(f"from the template: median() = {ex.result} in {ms(t1)} (create {(t1 - t0) * 1000:.1f} ms); "
              f"the session already holds `statistics` and {tsbx.run_code('len(numbers)').result} numbers")
    finally:
        for s in made:
            try:
                s.kill()
            except SandboxError:
                pass
            s.close()
        if root_snapshot:
            with Snapshots() as snaps:
                try:
                    snaps.delete(root_snapshot, subtree=True)
                except SandboxError:
                    pass
        remove_template()
        if pool_changed:
            restore_pool(pool, before)
        pool.close()
    print(f"\ncleaned up (sandboxes, snapshots, template, pool setting {IMAGE} "
          f"{'min %(min)d max %(max)d' % before if before else 'none'}); tour done in "
          f"{time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
