"""``branchbox bench cr`` without a daemon: the scripted tree search, the host-side model of
the sandbox (checked by replaying the script on an in-memory fake), the host parsers and the
JSON summary."""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from branchbox import CommandResult, Execution, Sandbox
from branchbox_bench import cr
from branchbox_cli import app as cli
from conftest import BASE, RESULT, SANDBOX, FakeDaemon, cli_runner

CHUNKS = 64
WORKLOADS = sorted(cr.WORKLOADS.values(), key=lambda w: w.key)


def originals_of(w: cr.Workload) -> Dict[str, str]:
    """Stand-ins for the workload's sources: every anchor and bug text, between other lines."""
    out = {rel: "# original %s\n" % rel for rel in w.edit_files}
    for spec in w.edits:
        if spec.anchor and spec.anchor not in out[spec.path]:
            out[spec.path] += "\n\n%s\n    pass\n" % spec.anchor
    for bug in w.bugs:
        if bug.old and bug.old not in out[bug.path]:
            out[bug.path] += "\n" + bug.old
    return out


# ----------------------------------------------------------------------------- the script


def test_search_tree_bookkeeping() -> None:
    t = cr.SearchTree()
    root = t.add(None, cr.NodeState())
    a = t.add(root, cr.NodeState(step=1))
    b = t.add(a, cr.NodeState(step=2))
    c = t.add(root, cr.NodeState(step=3))
    assert (root, a, b, c) == (0, 1, 2, 3) and len(t) == 4
    assert t.ancestors(b) == [a, root] and t.ancestors(root) == []
    assert t.path(b) == [root, a, b] and t.path(c) == [root, c]
    assert t.depth(b) == 2 and t.depth(root) == 0
    with pytest.raises(KeyError):
        t.add(99, cr.NodeState())


def test_apply_edit() -> None:
    assert cr.apply_edit("ab", "", "c") == "abc"
    assert cr.apply_edit("x = 1\ny = 2\ny = 2\n", "y = 2\n", "# n\ny = 2\n") == "x = 1\n# n\ny = 2\ny = 2\n"
    with pytest.raises(ValueError):
        cr.apply_edit("abc", "z", "q")


def test_node_state_model() -> None:
    st = cr.NodeState(
        edits=(("a.py", "", "x\n"), ("b.py", "", "y\n"), ("a.py", "B\n", "z\nB\n"), ("a.py", "B\n", "B!\n")),
        new_files=(("tests/test_bench_3.py", "..."), ("tests/utils_tests/test_bench_4.py", "...")),
        heap_writes=((5, 1), (7, 2), (5, 3)),
    )
    assert st.file_text("a.py", "A\nB\n") == "A\nz\nB!\nx\n"
    assert st.file_text("c.py", "C\n") == "C\n"
    assert st.bench_modules() == ["tests.test_bench_3", "tests.utils_tests.test_bench_4"]
    assert st.heap_overrides() == {5: 3, 7: 2}
    mi, dj = cr.WORKLOADS["more-itertools"], cr.WORKLOADS["django"]
    assert mi.test_command(("t.A", "t.B"), st) == (
        "python3 -m unittest -q t.A t.B tests.test_bench_3 tests.utils_tests.test_bench_4"
    )
    assert dj.test_command(("utils_tests.test_text",), st).endswith(
        "tests/runtests.py --parallel 1 -v 0 utils_tests.test_text test_bench_3 utils_tests.test_bench_4"
    )


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.key)
def test_workload_definitions(w: cr.Workload) -> None:
    assert cr.get_workload(w.key) is w and w.name == w.sdist.requirement
    assert not w.sdist.wheel and all(d.wheel for d in w.deps)
    assert all(len(a.sha256) == 64 for a in w.artifacts)
    assert w.edits and w.bugs and w.test_targets and w.quick_test_targets
    # Every test run must catch every bug: the targets share the module the bugs break.
    for targets in (w.test_targets, w.quick_test_targets):
        assert set.intersection(*(set(t) for t in targets))
    for spec in w.edits:
        old, new = spec.render(7)
        assert old == spec.anchor and new.endswith(spec.anchor) and len(new) > len(old)
        assert spec.anchor not in new[: -len(spec.anchor) or None] or not spec.anchor
    for bug in w.bugs:
        old, new = bug.render(7)
        assert cr.BUG_MARK in new and "step 7" in new and old == bug.old
    path, content = w.new_test(12)
    assert path == "%s/test_bench_12.py" % w.new_test_dir and "BenchStep12Tests" in content
    compile(content, path, "exec")
    w.check_sources(originals_of(w))
    if any(spec.anchor for spec in w.edits) or any(bug.old for bug in w.bugs):
        with pytest.raises(cr.BenchError, match="does not fit"):
            w.check_sources({rel: "" for rel in w.edit_files})
    with pytest.raises(cr.BenchError, match="unknown workload"):
        cr.get_workload("nope")


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.key)
def test_edits_on_the_real_sources(w: cr.Workload) -> None:
    """With the sdist in the cache (no download here): the anchors and bug texts are in the
    real sources, and every edit, repeated, and every bug leave them valid Python."""
    for d in cr.cache_dirs():
        path = os.path.join(d, w.sdist.filename)
        if os.path.isfile(path):
            break
    else:
        pytest.skip("%s is not in the bench cache" % w.sdist.filename)
    originals, n_files, n_bytes = cr.sdist_sources(path, w.edit_files)
    assert n_files > 10 and n_bytes > 100 * 1024
    w.check_sources(originals)
    texts = dict(originals)
    for step, spec in enumerate(w.edits * 3, 1):
        old, new = spec.render(step)
        texts[spec.path] = cr.apply_edit(texts[spec.path], old, new)
    for rel, text in texts.items():
        compile(text, rel, "exec")
    for bug in w.bugs:
        old, new = bug.render(99)
        compile(cr.apply_edit(texts[bug.path], old, new), bug.path, "exec")


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.key)
def test_generate_script_is_deterministic_and_consistent(w: cr.Workload) -> None:
    s1 = cr.generate_script(7, 60, CHUNKS, workload=w)
    s2 = cr.generate_script(7, 60, CHUNKS, workload=w)
    assert s1.ops == s2.ops and s1.workload is w
    assert cr.generate_script(8, 60, CHUNKS, workload=w).ops != s1.ops
    tree = s1.tree
    assert len(tree) == 60 and s1.count("checkpoint") == 60
    assert s1.count("rollback") >= 20 and s1.count("prune") >= 1 and s1.count("fork") >= 1
    common = set.intersection(*(set(t) for t in w.test_targets))

    checkpointed: Set[int] = set()
    cur = None
    bugged = False
    texts = originals_of(w)
    edited: Set[str] = set()
    for i, op in enumerate(s1.ops):
        if op.kind == "checkpoint":
            assert op.node not in checkpointed
            if cur is not None:
                assert tree.parent[op.node] == cur
            checkpointed.add(op.node)
            cur = op.node
            assert tree.depth(cur) <= 20
            bugged = tree.states[cur].bug
            assert {rel: tree.states[cur].file_text(rel, originals_of(w)[rel]) for rel in texts} == texts
        elif op.kind == "rollback":
            assert op.node in tree.ancestors(cur)  # only ever to an ancestor
            assert not tree.states[op.node].bug
            assert s1.ops[i + 1] == cr.Op("verify", node=op.node)  # every rollback is checked
            cur = op.node
            bugged = False
            texts = {rel: tree.states[cur].file_text(rel, originals_of(w)[rel]) for rel in texts}
        elif op.kind == "edit":
            assert op.path in w.edit_files
            bugged = bugged or cr.BUG_MARK in op.text
            texts[op.path] = cr.apply_edit(texts[op.path], op.old, op.text)
            edited.add(op.path)
        elif op.kind in ("test", "fork"):
            assert op.expect_ok is (not bugged)
            assert op.text.startswith(w.test_prefix)
            assert common & set(op.text[len(w.test_prefix) :].split())
        if op.kind in ("verify", "prune", "fork"):
            assert op.node == cur
        if op.kind == "checkpoint" and tree.states[op.node].bug:
            # A bug is always rolled back right after its checkpoint (and the tests failed).
            rest = [o.kind for o in s1.ops[i + 1 :] if o.kind not in ("verify", "fork")]
            assert rest[0] == "rollback"
    assert any(tree.states[n].bug for n in tree.states)  # the seed exercises a bug
    assert len(edited) >= min(3, len(w.edit_files))  # edits spread over the sources
    assert s1.count("new_file") >= 1


def test_generate_script_uses_the_given_targets() -> None:
    w = cr.WORKLOADS["django"]
    s = cr.generate_script(3, 30, CHUNKS, workload=w, test_targets=w.quick_test_targets)
    labels = {lab for op in s.ops if op.kind == "test" for lab in op.text[len(w.test_prefix) :].split()}
    assert labels and labels <= {lab for t in w.quick_test_targets for lab in t} | {
        w.test_label(m) for n in s.tree.states for m in s.tree.states[n].bench_modules()
    }


def test_generate_script_rejects_tiny_runs() -> None:
    with pytest.raises(ValueError):
        cr.generate_script(1, 1, CHUNKS)
    with pytest.raises(ValueError):
        cr.generate_script(1, 10, 0)


def test_rollback_targets_of_a_limited_replay() -> None:
    s = cr.generate_script(3, 40, CHUNKS)
    assert cr.rollback_targets(s, None, None) is None
    first = [op.node for op in s.ops if op.kind == "rollback"]
    got = cr.rollback_targets(s, 1, 2)
    assert got == set(first[:2])
    assert cr.rollback_targets(s, 10**6, 10**6) == set(first)


def _fake_module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def _run_python(ns: Dict[str, Any], code: str) -> Any:
    """Like the session server: exec, and the repr of a trailing expression."""
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<session>", "exec"), ns)
    if last is None:
        return None
    return repr(eval(compile(ast.Expression(last.value), "<session>", "eval"), ns))


@pytest.fixture
def fake_projects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modules the workloads' session code imports."""
    take = lambda n, iterable: list(itertools.islice(iterable, n))  # noqa: E731
    slugify = lambda v: "-".join(str(v).lower().split())  # noqa: E731
    monkeypatch.setitem(sys.modules, "more_itertools", _fake_module("more_itertools", take=take))
    text = _fake_module("django.utils.text", slugify=slugify)
    utils = _fake_module("django.utils", text=text)
    monkeypatch.setitem(sys.modules, "django", _fake_module("django", utils=utils))
    monkeypatch.setitem(sys.modules, "django.utils", utils)
    monkeypatch.setitem(sys.modules, "django.utils.text", text)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the set-up code inserts into it


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.key)
def test_session_code_matches_the_host_model(fake_projects: None, w: cr.Workload) -> None:
    """The checksum the session computes equals the one predicted on the host."""
    ns: Dict[str, Any] = {}
    assert _run_python(ns, cr.session_setup_code(CHUNKS, w)) == str(CHUNKS)
    assert sys.path[:2] == [cr.PROJECT_DIR, cr.SITE_DIR]
    st = cr.NodeState()
    assert ast.literal_eval(_run_python(ns, "_bench_check(%r)" % cr.verify_indices(st, CHUNKS))) == cr.expected_check(st, CHUNKS)
    for step in (1, 2, 3, 9, 64, 65):
        idx = cr.heap_index(step, CHUNKS)
        assert int(_run_python(ns, cr.session_step_code(step, idx, w))) > 0
        st = cr.NodeState(step=step, path=st.path + (step,), heap_writes=st.heap_writes + ((idx, step),))
    got = ast.literal_eval(_run_python(ns, "_bench_check(%r)" % cr.verify_indices(st, CHUNKS)))
    assert got == cr.expected_check(st, CHUNKS)
    assert all(len(b) == cr.HEAP_CHUNK for b in ns["heap"])
    assert cr.heap_checksum([0, 1], {}) != cr.heap_checksum([0, 1], {1: 5})


# ----------------------------------------------------------------------------- replay on a fake


class FakeSandbox:
    """Files in a dict; ``commands.run`` understands the workload's test command."""

    def __init__(self, files: Dict[str, str], workload: cr.Workload) -> None:
        self.id = "sb-fake"
        self.fs = dict(files)
        self.workload = workload
        self.commands = SimpleNamespace(run=self._run)
        self.files = SimpleNamespace(write=self._write, read=self._read, list=self._list)

    def _write(self, path: str, data: Any) -> None:
        self.fs[path] = data

    def _read(self, path: str) -> str:
        return self.fs[path]

    def _list(self, path: str) -> List[Any]:
        prefix = path.rstrip("/") + "/"
        names = {p[len(prefix) :].split("/")[0] for p in self.fs if p.startswith(prefix)}
        return [SimpleNamespace(name=n) for n in sorted(names)]

    def _run(self, cmd: str, cwd: Optional[str] = None, timeout: Any = None) -> CommandResult:
        w = self.workload
        assert cmd.startswith(w.test_prefix) and cwd == cr.PROJECT_DIR
        for label in cmd[len(w.test_prefix) :].split():
            if "test_bench_" in label:
                module = w.label_strip + label
                if "%s/%s.py" % (cr.PROJECT_DIR, module.replace(".", "/")) not in self.fs:
                    return CommandResult(exit_code=1, stderr="ModuleNotFoundError: %s" % label)
        if any(cr.BUG_MARK in self.fs["%s/%s" % (cr.PROJECT_DIR, rel)] for rel in w.edit_files):
            return CommandResult(exit_code=1, stderr="FAIL: test_slugify")
        return CommandResult(exit_code=0)


class FakeBackend(cr._Backend):
    """Copies files and replays session inputs (an in-memory copytree). ``lose_file_on`` makes
    that rollback forget to restore the files: the replay must notice."""

    name = "fake"

    def __init__(self, workload: cr.Workload, lose_file_on: Optional[int] = None) -> None:
        self.workload = workload
        self.lose_file_on = lose_file_on
        self.rollbacks = 0
        self.saved: Dict[int, Tuple[Dict[str, str], List[str]]] = {}
        self.checkpoints: List[int] = []
        self.pruned: List[Set[int]] = []
        self.forks: List[Tuple[int, int, bool]] = []

    def setup(self, files: Any, setup_code: str) -> None:
        originals = originals_of(self.workload)
        fs = {"%s/%s" % (cr.PROJECT_DIR, rel): text for rel, text in originals.items()}
        fs["%s/%s/__init__.py" % (cr.PROJECT_DIR, self.workload.new_test_dir)] = ""
        self.sbx = FakeSandbox(fs, self.workload)  # type: ignore[assignment]
        self.ns: Dict[str, Any] = {}
        self.inputs: List[str] = []
        self.session(setup_code)

    def session(self, code: str, record: bool = True) -> Any:
        result = _run_python(self.ns, code)
        if record:
            self.inputs.append(code)
        return Execution(result=result)

    def checkpoint(self, node: int) -> Optional[float]:
        self.checkpoints.append(node)
        self.saved[node] = (dict(self.sandbox.fs), list(self.inputs))  # type: ignore[attr-defined]
        return 0.5

    def rollback(self, node: int) -> Tuple[Optional[float], bool]:
        self.rollbacks += 1
        files, inputs = self.saved[node]
        if self.rollbacks != self.lose_file_on:
            self.sandbox.fs = dict(files)  # type: ignore[attr-defined]
        self.ns, self.inputs = {}, []
        for code in inputs:
            self.session(code)
        return 0.25, False

    def prune(self, keep: Set[int]) -> None:
        self.pruned.append(set(keep))
        for k in [k for k in self.saved if k not in keep]:
            del self.saved[k]

    def fork_run(self, node: int, n: int, cmd: str, expect_ok: bool, pool: ThreadPoolExecutor) -> Optional[List[Any]]:
        self.forks.append((node, n, expect_ok))
        return []

    def close(self) -> None:
        pass


def _replay(backend: FakeBackend, script: cr.Script, **kw: Any) -> cr.Phase:
    backend.setup(b"", cr.session_setup_code(CHUNKS, script.workload))
    with ThreadPoolExecutor(2) as pool:
        return cr.Replay(backend, script, originals_of(script.workload), CHUNKS, pool, lambda _m: None).run(**kw)


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.key)
def test_replay_on_a_faithful_fake_passes_every_check(fake_projects: None, w: cr.Workload) -> None:
    script = cr.generate_script(3, 40, CHUNKS, workload=w)
    b = FakeBackend(w)
    ph = _replay(b, script)
    assert len(ph.ckpt_ms) == 40 and ph.ckpt_server_ms == [0.5] * 40
    assert len(ph.rollback_ms) == script.count("rollback") == b.rollbacks
    assert ph.rollback_server_ms == [0.25] * b.rollbacks
    assert ph.verifications == script.count("verify") and ph.test_runs == script.count("test")
    assert len(ph.test_ms) == ph.test_runs
    assert ph.failing_test_runs >= 1 and ph.sessions_restarted == 0
    assert len(b.pruned) == script.count("prune") and len(b.forks) == script.count("fork")
    assert len(ph.search_fork_ms) == script.count("fork")


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.key)
def test_replay_detects_a_rollback_that_lost_files(fake_projects: None, w: cr.Workload) -> None:
    script = cr.generate_script(3, 40, CHUNKS, workload=w)
    with pytest.raises(cr.BenchError, match="differs from node|holds|expected"):
        _replay(FakeBackend(w, lose_file_on=2), script)


def test_replay_stops_at_the_baseline_limits(fake_projects: None) -> None:
    script = cr.generate_script(3, 40, CHUNKS)
    b = FakeBackend(script.workload)
    ph = _replay(b, script, max_ckpt=4, max_rollback=3)
    assert len(ph.ckpt_ms) == 4 and len(ph.rollback_ms) == 3
    # Untimed checkpoints are only taken for the nodes the replay rolls back to.
    needed = cr.rollback_targets(script, 4, 3)
    assert needed is not None and set(b.checkpoints[4:]) <= needed


# ----------------------------------------------------------------------------- host parsers

MOUNTINFO = (
    "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "95 27 0:52 / /var/lib/bb\\040x/sandboxes/sb-0123/rootfs-3 rw,nodev - overlay branchbox "
    "rw,lowerdir+=/var/lib/bb\\040x/snaplayers/sl-1,upperdir=/var/lib/bb\\040x/snaplayers/sl-2\n"
    "96 22 7:0 / /var/tmp/x/mnt rw - xfs /dev/loop0 rw,attr2\n"
)


def test_mountinfo_helpers() -> None:
    mounts = cr.parse_mountinfo(MOUNTINFO)
    assert mounts[1][0] == "/var/lib/bb x/sandboxes/sb-0123/rootfs-3" and mounts[1][1] == "overlay"
    assert cr.state_dir_of("sb-0123", MOUNTINFO) == "/var/lib/bb x"
    assert cr.state_dir_of("sb-0124", MOUNTINFO) is None
    assert cr.fs_type_of("/var/tmp/x/mnt/state", MOUNTINFO) == "xfs"
    assert cr.fs_type_of("/var/tmp/x/mntx", MOUNTINFO) == "ext4"
    assert cr.fs_type_of("/var/lib/bb x", MOUNTINFO) == "ext4"


def test_private_kib_and_cgroup_lookup(tmp_path) -> None:
    rollup = "Rss:  1000 kB\nPss:  500 kB\nPrivate_Clean:  12 kB\nPrivate_Dirty:  30 kB\nShared_Clean: 900 kB\n"
    assert cr.private_kib(rollup) == 42 and cr.pss_kib(rollup) == 500 and cr.pss_kib("Rss: 1 kB\n") == 0
    (tmp_path / "pids" / "bb" / "sb-1").mkdir(parents=True)  # v1: one dir per controller
    (tmp_path / "pids" / "bb" / "sb-1" / "cgroup.procs").write_text("1\n2\n")
    (tmp_path / "memory" / "bb" / "sb-1").mkdir(parents=True)
    (tmp_path / "memory" / "bb" / "sb-1" / "cgroup.procs").write_text("1\n2\n")
    (tmp_path / "bb2" / "sb-2").mkdir(parents=True)  # v2
    (tmp_path / "bb2" / "sb-2" / "cgroup.procs").write_text("3\n")
    assert len(cr.cgroup_procs_files("sb-1", str(tmp_path))) == 2
    assert cr.cgroup_procs_files("sb-2", str(tmp_path)) == [str(tmp_path / "bb2" / "sb-2" / "cgroup.procs")]
    assert cr.sandbox_private_mb("sb-9", str(tmp_path)) is None
    assert cr.sandbox_memory_mb("sb-9", str(tmp_path)) is None
    me = os.getpid()
    (tmp_path / "bb2" / "sb-3").mkdir(parents=True)
    (tmp_path / "bb2" / "sb-3" / "cgroup.procs").write_text("%d\n" % me)
    mem = cr.sandbox_memory_mb("sb-3", str(tmp_path))
    assert mem is not None and mem[0] > 0 and mem[1] > 0  # this process, read like a sandbox's
    assert cr.sandbox_private_mb("sb-3", str(tmp_path)) == pytest.approx(mem[0], rel=0.5)


def test_daemon_args_and_image_config() -> None:
    argv = ["branchboxd", "--state-dir", "/s", "--socket=/x.sock", "--kill-on-exit", "--init-bin", "/i"]
    assert cr.daemon_args(argv) == {"--state-dir": "/s", "--socket": "/x.sock", "--kill-on-exit": "", "--init-bin": "/i"}
    cfg = cr.docker_save_config("sha256:ab", arch="x86_64")
    assert cfg["architecture"] == "amd64" and cfg["rootfs"]["diff_ids"] == ["sha256:ab"]
    assert cr.docker_save_config("sha256:ab", arch="aarch64")["architecture"] == "arm64"


def test_probe_reflink_runs_anywhere(tmp_path) -> None:
    assert cr.probe_reflink(str(tmp_path)) in (True, False, None)
    assert cr.probe_reflink(str(tmp_path / "missing")) is None


# ----------------------------------------------------------------------------- summary


def _fake_result() -> cr.CrResult:
    res = cr.CrResult(seed=4, heap_mb=50.0, heap_rss_mb=60.0, project_files=6890, project_kib=44104.0)
    res.workdir_files, res.workdir_kib = 7500, 52000.0
    res.branchbox = cr.Phase(
        "branchbox", ckpt_ms=[2.0, 4.0, 6.0], ckpt_server_ms=[1.0, 2.0], rollback_ms=[3.0, 5.0], test_ms=[500.0]
    )
    res.copytree = cr.Phase("copytree", ckpt_ms=[120.0, 120.0], rollback_ms=[400.0])
    res.commit = cr.Phase("commit", ckpt_ms=[60.0], rollback_ms=[800.0])
    res.fork = {
        "n16_ms": 40.0,
        "n64_ms": 150.0,
        "child_private_mb": 1.5,
        "child_pss_mb": 4.5,
        "n16_samples_ms": [40.0],
        "n16_server_ms": 30.0,
        "n64_server_ms": 120.0,
        "n16_isolated_ms": 300.0,
        "n16_isolated_server_ms": 280.0,
        "n16_files_only_ms": 80.0,
        "children_sessions_restarted": False,
        "children_verified": 9,
    }
    res.warm = {k: 1.0 for k in cr.WARM_KEYS}
    res.warm.update(
        cold_first_touch_ms=16.0,
        warm_first_touch_ms=1.5,
        cold_first_touch_samples_ms=[16.0, 17.0],
        warm_first_touch_samples_ms=[1.5, 1.4],
        warm_children=2,
        warm_touch_fraction=0.25,
    )
    res.write_amp = {
        "xfs_bytes_per_edit": 8192,
        "default_fs_bytes_per_edit": 67108864,
        "xfs_reflink_supported": True,
        "xfs_fs_type": "xfs",
        "xfs_bytes_per_edit_samples": [8192],
        "xfs_layer_bytes_per_edit": 67108864,
        "default_fs_type": "ext4",
        "default_fs_reflink_supported": False,
        "default_fs_bytes_per_edit_samples": [67108864],
        "default_fs_layer_bytes_per_edit": 67108864,
    }
    res.branchbox.search_fork_ms = [900.0]
    res.notes = ["a note"]
    return res


def test_summary_shape_and_ratios() -> None:
    s = _fake_result().summary()
    assert tuple(s)[: len(cr.SUMMARY_KEYS)] == cr.SUMMARY_KEYS
    assert s["workload"] == "Django==5.2.8" and s["workload_deps"] == ["asgiref==3.8.1", "sqlparse==0.5.3"]
    assert s["project_files"] == 6890 and s["workdir_files"] == 7500 and s["test_run_ms_p50"] == 500.0
    assert s["ckpt_ms_p50"] == 4.0 and s["rollback_ms_p50"] == 4.0
    assert s["ckpt_speedup_vs_copytree"] == 30.0 and s["rollback_speedup_vs_copytree"] == 100.0
    assert s["ckpt_speedup_vs_commit"] == 15.0 and s["rollback_speedup_vs_commit"] == 200.0
    assert s["fork_n16_ms"] == 40.0 and s["child_private_mb"] == 1.5 and s["xfs_reflink_supported"] is True
    assert s["targets_met"] == {
        "ckpt_p50_le_5ms": True,
        "rollback_p50_le_5ms": True,
        "fork_n16_le_50ms": True,
        "ckpt_speedup_ge_30x": True,
        "rollback_speedup_ge_30x": True,
    }
    assert s["child_pss_mb"] == 4.5 and s["fork_n16_isolated_ms"] == 300.0 and s["fork_n16_files_only_ms"] == 80.0
    assert s["fork_children_sessions_restarted"] is False and s["fork_children_verified"] == 9
    assert s["cold_first_touch_ms"] == 16.0 and s["warm_first_touch_ms"] == 1.5
    json.dumps(s)
    labels = [row[0] for row in _fake_result().rows()]
    assert "fork n=16 isolated (fresh sessions)" in labels and "fork child: first heap writes (cold)" in labels


def test_restarted_fork_sessions_fail_the_fork_target() -> None:
    res = _fake_result()
    res.fork["children_sessions_restarted"] = True
    s = res.summary()
    assert s["fork_n16_ms"] == 40.0 and s["fork_children_sessions_restarted"] is True
    assert s["targets_met"]["fork_n16_le_50ms"] is False
    res.fork["n16_ms"] = None
    assert res.summary()["targets_met"]["fork_n16_le_50ms"] is False


def test_summary_with_missing_measurements() -> None:
    res = cr.CrResult()
    s = res.summary()
    assert all(s[k] is None for k in cr.SUMMARY_KEYS)
    assert set(s["targets_met"].values()) == {None}
    # Fork and async-warm details are always there too (null when not measured).
    assert all(s[k] is None for k in cr.WARM_KEYS) and s["child_pss_mb"] is None
    assert all(s["fork_" + k] is None for k in cr.FORK_DETAIL_KEYS if k != "child_pss_mb")
    assert cr.ratio(10.0, 0.0) is None and cr.ratio(None, 1.0) is None


def test_quick_config() -> None:
    q = cr.CrConfig.make(True, seed=3, xfs=None)
    full = cr.CrConfig()
    assert q.quick and not q.xfs and q.checkpoints < full.checkpoints and q.seed == 3
    assert q.baseline_limits == (1, 1) and full.baseline_limits == (5, 5)
    assert cr.CrConfig(workload="more-itertools").baseline_limits == (10, 10)
    assert cr.CrConfig.make(False, baseline_ckpt=3).baseline_limits == (3, 5)
    assert cr.CrConfig.make(True, xfs=True).xfs
    assert cr.CrConfig.make(False, checkpoints=None).checkpoints == 80
    assert full.workload == cr.DEFAULT_WORKLOAD == "django"
    dj = cr.WORKLOADS["django"]
    assert full.test_targets == dj.test_targets and q.test_targets == dj.quick_test_targets
    assert cr.CrConfig.make(True, workload="more-itertools").test_targets == cr.WORKLOADS["more-itertools"].quick_test_targets
    assert q.warm_children == 2 and full.warm_children == 4 and q.fork_n16_reps == 1 and full.fork_n16_reps == 3
    assert cr.CrConfig.make(True, warm_children=0).warm_children == 0


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Dict[str, Any] = {}

    def fake_run(cfg: cr.CrConfig, progress: Any = None) -> cr.CrResult:
        seen["cfg"] = cfg
        progress("working")
        return _fake_result()

    monkeypatch.setattr(cr, "run_cr_bench", fake_run)
    runner = cli_runner()
    r = runner.invoke(cli.app, ["--daemon", "unix:///x.sock", "bench", "cr", "--quick", "--seed", "9"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert tuple(summary)[: len(cr.SUMMARY_KEYS)] == cr.SUMMARY_KEYS
    assert any("speedup vs copytree" in line for line in lines[:-1])
    cfg = seen["cfg"]
    assert cfg.quick and cfg.seed == 9 and cfg.daemon == "unix:///x.sock" and not cfg.xfs
    assert cfg.workload == "django"

    r = runner.invoke(cli.app, ["bench", "cr", "--json", "--workload", "more-itertools"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1
    assert seen["cfg"].workload == "more-itertools" and not seen["cfg"].quick and seen["cfg"].warm_children == 4

    r = runner.invoke(cli.app, ["bench", "cr", "--json", "--quick", "--warm-children", "0"])
    assert r.exit_code == 0 and seen["cfg"].warm_children == 0

    r = runner.invoke(cli.app, ["bench", "cr", "--workload", "sympy"])
    assert r.exit_code == 2 and "more-itertools" in r.stderr


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg: cr.CrConfig, progress: Any = None) -> cr.CrResult:
        raise cr.BenchError("bench[branchbox]: more.py differs from node 3's")

    monkeypatch.setattr(cr, "run_cr_bench", broken)
    r = cli_runner().invoke(cli.app, ["bench", "cr", "--quick"])
    assert r.exit_code == 1 and "differs from node 3" in r.stderr


# ----------------------------------------------------------------------------- fork and async warm


@pytest.mark.parametrize("isolated", [False, True])
def test_fork_and_run_through_the_public_sdk(fake: FakeDaemon, isolated: bool) -> None:
    kids_json = [dict(SANDBOX, id="sb-kid%d" % i) for i in range(2)]
    fake.on("POST", BASE + "/fork", {"snapshot": "sn-2", "sandboxes": kids_json, "sessions_restarted": isolated, "took_ms": 7.5}, 201)
    for k in kids_json:
        fake.on("POST", "/v1/sandboxes/%s/commands" % k["id"], RESULT)
    sbx = Sandbox.create(transport=fake.transport())
    with ThreadPoolExecutor(2) as pool:
        kids, results, timing = cr.fork_and_run(sbx, "sn-2", 2, "true", pool, isolated=isolated)
    fork_bodies = [json.loads(r.content) for r in fake.requests if r.url.path == BASE + "/fork"]
    want = {"count": 2, "snapshot": "sn-2", "timeout": cr.FORK_TTL}
    assert fork_bodies == [dict(want, isolated=True) if isolated else want]
    assert [k.id for k in kids] == ["sb-kid0", "sb-kid1"] and all(r.exit_code == 0 for r in results)
    assert timing["server_ms"] == 7.5 and timing["sessions_restarted"] is isolated
    assert 0 <= timing["fork_ms"] <= timing["wall_ms"]


class FakeKid:
    """A forked child whose default session is a namespace (a copy of the parent's, or a fresh
    one); it records the code it ran. The pre-fault is simulated (it would madvise this test
    process)."""

    pf_result: Dict[str, Any] = {"ms": 30.0, "cpu_ms": 25.0, "bytes": 60 << 20, "failed_bytes": 0, "errno": 0}

    def __init__(self, i: int, ns: Optional[Dict[str, Any]]) -> None:
        self.id = "sb-kid%d" % i
        self.ns: Dict[str, Any] = {} if ns is None else dict(ns, heap=list(ns["heap"]), state=dict(ns["state"]))
        self.ran: List[str] = []
        self.killed = False

    def run_code(self, code: str, timeout: Any = None) -> Execution:
        self.ran.append(code)
        if code == cr.PREFAULT_CODE:
            self.ns["_bench_pf"] = dict(self.pf_result)
            self.ns["_bench_time"] = __import__("time")
            return Execution(result=str(60 << 20))
        try:
            return Execution(result=_run_python(self.ns, code))
        except Exception as e:  # noqa: BLE001 - like the session server
            return Execution(error=SimpleNamespace(name=type(e).__name__, value=str(e)))

    def kill(self) -> None:
        self.killed = True

    def close(self) -> None:
        pass


def _parent_ns(step: int = 3) -> Tuple[Dict[str, Any], cr.NodeState]:
    ns: Dict[str, Any] = {}
    _run_python(ns, cr.session_setup_code(CHUNKS, cr.WORKLOADS["more-itertools"]))
    st = cr.NodeState()
    for s in range(1, step + 1):
        idx = cr.heap_index(s, CHUNKS)
        _run_python(ns, cr.session_step_code(s, idx, cr.WORKLOADS["more-itertools"]))
        st = cr.NodeState(step=s, path=st.path + (s,), heap_writes=st.heap_writes + ((idx, s),))
    return ns, st


@pytest.fixture
def fake_fork(monkeypatch: pytest.MonkeyPatch, fake_projects: None) -> Dict[str, Any]:
    """``fork_and_run`` and the host's memory readings replaced: children are :class:`FakeKid`s
    with copies of a parent namespace (``fresh``: empty sessions; ``restarted``: what the API
    says)."""
    ns, st = _parent_ns()
    ctl: Dict[str, Any] = {"ns": ns, "state": st, "forks": [], "kids": [], "fresh": False, "restarted": False}

    def fork_and_run(sbx: Any, snapshot: Any, n: int, cmd: str, pool: Any, **kw: Any) -> Any:
        ctl["forks"].append((snapshot, n, kw.get("isolated", False)))
        fresh = ctl["fresh"] or kw.get("isolated", False)
        kids = [FakeKid(len(ctl["kids"]) + i, None if fresh else ctl["ns"]) for i in range(n)]
        ctl["kids"].extend(kids)
        timing = {
            "wall_ms": 10.0 * n,
            "fork_ms": 5.0 * n,
            "server_ms": 4.0 * n,
            "sessions_restarted": ctl["restarted"] or kw.get("isolated", False),
        }
        return kids, [], timing

    def memory(sid: str, root: str = "") -> Tuple[float, float]:
        kid = next(k for k in ctl["kids"] if k.id == sid)
        prefaulted = cr.PREFAULT_CODE in kid.ran
        touched = any("_bench_t0" in c for c in kid.ran)
        private = 60.0 if prefaulted else (25.0 if touched else 1.5)
        return private, private + 3.0

    monkeypatch.setattr(cr, "fork_and_run", fork_and_run)
    monkeypatch.setattr(cr, "sandbox_memory_mb", memory)
    ctl["sleeps"] = []
    monkeypatch.setattr(cr.time, "sleep", ctl["sleeps"].append)
    return ctl


def _bb() -> Any:
    return SimpleNamespace(sandbox=SimpleNamespace(id="sb-parent"), sids={7: "sn-7"}, files_only_sid="sn-0")


def _check_of(st: cr.NodeState) -> Tuple[str, Tuple[int, ...]]:
    return "_bench_check(%r)" % (cr.verify_indices(st, CHUNKS),), cr.expected_check(st, CHUNKS)


def test_measure_forks_checks_the_children_sessions(fake_fork: Dict[str, Any]) -> None:
    cfg = cr.CrConfig(fork_n16_reps=3)
    notes: List[str] = []
    with ThreadPoolExecutor(4) as pool:
        out = cr.measure_forks(_bb(), 7, _check_of(fake_fork["state"]), cfg, pool, lambda _m: None, notes)
    # Three live fork(16), one live fork(64), then isolated and files-only fork(16).
    assert fake_fork["forks"] == [("sn-7", 16, False)] * 3 + [("sn-7", 64, False), ("sn-7", 16, True), ("sn-0", 16, False)]
    assert out["n16_ms"] == 160.0 and out["n16_samples_ms"] == [160.0] * 3 and out["n64_ms"] == 640.0
    assert out["n16_isolated_ms"] == 160.0 and out["n16_files_only_ms"] == 160.0
    assert out["child_private_mb"] == 1.5 and out["child_pss_mb"] == 4.5
    assert out["children_sessions_restarted"] is False and out["children_verified"] == 4 * 3 and not notes
    # 0.3 s idle before the memory reading; a pause before every fork but the first.
    assert fake_fork["sleeps"] == [0.3] + [cfg.fork_pause_s] * 5
    kids = fake_fork["kids"]
    checked = [i for i, k in enumerate(kids[:16]) if any(c.startswith("_bench_check") for c in k.ran)]
    assert checked == [0, 8, 15]  # the first, the middle and the last child
    assert all(k.killed for k in kids)


def test_measure_forks_fails_on_a_silent_restart(fake_fork: Dict[str, Any]) -> None:
    fake_fork["fresh"] = True  # fresh sessions, but the API says sessions_restarted: false
    with ThreadPoolExecutor(4) as pool, pytest.raises(cr.BenchError, match="no copy of the parent's session"):
        cr.measure_forks(_bb(), 7, _check_of(fake_fork["state"]), cr.CrConfig(), pool, lambda _m: None, [])
    assert all(k.killed for k in fake_fork["kids"])


def test_measure_forks_fails_on_another_state(fake_fork: Dict[str, Any]) -> None:
    _, older = _parent_ns(step=2)  # the parent is at step 3
    with ThreadPoolExecutor(4) as pool, pytest.raises(cr.BenchError, match="has session state"):
        cr.measure_forks(_bb(), 7, _check_of(older), cr.CrConfig(), pool, lambda _m: None, [])


def test_measure_forks_reports_an_announced_restart(fake_fork: Dict[str, Any]) -> None:
    fake_fork["fresh"] = fake_fork["restarted"] = True
    notes: List[str] = []
    with ThreadPoolExecutor(4) as pool:
        out = cr.measure_forks(_bb(), 7, _check_of(fake_fork["state"]), cr.CrConfig(), pool, lambda _m: None, notes)
    assert out["children_sessions_restarted"] is True and out["children_verified"] == 0
    assert notes and "sessions_restarted: true" in notes[0]
    res = _fake_result()
    res.fork = out
    assert res.summary()["targets_met"]["fork_n16_le_50ms"] is False


def test_measure_warm_with_fake_children(fake_fork: Dict[str, Any]) -> None:
    cfg = cr.CrConfig(warm_children=3, warm_touch_stride=4)
    notes: List[str] = []
    with ThreadPoolExecutor(4) as pool:
        out = cr.measure_warm(_bb(), 7, cfg, pool, lambda _m: None, notes)
    assert set(out) == set(cr.WARM_KEYS) and not notes
    assert fake_fork["forks"] == [("sn-7", 6, False)]
    kids = fake_fork["kids"]
    warm, cold = kids[0::2], kids[1::2]
    assert all(cr.PREFAULT_CODE in k.ran for k in warm) and not any(cr.PREFAULT_CODE in k.ran for k in cold)
    assert all(k.ran[0] == cr.COLD_START_CODE for k in cold)
    # Each child wrote once; the cold ones a second time.
    assert [sum("_bench_t0" in c for c in k.ran) for k in kids] == [1, 2] * 3
    heap = cold[0].ns["heap"]
    assert [i for i, b in enumerate(heap) if b.startswith(b"X")] == list(range(0, CHUNKS, 4))
    assert all(len(b) == cr.HEAP_CHUNK for b in heap)
    assert len(out["cold_first_touch_samples_ms"]) == len(out["warm_first_touch_samples_ms"]) == 3
    assert out["warm_prefault_ms"] == 30.0 and out["warm_prefault_cpu_ms"] == 25.0 and out["warm_prefault_mb"] == 60.0
    assert out["warm_child_private_mb"] == 60.0 and out["cold_child_private_mb"] == 1.5
    assert out["cold_touched_child_private_mb"] == 25.0 and out["warm_touched_child_private_mb"] == 60.0
    assert out["warm_children"] == 3 and out["warm_touch_fraction"] == 0.25 and out["warm_wait_ms"] >= 0
    assert all(k.killed for k in kids)
    assert cr.measure_warm(_bb(), 7, cr.CrConfig(warm_children=0), None, lambda _m: None, []) == {}  # type: ignore[arg-type]


def test_measure_warm_reports_a_failed_prefault(fake_fork: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeKid, "pf_result", {"ms": 2.0, "cpu_ms": 1.0, "bytes": 0, "failed_bytes": 8 << 20, "errno": 22})
    notes: List[str] = []
    with ThreadPoolExecutor(4) as pool:
        out = cr.measure_warm(_bb(), 7, cr.CrConfig(warm_children=2), pool, lambda _m: None, notes)
    assert out["warm_prefault_mb"] == 0.0 and "8192 KiB (errno 22) in 2 of 2" in notes[0]
    monkeypatch.setattr(FakeKid, "pf_result", {"ms": None, "error": "OSError('x')"})
    notes = []
    with ThreadPoolExecutor(4) as pool:
        out = cr.measure_warm(_bb(), 7, cr.CrConfig(warm_children=1), pool, lambda _m: None, notes)
    assert out["warm_prefault_ms"] is None and "thread failed in 1 of 1 children: OSError('x')" in notes[0]


def test_measure_warm_skips_fresh_sessions(fake_fork: Dict[str, Any]) -> None:
    fake_fork["fresh"] = fake_fork["restarted"] = True
    notes: List[str] = []
    with ThreadPoolExecutor(4) as pool:
        assert cr.measure_warm(_bb(), 7, cr.CrConfig(warm_children=1), pool, lambda _m: None, notes) == {}
    assert "fresh sessions" in notes[0] and all(k.killed for k in fake_fork["kids"])


def test_prefault_and_touch_code_run_in_a_real_python(tmp_path) -> None:
    """The session code of the experiment, in a python of its own (the pre-fault really
    madvises that process: on kernels before 5.14 it reports the failure instead)."""
    prog = (
        "heap = [(b'%%08d' %% _i) * 512 for _i in range(2048)]\n"
        "%s\n"
        "import time\n"
        "deadline = time.time() + 30\n"
        "while 'ms' not in _bench_pf and time.time() < deadline:\n"
        "    time.sleep(0.01)\n"
        "%s\n"
        "t = (_bench_time.perf_counter() - _bench_t0) * 1000.0\n"
        "print(repr((_bench_pf, t, sum(b.startswith(b'W') for b in heap), {len(b) for b in heap})))\n"
    ) % (cr.PREFAULT_CODE, cr.touch_code(4))
    proc = subprocess.run([sys.executable, "-c", prog], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pf, t, written, sizes = ast.literal_eval(proc.stdout.strip())
    assert set(pf) == {"ms", "cpu_ms", "bytes", "failed_bytes", "errno"} and pf["ms"] >= 0 and t >= 0
    assert pf["bytes"] > 4 << 20 or pf["failed_bytes"] > 0  # the heap (8 MiB here) was covered
    assert written == 512 and sizes == {cr.HEAP_CHUNK}


# ----------------------------------------------------------------------------- docs and CI smoke

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "BENCHMARKS.md")


def test_every_summary_key_is_documented() -> None:
    if not os.path.isfile(DOCS):
        pytest.skip("docs/BENCHMARKS.md is not next to the package")
    with open(DOCS) as f:
        text = f.read()
    start = text.index("## `bench cr`")
    section = text[start : text.find("\n## ", start + 1) if "\n## " in text[start + 1 :] else len(text)]
    documented = set(re.findall(r"`([a-z0-9_]+)`", section))
    res = _fake_result()
    keys = set(res.summary())
    keys |= set(res.summary()["targets_met"])
    missing = sorted(k for k in keys if k not in documented)
    assert not missing, "keys of the bench cr JSON missing from docs/BENCHMARKS.md: %s" % missing


@pytest.mark.skipif(not os.environ.get("BRANCHBOX_BENCH_CR_DAEMON"), reason="set BRANCHBOX_BENCH_CR_DAEMON=unix:///... to run")
def test_quick_bench_against_a_live_daemon() -> None:
    """CI smoke test (opt-in): ``bench cr --quick --workload more-itertools --no-xfs``."""
    import time

    t0 = time.monotonic()
    r = cli_runner().invoke(
        cli.app,
        ["--daemon", os.environ["BRANCHBOX_BENCH_CR_DAEMON"], "bench", "cr", "--json", "--quick", "--workload",
         "more-itertools", "--no-xfs"],
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert tuple(s)[: len(cr.SUMMARY_KEYS)] == cr.SUMMARY_KEYS and s["quick"] is True
    assert s["fork_n16_ms"] is not None and s["fork_children_verified"] >= 2
    assert time.monotonic() - t0 < 60
