"""``branchbox bench cr``: checkpoint, rollback and fork on a real workload, against two baselines.

The workload (:data:`WORKLOADS`, ``--workload``): the sdist of a real Python project with its
test suite, fetched once on the host with ``pip download`` into a cache (sha256 pinned, with the
pure-Python wheels its tests need), uploaded into the sandbox (sandboxes have no network) and
unpacked in :data:`PROJECT_DIR` (the wheels in :data:`SITE_DIR`); and a Python session that
imports the project and holds ``heap_mb`` of live, touched heap (distinct 4 KiB ``bytes``
objects). The default is Django (:data:`DEFAULT_WORKLOAD`: about 6,900 files, 43 MiB, the
size of the repositories agents work on); ``more-itertools`` (38 files) is the old, small one.

A seeded script of a tree search (:func:`generate_script`) is replayed: small edits of the
project's real sources (a helper function or method inserted, a comment in a function body),
new test modules, session updates (a state dict and one heap object per step), test runs (the
project's own runner on a few test modules; an injected bug must make them fail), checkpoints,
rollbacks to random ancestors, forks, pruning of abandoned branches. After every rollback the
sandbox is checked against what the script recorded for that node (files, the session's state
and a checksum of heap objects); any mismatch aborts the benchmark.

The same script is replayed on two baselines (fewer iterations: they are slow):

- ``copytree``: checkpoint = ``cp -a /work /snap/N`` in the sandbox and the session's inputs
  recorded; rollback = copy it back, kill the session and replay its inputs in a new one.
- ``commit``: checkpoint = tar of ``/work`` (the writable content) fetched to the host, like
  ``docker commit``; rollback = kill the sandbox, create a new one, upload and unpack the
  archive, replay the session's inputs.

Then ``fork`` of 16 and 64 children (until every child has run ``true``; children get live
copies of the session, checked in a sample of them), the same fork with ``isolated`` (fresh
sessions) and of a snapshot without sessions, the private memory and PSS of an idle child, the
"async warm" experiment (:func:`measure_warm`: does pre-faulting a forked child's writable
memory in the background make its first heap writes faster, and at what cost), and the write
amplification of an edit (10 bytes in a 64 MiB file between two checkpoints) on the daemon's
state-dir filesystem and on a reflink-enabled XFS loop device served by a second daemon started
for the purpose.

All times are client-side wall times (``*_server_ms`` are the daemon's ``took_ms``).
"""

from __future__ import annotations

import ast
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from branchbox import Images, Sandbox, SandboxError, Snapshots
from branchbox.sandbox_sync import health

from .stats import percentile, stats_row

__all__ = [
    "BenchError",
    "CrConfig",
    "CrResult",
    "DEFAULT_WORKLOAD",
    "NodeState",
    "Op",
    "Script",
    "SearchTree",
    "SUMMARY_KEYS",
    "WORKLOADS",
    "Workload",
    "generate_script",
    "heap_checksum",
    "run_cr_bench",
]

#: Where the project is unpacked; the baselines copy (``copytree``) or archive (``commit``)
#: everything under ``/work``: the project and :data:`SITE_DIR`.
PROJECT_DIR = "/work/proj"
#: Where the wheels the project's tests need are unpacked (on ``PYTHONPATH``).
SITE_DIR = "/work/site"
#: Marks an injected bug in a source file (the unit tests' fake sandbox looks for it).
BUG_MARK = "bench: injected bug"
HEAP_CHUNK = 4096
#: Heap objects checksummed by every verification (besides those the path wrote).
HEAP_SAMPLE = 48
FORK_TTL = 120.0
KIB = 1024
MIB = 1024 * 1024

SUMMARY_KEYS = (
    "ckpt_ms_p50",
    "ckpt_ms_p99",
    "rollback_ms_p50",
    "rollback_ms_p99",
    "fork_n16_ms",
    "fork_n64_ms",
    "child_private_mb",
    "copytree_ckpt_ms_p50",
    "copytree_rollback_ms_p50",
    "commit_ckpt_ms_p50",
    "commit_rollback_ms_p50",
    "ckpt_speedup_vs_copytree",
    "rollback_speedup_vs_copytree",
    "xfs_bytes_per_edit",
    "default_fs_bytes_per_edit",
)

#: Fork details in the summary (always present, ``null`` when not measured), as
#: ``fork_<key>`` except ``child_pss_mb``; values come from :attr:`CrResult.fork`.
FORK_DETAIL_KEYS = (
    "n16_samples_ms",
    "n16_server_ms",
    "n64_server_ms",
    "n16_isolated_ms",
    "n16_isolated_server_ms",
    "n16_files_only_ms",
    "children_sessions_restarted",
    "children_verified",
    "child_pss_mb",
)

#: The async-warm experiment's keys in the summary (always present, ``null`` when not
#: measured); values come from :attr:`CrResult.warm` (see :func:`measure_warm`).
WARM_KEYS = (
    "cold_first_touch_ms",
    "warm_first_touch_ms",
    "cold_second_touch_ms",
    "cold_first_touch_samples_ms",
    "warm_first_touch_samples_ms",
    "warm_prefault_ms",
    "warm_prefault_cpu_ms",
    "warm_prefault_mb",
    "warm_wait_ms",
    "warm_child_private_mb",
    "warm_child_pss_mb",
    "cold_child_private_mb",
    "cold_touched_child_private_mb",
    "warm_touched_child_private_mb",
    "warm_children",
    "warm_touch_fraction",
)


class BenchError(SandboxError):
    """The benchmark found the sandbox in a state the script did not predict (or could not run)."""


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Artifact:
    """A file fetched from PyPI with ``pip download`` (sha256 pinned)."""

    requirement: str  # "Django==5.2.8"
    filename: str
    sha256: str
    #: A wheel (``--only-binary :all:``, unpacked in :data:`SITE_DIR`) or the project's sdist.
    wheel: bool = False


@dataclass(frozen=True)
class EditSpec:
    """A small edit of a real source file: ``template % {"step": step}`` inserted just before
    the first occurrence of ``anchor`` (appended when ``anchor`` is empty). Insertions keep
    every anchor in place and make the file grow along a branch of the search."""

    path: str
    anchor: str
    template: str

    def render(self, step: int) -> Tuple[str, str]:
        """``(old, new)`` of the edit (see :func:`apply_edit`)."""
        snippet = self.template % {"step": step}
        return self.anchor, snippet + self.anchor


@dataclass(frozen=True)
class BugSpec:
    """An injected bug: the first ``old`` of ``path`` becomes ``new % {"step": step}`` (which
    carries :data:`BUG_MARK`); every test target must then fail."""

    path: str
    old: str
    new: str

    def render(self, step: int) -> Tuple[str, str]:
        return self.old, self.new % {"step": step}


@dataclass(frozen=True)
class Workload:
    """A real project, how its tests run, and the edits the tree search makes to it."""

    key: str
    sdist: Artifact
    deps: Tuple[Artifact, ...]
    #: Python run once in the session after ``sys.path`` is set (imports the project).
    session_import: str
    #: An expression the session evaluates at every step (``%d``: an int).
    session_probe: str
    edits: Tuple[EditSpec, ...]
    bugs: Tuple[BugSpec, ...]
    #: Test runs: each target is a few test labels; every target catches every bug.
    test_targets: Tuple[Tuple[str, ...], ...]
    #: A smaller selection for ``--quick``.
    quick_test_targets: Tuple[Tuple[str, ...], ...]
    #: Command line the labels are appended to (run with ``cwd`` = :data:`PROJECT_DIR`).
    test_prefix: str
    #: Directory (relative to the project) of the test modules the search adds.
    new_test_dir: str
    #: Their text (``%(step)d``, ``%(k)d`` = ``step % 7``): they pass unless a bug is in.
    new_test_template: str
    #: Prefix of a module's dotted path the runner's labels leave out (Django: ``tests.``).
    label_strip: str = ""
    #: Checkpoints and rollbacks each baseline replays (a full run; ``--quick``: 1).
    baseline_iters: int = 10
    notes: str = ""

    @property
    def name(self) -> str:
        return self.sdist.requirement

    @property
    def edit_files(self) -> Tuple[str, ...]:
        """Every file an edit or a bug touches (relative to :data:`PROJECT_DIR`), in order."""
        seen: Dict[str, None] = {}
        for spec in list(self.edits) + list(self.bugs):
            seen.setdefault(spec.path, None)
        return tuple(seen)

    @property
    def artifacts(self) -> Tuple[Artifact, ...]:
        return (self.sdist,) + self.deps

    def test_label(self, module: str) -> str:
        if self.label_strip and module.startswith(self.label_strip):
            return module[len(self.label_strip) :]
        return module

    def test_command(self, target: Sequence[str], state: "NodeState") -> str:
        labels = list(target) + [self.test_label(m) for m in state.bench_modules()]
        return self.test_prefix + " ".join(labels)

    def new_test(self, step: int) -> Tuple[str, str]:
        path = "%s/test_bench_%d.py" % (self.new_test_dir, step)
        return path, self.new_test_template % {"step": step, "k": step % 7}

    def check_sources(self, originals: Dict[str, str]) -> None:
        """Every anchor and bug text is in the original sources, and none overlaps another
        (an insertion never touches what a bug replaces)."""
        problems = []
        for spec in self.edits:
            if spec.anchor and spec.anchor not in originals.get(spec.path, ""):
                problems.append("anchor %r not in %s" % (spec.anchor[:40], spec.path))
        for bug in self.bugs:
            if bug.old not in originals.get(bug.path, ""):
                problems.append("bug text %r not in %s" % (bug.old[:40], bug.path))
            for spec in self.edits:
                if spec.path == bug.path and spec.anchor and (spec.anchor in bug.old or bug.old in spec.anchor):
                    problems.append("anchor %r overlaps a bug" % spec.anchor[:40])
        if problems:
            raise BenchError("bench: workload %s does not fit its sources: %s" % (self.key, "; ".join(problems)))


def apply_edit(text: str, old: str, new: str) -> str:
    """``text`` with the first ``old`` replaced by ``new`` (``new`` appended if ``old`` is
    empty); ``ValueError`` if ``old`` is not there."""
    if not old:
        return text + new
    i = text.find(old)
    if i < 0:
        raise ValueError("edit anchor %r not found" % old[:60])
    return text[:i] + new + text[i + len(old) :]


_DJ_HELPER = (
    "def _search_step_%(step)d(value):\n"
    '    """Helper added by the tree search at step %(step)d."""\n'
    "    return str(value).strip()\n\n\n"
)
_DJ_METHOD = (
    "    def _search_step_%(step)d(self):\n"
    '        """Added by the tree search at step %(step)d."""\n'
    "        return self.all()\n\n"
)
_DJ_TEST = (
    "from django.test import SimpleTestCase\n"
    "from django.utils.text import slugify\n\n\n"
    "class BenchStep%(step)dTests(SimpleTestCase):\n"
    '    """Added by the tree search at step %(step)d."""\n\n'
    "    def test_slugify(self):\n"
    '        self.assertEqual(slugify("Tree Search, step %(step)d!"), "tree-search-step-%(step)d")\n\n'
    "    def test_slugify_%(k)d(self):\n"
    '        self.assertEqual(slugify(" %(k)d  Spaces "), "%(k)d-spaces")\n'
)

DJANGO = Workload(
    key="django",
    sdist=Artifact(
        "Django==5.2.8", "django-5.2.8.tar.gz", "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f"
    ),
    deps=(
        Artifact(
            "asgiref==3.8.1",
            "asgiref-3.8.1-py3-none-any.whl",
            "3e1e3ecc849832fe52ccf2cb6686b7a55f82bb1d6aee72a58826471390335e47",
            wheel=True,
        ),
        Artifact(
            "sqlparse==0.5.3",
            "sqlparse-0.5.3-py3-none-any.whl",
            "cf2196ed3418f3ba5de6af7e82c694a9fbdbfecccdfc72e281548517081f16ca",
            wheel=True,
        ),
    ),
    session_import="import django\nfrom django.utils.text import slugify\n",
    session_probe="len(slugify('Tree search step %d'))",
    edits=(
        EditSpec("django/utils/text.py", "@keep_lazy_text\ndef wrap(text, width):", _DJ_HELPER),
        EditSpec(
            "django/utils/text.py",
            "    value = str(value)\n    if allow_unicode:",
            "    # tree-search step %(step)d: normalisation happens below\n",
        ),
        EditSpec("django/utils/html.py", "@keep_lazy(SafeString)\ndef escape(text):", _DJ_HELPER),
        EditSpec("django/utils/functional.py", "def lazystr(text):", _DJ_HELPER),
        EditSpec(
            "django/utils/datastructures.py",
            "        try:\n            list_ = super().__getitem__(key)\n",
            "        # tree-search step %(step)d: the last value wins\n",
        ),
        EditSpec(
            "django/template/defaultfilters.py",
            "@register.filter(is_safe=True)\n@stringfilter\ndef slugify(value):",
            _DJ_HELPER,
        ),
        EditSpec("django/db/models/query.py", "    def filter(self, *args, **kwargs):", _DJ_METHOD),
        EditSpec("django/forms/fields.py", "class IntegerField(Field):", _DJ_HELPER),
        EditSpec("django/template/base.py", "class Lexer:", _DJ_HELPER),
    ),
    bugs=(
        BugSpec(
            "django/utils/text.py",
            r'    value = re.sub(r"[^\w\s-]", "", value.lower())' + "\n",
            r'    value = re.sub(r"[^\w\s-]", "", value)  # ' + BUG_MARK + " (step %(step)d)\n",
        ),
        BugSpec(
            "django/utils/text.py",
            "        str(last_word),\n",
            "        str(last_word).upper(),  # " + BUG_MARK + " (step %(step)d)\n",
        ),
        BugSpec(
            "django/utils/text.py",
            '    if s in {"", ".", ".."}:\n',
            '    if s in {"", "."}:  # ' + BUG_MARK + " (step %(step)d)\n",
        ),
    ),
    test_targets=(
        ("utils_tests.test_text", "template_tests.filter_tests"),
        (
            "utils_tests.test_text",
            "utils_tests.test_datastructures",
            "utils_tests.test_functional",
            "utils_tests.test_dateparse",
            "utils_tests.test_http",
        ),
        ("utils_tests.test_text", "basic", "lookup", "forms_tests.field_tests.test_charfield"),
    ),
    quick_test_targets=(
        ("utils_tests.test_text",),
        ("utils_tests.test_text", "template_tests.filter_tests.test_slugify"),
    ),
    test_prefix="PYTHONPATH=%s:%s python3 tests/runtests.py --parallel 1 -v 0 " % (PROJECT_DIR, SITE_DIR),
    new_test_dir="tests/utils_tests",
    new_test_template=_DJ_TEST,
    label_strip="tests.",
    # A copytree rollback copies ~7,000 files back (several seconds): fewer iterations.
    baseline_iters=5,
    notes="Django's own runner (tests/runtests.py, settings test_sqlite: in-memory SQLite)",
)

_MI_TEST = (
    "import unittest\n\nimport more_itertools as mi\n\n\n"
    "class BenchStep%(step)dTests(unittest.TestCase):\n"
    "    def test_take(self):\n"
    "        self.assertEqual(mi.take(%(k)d, range(100)), list(range(%(k)d)))\n"
)
_MI_TARGETS = (
    (
        "tests.test_recipes.TakeTests",
        "tests.test_recipes.TailTests",
        "tests.test_recipes.PairwiseTests",
        "tests.test_recipes.GrouperTests",
        "tests.test_recipes.UniqueEverseenTests",
    ),
    (
        "tests.test_recipes.TakeTests",
        "tests.test_more.ChunkedTests",
        "tests.test_more.WindowedTests",
        "tests.test_more.SpyTests",
        "tests.test_more.SplitAtTests",
    ),
    (
        "tests.test_recipes.TakeTests",
        "tests.test_recipes.PowersetTests",
        "tests.test_more.PeekableTests",
        "tests.test_more.IlenTests",
    ),
)

MORE_ITERTOOLS = Workload(
    key="more-itertools",
    sdist=Artifact(
        "more-itertools==10.5.0",
        "more-itertools-10.5.0.tar.gz",
        "5482bfef7849c25dc3c6dd53a6173ae4795da2a41a80faea6700d9f5846c5da6",
    ),
    deps=(),
    session_import="import more_itertools\n",
    session_probe="len(more_itertools.take(3, range(%d)))",
    edits=(
        EditSpec("more_itertools/recipes.py", "", "\n_BENCH_STEP_%(step)d = %(step)d  # bench: tree-search edit\n"),
        EditSpec("more_itertools/more.py", "", "\n_BENCH_STEP_%(step)d = %(step)d  # bench: tree-search edit\n"),
    ),
    # Appended to recipes.py it shadows ``take``: every test target (TakeTests) then fails.
    bugs=(
        BugSpec(
            "more_itertools/recipes.py",
            "",
            "\n\ndef take(n, iterable):  # " + BUG_MARK + " (step %(step)d)\n    return []\n",
        ),
    ),
    test_targets=_MI_TARGETS,
    quick_test_targets=_MI_TARGETS,
    test_prefix="python3 -m unittest -q ",
    new_test_dir="tests",
    new_test_template=_MI_TEST,
    notes="plain unittest",
)

WORKLOADS: Dict[str, Workload] = {w.key: w for w in (DJANGO, MORE_ITERTOOLS)}
DEFAULT_WORKLOAD = DJANGO.key


def get_workload(key: str) -> Workload:
    try:
        return WORKLOADS[key]
    except KeyError:
        raise BenchError("bench: unknown workload %r (one of: %s)" % (key, ", ".join(WORKLOADS))) from None


# ----------------------------------------------------------------------------- the script


@dataclass(frozen=True)
class NodeState:
    """What the sandbox holds at a point of the search (a node after its checkpoint)."""

    step: int = 0
    #: ``(file, old, new)`` edits of project files, in order (see :func:`apply_edit`).
    edits: Tuple[Tuple[str, str, str], ...] = ()
    #: ``(path, content)`` of files the search created (relative to the project).
    new_files: Tuple[Tuple[str, str], ...] = ()
    bug: bool = False
    #: ``(heap index, step)``: ``heap[index]`` was set by ``step`` (later entries win).
    heap_writes: Tuple[Tuple[int, int], ...] = ()
    #: ``state['path']`` of the session: the steps taken to reach the node.
    path: Tuple[int, ...] = ()

    def file_text(self, rel: str, original: str) -> str:
        text = original
        for f, old, new in self.edits:
            if f == rel:
                text = apply_edit(text, old, new)
        return text

    def bench_modules(self) -> List[str]:
        """Dotted names (from the project's root) of the test modules the search created."""
        return [p[: -len(".py")].replace("/", ".") for p, _ in self.new_files]

    def heap_overrides(self) -> Dict[int, int]:
        return dict(self.heap_writes)


@dataclass(frozen=True)
class Op:
    """One step of the script.

    ``kind``: ``edit`` (replace the first ``old`` of ``path`` by ``text``, or append ``text``
    if ``old`` is empty), ``new_file``, ``session`` (run ``text``), ``test`` (run the test
    command ``text``; it must pass iff ``expect_ok``), ``checkpoint`` (``node`` is the new
    node), ``rollback`` (to ``node``), ``verify`` (the sandbox must match ``node``), ``prune``
    (keep only ``node`` and its ancestors), ``fork`` (``n`` children of ``node`` each run the
    test command ``text``).
    """

    kind: str
    node: int = -1
    path: str = ""
    text: str = ""
    expect_ok: Optional[bool] = None
    n: int = 0
    old: str = ""


class SearchTree:
    """Nodes (ints from 0) with their parent and :class:`NodeState`."""

    def __init__(self) -> None:
        self.parent: Dict[int, Optional[int]] = {}
        self.states: Dict[int, NodeState] = {}

    def add(self, parent: Optional[int], state: NodeState) -> int:
        if parent is not None and parent not in self.parent:
            raise KeyError("unknown parent node %r" % (parent,))
        node = len(self.parent)
        self.parent[node] = parent
        self.states[node] = state
        return node

    def ancestors(self, node: int) -> List[int]:
        """Proper ancestors, nearest first."""
        out = []
        cur = self.parent[node]
        while cur is not None:
            out.append(cur)
            cur = self.parent[cur]
        return out

    def depth(self, node: int) -> int:
        return len(self.ancestors(node))

    def path(self, node: int) -> List[int]:
        """Root first, ``node`` last."""
        return list(reversed(self.ancestors(node))) + [node]

    def __len__(self) -> int:
        return len(self.parent)


@dataclass
class Script:
    ops: List[Op]
    tree: SearchTree
    seed: int
    workload: Workload = DJANGO

    def count(self, kind: str) -> int:
        return sum(1 for op in self.ops if op.kind == kind)


def heap_index(step: int, chunks: int) -> int:
    return (step * 7919) % chunks


def session_setup_code(chunks: int, workload: Workload = DJANGO) -> str:
    """Run once in the session: the project imported, ``chunks`` distinct 4 KiB objects."""
    return (
        "import os, sys, zlib\n"
        "sys.path[:0] = [%r, %r]\n"
        "%s"
        "heap = [(b'%%08d' %% _i) * 512 for _i in range(%d)]\n"
        "state = {'step': 0, 'path': []}\n"
        "def _bench_check(idx):\n"
        "    c = 0\n"
        "    for i in idx:\n"
        "        c = zlib.crc32(heap[i], c)\n"
        "    return (state['step'], len(state['path']), sum(state['path']), len(heap), c)\n"
        "len(heap)\n"
    ) % (PROJECT_DIR, SITE_DIR, workload.session_import, chunks)


def session_step_code(step: int, idx: int, workload: Workload = DJANGO) -> str:
    return (
        "state['step'] = %d\n"
        "state['path'].append(%d)\n"
        "heap[%d] = (b'S%%07d' %% %d) * 512\n"
        "%s\n"
    ) % (step, step, idx, step, workload.session_probe % (step + 3))


def heap_chunk(i: int, overrides: Dict[int, int]) -> bytes:
    if i in overrides:
        return (b"S%07d" % overrides[i]) * 512
    return (b"%08d" % i) * 512


def heap_checksum(indices: Iterable[int], overrides: Dict[int, int]) -> int:
    """CRC-32 of the heap objects at ``indices`` (what ``_bench_check`` computes)."""
    c = 0
    for i in indices:
        c = zlib.crc32(heap_chunk(i, overrides), c)
    return c


def verify_indices(state: NodeState, chunks: int) -> List[int]:
    sample = range(0, chunks, max(1, chunks // HEAP_SAMPLE))
    return sorted(set(sample) | {i for i, _ in state.heap_writes})


def expected_check(state: NodeState, chunks: int) -> Tuple[int, int, int, int, int]:
    idx = verify_indices(state, chunks)
    return (state.step, len(state.path), sum(state.path), chunks, heap_checksum(idx, state.heap_overrides()))


def generate_script(
    seed: int,
    checkpoints: int,
    chunks: int,
    *,
    workload: Workload = DJANGO,
    test_targets: Optional[Sequence[Sequence[str]]] = None,
    p_rollback: float = 0.55,
    p_test: float = 0.35,
    p_new_file: float = 0.2,
    p_bug: float = 0.08,
    max_depth: int = 20,
    prune_every: int = 6,
    verify_every: int = 10,
    fork_every: int = 30,
    fork_n: int = 4,
) -> Script:
    """A deterministic tree search of ``checkpoints`` checkpoints (node 0 is the set-up state).

    Each step makes a small edit of one of the workload's source files (sometimes injecting
    one of its bugs instead, sometimes adding a test module), updates the session, sometimes
    runs tests (one of ``test_targets``, default the workload's, plus the added test modules),
    checkpoints; then, with probability ``p_rollback`` (always after a bug, or at
    ``max_depth``), rolls back to a uniformly random ancestor (a bug-free one after a bug) and
    verifies it. Every ``prune_every`` rollbacks the branches left behind are pruned (only
    ancestors are ever rolled back to, so nothing else is needed again); every ``fork_every``
    checkpoints ``fork_n`` children run the tests.
    """
    if checkpoints < 2:
        raise ValueError("checkpoints must be at least 2")
    if chunks < 1:
        raise ValueError("chunks must be at least 1")
    targets = [tuple(t) for t in (test_targets or workload.test_targets)]
    if not targets:
        raise ValueError("no test targets")
    rng = random.Random(seed)
    tree = SearchTree()
    state = NodeState()
    cur = tree.add(None, state)
    ops = [Op("checkpoint", node=cur), Op("verify", node=cur)]
    step = 0
    rollbacks = 0
    while len(tree) < checkpoints:
        step += 1
        injected = not state.bug and rng.random() < p_bug
        if injected:
            spec: Any = workload.bugs[rng.randrange(len(workload.bugs))] if len(workload.bugs) > 1 else workload.bugs[0]
        else:
            spec = rng.choice(workload.edits)
        old, new = spec.render(step)
        ops.append(Op("edit", path=spec.path, old=old, text=new))
        state = replace(state, edits=state.edits + ((spec.path, old, new),), bug=state.bug or injected)
        if rng.random() < p_new_file:
            path, content = workload.new_test(step)
            ops.append(Op("new_file", path=path, text=content))
            state = replace(state, new_files=state.new_files + ((path, content),))
        idx = heap_index(step, chunks)
        ops.append(Op("session", text=session_step_code(step, idx, workload)))
        state = replace(
            state, step=step, path=state.path + (step,), heap_writes=state.heap_writes + ((idx, step),)
        )
        if injected or rng.random() < p_test:
            target = targets[rng.randrange(len(targets))]
            ops.append(Op("test", text=workload.test_command(target, state), expect_ok=not state.bug))
        cur = tree.add(cur, state)
        ops.append(Op("checkpoint", node=cur))
        if len(tree) % verify_every == 0:
            ops.append(Op("verify", node=cur))
        if fork_every and len(tree) % fork_every == 0:
            target = targets[rng.randrange(len(targets))]
            ops.append(
                Op("fork", node=cur, n=fork_n, text=workload.test_command(target, state), expect_ok=not state.bug)
            )
        ancestors = tree.ancestors(cur)
        if ancestors and (state.bug or len(ancestors) >= max_depth or rng.random() < p_rollback):
            candidates = [a for a in ancestors if not tree.states[a].bug]
            target_node = candidates[rng.randrange(len(candidates))]
            ops.append(Op("rollback", node=target_node))
            ops.append(Op("verify", node=target_node))
            cur = target_node
            state = tree.states[cur]
            rollbacks += 1
            if prune_every and rollbacks % prune_every == 0:
                ops.append(Op("prune", node=cur))
    return Script(ops=ops, tree=tree, seed=seed, workload=workload)


def rollback_targets(script: Script, max_ckpt: Optional[int], max_rollback: Optional[int]) -> Optional[Set[int]]:
    """Nodes a replay limited to ``max_ckpt`` checkpoints and ``max_rollback`` rollbacks (see
    :meth:`Replay.run`) rolls back to; ``None`` without limits (every node may be needed)."""
    if max_ckpt is None or max_rollback is None:
        return None
    out: Set[int] = set()
    ckpts = rollbacks = 0
    for op in script.ops:
        if ckpts >= max_ckpt and rollbacks >= max_rollback:
            break
        if op.kind == "checkpoint":
            ckpts += 1
        elif op.kind == "rollback":
            rollbacks += 1
            out.add(op.node)
    return out


# ----------------------------------------------------------------------------- results


@dataclass
class Phase:
    """Samples of one backend's replay (ms)."""

    name: str
    ckpt_ms: List[float] = field(default_factory=list)
    ckpt_server_ms: List[float] = field(default_factory=list)
    rollback_ms: List[float] = field(default_factory=list)
    rollback_server_ms: List[float] = field(default_factory=list)
    search_fork_ms: List[float] = field(default_factory=list)
    test_ms: List[float] = field(default_factory=list)
    sessions_restarted: int = 0
    verifications: int = 0
    test_runs: int = 0
    failing_test_runs: int = 0
    edits: int = 0
    seconds: float = 0.0

    def p(self, attr: str, q: float) -> Optional[float]:
        xs = getattr(self, attr)
        return percentile(xs, q) if xs else None


@dataclass
class CrResult:
    workload: str = DJANGO.name
    workload_deps: List[str] = field(default_factory=lambda: [d.requirement for d in DJANGO.deps])
    seed: int = 0
    quick: bool = False
    heap_mb: float = 0.0
    heap_rss_mb: Optional[float] = None
    project_files: Optional[int] = None
    project_kib: Optional[float] = None
    #: What ``/work`` holds when the search starts (project, wheels, the session's ``__pycache__``):
    #: what the baselines copy at node 0 (test runs add ``__pycache__`` later).
    workdir_files: Optional[int] = None
    workdir_kib: Optional[float] = None
    branchbox: Phase = field(default_factory=lambda: Phase("branchbox"))
    copytree: Phase = field(default_factory=lambda: Phase("copytree"))
    commit: Phase = field(default_factory=lambda: Phase("commit"))
    fork: Dict[str, Any] = field(default_factory=dict)
    #: The async-warm experiment (:func:`measure_warm`), keys of :data:`WARM_KEYS`.
    warm: Dict[str, Any] = field(default_factory=dict)
    write_amp: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> Dict[str, Any]:
        """The JSON summary: :data:`SUMMARY_KEYS` first, then details. Ratios come from numbers
        measured in this run; a value that could not be measured is ``null``."""
        b, c, m = self.branchbox, self.copytree, self.commit
        out: Dict[str, Any] = {
            "ckpt_ms_p50": b.p("ckpt_ms", 50),
            "ckpt_ms_p99": b.p("ckpt_ms", 99),
            "rollback_ms_p50": b.p("rollback_ms", 50),
            "rollback_ms_p99": b.p("rollback_ms", 99),
            "fork_n16_ms": self.fork.get("n16_ms"),
            "fork_n64_ms": self.fork.get("n64_ms"),
            "child_private_mb": self.fork.get("child_private_mb"),
            "copytree_ckpt_ms_p50": c.p("ckpt_ms", 50),
            "copytree_rollback_ms_p50": c.p("rollback_ms", 50),
            "commit_ckpt_ms_p50": m.p("ckpt_ms", 50),
            "commit_rollback_ms_p50": m.p("rollback_ms", 50),
            "ckpt_speedup_vs_copytree": ratio(c.p("ckpt_ms", 50), b.p("ckpt_ms", 50)),
            "rollback_speedup_vs_copytree": ratio(c.p("rollback_ms", 50), b.p("rollback_ms", 50)),
            "xfs_bytes_per_edit": self.write_amp.get("xfs_bytes_per_edit"),
            "default_fs_bytes_per_edit": self.write_amp.get("default_fs_bytes_per_edit"),
        }
        out.update(
            {
                "ckpt_speedup_vs_commit": ratio(m.p("ckpt_ms", 50), b.p("ckpt_ms", 50)),
                "rollback_speedup_vs_commit": ratio(m.p("rollback_ms", 50), b.p("rollback_ms", 50)),
                "ckpt_server_ms_p50": b.p("ckpt_server_ms", 50),
                "rollback_server_ms_p50": b.p("rollback_server_ms", 50),
                "n_ckpt": len(b.ckpt_ms),
                "n_rollback": len(b.rollback_ms),
                "copytree_rollback_ms_p99": c.p("rollback_ms", 99),
                "copytree_n_ckpt": len(c.ckpt_ms),
                "copytree_n_rollback": len(c.rollback_ms),
                "commit_n_ckpt": len(m.ckpt_ms),
                "commit_n_rollback": len(m.rollback_ms),
                "search_fork_n4_ms_p50": b.p("search_fork_ms", 50),
                "rollback_sessions_restarted": b.sessions_restarted,
                "verifications": b.verifications + c.verifications + m.verifications,
                "test_runs": b.test_runs,
                "failing_test_runs": b.failing_test_runs,
                "test_run_ms_p50": b.p("test_ms", 50),
                "test_run_ms_max": max(b.test_ms) if b.test_ms else None,
            }
        )
        for k in FORK_DETAIL_KEYS:
            out[k if k == "child_pss_mb" else "fork_" + k] = self.fork.get(k)
        for k in WARM_KEYS:
            out[k] = self.warm.get(k)
        for k, v in self.write_amp.items():
            if k not in out:
                out[k] = v
        out.update(
            {
                "heap_mb": self.heap_mb,
                "heap_rss_mb": self.heap_rss_mb,
                "workload": self.workload,
                "workload_deps": list(self.workload_deps),
                "project_files": self.project_files,
                "project_kib": self.project_kib,
                "workdir_files": self.workdir_files,
                "workdir_kib": self.workdir_kib,
                "seed": self.seed,
                "quick": self.quick,
                "targets_met": targets_met(out),
                "bench_seconds": self.seconds,
            }
        )
        if self.notes:
            out["notes"] = list(self.notes)
        return {k: _round(v) for k, v in out.items()}

    def rows(self) -> List[List[str]]:
        """Table rows: metric, samples, p50, p99, min, max (ms)."""
        rows = []
        for phase in (self.branchbox, self.copytree, self.commit):
            for label, attr in (
                ("checkpoint", "ckpt_ms"),
                ("checkpoint (server)", "ckpt_server_ms"),
                ("rollback", "rollback_ms"),
                ("rollback (server)", "rollback_server_ms"),
                ("fork n=4 + tests", "search_fork_ms"),
                ("test run", "test_ms"),
            ):
                _row(rows, "%s %s" % (phase.name, label), getattr(phase, attr))
        _row(rows, "fork n=16, live sessions, until all exec'd", self.fork.get("n16_samples_ms") or [])
        for label, key in (
            ("fork n=64, live sessions", "n64_ms"),
            ("fork n=16 isolated (fresh sessions)", "n16_isolated_ms"),
            ("fork n=16 of a snapshot without sessions", "n16_files_only_ms"),
        ):
            if self.fork.get(key) is not None:
                _row(rows, label, [self.fork[key]])
        _row(rows, "fork child: first heap writes (cold)", self.warm.get("cold_first_touch_samples_ms") or [])
        _row(rows, "fork child: first heap writes (pre-faulted)", self.warm.get("warm_first_touch_samples_ms") or [])
        return rows


def _row(rows: List[List[str]], label: str, xs: Sequence[float]) -> None:
    if xs:
        rows.append(stats_row(label, xs))


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, list):
        return [_round(x) for x in v]
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    return v


def targets_met(s: Dict[str, Any]) -> Dict[str, Optional[bool]]:
    """The issue's targets against this run's numbers (``None``: not measured).

    ``fork_n16_le_50ms`` is False whenever forked children started fresh sessions
    (``fork_children_sessions_restarted``): the target is about children with live sessions."""

    def le(key: str, limit: float) -> Optional[bool]:
        v = s.get(key)
        return None if v is None else v <= limit

    def ge(key: str, limit: float) -> Optional[bool]:
        v = s.get(key)
        return None if v is None else v >= limit

    fork_n16 = le("fork_n16_ms", 50.0)
    if s.get("fork_children_sessions_restarted"):
        # Children with fresh sessions are not what the target is about (live copies).
        fork_n16 = False
    return {
        "ckpt_p50_le_5ms": le("ckpt_ms_p50", 5.0),
        "rollback_p50_le_5ms": le("rollback_ms_p50", 5.0),
        "fork_n16_le_50ms": fork_n16,
        "ckpt_speedup_ge_30x": ge("ckpt_speedup_vs_copytree", 30.0),
        "rollback_speedup_ge_30x": ge("rollback_speedup_vs_copytree", 30.0),
    }


# ----------------------------------------------------------------------------- host helpers


def private_kib(smaps_rollup: str) -> int:
    """``Private_Clean + Private_Dirty`` (kB) of a ``/proc/<pid>/smaps_rollup`` text."""
    total = 0
    for line in smaps_rollup.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Private_Clean", "Private_Dirty"):
            total += int(rest.split()[0])
    return total


def cgroup_procs_files(sandbox_id: str, root: str = "/sys/fs/cgroup") -> List[str]:
    """``cgroup.procs`` of the sandbox's cgroup (``<parent>/<id>``) in every hierarchy found
    (v1: one per controller; v2: the unified tree)."""
    found = []
    for depth in range(1, 5):
        pattern = os.path.join(root, *(["*"] * depth), sandbox_id, "cgroup.procs")
        found.extend(glob.glob(pattern))
    return sorted(set(found))


def pss_kib(smaps_rollup: str) -> int:
    """``Pss`` (kB) of a ``/proc/<pid>/smaps_rollup`` text."""
    for line in smaps_rollup.splitlines():
        key, _, rest = line.partition(":")
        if key == "Pss":
            return int(rest.split()[0])
    return 0


def sandbox_memory_mb(sandbox_id: str, root: str = "/sys/fs/cgroup") -> Optional[Tuple[float, float]]:
    """``(private, pss)`` memory (MiB) summed over every process in the sandbox's cgroup, read
    on the host: ``Private_Clean + Private_Dirty`` and ``Pss`` of ``smaps_rollup``. ``None`` if
    the cgroup has no process visible here."""
    pids: Set[int] = set()
    for path in cgroup_procs_files(sandbox_id, root):
        try:
            with open(path) as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            continue
    if not pids:
        return None
    private = pss = 0
    for pid in pids:
        try:
            with open("/proc/%d/smaps_rollup" % pid) as f:
                text = f.read()
            private += private_kib(text)
            pss += pss_kib(text)
        except (OSError, ValueError):
            continue
    return private / KIB, pss / KIB


def sandbox_private_mb(sandbox_id: str, root: str = "/sys/fs/cgroup") -> Optional[float]:
    """Private memory (MiB) of every process in the sandbox's cgroup, read on the host."""
    mem = sandbox_memory_mb(sandbox_id, root)
    return None if mem is None else mem[0]


def _unescape_mountinfo(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def parse_mountinfo(text: str) -> List[Tuple[str, str, str]]:
    """``(mount point, fstype, super options)`` of each line of ``/proc/self/mountinfo``."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        out.append((_unescape_mountinfo(fields[4]), rfields[0], rfields[2] if len(rfields) > 2 else ""))
    return out


def state_dir_of(sandbox_id: str, mountinfo: str) -> Optional[str]:
    """The daemon's state dir, from the host mount of the sandbox's root
    (``<state>/sandboxes/<id>/rootfs[-N]``)."""
    pat = re.compile(r"^(.*)/sandboxes/%s/rootfs(-\d+)?$" % re.escape(sandbox_id))
    for mnt, _fstype, _opts in parse_mountinfo(mountinfo):
        m = pat.match(mnt)
        if m:
            return m.group(1) or "/"
    return None


def fs_type_of(path: str, mountinfo: str) -> Optional[str]:
    """Filesystem type of the mount holding ``path`` (longest mount-point prefix)."""
    path = os.path.abspath(path)
    best, best_type = "", None
    for mnt, fstype, _ in parse_mountinfo(mountinfo):
        prefix = mnt.rstrip("/") + "/"
        if (path == mnt or path.startswith(prefix) or mnt == "/") and len(mnt) >= len(best):
            best, best_type = mnt, fstype
    return best_type


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def fs_used_bytes(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def syncfs(path: str) -> None:
    """``syncfs(2)`` on the filesystem holding ``path`` (``sync(2)`` where unavailable)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


FICLONE = 0x40049409


def probe_reflink(directory: str) -> Optional[bool]:
    """Whether the filesystem holding ``directory`` can reflink (``FICLONE`` between two
    temporary files); ``None`` if the probe could not run."""
    try:
        with tempfile.TemporaryFile(dir=directory) as src, tempfile.TemporaryFile(dir=directory) as dst:
            src.write(b"x" * 4096)
            src.flush()
            try:
                fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.EXDEV, errno.ENOTTY, errno.ENOSYS):
                    return False
                return None
            return True
    except OSError:
        return None


def daemon_args(argv: Sequence[str]) -> Dict[str, str]:
    """``--flag value`` / ``--flag=value`` options of a command line."""
    out: Dict[str, str] = {}
    i = 1
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif a.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[a] = argv[i + 1]
            i += 1
        elif a.startswith("--"):
            out[a] = ""
        i += 1
    return out


def find_daemon_process(state_dir: str) -> Optional[Tuple[str, Optional[str]]]:
    """``(binary, init binary or None)`` of the running branchboxd serving ``state_dir``."""
    want = os.path.realpath(state_dir)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if not argv or "branchboxd" not in os.path.basename(argv[0]):
            continue
        try:
            cwd = os.readlink("/proc/%s/cwd" % entry)
        except OSError:
            cwd = "/"
        opts = daemon_args(argv)
        sd = opts.get("--state-dir") or "/var/lib/branchbox"
        if os.path.realpath(os.path.join(cwd, sd)) != want:
            continue
        try:
            exe = os.readlink("/proc/%s/exe" % entry)
        except OSError:
            exe = ""
        if not exe or exe.endswith(" (deleted)") or not os.access(exe, os.X_OK):
            exe = os.path.join(cwd, argv[0]) if "/" in argv[0] else (shutil.which(argv[0]) or "")
        init = opts.get("--init-bin")
        if init:
            init = os.path.join(cwd, init)
        if exe and os.access(exe, os.X_OK):
            return exe, init or None
    return None


def docker_save_config(diff_id: str, arch: Optional[str] = None) -> Dict[str, Any]:
    machine = arch or platform.machine()
    goarch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)
    return {
        "architecture": goarch,
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }


# ----------------------------------------------------------------------------- workload


def cache_dirs(cache_dir: Optional[str] = None) -> List[str]:
    """Where the workload's files are looked for, the first one being where they are fetched to."""
    candidates = [cache_dir] if cache_dir else []
    candidates += [
        os.environ.get("BRANCHBOX_BENCH_CACHE", ""),
        os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "branchbox-bench"),
        "/var/cache/branchbox-bench",
    ]
    return [c for c in candidates if c]


def fetch_artifact(art: Artifact, cache_dir: Optional[str] = None, say: Callable[[str], None] = lambda _m: None) -> str:
    """Path of ``art`` in the cache, downloaded once with ``pip download`` (sha256 checked)."""
    candidates = cache_dirs(cache_dir)
    for d in candidates:
        p = os.path.join(d, art.filename)
        if os.path.isfile(p) and _sha256_file(p) == art.sha256:
            return p
    target = candidates[0]
    os.makedirs(target, exist_ok=True)
    say("downloading %s (%s) into %s" % (art.requirement, "wheel" if art.wheel else "sdist", target))
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary" if art.wheel else "--no-binary", ":all:",
        "--dest", target, art.requirement,
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p = os.path.join(target, art.filename)
    if proc.returncode != 0 or not os.path.isfile(p):
        raise BenchError(
            "bench: could not download the workload (%s): %s; put %s in %s"
            % (" ".join(cmd), proc.stdout.strip()[-300:], art.filename, target)
        )
    got = _sha256_file(p)
    if got != art.sha256:
        raise BenchError("bench: %s has sha256 %s, expected %s" % (p, got, art.sha256))
    return p


@dataclass
class WorkloadFiles:
    """The workload's files as uploaded: the project's sdist and the wheels."""

    sdist: bytes
    wheels: List[Tuple[str, bytes]] = field(default_factory=list)


def load_workload(
    workload: Workload, cache_dir: Optional[str] = None, say: Callable[[str], None] = lambda _m: None
) -> Tuple[WorkloadFiles, str]:
    """The workload's files (fetched if needed) and the path of its sdist."""
    sdist_path = fetch_artifact(workload.sdist, cache_dir, say)
    with open(sdist_path, "rb") as f:
        files = WorkloadFiles(f.read())
    for dep in workload.deps:
        with open(fetch_artifact(dep, cache_dir, say), "rb") as f:
            files.wheels.append((dep.filename, f.read()))
    return files, sdist_path


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist_sources(sdist: str, edit_files: Sequence[str]) -> Tuple[Dict[str, str], int, int]:
    """The original text of ``edit_files``, and the number of files / bytes in the sdist."""
    out: Dict[str, str] = {}
    wanted = set(edit_files)
    files = size = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            files += 1
            size += m.size
            rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
            if rel in wanted:
                f = tar.extractfile(m)
                assert f is not None
                out[rel] = f.read().decode("utf-8")
    missing = wanted - set(out)
    if missing:
        raise BenchError("bench: %s lacks %s" % (sdist, ", ".join(sorted(missing))))
    return out, files, size


# ----------------------------------------------------------------------------- backends


def _check_cmd(result: Any, what: str) -> Any:
    if result.exit_code != 0:
        raise BenchError(
            "bench: %s failed (exit_code=%r, signal=%r): %s"
            % (what, result.exit_code, result.signal, ((result.stderr or "") + (result.stdout or ""))[-400:])
        )
    return result


def _check_exec(ex: Any, what: str) -> Any:
    if ex.error is not None or ex.timed_out:
        raise BenchError("bench: %s raised in the session: %s" % (what, ex.error or "timed out"))
    return ex


class _Backend:
    """A way to hold the workload and take checkpoints (one sandbox per backend)."""

    name = "?"

    def __init__(self, cfg: "CrConfig") -> None:
        self.cfg = cfg
        self.sbx: Optional[Sandbox] = None

    def _create(self) -> Sandbox:
        return Sandbox.create(
            self.cfg.image,
            memory_mb=self.cfg.memory_mb,
            timeout=self.cfg.sandbox_ttl,
            metadata={"branchbox-bench": "cr-" + self.name},
            daemon=self.cfg.daemon,
            token=self.cfg.token,
        )

    def _unpack(self, sbx: Sandbox, files: WorkloadFiles) -> None:
        """The sdist unpacked in :data:`PROJECT_DIR`, the wheels in :data:`SITE_DIR`."""
        sbx.files.write("/tmp/workload.tar.gz", files.sdist)
        cmd = [
            "mkdir -p %s %s" % (PROJECT_DIR, SITE_DIR),
            "tar -xzf /tmp/workload.tar.gz -C %s --strip-components=1" % PROJECT_DIR,
            "rm /tmp/workload.tar.gz",
        ]
        for name, data in files.wheels:
            tmp = "/tmp/" + os.path.basename(name)
            sbx.files.write(tmp, data)
            cmd.append("python3 -m zipfile -e %s %s && rm %s" % (shlex.quote(tmp), SITE_DIR, shlex.quote(tmp)))
        _check_cmd(sbx.commands.run(" && ".join(cmd), timeout=300), "unpacking the workload")

    def setup(self, files: WorkloadFiles, setup_code: str) -> None:
        raise NotImplementedError

    @property
    def sandbox(self) -> Sandbox:
        assert self.sbx is not None
        return self.sbx

    def session(self, code: str, record: bool = True) -> Any:
        raise NotImplementedError

    def checkpoint(self, node: int) -> Optional[float]:
        """Returns the server-side time (ms) if known."""
        raise NotImplementedError

    def rollback(self, node: int) -> Tuple[Optional[float], bool]:
        """Returns (server-side ms or None, whether sessions were restarted)."""
        raise NotImplementedError

    def prune(self, keep: Set[int]) -> None:
        pass

    def fork_run(
        self, node: int, n: int, cmd: str, expect_ok: bool, pool: ThreadPoolExecutor
    ) -> Optional[List[Any]]:
        """Fork ``n`` children of ``node`` that each run ``cmd``; None if unsupported."""
        return None

    def close(self) -> None:
        if self.sbx is not None:
            try:
                self.sbx.kill()
            except SandboxError:
                pass
            finally:
                self.sbx.close()
                self.sbx = None


class BranchboxBackend(_Backend):
    name = "branchbox"

    def __init__(self, cfg: "CrConfig") -> None:
        super().__init__(cfg)
        self.sids: Dict[int, str] = {}
        self.files_only_sid: Optional[str] = None
        self.snaps = Snapshots(daemon=cfg.daemon, token=cfg.token)

    def setup(self, files: WorkloadFiles, setup_code: str) -> None:
        self.sbx = self._create()
        self._unpack(self.sbx, files)
        # Files only (no session yet): the fork diagnostic forks it.
        self.files_only_sid = self.sbx.checkpoint("bench: files only")
        _check_exec(self.sbx.run_code(setup_code, timeout=120), "the session set-up")

    def session(self, code: str, record: bool = True) -> Any:
        return self.sandbox.run_code(code, timeout=60)

    def checkpoint(self, node: int) -> Optional[float]:
        info = self.sandbox.checkpoint_info("node %d" % node)
        self.sids[node] = info.id
        return info.took_ms

    def rollback(self, node: int) -> Tuple[Optional[float], bool]:
        res = self.sandbox.rollback(self.sids[node])
        return res.took_ms, bool(res.sessions_restarted)

    def prune(self, keep: Set[int]) -> None:
        keep_sids = [self.sids[k] for k in keep if k in self.sids]
        self.snaps.gc(keep_sids, sandbox=self.sandbox.id)
        for k in [k for k in self.sids if k not in keep]:
            del self.sids[k]

    def fork_run(
        self, node: int, n: int, cmd: str, expect_ok: bool, pool: ThreadPoolExecutor
    ) -> Optional[List[Any]]:
        kids, results, _ = fork_and_run(
            self.sandbox, self.sids[node], n, cmd, pool, cwd=PROJECT_DIR, expect_ok=expect_ok
        )
        kill_all(kids, pool)
        return results

    def close(self) -> None:
        sid = self.sandbox.id if self.sbx is not None else None
        super().close()
        if sid is not None:
            try:
                self.snaps.gc([], sandbox=sid)
            except SandboxError:
                pass
        self.snaps.close()


class _ReplayBackend(_Backend):
    """Baselines: an explicit python session whose inputs are recorded and replayed."""

    def __init__(self, cfg: "CrConfig") -> None:
        super().__init__(cfg)
        self.sess: Any = None
        self.inputs: List[str] = []
        self.saved: Dict[int, List[str]] = {}

    def _new_session(self, inputs: Sequence[str]) -> None:
        self.sess = self.sandbox.sessions.create("python")
        for code in inputs:
            _check_exec(self.sess.run(code, timeout=120), "replaying the session")

    def setup(self, files: WorkloadFiles, setup_code: str) -> None:
        self.sbx = self._create()
        self._unpack(self.sbx, files)
        self._new_session([setup_code])
        self.inputs = [setup_code]

    def session(self, code: str, record: bool = True) -> Any:
        ex = self.sess.run(code, timeout=60)
        if record:
            self.inputs.append(code)
        return ex


class CopytreeBackend(_ReplayBackend):
    name = "copytree"

    def checkpoint(self, node: int) -> Optional[float]:
        _check_cmd(self.sandbox.commands.run("mkdir -p /snap && cp -a /work /snap/%d" % node, timeout=600), "cp -a")
        self.saved[node] = list(self.inputs)
        return None

    def rollback(self, node: int) -> Tuple[Optional[float], bool]:
        _check_cmd(self.sandbox.commands.run("rm -rf /work && cp -a /snap/%d /work" % node, timeout=600), "copy back")
        self.sess.kill()
        self._new_session(self.saved[node])
        self.inputs = list(self.saved[node])
        return None, True

    def prune(self, keep: Set[int]) -> None:
        dead = sorted(k for k in self.saved if k not in keep)
        if dead:
            _check_cmd(self.sandbox.commands.run("rm -rf " + " ".join("/snap/%d" % k for k in dead), timeout=600), "prune")
        for k in dead:
            del self.saved[k]


class CommitBackend(_ReplayBackend):
    name = "commit"

    def __init__(self, cfg: "CrConfig") -> None:
        super().__init__(cfg)
        self.store = tempfile.mkdtemp(prefix="branchbox-bench-commit-")

    def _archive(self, node: int) -> str:
        return os.path.join(self.store, "%d.tar" % node)

    def checkpoint(self, node: int) -> Optional[float]:
        sbx = self.sandbox
        _check_cmd(sbx.commands.run("tar -C / -cf /tmp/.commit.tar work", timeout=600), "tar (commit)")
        with sbx.files.read("/tmp/.commit.tar", format="stream") as stream, open(self._archive(node), "wb") as f:
            for chunk in stream:
                f.write(chunk)
        sbx.files.remove("/tmp/.commit.tar")
        self.saved[node] = list(self.inputs)
        return None

    def rollback(self, node: int) -> Tuple[Optional[float], bool]:
        old = self.sandbox
        old.kill()
        old.close()
        self.sbx = None
        self.sbx = self._create()
        with open(self._archive(node), "rb") as f:
            self.sbx.files.write("/tmp/.commit.tar", f)
        _check_cmd(
            self.sbx.commands.run("tar -C / -xf /tmp/.commit.tar && rm /tmp/.commit.tar", timeout=600), "untar (restart)"
        )
        self._new_session(self.saved[node])
        self.inputs = list(self.saved[node])
        return None, True

    def prune(self, keep: Set[int]) -> None:
        for k in [k for k in self.saved if k not in keep]:
            del self.saved[k]
            try:
                os.unlink(self._archive(k))
            except OSError:
                pass

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.store, ignore_errors=True)


# ----------------------------------------------------------------------------- fork helpers


def fork_and_run(
    sbx: Sandbox,
    snapshot: Optional[str],
    n: int,
    cmd: str,
    pool: ThreadPoolExecutor,
    *,
    cwd: Optional[str] = None,
    expect_ok: bool = True,
    isolated: bool = False,
) -> Tuple[List[Sandbox], List[Any], Dict[str, Any]]:
    """Fork ``n`` children and run ``cmd`` in each, concurrently.

    Returns the children (the caller kills them), the command results and timings:
    ``wall_ms`` (fork request until every child's command returned), ``fork_ms`` (the fork
    request alone), ``server_ms`` (its ``took_ms``), ``sessions_restarted`` (the API's).
    ``isolated``: independent children with fresh sessions (``"isolated": true``).
    """
    t0 = time.perf_counter()
    kids, res = sbx.fork_info(n, snapshot, FORK_TTL, isolated)
    t_fork = time.perf_counter()
    try:
        results = list(pool.map(lambda k: k.commands.run(cmd, cwd=cwd, timeout=120), kids))
        t_done = time.perf_counter()
        if len(kids) != n:
            raise BenchError("bench: fork(%d) returned %d sandboxes" % (n, len(kids)))
        for k, r in zip(kids, results):
            if (r.exit_code == 0) != expect_ok:
                raise BenchError(
                    "bench: `%s` in fork child %s exited %r (expected %s): %s"
                    % (cmd, k.id, r.exit_code, "success" if expect_ok else "failure", (r.stderr or "")[-300:])
                )
    except BaseException:
        kill_all(kids, pool)
        raise
    timing = {
        "wall_ms": (t_done - t0) * 1000.0,
        "fork_ms": (t_fork - t0) * 1000.0,
        "server_ms": res.took_ms,
        "sessions_restarted": res.sessions_restarted,
    }
    return kids, results, timing


def check_children_sessions(
    kids: Sequence[Sandbox],
    check_code: str,
    want: Tuple[int, ...],
    pool: ThreadPoolExecutor,
    what: str = "fork",
) -> int:
    """Run ``check_code`` (a ``_bench_check(...)`` call) in the default session of a sample of
    ``kids`` (the first, the middle and the last) and compare with ``want``: a child whose
    session is not a live copy of the parent's (a fresh one, or another state) raises
    :class:`BenchError`. Returns how many children were checked."""
    if not kids:
        return 0
    sample = sorted({0, len(kids) // 2, len(kids) - 1})

    def one(i: int) -> None:
        k = kids[i]
        ex = k.run_code(check_code, timeout=60)
        if ex.error is not None or ex.timed_out:
            raise BenchError(
                "bench: %s child %d/%d (%s) has no copy of the parent's session (the API said "
                "sessions_restarted: false): %s" % (what, i + 1, len(kids), k.id, ex.error or "timed out")
            )
        try:
            got = tuple(ast.literal_eval(ex.result or ""))
        except (ValueError, SyntaxError, TypeError):
            raise BenchError("bench: %s child %s: the session check returned %r" % (what, k.id, ex.result)) from None
        if got != tuple(want):
            raise BenchError(
                "bench: %s child %d/%d (%s) has session state %r, the parent's is %r (step, len(path), "
                "sum(path), len(heap), crc)" % (what, i + 1, len(kids), k.id, got, tuple(want))
            )

    list(pool.map(one, sample))
    return len(sample)


def kill_all(kids: Sequence[Sandbox], pool: ThreadPoolExecutor) -> None:
    def one(k: Sandbox) -> None:
        try:
            k.kill()
        except SandboxError:
            pass
        finally:
            k.close()

    list(pool.map(one, kids))


# ----------------------------------------------------------------------------- replay


class Replay:
    """Replays a :class:`Script` on a backend, timing checkpoints and rollbacks and checking
    every ``verify`` and ``test`` op."""

    def __init__(
        self,
        backend: _Backend,
        script: Script,
        originals: Dict[str, str],
        chunks: int,
        pool: ThreadPoolExecutor,
        say: Callable[[str], None],
    ) -> None:
        self.b = backend
        self.script = script
        self.originals = originals
        self.chunks = chunks
        self.pool = pool
        self.say = say
        self.phase = Phase(backend.name)
        self.workload = script.workload
        self.cur: Dict[str, str] = dict(originals)  # current text of the workload's edit files
        self.node = 0

    def run(self, max_ckpt: Optional[int] = None, max_rollback: Optional[int] = None) -> Phase:
        ph = self.phase
        t_start = time.perf_counter()
        b = self.b
        tree = self.script.tree
        # Past the timed checkpoints, a limited replay only takes those it will roll back to.
        needed = rollback_targets(self.script, max_ckpt, max_rollback)
        for op in self.script.ops:
            if (
                max_ckpt is not None
                and max_rollback is not None
                and len(ph.ckpt_ms) >= max_ckpt
                and len(ph.rollback_ms) >= max_rollback
            ):
                break
            if op.kind == "edit":
                self.cur[op.path] = apply_edit(self.cur[op.path], op.old, op.text)
                b.sandbox.files.write(PROJECT_DIR + "/" + op.path, self.cur[op.path])
                ph.edits += 1
            elif op.kind == "new_file":
                b.sandbox.files.write(PROJECT_DIR + "/" + op.path, op.text)
            elif op.kind == "session":
                _check_exec(b.session(op.text), "a search step")
            elif op.kind == "test":
                t0 = time.perf_counter()
                r = b.sandbox.commands.run(op.text, cwd=PROJECT_DIR, timeout=120)
                ph.test_ms.append((time.perf_counter() - t0) * 1000.0)
                ph.test_runs += 1
                ph.failing_test_runs += r.exit_code != 0
                if (r.exit_code == 0) != op.expect_ok:
                    raise BenchError(
                        "bench[%s]: `%s` exited %r, expected %s: %s"
                        % (b.name, op.text, r.exit_code, "success" if op.expect_ok else "failure", (r.stderr or "")[-500:])
                    )
            elif op.kind == "checkpoint":
                if max_ckpt is not None and len(ph.ckpt_ms) >= max_ckpt and op.node != 0:
                    # Enough checkpoint samples: still take it if a rollback needs it, untimed.
                    if needed is None or op.node in needed:
                        b.checkpoint(op.node)
                else:
                    t0 = time.perf_counter()
                    server = b.checkpoint(op.node)
                    ph.ckpt_ms.append((time.perf_counter() - t0) * 1000.0)
                    if server is not None:
                        ph.ckpt_server_ms.append(server)
                self.node = op.node
            elif op.kind == "rollback":
                t0 = time.perf_counter()
                server, restarted = b.rollback(op.node)
                ph.rollback_ms.append((time.perf_counter() - t0) * 1000.0)
                if server is not None:
                    ph.rollback_server_ms.append(server)
                if restarted and b.name == "branchbox":
                    ph.sessions_restarted += 1
                    # The template was gone: rebuild the session the node recorded.
                    self._rebuild_session(op.node)
                self.node = op.node
                st = tree.states[op.node]
                self.cur = {rel: st.file_text(rel, self.originals[rel]) for rel in self.workload.edit_files}
                if len(ph.rollback_ms) % 10 == 0:
                    self.say("%s: %d checkpoints, %d rollbacks" % (b.name, len(ph.ckpt_ms), len(ph.rollback_ms)))
            elif op.kind == "verify":
                self.verify(op.node)
                ph.verifications += 1
            elif op.kind == "prune":
                keep = set(tree.path(op.node))
                b.prune(keep)
            elif op.kind == "fork":
                t0 = time.perf_counter()
                results = b.fork_run(op.node, op.n, op.text, bool(op.expect_ok), self.pool)
                if results is not None:
                    ph.search_fork_ms.append((time.perf_counter() - t0) * 1000.0)
            else:  # pragma: no cover - the generator only emits the kinds above
                raise ValueError("unknown op %r" % op.kind)
        ph.seconds = time.perf_counter() - t_start
        return ph

    def _rebuild_session(self, node: int) -> None:
        st = self.script.tree.states[node]
        code = session_setup_code(self.chunks, self.workload)
        for step in st.path:
            code += session_step_code(step, heap_index(step, self.chunks), self.workload)
        _check_exec(self.b.session(code), "rebuilding a restarted session")

    def verify(self, node: int) -> None:
        st = self.script.tree.states[node]
        sbx = self.b.sandbox
        name = self.b.name
        for rel in self.workload.edit_files:
            got = sbx.files.read(PROJECT_DIR + "/" + rel)
            want = st.file_text(rel, self.originals[rel])
            if got != want:
                raise BenchError(
                    "bench[%s]: %s differs from node %d's (%d bytes, expected %d)" % (name, rel, node, len(got), len(want))
                )
        test_dir = self.workload.new_test_dir
        names = {e.name for e in sbx.files.list(PROJECT_DIR + "/" + test_dir)}
        got_tests = sorted(n for n in names if n.startswith("test_bench_"))
        want_tests = sorted(os.path.basename(p) for p, _ in st.new_files)
        if got_tests != want_tests:
            raise BenchError("bench[%s]: %s/ holds %s, node %d expects %s" % (name, test_dir, got_tests, node, want_tests))
        for p, content in st.new_files:
            got = sbx.files.read(PROJECT_DIR + "/" + p)
            if got != content:
                raise BenchError("bench[%s]: %s differs from node %d's" % (name, p, node))
        idx = verify_indices(st, self.chunks)
        ex = _check_exec(self.b.session("_bench_check(%r)" % (idx,), record=False), "the verification")
        try:
            got_check = ast.literal_eval(ex.result or "")
        except (ValueError, SyntaxError):
            raise BenchError("bench[%s]: verification returned %r" % (name, ex.result)) from None
        want_check = expected_check(st, self.chunks)
        if tuple(got_check) != want_check:
            raise BenchError(
                "bench[%s]: session state at node %d is %r, expected %r (step, len(path), sum(path), len(heap), crc)"
                % (name, node, got_check, want_check)
            )


# ----------------------------------------------------------------------------- write amplification


def measure_write_amp(
    sbx: Sandbox,
    snaps: Snapshots,
    fs_path: str,
    *,
    file_mb: int = 64,
    reps: int = 3,
) -> Dict[str, Any]:
    """Bytes the filesystem holding ``fs_path`` gains per edit of 10 bytes in a ``file_mb`` MiB
    file between two checkpoints (median of ``reps``), and the snapshot layer's allocation."""
    _check_cmd(
        sbx.commands.run("mkdir -p /work && head -c %dM /dev/urandom > /work/big.bin" % file_mb, timeout=120),
        "writing the big file",
    )
    sbx.checkpoint("bench: big file")
    deltas: List[int] = []
    sids: List[str] = []
    for i in range(reps):
        syncfs(fs_path)
        used0 = fs_used_bytes(fs_path)
        offset = file_mb * MIB // 2 + i * 65536
        data = "e%09d" % i  # 10 bytes
        _check_cmd(
            sbx.commands.run(
                "printf %s | dd of=/work/big.bin bs=1 seek=%d conv=notrunc status=none" % (shlex.quote(data), offset)
            ),
            "the 10-byte edit",
        )
        sids.append(sbx.checkpoint("bench: edit %d" % i))
        syncfs(fs_path)
        deltas.append(fs_used_bytes(fs_path) - used0)
    layer: List[int] = []
    deadline = time.monotonic() + 5.0
    for sid in sids:
        size = 0
        while True:
            size = snaps.get(sid).size_bytes or 0
            if size or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        layer.append(size)
    return {
        "bytes_per_edit": int(percentile(deltas, 50)),
        "samples": deltas,
        "layer_bytes_per_edit": int(percentile(layer, 50)) if layer else None,
    }


class XfsDaemon:
    """A second branchboxd whose state dir is on a fresh reflink-enabled XFS loop device.

    Everything it sets up is undone by :meth:`close`, whatever failed."""

    def __init__(self, daemon_bin: str, init_bin: Optional[str], size_gib: int = 2) -> None:
        self.daemon_bin = daemon_bin
        self.init_bin = init_bin
        self.size_gib = size_gib
        self.tmp: Optional[str] = None
        self.loop: Optional[str] = None
        self.mnt: Optional[str] = None
        self.mounted = False
        self.proc: Optional[subprocess.Popen] = None
        self.cgroup_parent = "bb-bench-xfs-%d" % os.getpid()
        self.url = ""
        self.warnings: List[str] = []

    def start(self, wait: float = 30.0) -> None:
        self.tmp = tempfile.mkdtemp(dir="/var/tmp", prefix="branchbox-bench-xfs-")
        # Sandbox processes (mapped uids) must traverse down to the state dir.
        os.chmod(self.tmp, 0o755)
        img = os.path.join(self.tmp, "xfs.img")
        with open(img, "wb") as f:
            f.truncate(self.size_gib << 30)
        _run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", img])
        self.loop = _run(["losetup", "--find", "--show", img]).strip()
        self.mnt = os.path.join(self.tmp, "mnt")
        os.mkdir(self.mnt)
        _run(["mount", "-t", "xfs", self.loop, self.mnt])
        self.mounted = True
        os.chmod(self.mnt, 0o755)
        state = os.path.join(self.mnt, "state")
        sock = os.path.join(self.tmp, "d.sock")
        self.url = "unix://" + sock
        argv = [
            self.daemon_bin, "--state-dir", state, "--socket", sock, "--cgroup-parent", self.cgroup_parent,
            "--kill-on-exit",
        ]
        if self.init_bin:
            argv += ["--init-bin", self.init_bin]
        log = open(os.path.join(self.tmp, "branchboxd.log"), "ab")
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/"
            )
        finally:
            log.close()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                health(daemon=self.url, request_timeout=1.0)
                return
            except SandboxError:
                time.sleep(0.1)
        raise BenchError("bench: the XFS daemon did not start: %s" % self.log_tail())

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.tmp or "", "branchboxd.log"), "rb") as f:
                return f.read()[-600:].decode("utf-8", "replace")
        except OSError:
            return ""

    @property
    def state_dir(self) -> str:
        assert self.mnt is not None
        return os.path.join(self.mnt, "state")

    def close(self) -> None:
        def step(what: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - clean-up reports and goes on
                self.warnings.append("xfs clean-up: %s: %s" % (what, e))

        if self.proc is not None and self.proc.poll() is None:
            proc = self.proc

            def stop() -> None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

            step("stop daemon", stop)
        if self.mounted and self.mnt:
            mnt = self.mnt

            def umount() -> None:
                try:
                    _run(["umount", "-R", mnt])
                except BenchError:
                    _run(["umount", "-R", "-l", mnt])

            step("umount", umount)
        if self.loop:
            loop = self.loop
            step("losetup -d", lambda: _run(["losetup", "-d", loop]))
        if self.tmp:
            tmp = self.tmp
            step("rm", lambda: shutil.rmtree(tmp))
        step("cgroups", lambda: _rmdir_cgroups(self.cgroup_parent))


def _rmdir_cgroups(parent: str, root: str = "/sys/fs/cgroup") -> None:
    for depth in range(0, 3):
        for d in glob.glob(os.path.join(root, *(["*"] * depth), parent)):
            for child in glob.glob(os.path.join(d, "*", "")):
                try:
                    os.rmdir(child)
                except OSError:
                    pass
            try:
                os.rmdir(d)
            except OSError:
                pass


def _run(argv: List[str]) -> str:
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise BenchError("bench: `%s` failed: %s" % (" ".join(argv), proc.stderr.strip()[-300:]))
    return proc.stdout


def export_image(sbx: Sandbox, out_dir: str) -> str:
    """Write a ``docker save`` layout of ``sbx``'s root filesystem into ``out_dir`` (one layer)."""
    os.makedirs(out_dir, exist_ok=True)
    _check_cmd(
        sbx.commands.run(
            "tar --one-file-system -C / -cf /tmp/.bench-root.tar --exclude=./tmp/.bench-root.tar "
            "--exclude=./proc --exclude=./sys --exclude=./dev .",
            timeout=300,
        ),
        "exporting the image",
    )
    h = hashlib.sha256()
    with sbx.files.read("/tmp/.bench-root.tar", format="stream") as stream, open(
        os.path.join(out_dir, "layer.tar"), "wb"
    ) as f:
        for chunk in stream:
            h.update(chunk)
            f.write(chunk)
    sbx.files.remove("/tmp/.bench-root.tar")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(docker_save_config("sha256:" + h.hexdigest()), f)
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump([{"Config": "config.json", "RepoTags": ["base:latest"], "Layers": ["layer.tar"]}], f)
    return out_dir


def locate_daemon_binaries(state_dir: Optional[str], explicit: Optional[str]) -> Optional[Tuple[str, Optional[str]]]:
    if explicit:
        return explicit, None
    env = os.environ.get("BRANCHBOX_DAEMON_BIN")
    if env:
        return env, None
    if state_dir:
        found = find_daemon_process(state_dir)
        if found:
            return found
    which = shutil.which("branchboxd")
    return (which, None) if which else None


def run_write_amp(cfg: "CrConfig", say: Callable[[str], None], notes: List[str]) -> Dict[str, Any]:
    """Write amplification on the daemon's state-dir filesystem and on XFS with reflink."""
    out: Dict[str, Any] = {}
    with Snapshots(daemon=cfg.daemon, token=cfg.token) as snaps:
        sbx = Sandbox.create(cfg.image, timeout=cfg.sandbox_ttl, daemon=cfg.daemon, token=cfg.token,
                             metadata={"branchbox-bench": "cr-write-amp"})
        state_dir = None
        try:
            try:
                state_dir = state_dir_of(sbx.id, _read("/proc/self/mountinfo"))
            except OSError:
                state_dir = None
            if state_dir is None:
                notes.append("write amplification skipped: the daemon's state dir is not visible here (remote daemon?)")
                return out
            mountinfo = _read("/proc/self/mountinfo")
            out["default_fs_type"] = fs_type_of(state_dir, mountinfo)
            probe_dir = os.path.join(state_dir, "tmp")
            out["default_fs_reflink_supported"] = probe_reflink(probe_dir if os.path.isdir(probe_dir) else state_dir)
            say("write amplification on the state dir (%s)" % out["default_fs_type"])
            wa = measure_write_amp(sbx, snaps, state_dir, reps=cfg.write_amp_reps)
            out["default_fs_bytes_per_edit"] = wa["bytes_per_edit"]
            out["default_fs_bytes_per_edit_samples"] = wa["samples"]
            out["default_fs_layer_bytes_per_edit"] = wa["layer_bytes_per_edit"]
        finally:
            sid = sbx.id
            sbx.kill()
            sbx.close()
            try:
                snaps.gc([], sandbox=sid)
            except SandboxError:
                pass
    if not cfg.xfs:
        return out
    why = _xfs_unavailable()
    bins = locate_daemon_binaries(state_dir, cfg.daemon_bin)
    if why is None and bins is None:
        why = "no branchboxd binary found (pass --daemon-bin)"
    if why is not None:
        notes.append("xfs write amplification skipped: " + why)
        return out
    assert bins is not None
    try:
        out.update(_xfs_write_amp(cfg, bins, say, notes))
    except (SandboxError, OSError) as e:
        # The environment, not the product: report it and keep the other numbers.
        notes.append("xfs write amplification failed: %s" % e)
    return out


def _xfs_write_amp(
    cfg: "CrConfig", bins: Tuple[str, Optional[str]], say: Callable[[str], None], notes: List[str]
) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    xfs = XfsDaemon(bins[0], bins[1])
    try:
        say("xfs: loop device + second daemon")
        xfs.start()
        out["xfs_fs_type"] = fs_type_of(xfs.state_dir, _read("/proc/self/mountinfo"))
        out["xfs_reflink_supported"] = probe_reflink(xfs.mnt or "")
        assert xfs.tmp is not None
        export_dir = os.path.join(xfs.tmp, "image")  # /var/tmp, not on the XFS
        say("xfs: exporting image %r from the main daemon" % cfg.image)
        src = Sandbox.create(cfg.image, timeout=cfg.sandbox_ttl, daemon=cfg.daemon, token=cfg.token,
                             metadata={"branchbox-bench": "cr-export"})
        try:
            export_image(src, export_dir)
        finally:
            src.kill()
            src.close()
        say("xfs: importing it")
        with Images(daemon=xfs.url, request_timeout=600) as images:
            images.import_(cfg.image, export_dir)
        shutil.rmtree(export_dir, ignore_errors=True)
        with Snapshots(daemon=xfs.url) as xsnaps:
            xsbx = Sandbox.create(cfg.image, timeout=cfg.sandbox_ttl, daemon=xfs.url)
            try:
                say("write amplification on XFS (reflink)")
                wa = measure_write_amp(xsbx, xsnaps, xfs.state_dir, reps=cfg.write_amp_reps)
            finally:
                xsbx.kill()
                xsbx.close()
        out["xfs_bytes_per_edit"] = wa["bytes_per_edit"]
        out["xfs_bytes_per_edit_samples"] = wa["samples"]
        out["xfs_layer_bytes_per_edit"] = wa["layer_bytes_per_edit"]
    finally:
        xfs.close()
        notes.extend(xfs.warnings)
    return out


def _xfs_unavailable() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root (loop device, mount)"
    for tool in ("mkfs.xfs", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            return "%s not found" % tool
    return None


# ----------------------------------------------------------------------------- driver


@dataclass
class CrConfig:
    daemon: Optional[str] = None
    token: Optional[str] = None
    image: str = "base"
    quick: bool = False
    seed: int = 1
    checkpoints: int = 80
    #: ``None``: the workload's :attr:`Workload.baseline_iters`.
    baseline_ckpt: Optional[int] = None
    baseline_rollback: Optional[int] = None
    heap_mb: int = 50
    fork_n16_reps: int = 3
    #: Pause between two forks of the same snapshot (the first ``fork(16)`` follows the search).
    fork_pause_s: float = 1.0
    #: Async warm: children pre-faulted (and as many not), the wait before the measured
    #: writes, and the stride of the heap objects they replace (4: a quarter).
    warm_children: int = 4
    warm_wait_s: float = 0.2
    warm_touch_stride: int = 4
    xfs: bool = True
    write_amp_reps: int = 3
    daemon_bin: Optional[str] = None
    memory_mb: int = 2048
    sandbox_ttl: float = 1800
    cache_dir: Optional[str] = None
    #: A key of :data:`WORKLOADS`.
    workload: str = DEFAULT_WORKLOAD

    @classmethod
    def make(cls, quick: bool = False, **kw: Any) -> "CrConfig":
        if quick:
            base = dict(
                checkpoints=16,
                baseline_ckpt=1,
                baseline_rollback=1,
                fork_n16_reps=1,
                warm_children=2,
                xfs=False,
                write_amp_reps=1,
            )
            base.update({k: v for k, v in kw.items() if v is not None})
            return cls(quick=True, **base)
        return cls(**{k: v for k, v in kw.items() if v is not None})

    @property
    def test_targets(self) -> Tuple[Tuple[str, ...], ...]:
        w = get_workload(self.workload)
        return w.quick_test_targets if self.quick else w.test_targets

    @property
    def baseline_limits(self) -> Tuple[int, int]:
        """Checkpoints and rollbacks each baseline replays."""
        n = get_workload(self.workload).baseline_iters
        return (
            n if self.baseline_ckpt is None else self.baseline_ckpt,
            n if self.baseline_rollback is None else self.baseline_rollback,
        )


def run_cr_bench(cfg: CrConfig, progress: Optional[Callable[[str], None]] = None) -> CrResult:
    """Run the whole benchmark against the daemon; everything it creates is removed."""
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    workload = get_workload(cfg.workload)
    res = CrResult(
        seed=cfg.seed, quick=cfg.quick, workload=workload.name, workload_deps=[d.requirement for d in workload.deps]
    )
    files, sdist_path = load_workload(workload, cfg.cache_dir, say)
    originals, n_files, n_bytes = sdist_sources(sdist_path, workload.edit_files)
    workload.check_sources(originals)
    res.project_files, res.project_kib = n_files, n_bytes / KIB
    chunks = cfg.heap_mb * MIB // HEAP_CHUNK
    res.heap_mb = chunks * HEAP_CHUNK / MIB
    script = generate_script(cfg.seed, cfg.checkpoints, chunks, workload=workload, test_targets=cfg.test_targets)
    setup_code = session_setup_code(chunks, workload)

    with ThreadPoolExecutor(max_workers=64) as pool:
        # 1. branchbox: the full search, then forks from where it ended.
        bb = BranchboxBackend(cfg)
        try:
            say("branchbox: set-up (%s, %d MiB session heap)" % (res.workload, cfg.heap_mb))
            bb.setup(files, setup_code)
            res.workdir_files, res.workdir_kib = workdir_size(bb.sandbox)
            rss = bb.session("[l.split()[1] for l in open('/proc/self/status') if l.startswith(('VmRSS', 'RssAnon'))]")
            try:
                vals = ast.literal_eval(rss.result or "[]")
                res.heap_rss_mb = int(vals[-1]) / KIB if vals else None
            except (ValueError, SyntaxError, IndexError):
                res.heap_rss_mb = None
            say("branchbox: tree search (%d checkpoints)" % cfg.checkpoints)
            replay = Replay(bb, script, originals, chunks, pool, say)
            res.branchbox = replay.run()
            st = script.tree.states[replay.node]
            check = ("_bench_check(%r)" % (verify_indices(st, chunks),), expected_check(st, chunks))
            res.fork = measure_forks(bb, replay.node, check, cfg, pool, say, res.notes)
            res.warm = measure_warm(bb, replay.node, cfg, pool, say, res.notes)
        finally:
            bb.close()

        # 2. the baselines: same workload, same script, fewer iterations.
        for cls in (CopytreeBackend, CommitBackend):
            backend = cls(cfg)
            try:
                say("%s: set-up" % backend.name)
                backend.setup(files, setup_code)
                max_ckpt, max_rollback = cfg.baseline_limits
                say("%s: replay (%d checkpoints, %d rollbacks)" % (backend.name, max_ckpt, max_rollback))
                phase = Replay(backend, script, originals, chunks, pool, say).run(max_ckpt, max_rollback)
            finally:
                backend.close()
            setattr(res, backend.name, phase)

    # 3. write amplification (state-dir filesystem, then XFS with reflink).
    res.write_amp = run_write_amp(cfg, say, res.notes)
    res.seconds = time.perf_counter() - t_start
    return res


def workdir_size(sbx: Sandbox) -> Tuple[Optional[int], Optional[float]]:
    """Regular files and their apparent size (KiB) under ``/work``: what the baselines copy."""
    r = sbx.commands.run("find /work -type f | wc -l; du -s --apparent-size --block-size=1024 /work", timeout=120)
    try:
        lines = (r.stdout or "").split()
        return int(lines[0]), float(lines[1])
    except (IndexError, ValueError):
        return None, None


def measure_forks(
    bb: BranchboxBackend,
    node: int,
    check: Tuple[str, Tuple[int, ...]],
    cfg: CrConfig,
    pool: ThreadPoolExecutor,
    say: Callable[[str], None],
    notes: List[str],
) -> Dict[str, Any]:
    """Forks of the search's last node (its session live): ``fork(16)`` ``cfg.fork_n16_reps``
    times and ``fork(64)`` once, each timed until every child has run ``true``; a sample of
    the children of every fork must hold the parent's session (``check``: the
    ``_bench_check`` call and its expected answer) unless the API said
    ``sessions_restarted``; ``cfg.fork_pause_s`` between two of them. Then the same
    ``fork(16)`` with ``isolated`` (fresh sessions) and a ``fork(16)`` of the snapshot taken
    before any session existed."""
    sbx = bb.sandbox
    sid = bb.sids[node]
    check_code, want = check
    out: Dict[str, Any] = {"children_sessions_restarted": False, "children_verified": 0}
    restarted_forks: List[str] = []

    forks = 0

    def live_fork(n: int, what: str, idle_memory: bool = False) -> Dict[str, Any]:
        nonlocal forks
        if forks:
            # A search's forks are separated by work: let the daemon refill its pre-built
            # nested shells, as it would between two forks of a tree search.
            time.sleep(cfg.fork_pause_s)
        forks += 1
        kids, _, t = fork_and_run(sbx, sid, n, "true", pool)
        try:
            if idle_memory:
                time.sleep(0.3)  # idle
                mem = sandbox_memory_mb(kids[0].id)
                out["child_private_mb"], out["child_pss_mb"] = mem if mem is not None else (None, None)
            if t["sessions_restarted"]:
                out["children_sessions_restarted"] = True
                restarted_forks.append(what)
            else:
                out["children_verified"] += check_children_sessions(kids, check_code, want, pool, what)
        finally:
            kill_all(kids, pool)
        return t

    n16: List[float] = []
    n16_server: List[float] = []
    for rep in range(cfg.fork_n16_reps):
        say("fork n=16 (%d/%d)" % (rep + 1, cfg.fork_n16_reps))
        t = live_fork(16, "fork(16) #%d" % (rep + 1), idle_memory=rep == 0)
        n16.append(t["wall_ms"])
        if t["server_ms"] is not None:
            n16_server.append(t["server_ms"])
    out["n16_ms"] = percentile(n16, 50)
    out["n16_samples_ms"] = n16
    out["n16_server_ms"] = percentile(n16_server, 50) if n16_server else None
    say("fork n=64")
    t = live_fork(64, "fork(64)")
    out["n64_ms"] = t["wall_ms"]
    out["n64_server_ms"] = t["server_ms"]
    if restarted_forks:
        notes.append(
            "fork children started fresh sessions (sessions_restarted: true) in %s: fork_n16_ms does not "
            "measure live copies (targets_met.fork_n16_le_50ms is false)" % ", ".join(restarted_forks)
        )
    say("fork n=16 isolated (fresh sessions)")
    time.sleep(cfg.fork_pause_s)
    kids, _, t = fork_and_run(sbx, sid, 16, "true", pool, isolated=True)
    kill_all(kids, pool)
    out["n16_isolated_ms"] = t["wall_ms"]
    out["n16_isolated_server_ms"] = t["server_ms"]
    if bb.files_only_sid is not None:
        say("fork n=16 of a snapshot without sessions")
        time.sleep(cfg.fork_pause_s)
        kids, _, t = fork_and_run(sbx, bb.files_only_sid, 16, "true", pool)
        kill_all(kids, pool)
        out["n16_files_only_ms"] = t["wall_ms"]
    return out


# ----------------------------------------------------------------------------- async warm

#: ``madvise`` advice that faults a range in as if written (Linux 5.14): on a private mapping
#: shared copy-on-write with the template, every page is copied.
MADV_POPULATE_WRITE = 23

#: Run in a pre-faulted ("warm") child right after the fork: the session's private anonymous
#: writable mappings (``[heap]`` and nameless ``rw-p`` ones, read before the thread exists so
#: that its own stack is left out) are populated for writing by a background thread; ctypes
#: releases the GIL during ``madvise``. ``_bench_pf`` gets ``ms`` (wall), ``cpu_ms`` (the
#: thread's CPU time, kernel included), ``bytes`` populated, ``failed_bytes`` and ``errno``
#: (or ``error`` and ``ms=None`` if the thread raised).
PREFAULT_CODE = (
    "import ctypes as _bench_ct, threading as _bench_th, time as _bench_time\n"
    "_bench_pf = {}\n"
    "def _bench_pf_ranges():\n"
    "    out = []\n"
    "    with open('/proc/self/maps') as f:\n"
    "        for line in f:\n"
    "            p = line.split()\n"
    "            if len(p) < 5 or not p[1].startswith('rw') or p[1][3] != 'p':\n"
    "                continue\n"
    "            if len(p) > 5 and p[5] != '[heap]':\n"
    "                continue\n"
    "            lo, hi = (int(x, 16) for x in p[0].split('-'))\n"
    "            out.append((lo, hi - lo))\n"
    "    return out\n"
    "def _bench_prefault(ranges):\n"
    "    try:\n"
    "        libc = _bench_ct.CDLL(None, use_errno=True)\n"
    "        libc.madvise.argtypes = [_bench_ct.c_void_p, _bench_ct.c_size_t, _bench_ct.c_int]\n"
    "        libc.madvise.restype = _bench_ct.c_int\n"
    "        t0, c0 = _bench_time.perf_counter(), _bench_time.thread_time()\n"
    "        done = failed = err = 0\n"
    "        for addr, size in ranges:\n"
    "            if libc.madvise(addr, size, %d) == 0:\n"
    "                done += size\n"
    "            else:\n"
    "                failed += size\n"
    "                err = _bench_ct.get_errno()\n"
    "        _bench_pf.update(cpu_ms=(_bench_time.thread_time() - c0) * 1e3, bytes=done, failed_bytes=failed,\n"
    "                         errno=err, ms=(_bench_time.perf_counter() - t0) * 1e3)\n"
    "    except Exception as e:\n"
    "        _bench_pf.update(error=repr(e), ms=None)\n"
    "_bench_pf_todo = _bench_pf_ranges()\n"
    "_bench_th.Thread(target=_bench_prefault, args=(_bench_pf_todo,), daemon=True).start()\n"
    "sum(size for _, size in _bench_pf_todo)\n"
) % MADV_POPULATE_WRITE

#: Run in a baseline ("cold") child at the same moment: one request, no pre-fault.
COLD_START_CODE = "import time as _bench_time\n0\n"


def touch_code(stride: int, tag: str = "W") -> str:
    """The measured operation: replace every ``stride``-th heap object (the search's own kind
    of session step, on ``1/stride`` of the heap: each replacement frees a 4 KiB object and
    writes a new one, so its pages are written); evaluates to its duration in ms, timed
    inside the session."""
    return (
        "_bench_t0 = _bench_time.perf_counter()\n"
        "for _bench_i in range(0, len(heap), %d):\n"
        "    heap[_bench_i] = (b'%s%%07d' %% _bench_i) * 512\n"
        "(_bench_time.perf_counter() - _bench_t0) * 1000.0\n"
    ) % (stride, tag)


def _float_result(ex: Any, what: str) -> float:
    _check_exec(ex, what)
    try:
        return float(ex.result or "")
    except ValueError:
        raise BenchError("bench: %s returned %r" % (what, ex.result)) from None


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return percentile(vals, 50) if vals else None


def measure_warm(
    bb: BranchboxBackend,
    node: int,
    cfg: CrConfig,
    pool: ThreadPoolExecutor,
    say: Callable[[str], None],
    notes: List[str],
) -> Dict[str, Any]:
    """The issue's "async warm" idea, measured without changing the daemon: does pre-faulting a
    forked child's writable memory off the critical path make its session's first writes to
    the heap faster, and what does it cost?

    ``2 * cfg.warm_children`` children of the search's last node (live sessions) in one fork;
    right after it, half of them (alternating) start :data:`PREFAULT_CODE` in their session
    (``MADV_POPULATE_WRITE`` over the session's private anonymous writable memory, in a
    background thread), the other half run a no-op (:data:`COLD_START_CODE`). After
    ``cfg.warm_wait_s`` (and until every pre-fault has finished: an agent's next step comes
    after a model call, seconds later), one child at a time, alternating cold and warm, runs
    :func:`touch_code` (``1/cfg.warm_touch_stride`` of the heap objects replaced), timed in
    the session; the cold children run it a second time (their pages are private by then:
    the floor). Memory (private, PSS) of each child is read on the host when idle after the
    wait and after the touch."""
    sbx = bb.sandbox
    sid = bb.sids[node]
    k = cfg.warm_children
    if k < 1:
        return {}
    say("async warm: fork n=%d, pre-fault in %d children" % (2 * k, k))
    kids, _, t = fork_and_run(sbx, sid, 2 * k, "true", pool)
    try:
        if t["sessions_restarted"]:
            notes.append("async warm not measured: the fork started fresh sessions (no heap to pre-fault)")
            return {}
        warm, cold = kids[0::2], kids[1::2]
        t_start = time.perf_counter()

        warm_ids = {w.id for w in warm}

        def start(kid: Sandbox) -> None:
            if kid.id in warm_ids:
                _check_exec(kid.run_code(PREFAULT_CODE, timeout=60), "starting the pre-fault")
            else:
                _check_exec(kid.run_code(COLD_START_CODE, timeout=60), "the cold children's first request")

        list(pool.map(start, kids))
        time.sleep(max(0.0, cfg.warm_wait_s - (time.perf_counter() - t_start)))
        deadline = time.monotonic() + 60.0
        pending = list(warm)
        while pending and time.monotonic() < deadline:
            pending = [w for w in pending if w.run_code("'ms' in _bench_pf", timeout=30).result != "True"]
            if pending:
                time.sleep(0.05)
        if pending:
            raise BenchError("bench: the pre-fault did not finish within 60 s in %s" % ", ".join(w.id for w in pending))
        wait_ms = (time.perf_counter() - t_start) * 1000.0
        idle = {kid.id: sandbox_memory_mb(kid.id) for kid in kids}
        stride = max(1, cfg.warm_touch_stride)
        code = touch_code(stride)
        first: Dict[str, float] = {}
        for i, (c, w) in enumerate(zip(cold, warm)):
            for kid in ((c, w) if i % 2 == 0 else (w, c)):
                first[kid.id] = _float_result(kid.run_code(code, timeout=60), "the first heap writes")
        touched = {kid.id: sandbox_memory_mb(kid.id) for kid in kids}
        second = [_float_result(c.run_code(touch_code(stride, "X"), timeout=60), "the second heap writes") for c in cold]
        pf = []
        for w in warm:
            ex = _check_exec(w.run_code("_bench_pf", timeout=30), "reading the pre-fault's numbers")
            pf.append(ast.literal_eval(ex.result or "{}"))
    finally:
        kill_all(kids, pool)
    broken = [p["error"] for p in pf if p.get("error")]
    if broken:
        notes.append("async warm: the pre-fault thread failed in %d of %d children: %s" % (len(broken), len(pf), broken[0]))
    failed = [p for p in pf if p.get("failed_bytes")]
    if failed:
        notes.append(
            "async warm: madvise(MADV_POPULATE_WRITE) failed on %d KiB (errno %s) in %d of %d children"
            % (failed[0]["failed_bytes"] // KIB, failed[0].get("errno"), len(failed), len(pf))
        )

    def mem(group: Sequence[Sandbox], table: Dict[str, Optional[Tuple[float, float]]], j: int) -> Optional[float]:
        return _median([table[kid.id][j] if table.get(kid.id) else None for kid in group])

    cold_first = [first[c.id] for c in cold]
    warm_first = [first[w.id] for w in warm]
    return {
        "cold_first_touch_ms": percentile(cold_first, 50),
        "warm_first_touch_ms": percentile(warm_first, 50),
        "cold_second_touch_ms": percentile(second, 50),
        "cold_first_touch_samples_ms": cold_first,
        "warm_first_touch_samples_ms": warm_first,
        "warm_prefault_ms": _median([p.get("ms") for p in pf]),
        "warm_prefault_cpu_ms": _median([p.get("cpu_ms") for p in pf]),
        "warm_prefault_mb": _median([p["bytes"] / MIB if "bytes" in p else None for p in pf]),
        "warm_wait_ms": wait_ms,
        "warm_child_private_mb": mem(warm, idle, 0),
        "warm_child_pss_mb": mem(warm, idle, 1),
        "cold_child_private_mb": mem(cold, idle, 0),
        "cold_touched_child_private_mb": mem(cold, touched, 0),
        "warm_touched_child_private_mb": mem(warm, touched, 0),
        "warm_children": k,
        "warm_touch_fraction": 1.0 / stride,
    }
