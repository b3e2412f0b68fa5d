"""CLI for sandbox network modes: ``sandbox create --network MODE --allow ENTRY [--proxy] [--max-connections N]
[--bandwidth-mbps X]``, ``sandbox fork --network/--allow/--clear-allow`` and ``sandbox network ID
[--set-mode|--allow|--clear-allow|--max-connections|--bandwidth-mbps|--clear-limits|--json]``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from branchbox import NetLimits, NetworkInfo
from branchbox_cli import app as cli
from conftest import BASE, SANDBOX, SID, FakeDaemon, invoke, one_red_line
from test_network_sdk import (
    ADDRESS, ENTRIES, LIMITS, NETWORK, PROXY, SANDBOX_NET, SANDBOX_PROXY, Network, error, fork_answer, routes,
)


@pytest.fixture
def nd(daemon: FakeDaemon) -> Network:
    return routes(daemon)


def requests_to(daemon: FakeDaemon, path: str):
    return [(q.method, q.url.path) for q in daemon.requests if q.url.path == path]


# ----------------------------------------------------------------------------- create


def test_create_network_and_allow(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--network", "allowlist", "--allow", ENTRIES[0], "--allow", ENTRIES[1])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == SID
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "allowlist", "allow": ENTRIES[:2]}
    r = invoke(runner, "sandbox", "create", "--network", "open")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "open"}
    r = invoke(runner, "sandbox", "create")
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "none"}, "default unchanged"


def test_create_json_shows_the_network(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/sandboxes", SANDBOX_NET, 201)
    r = invoke(runner, "sandbox", "create", "--network", "allowlist", "--allow", "api.example.com", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == SANDBOX_NET and out["address"] == ADDRESS and out["network"] == "allowlist"


def test_create_with_a_proxy(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/sandboxes", SANDBOX_PROXY, 201)
    r = invoke(runner, "sandbox", "create", "--proxy", "--allow", "allowed.test")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == SID
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "none", "allow": ["allowed.test"], "proxy": True}
    r = invoke(runner, "sandbox", "create", "--network", "open", "--proxy", "--json")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "open", "proxy": True}
    assert json.loads(r.stdout)["proxy"] == PROXY
    r = invoke(runner, "sandbox", "create", "--allow", "a.test")
    assert r.exit_code == 0 and "proxy" not in daemon.body(), "sent only with --proxy"
    r = invoke(runner, "sandbox", "create", "--proxy", "--proxy-record")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "none", "proxy": True, "proxy_record": True}
    r = invoke(runner, "sandbox", "create", "--proxy")
    assert "proxy_record" not in daemon.body(), "sent only with --proxy-record"


def test_create_from_a_snapshot_keeps_its_network_unless_given(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--snapshot", "sn-000000000001")
    assert r.exit_code == 0, r.stderr
    assert "network" not in daemon.body() and "allow" not in daemon.body()
    r = invoke(runner, "sandbox", "create", "--snapshot", "sn-000000000001", "--allow", "a.test")
    assert r.exit_code == 0 and daemon.body() == {"snapshot": "sn-000000000001", "timeout": 300.0, "allow": ["a.test"]}
    r = invoke(runner, "sandbox", "create", "-s", "sn-000000000001", "--network", "none")
    assert r.exit_code == 0 and daemon.body()["network"] == "none"


@pytest.mark.parametrize("bad", ["wide", "NONE", "bridge", ""])
def test_create_bad_mode_is_a_usage_error(runner: CliRunner, daemon: FakeDaemon, bad: str) -> None:
    r = invoke(runner, "sandbox", "create", "--network", bad)
    assert r.exit_code == 2 and "--network" in r.output + r.stderr
    assert "allowlist" in r.output + r.stderr
    assert daemon.requests == []


def test_create_daemon_refusal_is_one_red_line(runner: CliRunner, daemon: FakeDaemon) -> None:
    msg = 'network mode "none" takes no allow entries: use "allowlist" (or "open") to let traffic out'
    daemon.on("POST", "/v1/sandboxes", error("bad_request", msg, 400))
    assert one_red_line(invoke(runner, "sandbox", "create", "--allow", "a.test")) == "error: " + msg
    assert daemon.body() == {"image": "base", "timeout": 300.0, "network": "none", "allow": ["a.test"]}


# ----------------------------------------------------------------------------- fork


def test_fork_network_flags(runner: CliRunner, daemon: FakeDaemon) -> None:
    child = dict(SANDBOX, id="sb-child0000001")
    daemon.on("POST", BASE + "/fork", fork_answer(child), 201)
    r = invoke(runner, "sandbox", "fork", SID, "--network", "open", "--allow", "a.test", "--allow", "b.test:443")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "sb-child0000001\n"
    assert daemon.body() == {"count": 1, "network": "open", "allow": ["a.test", "b.test:443"]}
    r = invoke(runner, "sandbox", "fork", SID, "-n", "2", "--clear-allow")
    assert r.exit_code == 0 and daemon.body() == {"count": 2, "allow": []}
    r = invoke(runner, "sandbox", "fork", SID)
    assert r.exit_code == 0 and daemon.body() == {"count": 1}, "the parent's network: nothing sent"


def test_fork_bad_flags_are_usage_errors(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "fork", SID, "--network", "wide")
    assert r.exit_code == 2 and "--network" in r.output + r.stderr
    r = invoke(runner, "sandbox", "fork", SID, "--allow", "a.test", "--clear-allow")
    assert r.exit_code == 2 and "--clear-allow" in r.output + r.stderr
    assert daemon.requests == []


# ----------------------------------------------------------------------------- sandbox network


def test_network_shows_the_network(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    nd.network, nd.allow, nd.rx, nd.tx = "allowlist", ENTRIES[:2], 2 * 1024 * 1024 + 1, 512
    r = invoke(runner, "sandbox", "network", SID)
    assert r.exit_code == 0, r.stderr
    assert [line.split(None, 1) for line in r.stdout.strip().splitlines()] == [
        ["mode", "allowlist"],
        ["address", ADDRESS],
        ["allow", "api.example.com, *.example.org"],
        ["proxy", "-"],
        ["limits", "-"],
        ["rx", "2.0 MiB"],
        ["tx", "512 B"],
    ]
    assert [(q.method, q.url.path) for q in daemon.requests] == [("GET", BASE), ("GET", NETWORK)], "connect does not resume"


def test_network_mode_none(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    r = invoke(runner, "sandbox", "network", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[:3] == ["mode     none", "address  -", "allow    -"]


def test_network_shows_the_proxy(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    nd.allow, nd.proxy = ["allowed.test"], PROXY
    r = invoke(runner, "sandbox", "network", SID)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[:4] == ["mode     none", "address  -", "allow    allowed.test", "proxy    " + PROXY]
    r = invoke(runner, "sandbox", "network", SID, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["proxy"] == PROXY
    r = invoke(runner, "sandbox", "network", SID, "--allow", "also.allowed.test")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"allow": ["also.allowed.test"]} and "proxy    " + PROXY in r.stdout


def test_network_json(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    r = invoke(runner, "sandbox", "network", SID, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == nd.info()
    r = invoke(runner, "sandbox", "network", SID, "--set-mode", "open", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["network"] == "open" and json.loads(r.stdout)["address"] == ADDRESS


def test_network_updates(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    r = invoke(runner, "sandbox", "network", SID, "--set-mode", "allowlist", "--allow", "a.test", "--allow", "*.b.test:80")
    assert r.exit_code == 0, r.stderr
    assert (daemon.last.method, daemon.last.url.path) == ("PUT", NETWORK)
    assert daemon.body() == {"network": "allowlist", "allow": ["a.test", "*.b.test:80"]}
    assert "allow    a.test, *.b.test:80" in r.stdout and "mode     allowlist" in r.stdout
    r = invoke(runner, "sandbox", "network", SID, "--allow", "c.test")  # replaces the list, keeps the mode
    assert r.exit_code == 0 and daemon.body() == {"allow": ["c.test"]}
    assert (nd.network, nd.allow) == ("allowlist", ["c.test"])
    r = invoke(runner, "sandbox", "network", SID, "--clear-allow")
    assert r.exit_code == 0 and daemon.body() == {"allow": []} and nd.allow == []
    r = invoke(runner, "sandbox", "network", SID, "--set-mode", "none")
    assert r.exit_code == 0 and daemon.body() == {"network": "none"}
    assert "address  -" in r.stdout
    assert len(requests_to(daemon, NETWORK)) == 4 and all(m == "PUT" for m, _ in requests_to(daemon, NETWORK))


def test_network_usage_errors(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    r = invoke(runner, "sandbox", "network", SID, "--set-mode", "wide")
    assert r.exit_code == 2 and "--set-mode" in r.output + r.stderr
    r = invoke(runner, "sandbox", "network", SID, "--allow", "a.test", "--clear-allow")
    assert r.exit_code == 2 and "--clear-allow" in r.output + r.stderr
    r = invoke(runner, "sandbox", "network")
    assert r.exit_code == 2
    assert daemon.requests == []


def test_network_errors_are_one_red_line(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    line = one_red_line(invoke(runner, "sandbox", "network", SID, "--allow", "not a name"))
    assert "not a name" in line
    assert nd.allow == [], "nothing changed"
    line = one_red_line(invoke(runner, "sandbox", "network", SID, "--set-mode", "none", "--allow", "a.test"))
    assert "takes no allow entries" in line
    assert "sb-missing" in one_red_line(invoke(runner, "sandbox", "network", "sb-missing"))
    daemon.on("GET", NETWORK, error("conflict", "sandbox %s is paused" % SID, 409))
    assert one_red_line(invoke(runner, "sandbox", "network", SID)) == "error: sandbox %s is paused" % SID


def test_network_lines_without_fields() -> None:
    assert cli.network_lines(NetworkInfo()) == [
        "mode     -", "address  -", "allow    -", "proxy    -", "limits   -", "rx       0 B", "tx       0 B",
    ]


def test_sandbox_info_prints_the_network_fields(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", BASE, SANDBOX_NET)
    r = invoke(runner, "sandbox", "info", SID)
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["network"], out["address"], out["allow"], out["net_rx_bytes"]) == ("allowlist", ADDRESS, ENTRIES[:2], 2_000_123)
    daemon.on("GET", BASE, SANDBOX_PROXY)
    r = invoke(runner, "sandbox", "info", SID)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["proxy"] == PROXY


def test_help_lists_network_and_its_flags(runner: CliRunner) -> None:
    r = invoke(runner, "sandbox", "--help")
    assert r.exit_code == 0
    names = [line.strip("│ ").split(" ")[0] for line in r.stdout.splitlines()]
    assert "network" in names
    for cmd, flags in (("network", ("--set-mode", "--allow", "--clear-allow", "--max-connections", "--bandwidth-mbps",
                                    "--clear-limits", "--json")),
                       ("create", ("--network", "--allow", "--proxy", "--proxy-record", "--max-connections", "--bandwidth-mbps")),
                       ("fork", ("--network", "--allow", "--clear-allow"))):
        r = invoke(runner, "sandbox", cmd, "--help")
        assert r.exit_code == 0
        for flag in flags:
            assert flag in r.stdout, (cmd, flag)


# ----------------------------------------------------------------------------- limits


def test_create_with_limits(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--network", "open", "--max-connections", "64", "--bandwidth-mbps", "2.5")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == SID
    assert daemon.body() == {
        "image": "base", "timeout": 300.0, "network": "open", "net_limits": {"max_connections": 64, "bandwidth_mbps": 2.5},
    }
    r = invoke(runner, "sandbox", "create", "--max-connections", "8")
    assert r.exit_code == 0 and daemon.body()["net_limits"] == {"max_connections": 8}
    r = invoke(runner, "sandbox", "create", "--bandwidth-mbps", "100")
    assert r.exit_code == 0 and daemon.body()["net_limits"] == {"bandwidth_mbps": 100.0}
    r = invoke(runner, "sandbox", "create", "-s", "sn-000000000001", "--max-connections", "1")
    assert r.exit_code == 0 and daemon.body() == {
        "snapshot": "sn-000000000001", "timeout": 300.0, "net_limits": {"max_connections": 1},
    }
    r = invoke(runner, "sandbox", "create")
    assert r.exit_code == 0 and "net_limits" not in daemon.body(), "sent only when given"


@pytest.mark.parametrize("flag, value", [
    ("--max-connections", "0"), ("--max-connections", "65537"), ("--max-connections", "many"),
    ("--bandwidth-mbps", "0.05"), ("--bandwidth-mbps", "100001"), ("--bandwidth-mbps", "fast"),
])
def test_create_bad_limits_are_usage_errors(runner: CliRunner, daemon: FakeDaemon, flag: str, value: str) -> None:
    r = invoke(runner, "sandbox", "create", flag, value)
    assert r.exit_code == 2 and flag in r.output + r.stderr
    r = invoke(runner, "sandbox", "network", SID, flag, value)
    assert r.exit_code == 2 and flag in r.output + r.stderr
    assert daemon.requests == []


def test_network_shows_the_limits(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    nd.limits = dict(LIMITS)
    r = invoke(runner, "sandbox", "network", SID)
    assert r.exit_code == 0, r.stderr
    assert "limits   64 connections, 2.5 Mbit/s" in r.stdout.splitlines()
    r = invoke(runner, "sandbox", "network", SID, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["limits"] == LIMITS
    assert cli.limits_text(NetLimits(bandwidth_mbps=100.0)) == "100 Mbit/s"
    assert cli.limits_text(NetLimits(max_connections=1)) == "1 connection"
    assert cli.limits_text(NetLimits()) == "-"


def test_network_limit_updates(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    r = invoke(runner, "sandbox", "network", SID, "--max-connections", "64", "--bandwidth-mbps", "2.5")
    assert r.exit_code == 0, r.stderr
    assert (daemon.last.method, daemon.last.url.path) == ("PUT", NETWORK)
    assert daemon.body() == {"limits": {"max_connections": 64, "bandwidth_mbps": 2.5}}
    assert "limits   64 connections, 2.5 Mbit/s" in r.stdout and nd.limits == LIMITS
    r = invoke(runner, "sandbox", "network", SID, "--bandwidth-mbps", "10")  # replaces the limits
    assert r.exit_code == 0 and daemon.body() == {"limits": {"bandwidth_mbps": 10.0}}
    assert "limits   10 Mbit/s" in r.stdout
    r = invoke(runner, "sandbox", "network", SID, "--set-mode", "open", "--max-connections", "3")
    assert r.exit_code == 0 and daemon.body() == {"network": "open", "limits": {"max_connections": 3}}
    r = invoke(runner, "sandbox", "network", SID, "--set-mode", "allowlist")
    assert r.exit_code == 0 and "limits" not in daemon.body() and nd.limits == {"max_connections": 3}, "kept"
    r = invoke(runner, "sandbox", "network", SID, "--clear-limits")
    assert r.exit_code == 0 and daemon.body() == {"limits": {}} and nd.limits == {}
    assert "limits   -" in r.stdout
    r = invoke(runner, "sandbox", "network", SID, "--clear-limits", "--clear-allow", "--json")
    assert r.exit_code == 0 and daemon.body() == {"allow": [], "limits": {}} and json.loads(r.stdout)["limits"] == {}


def test_network_limit_usage_errors(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    for extra in (("--max-connections", "4"), ("--bandwidth-mbps", "1")):
        r = invoke(runner, "sandbox", "network", SID, "--clear-limits", *extra)
        assert r.exit_code == 2 and "--clear-limits" in r.output + r.stderr
    assert daemon.requests == []


def test_network_limit_refusal_is_one_red_line(runner: CliRunner, daemon: FakeDaemon, nd: Network) -> None:
    daemon.on("PUT", NETWORK, error("bad_request", "network limits: not supported by this kernel", 400))
    line = one_red_line(invoke(runner, "sandbox", "network", SID, "--max-connections", "4"))
    assert line == "error: network limits: not supported by this kernel"
