"""CLI for sandbox ports: ``sandbox port ID PORT [--url|--json|--close]`` and ``sandbox ports ID``."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from typer.testing import CliRunner

from conftest import BASE, SID, FakeDaemon, invoke, one_red_line
from test_ports_sdk import P8000, PORTS, Ports, error, port_info, routes


@pytest.fixture
def pd(daemon: FakeDaemon) -> Ports:
    return routes(daemon)


def test_port_prints_the_host(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    r = invoke(runner, "sandbox", "port", SID, "8000")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "127.0.0.1:41234\n"
    assert (daemon.last.method, daemon.last.url.path) == ("GET", PORTS + "/8000")
    assert invoke(runner, "sandbox", "port", SID, "8000").stdout == "127.0.0.1:41234\n", "the same after"


def test_port_url(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    r = invoke(runner, "sandbox", "port", SID, "8000", "--url")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "http://127.0.0.1:41234\n"


def test_port_json(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    r = invoke(runner, "sandbox", "port", SID, "8000", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == P8000


def test_port_close(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    invoke(runner, "sandbox", "port", SID, "8000")
    r = invoke(runner, "sandbox", "port", SID, "8000", "--close")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "closed port 8000 of sandbox %s\n" % SID
    assert (daemon.last.method, daemon.last.url.path) == ("DELETE", PORTS + "/8000")
    r = invoke(runner, "sandbox", "port", SID, "8000", "--close")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "port 8000 of sandbox %s was not open\n" % SID
    r = invoke(runner, "sandbox", "port", SID, "8000", "--close", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"removed": False}
    assert not [q for q in daemon.requests if q.method == "GET" and q.url.path == PORTS + "/8000"][1:], "--close opens nothing"


def test_port_close_with_url_is_a_usage_error(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    r = invoke(runner, "sandbox", "port", SID, "8000", "--close", "--url")
    assert r.exit_code == 2 and "--url" in r.output + r.stderr
    assert daemon.requests == []


@pytest.mark.parametrize("bad", ["0", "65536", "http"])
def test_port_bad_port_is_a_usage_error(runner: CliRunner, daemon: FakeDaemon, pd: Ports, bad: str) -> None:
    r = invoke(runner, "sandbox", "port", SID, bad)
    assert r.exit_code == 2 and "PORT" in r.output + r.stderr
    assert daemon.requests == []


def test_port_errors_are_one_red_line(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    daemon.on("GET", PORTS + "/9000", error("conflict", "sandbox %s is paused: resume it" % SID, 409))
    assert one_red_line(invoke(runner, "sandbox", "port", SID, "9000")) == "error: sandbox %s is paused: resume it" % SID
    assert "sb-missing" in one_red_line(invoke(runner, "sandbox", "port", "sb-missing", "80"))
    assert "sb-missing" in one_red_line(invoke(runner, "sandbox", "ports", "sb-missing"))


def test_ports_table(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    opened = time.time() - (2 * 3600 + 3 * 60 + 10)  # 2h03m ago
    pd.open = {8001: dict(port_info(8001, 41235), opened_at=opened), 22: dict(port_info(22, 41299), opened_at=opened)}
    r = invoke(runner, "sandbox", "ports", SID)
    assert r.exit_code == 0, r.stderr
    assert (daemon.last.method, daemon.last.url.path) == ("GET", PORTS)
    lines = [line.split() for line in r.stdout.strip().splitlines()]
    assert lines == [["PORT", "HOST", "AGE"], ["22", "127.0.0.1:41299", "2h03m"], ["8001", "127.0.0.1:41235", "2h03m"]]


def test_ports_empty_and_json(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    r = invoke(runner, "sandbox", "ports", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "no ports open in sandbox %s\n" % SID
    r = invoke(runner, "sandbox", "ports", SID, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == []
    invoke(runner, "sandbox", "port", SID, "8000")
    r = invoke(runner, "sandbox", "ports", SID, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [P8000]


def test_ports_without_opened_at(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", PORTS, httpx.Response(200, json={"ports": [{"port": 80, "host": "127.0.0.1:1"}]}))
    r = invoke(runner, "sandbox", "ports", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip().splitlines()[1].split() == ["80", "127.0.0.1:1", "-"]


def test_sandbox_help_lists_port_and_ports(runner: CliRunner) -> None:
    r = invoke(runner, "sandbox", "--help")
    assert r.exit_code == 0
    names = [line.strip("│ ").split(" ")[0] for line in r.stdout.splitlines()]
    assert "port" in names and "ports" in names
    r = invoke(runner, "sandbox", "port", "--help")
    assert r.exit_code == 0
    for flag in ("--url", "--close", "--json"):
        assert flag in r.stdout


def test_connect_goes_first_and_does_not_resume(runner: CliRunner, daemon: FakeDaemon, pd: Ports) -> None:
    invoke(runner, "sandbox", "port", SID, "8000")
    assert [(q.method, q.url.path) for q in daemon.requests] == [("GET", BASE), ("GET", PORTS + "/8000")]
