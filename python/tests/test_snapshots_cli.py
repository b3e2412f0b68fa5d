"""CLI for snapshots: ``sandbox checkpoint/rollback/fork`` and the ``snapshot`` group."""

from __future__ import annotations

import json

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from branchbox import RollbackResult, SnapshotInfo
from branchbox_cli import app as cli
from conftest import BASE, SANDBOX, SID, FakeDaemon, invoke, one_red_line
from test_snapshots_sdk import CHECKPOINT, CHILD1, CHILD2, FORK, GC, ROLLBACK, SN1, SN2, SN3, SNAP, SNAP2


# ----------------------------------------------------------------------------- sandbox checkpoint/rollback/fork


def test_checkpoint_prints_the_id(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/checkpoint", CHECKPOINT, 201)
    r = invoke(runner, "sandbox", "checkpoint", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == SN1 + "\n"
    assert (daemon.last.method, daemon.last.url.path, daemon.body()) == ("POST", BASE + "/checkpoint", {})
    r = invoke(runner, "sandbox", "checkpoint", SID, "--label", "before tests")
    assert r.exit_code == 0 and r.stdout.strip() == SN1
    assert daemon.body() == {"label": "before tests"}


def test_checkpoint_conflict_is_one_red_line(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/checkpoint", {"error": {"code": "conflict", "message": "sandbox is dead"}}, 409)
    assert one_red_line(invoke(runner, "sandbox", "checkpoint", SID)) == "error: sandbox is dead"
    assert "sb-missing" in one_red_line(invoke(runner, "sandbox", "checkpoint", "sb-missing"))


def test_rollback_summary(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/rollback", ROLLBACK)
    r = invoke(runner, "sandbox", "rollback", SID, SN1)
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"snapshot": SN1}
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0] == "rolled back %s to %s in 3.2 ms (sessions restarted: yes, killed pids: 41, 42)" % (SID, SN1)


def test_rollback_summary_nothing_killed() -> None:
    r = RollbackResult(snapshot=SN2, sessions_restarted=False, killed=[], took_ms=None)
    assert cli.rollback_summary("sb-x", r) == "rolled back sb-x to %s (sessions restarted: no, killed pids: none)" % SN2


def test_rollback_unknown_snapshot(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/rollback", {"error": {"code": "not_found", "message": "snapshot sn-x not found"}}, 404)
    assert one_red_line(invoke(runner, "sandbox", "rollback", SID, "sn-x")) == "error: snapshot sn-x not found"


def test_fork_prints_child_ids(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/fork", FORK, 201)
    r = invoke(runner, "sandbox", "fork", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [CHILD1["id"], CHILD2["id"]]
    assert daemon.body() == {"count": 1}
    r = invoke(runner, "sandbox", "fork", SID, "-n", "2", "--snapshot", SN1)
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"count": 2, "snapshot": SN1}
    r = invoke(runner, "sandbox", "fork", SID, "--count", "3")
    assert r.exit_code == 0 and daemon.body() == {"count": 3}


@pytest.mark.parametrize("n", ["0", "65", "-1", "two"])
def test_fork_bad_n_is_a_usage_error(runner: CliRunner, daemon: FakeDaemon, n: str) -> None:
    before = len(daemon.requests)
    r = invoke(runner, "sandbox", "fork", SID, "-n", n)
    assert r.exit_code == 2
    assert len(daemon.requests) == before


# ----------------------------------------------------------------------------- snapshot ls


def render(tree) -> str:
    console = Console(width=200, no_color=True, highlight=False)
    with console.capture() as cap:
        console.print(tree)
    return cap.get()


def test_snapshot_tree_structure() -> None:
    now = 1732250000.5 + 125
    snaps = [
        SnapshotInfo.from_dict(SNAP),  # root, children [SN2]
        SnapshotInfo.from_dict(SNAP2),  # child of SN1 (listed in children)
        # SN3 names SN1 as parent but SN1 does not list it: still a child
        SnapshotInfo.from_dict(dict(SNAP2, id=SN3, label="b", size_bytes=2 * 1024 * 1024, lightweight=False)),
        # parent not in the list (e.g. deleted or filtered): a root of its own
        SnapshotInfo.from_dict(dict(SNAP2, id="sn-orphan00000", parent="sn-gone", label=None)),
    ]
    text = render(cli.snapshot_tree(snaps, "snapshots", now=now))
    lines = text.splitlines()
    assert lines[0] == "snapshots"
    row = {sid: next(i for i, line in enumerate(lines) if sid in line) for sid in (SN1, SN2, SN3, "sn-orphan00000")}
    indent = {sid: lines[i].index(sid) for sid, i in row.items()}
    assert row[SN1] < row[SN2] < row[SN3] < row["sn-orphan00000"]
    assert indent[SN2] == indent[SN3] > indent[SN1] == indent["sn-orphan00000"]
    root = lines[row[SN1]]
    assert "clean" in root and "2m05s ago" in root and "4.0 KiB" in root and SID in root
    assert "lightweight" in lines[row[SN2]] and "0 B" in lines[row[SN2]]
    assert "2.0 MiB" in lines[row[SN3]] and " b " in lines[row[SN3]]


def test_snapshot_tree_survives_a_cycle() -> None:
    a = SnapshotInfo.from_dict({"id": "sn-a", "parent": "sn-b", "children": ["sn-b"]})
    b = SnapshotInfo.from_dict({"id": "sn-b", "parent": "sn-a", "children": ["sn-a"]})
    text = render(cli.snapshot_tree([a, b], now=0))
    assert text.count("sn-a") == 1 and text.count("sn-b") == 1


def test_a_deep_chain_is_a_flat_run_and_branches_nest() -> None:
    # 5,000 checkpoints in a line (recursion would fail; one indentation level per snapshot
    # would be unreadable), then a branch point with two children.
    n = 5000
    ids = ["sn-%011d" % i for i in range(n)] + ["sn-branch-one", "sn-branch-two"]
    parent = [None] + ids[: n - 1] + [ids[n - 1], ids[n - 1]]
    snaps = [SnapshotInfo.from_dict({"id": sid, "parent": p, "created_at": 0}) for sid, p in zip(ids, parent)]
    lines = render(cli.snapshot_tree(snaps, now=0)).splitlines()
    col = {sid: next(line.index(sid) for line in lines if sid in line) for sid in ids}
    assert len({col[sid] for sid in ids[:n]}) == 1, "a run is one entry"
    assert col["sn-branch-one"] == col["sn-branch-two"] > col[ids[0]]
    assert all(sum(sid in line for line in lines) == 1 for sid in (ids[0], ids[n - 1], "sn-branch-two"))


def test_snapshot_ls(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/snapshots", {"snapshots": [SNAP, SNAP2]})
    r = invoke(runner, "snapshot", "ls")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[0] == "snapshots"
    assert SN1 in r.stdout and SN2 in r.stdout and "clean" in r.stdout
    assert daemon.last.url.path == "/v1/snapshots"


def test_snapshot_ls_for_a_sandbox_and_json(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", BASE + "/snapshots", {"snapshots": [SNAP, SNAP2]})
    r = invoke(runner, "snapshot", "ls", "--sandbox", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[0] == "snapshots of %s" % SID
    assert daemon.last.url.path == BASE + "/snapshots"
    r = invoke(runner, "snapshot", "ls", "--sandbox", SID, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [SNAP, SNAP2]


def test_snapshot_ls_empty_and_unknown_sandbox(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/snapshots", {"snapshots": []})
    r = invoke(runner, "snapshot", "ls")
    assert r.exit_code == 0 and r.stdout.strip() == "no snapshots"
    r = invoke(runner, "snapshot", "ls", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == []
    one_red_line(invoke(runner, "snapshot", "ls", "--sandbox", "sb-missing"))


# ----------------------------------------------------------------------------- snapshot rm / gc


def test_snapshot_rm(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("DELETE", "/v1/snapshots/" + SN1, httpx.Response(204))
    r = invoke(runner, "snapshot", "rm", SN1)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "removed snapshot %s" % SN1
    assert (daemon.last.method, daemon.last.url.path, dict(daemon.last.url.params)) == (
        "DELETE", "/v1/snapshots/" + SN1, {"subtree": "false"})
    r = invoke(runner, "snapshot", "rm", SN1, "--subtree")
    assert r.exit_code == 0 and "and its descendants" in r.stdout
    assert daemon.last.url.params["subtree"] == "true"
    assert "no route" in one_red_line(invoke(runner, "snapshot", "rm", "sn-nope"))


def test_snapshot_gc(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/snapshots/gc", GC)
    r = invoke(runner, "snapshot", "gc", "--keep", SN1, "--keep", SN2, "--sandbox", SID)
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"keep": [SN1, SN2], "sandbox": SID}
    assert r.stdout.strip() == "deleted 2 snapshots, freed 8.0 KiB: %s %s" % (SN2, SN3)
    r = invoke(runner, "snapshot", "gc")
    assert r.exit_code == 0 and daemon.body() == {"keep": []}
    daemon.on("POST", "/v1/snapshots/gc", {"deleted": [], "freed_bytes": 0})
    r = invoke(runner, "snapshot", "gc", "-k", SN1)
    assert r.exit_code == 0 and r.stdout.strip() == "deleted 0 snapshots, freed 0 B"


def test_snapshot_group_help(runner: CliRunner) -> None:
    r = invoke(runner, "snapshot", "--help")
    assert r.exit_code == 0
    for name in ("ls", "rm", "gc"):
        assert name in r.stdout
    r = invoke(runner, "sandbox", "--help")
    for name in ("checkpoint", "rollback", "fork"):
        assert name in r.stdout


def test_snapshot_ls_deep_tree_is_not_cropped(runner: CliRunner, daemon: FakeDaemon) -> None:
    chain = []
    for i in range(12):
        chain.append(dict(SNAP, id="sn-%012x" % i, parent=chain[-1]["id"] if chain else None,
                          children=["sn-%012x" % (i + 1)] if i < 11 else [], label="step-%d" % i))
    daemon.on("GET", "/v1/snapshots", {"snapshots": chain})
    r = runner.invoke(cli.app, ["snapshot", "ls"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.stderr
    words = r.stdout.split()
    # the deepest rows wrap under their guide instead of losing their tail
    assert words.count("(%s)" % SID) == 12
    for s in chain:
        assert s["id"] in words and s["label"] in words
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
