"""CLI for volumes: the ``volume`` group and ``sandbox create --volume``."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from branchbox import VolumeMount
from branchbox_cli import app as cli
from branchbox_cli.volumes import parse_volume_flags, volume_flag
from conftest import SID, FakeDaemon, invoke, one_red_line
from test_volumes_sdk import FORKED, MOUNTED, VBASE, VID, VID2, VOLUME, VS1, VS2, VSNAP, VSNAP2, routes


@pytest.fixture
def vd(daemon: FakeDaemon) -> FakeDaemon:
    return routes(daemon)


# ----------------------------------------------------------------------------- sandbox create --volume


def test_parse_volume_flags() -> None:
    assert parse_volume_flags(None) == []
    assert parse_volume_flags(["/workspace=ws", "/ro=vol-1:ro", "/c=cache:nobranch", "/x=v:nobranch:ro"]) == [
        VolumeMount(volume="ws", path="/workspace"),
        VolumeMount(volume="vol-1", path="/ro", read_only=True),
        VolumeMount(volume="cache", path="/c", branch=False),
        VolumeMount(volume="v", path="/x", read_only=True, branch=False),
    ]


def test_volume_flag_is_the_inverse_of_parse() -> None:
    flags = ["/workspace=ws", "/ro=vol-1:ro", "/c=cache:nobranch", "/x=v:ro:nobranch"]
    assert [volume_flag(m) for m in parse_volume_flags(flags)] == flags


@pytest.mark.parametrize("bad", ["ws", "/w", "/w=", "workspace=ws", "=ws", "/w=ws:rw", "/w=ws:", "/w=:ro"])
def test_parse_volume_flags_bad(bad: str) -> None:
    with pytest.raises(typer.BadParameter, match="/path=VOLUME"):
        parse_volume_flags([bad])


def test_sandbox_create_with_volumes(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/sandboxes", MOUNTED, 201)
    r = invoke(runner, "sandbox", "create", "--volume", "/workspace=ws", "-v", "/cache=" + VID + ":ro:nobranch")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == SID
    assert daemon.body()["volumes"] == [
        {"volume": "ws", "path": "/workspace", "read_only": False, "branch": True},
        {"volume": VID, "path": "/cache", "read_only": True, "branch": False},
    ]
    r = invoke(runner, "sandbox", "create", "--json")
    assert r.exit_code == 0 and "volumes" not in daemon.body()


def test_sandbox_create_bad_volume_flags(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--volume", "workspace")
    assert r.exit_code == 2 and "/path=VOLUME" in r.output + r.stderr
    line = one_red_line(invoke(runner, "sandbox", "create", "-v", "/w=a", "-v", "/w=b"))
    assert "more than one volume mounted at /w" in line
    assert daemon.requests == []


# ----------------------------------------------------------------------------- volume group


def test_volume_create(runner: CliRunner, vd: FakeDaemon) -> None:
    r = invoke(runner, "volume", "create")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == VID + "\n"
    assert (vd.last.method, vd.last.url.path, vd.body()) == ("POST", "/v1/volumes", {"access": "rwo"})
    r = invoke(runner, "volume", "create", "--name", "ws", "--access", "rox", "--quota-mb", "512", "--json")
    assert r.exit_code == 0, r.stderr
    assert vd.body() == {"name": "ws", "access": "rox", "quota_mb": 512}
    assert json.loads(r.stdout) == VOLUME


def test_volume_create_bad_input(runner: CliRunner, vd: FakeDaemon) -> None:
    assert "access" in one_red_line(invoke(runner, "volume", "create", "--access", "rw"))
    assert invoke(runner, "volume", "create", "--quota-mb", "0").exit_code == 2
    assert vd.requests == []
    vd.on("POST", "/v1/volumes", {"error": {"code": "conflict", "message": "volume name ws is taken"}}, 409)
    assert one_red_line(invoke(runner, "volume", "create", "-n", "ws")) == "error: volume name ws is taken"


def test_volume_ls(runner: CliRunner, vd: FakeDaemon) -> None:
    vd.on("GET", "/v1/volumes", {"volumes": [VOLUME, dict(FORKED, durability="durable", quota_mb=None)]})
    r = runner.invoke(cli.app, ["volume", "ls"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["ID", "NAME", "ACCESS", "SIZE"]
    first, second = lines[1], lines[2]
    assert first.split()[:3] == [VID, "ws", "rwo"] and "1024 MiB" in first and "%s:/workspace" % SID in first
    assert "node-local (4.0 KiB unsynced)" in first
    assert second.split()[:2] == [VID2, "ws2"] and "durable" in second and "node-local" not in second
    assert "object store only" not in second
    r = invoke(runner, "volume", "ls", "--json")
    assert r.exit_code == 0 and [v["id"] for v in json.loads(r.stdout)] == [VID, VID2]
    vd.on("GET", "/v1/volumes", {"volumes": [dict(FORKED, durability="durable", cached=False)]})
    r = runner.invoke(cli.app, ["volume", "ls"], env={"COLUMNS": "250"})
    assert "durable (in the object store only)" in r.stdout, r.stdout
    vd.on("GET", "/v1/volumes", {"volumes": []})
    r = invoke(runner, "volume", "ls")
    assert r.exit_code == 0 and r.stdout.startswith("no volumes")


def test_volume_info_and_rm(runner: CliRunner, vd: FakeDaemon) -> None:
    r = invoke(runner, "volume", "info", "ws")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == VOLUME and vd.last.url.path == "/v1/volumes/ws"
    r = invoke(runner, "volume", "rm", "ws")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "removed volume ws"
    assert (vd.last.method, vd.last.url.path) == ("DELETE", VBASE)  # by id once connected
    vd.on("DELETE", VBASE, {"error": {"code": "conflict", "message": "volume %s is mounted in %s" % (VID, SID)}}, 409)
    assert SID in one_red_line(invoke(runner, "volume", "rm", VID))
    assert "no route" in one_red_line(invoke(runner, "volume", "info", "vol-missing"))


def test_volume_snapshot_and_snapshots(runner: CliRunner, vd: FakeDaemon) -> None:
    r = invoke(runner, "volume", "snapshot", VID, "--label", "clean")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == VS1 + "\n" and vd.body() == {"label": "clean"}
    r = invoke(runner, "volume", "snapshot", VID, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == VSNAP and vd.body() == {}
    r = invoke(runner, "volume", "snapshots", VID)
    assert r.exit_code == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].split() == ["ID", "LABEL", "LAYERS", "STORED", "AGE"]
    assert rows[1].split()[:4] == [VS1, "clean", "2", "durable"] and rows[2].split()[:3] == [VS2, "3", "node-local"]
    r = invoke(runner, "volume", "snapshots", VID, "--json")
    assert json.loads(r.stdout) == [VSNAP, VSNAP2]
    vd.on("GET", VBASE + "/snapshots", {"snapshots": []})
    assert invoke(runner, "volume", "snapshots", VID).stdout.strip() == "no snapshots of volume %s" % VID


def test_volume_restore_fork_sync(runner: CliRunner, vd: FakeDaemon) -> None:
    r = invoke(runner, "volume", "restore", VID, VS1)
    assert r.exit_code == 0, r.stderr
    assert vd.body() == {"snapshot": VS1}
    assert r.stdout.strip() == "restored volume %s to %s (8.0 KiB)" % (VID, VS1)
    r = invoke(runner, "volume", "fork", VID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == VID2 + "\n" and vd.body() == {}
    r = invoke(runner, "volume", "fork", VID, "--name", "ws2", "--snapshot", VS1, "--json")
    assert r.exit_code == 0 and vd.body() == {"name": "ws2", "snapshot": VS1}
    assert json.loads(r.stdout) == FORKED
    r = invoke(runner, "volume", "sync", VID)
    assert r.exit_code == 0, r.stderr
    assert (vd.last.method, vd.last.url.path) == ("POST", VBASE + "/sync")
    assert r.stdout.startswith("volume %s durable at version 4 (8.0 KiB), in " % VID)
    r = invoke(runner, "volume", "sync", VID, "--json")
    assert json.loads(r.stdout)["durability"] == "durable"
    vd.on("POST", VBASE + "/sync", {"error": {"code": "unavailable", "message": "object store unreachable"}}, 503)
    assert one_red_line(invoke(runner, "volume", "sync", VID)) == "error: object store unreachable"


def test_volume_group_help(runner: CliRunner) -> None:
    r = invoke(runner, "volume", "--help")
    assert r.exit_code == 0
    for name in ("create", "ls", "info", "rm", "snapshot", "snapshots", "restore", "fork", "sync"):
        assert name in r.stdout
    assert "--volume" in invoke(runner, "sandbox", "create", "--help").stdout
