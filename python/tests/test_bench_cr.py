"""``branchbox bench cr`` without a daemon: the scripted tree search, the host-side model of
the sandbox (checked by replaying the script on an in-memory fake), the host parsers and the
JSON summary."""

from __future__ import annotations

import ast
import itertools
import json
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
from typer.testing import CliRunner

from branchbox import CommandResult, Execution, bench_cr as cr, cli

ORIGINALS = {rel: "# original %s\n" % rel for rel in cr.EDIT_FILES}
CHUNKS = 64


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


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


def test_node_state_model() -> None:
    st = cr.NodeState(
        appends=(("a.py", "x\n"), ("b.py", "y\n"), ("a.py", "z\n")),
        new_files=(("tests/test_bench_3.py", "..."),),
        heap_writes=((5, 1), (7, 2), (5, 3)),
    )
    assert st.file_text("a.py", "A\n") == "A\nx\nz\n"
    assert st.file_text("c.py", "C\n") == "C\n"
    assert st.bench_modules() == ["tests.test_bench_3"]
    assert st.heap_overrides() == {5: 3, 7: 2}
    assert cr.test_command(("t.A", "t.B"), st) == "python3 -m unittest -q t.A t.B tests.test_bench_3"


def test_generate_script_is_deterministic_and_consistent() -> None:
    s1 = cr.generate_script(7, 60, CHUNKS)
    s2 = cr.generate_script(7, 60, CHUNKS)
    assert s1.ops == s2.ops
    assert cr.generate_script(8, 60, CHUNKS).ops != s1.ops
    tree = s1.tree
    assert len(tree) == 60 and s1.count("checkpoint") == 60
    assert s1.count("rollback") >= 20 and s1.count("prune") >= 1 and s1.count("fork") >= 1

    checkpointed: Set[int] = set()
    cur = None
    bugged = False
    for i, op in enumerate(s1.ops):
        if op.kind == "checkpoint":
            assert op.node not in checkpointed
            if cur is not None:
                assert tree.parent[op.node] == cur
            checkpointed.add(op.node)
            cur = op.node
            assert tree.depth(cur) <= 20
            bugged = tree.states[cur].bug
        elif op.kind == "rollback":
            assert op.node in tree.ancestors(cur)  # only ever to an ancestor
            assert not tree.states[op.node].bug
            assert s1.ops[i + 1] == cr.Op("verify", node=op.node)  # every rollback is checked
            cur = op.node
            bugged = False
        elif op.kind == "edit":
            assert op.path in cr.EDIT_FILES
            bugged = bugged or op.text.startswith("\n\ndef take")
        elif op.kind == "test":
            assert op.expect_ok is (not bugged)
            assert op.text.startswith("python3 -m unittest -q tests.test_recipes.TakeTests")
        elif op.kind in ("verify", "prune", "fork"):
            assert op.node == cur
        if op.kind == "checkpoint" and tree.states[op.node].bug:
            # A bug is always rolled back right after its checkpoint (and the tests failed).
            rest = [o.kind for o in s1.ops[i + 1 :] if o.kind not in ("verify", "fork")]
            assert rest[0] == "rollback"
    assert any(tree.states[n].bug for n in tree.states)  # the seed exercises a bug


def test_generate_script_rejects_tiny_runs() -> None:
    with pytest.raises(ValueError):
        cr.generate_script(1, 1, CHUNKS)
    with pytest.raises(ValueError):
        cr.generate_script(1, 10, 0)


class FakeMoreItertools(types.ModuleType):
    @staticmethod
    def take(n: int, iterable: Any) -> list:
        return list(itertools.islice(iterable, n))


def _run_python(ns: Dict[str, Any], code: str) -> Any:
    """Like the session server: exec, and the repr of a trailing expression."""
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<session>", "exec"), ns)
    if last is None:
        return None
    return repr(eval(compile(ast.Expression(last.value), "<session>", "eval"), ns))


@pytest.fixture
def fake_more_itertools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "more_itertools", FakeMoreItertools("more_itertools"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the set-up code inserts into it


def test_session_code_matches_the_host_model(fake_more_itertools: None) -> None:
    """The checksum the session computes equals the one predicted on the host."""
    ns: Dict[str, Any] = {}
    assert _run_python(ns, cr.session_setup_code(CHUNKS)) == str(CHUNKS)
    st = cr.NodeState()
    assert ast.literal_eval(_run_python(ns, "_bench_check(%r)" % cr.verify_indices(st, CHUNKS))) == cr.expected_check(st, CHUNKS)
    for step in (1, 2, 3, 9, 64, 65):
        idx = cr.heap_index(step, CHUNKS)
        _run_python(ns, cr.session_step_code(step, idx))
        st = cr.NodeState(step=step, path=st.path + (step,), heap_writes=st.heap_writes + ((idx, step),))
    got = ast.literal_eval(_run_python(ns, "_bench_check(%r)" % cr.verify_indices(st, CHUNKS)))
    assert got == cr.expected_check(st, CHUNKS)
    assert all(len(b) == cr.HEAP_CHUNK for b in ns["heap"])
    assert cr.heap_checksum([0, 1], {}) != cr.heap_checksum([0, 1], {1: 5})


# ----------------------------------------------------------------------------- replay on a fake


class FakeSandbox:
    """Files in a dict; ``commands.run`` understands the bench's unittest command."""

    def __init__(self, files: Dict[str, str]) -> None:
        self.id = "sb-fake"
        self.fs = dict(files)
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
        assert cmd.startswith("python3 -m unittest") and cwd == cr.PROJECT_DIR
        for mod in cmd.split()[4:]:
            if mod.startswith("tests.test_bench_"):
                if "%s/%s.py" % (cr.PROJECT_DIR, mod.replace(".", "/")) not in self.fs:
                    return CommandResult(exit_code=1, stderr="ModuleNotFoundError: %s" % mod)
        if "injected bug" in self.fs["%s/%s" % (cr.PROJECT_DIR, cr.BUG_FILE)]:
            return CommandResult(exit_code=1, stderr="FAIL: test_simple_take")
        return CommandResult(exit_code=0)


class FakeBackend(cr._Backend):
    """Copies files and replays session inputs (an in-memory copytree). ``lose_file_on`` makes
    that rollback forget to restore the files: the replay must notice."""

    name = "fake"

    def __init__(self, lose_file_on: Optional[int] = None) -> None:
        self.lose_file_on = lose_file_on
        self.rollbacks = 0
        self.saved: Dict[int, Tuple[Dict[str, str], List[str]]] = {}
        self.pruned: List[Set[int]] = []
        self.forks: List[Tuple[int, int, bool]] = []

    def setup(self, sdist: bytes, setup_code: str) -> None:
        self.sbx = FakeSandbox({"%s/%s" % (cr.PROJECT_DIR, rel): text for rel, text in ORIGINALS.items()})  # type: ignore[assignment]
        self.ns: Dict[str, Any] = {}
        self.inputs: List[str] = []
        self.session(setup_code)

    def session(self, code: str, record: bool = True) -> Any:
        result = _run_python(self.ns, code)
        if record:
            self.inputs.append(code)
        return Execution(result=result)

    def checkpoint(self, node: int) -> Optional[float]:
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
    backend.setup(b"", cr.session_setup_code(CHUNKS))
    with ThreadPoolExecutor(2) as pool:
        return cr.Replay(backend, script, ORIGINALS, CHUNKS, pool, lambda _m: None).run(**kw)


def test_replay_on_a_faithful_fake_passes_every_check(fake_more_itertools: None) -> None:
    script = cr.generate_script(3, 40, CHUNKS)
    b = FakeBackend()
    ph = _replay(b, script)
    assert len(ph.ckpt_ms) == 40 and ph.ckpt_server_ms == [0.5] * 40
    assert len(ph.rollback_ms) == script.count("rollback") == b.rollbacks
    assert ph.rollback_server_ms == [0.25] * b.rollbacks
    assert ph.verifications == script.count("verify") and ph.test_runs == script.count("test")
    assert ph.failing_test_runs >= 1 and ph.sessions_restarted == 0
    assert len(b.pruned) == script.count("prune") and len(b.forks) == script.count("fork")
    assert len(ph.search_fork_ms) == script.count("fork")


def test_replay_detects_a_rollback_that_lost_files(fake_more_itertools: None) -> None:
    script = cr.generate_script(3, 40, CHUNKS)
    with pytest.raises(cr.BenchError, match="differs from node|tests/ holds|expected"):
        _replay(FakeBackend(lose_file_on=2), script)


def test_replay_stops_at_the_baseline_limits(fake_more_itertools: None) -> None:
    script = cr.generate_script(3, 40, CHUNKS)
    b = FakeBackend()
    ph = _replay(b, script, max_ckpt=4, max_rollback=3)
    assert len(ph.ckpt_ms) == 4 and len(ph.rollback_ms) == 3


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
    assert cr.private_kib(rollup) == 42
    (tmp_path / "pids" / "bb" / "sb-1").mkdir(parents=True)  # v1: one dir per controller
    (tmp_path / "pids" / "bb" / "sb-1" / "cgroup.procs").write_text("1\n2\n")
    (tmp_path / "memory" / "bb" / "sb-1").mkdir(parents=True)
    (tmp_path / "memory" / "bb" / "sb-1" / "cgroup.procs").write_text("1\n2\n")
    (tmp_path / "bb2" / "sb-2").mkdir(parents=True)  # v2
    (tmp_path / "bb2" / "sb-2" / "cgroup.procs").write_text("3\n")
    assert len(cr.cgroup_procs_files("sb-1", str(tmp_path))) == 2
    assert cr.cgroup_procs_files("sb-2", str(tmp_path)) == [str(tmp_path / "bb2" / "sb-2" / "cgroup.procs")]
    assert cr.sandbox_private_mb("sb-9", str(tmp_path)) is None


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
    res = cr.CrResult(seed=4, heap_mb=50.0, heap_rss_mb=60.0)
    res.branchbox = cr.Phase("branchbox", ckpt_ms=[2.0, 4.0, 6.0], ckpt_server_ms=[1.0, 2.0], rollback_ms=[3.0, 5.0])
    res.copytree = cr.Phase("copytree", ckpt_ms=[120.0, 120.0], rollback_ms=[400.0])
    res.commit = cr.Phase("commit", ckpt_ms=[60.0], rollback_ms=[800.0])
    res.fork = {"n16_ms": 40.0, "n64_ms": 150.0, "child_private_mb": 1.5, "n16_samples_ms": [40.0]}
    res.write_amp = {"xfs_bytes_per_edit": 8192, "default_fs_bytes_per_edit": 67108864, "xfs_reflink_supported": True}
    return res


def test_summary_shape_and_ratios() -> None:
    s = _fake_result().summary()
    assert tuple(s)[: len(cr.SUMMARY_KEYS)] == cr.SUMMARY_KEYS
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
    json.dumps(s)


def test_summary_with_missing_measurements() -> None:
    res = cr.CrResult()
    s = res.summary()
    assert all(s[k] is None for k in cr.SUMMARY_KEYS)
    assert set(s["targets_met"].values()) == {None}
    assert cr.ratio(10.0, 0.0) is None and cr.ratio(None, 1.0) is None


def test_quick_config() -> None:
    q = cr.CrConfig.make(True, seed=3, xfs=None)
    assert q.quick and not q.xfs and q.checkpoints < cr.CrConfig().checkpoints and q.seed == 3
    assert cr.CrConfig.make(True, xfs=True).xfs
    assert cr.CrConfig.make(False, checkpoints=None).checkpoints == 80


def test_cli_prints_the_json_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Dict[str, Any] = {}

    def fake_run(cfg: cr.CrConfig, progress: Any = None) -> cr.CrResult:
        seen["cfg"] = cfg
        progress("working")
        return _fake_result()

    monkeypatch.setattr(cr, "run_cr_bench", fake_run)
    runner = _runner()
    r = runner.invoke(cli.app, ["--daemon", "unix:///x.sock", "bench", "cr", "--quick", "--seed", "9"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert tuple(summary)[: len(cr.SUMMARY_KEYS)] == cr.SUMMARY_KEYS
    assert any("speedup vs copytree" in line for line in lines[:-1])
    cfg = seen["cfg"]
    assert cfg.quick and cfg.seed == 9 and cfg.daemon == "unix:///x.sock" and not cfg.xfs

    r = runner.invoke(cli.app, ["bench", "cr", "--json"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1


def test_cli_reports_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg: cr.CrConfig, progress: Any = None) -> cr.CrResult:
        raise cr.BenchError("bench[branchbox]: more.py differs from node 3's")

    monkeypatch.setattr(cr, "run_cr_bench", broken)
    r = _runner().invoke(cli.app, ["bench", "cr", "--quick"])
    assert r.exit_code == 1 and "differs from node 3" in r.stderr
