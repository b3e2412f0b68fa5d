"""Sandbox network modes in the sync and async SDKs: ``Sandbox.create(network=..., allow=..., proxy=...,
net_limits=...)``, ``sbx.fork(..., network=..., allow=...)`` and ``sbx.network.get()`` / ``.update()``
against the contract of ``/v1/sandboxes`` and ``/v1/sandboxes/{id}/network``."""

from __future__ import annotations

import inspect
import json
import math
from typing import List, Optional

import httpx
import pytest

from branchbox import (
    AsyncSandbox,
    InvalidArgumentError,
    NetLimits,
    NetworkInfo,
    NotFoundError,
    Sandbox,
    SandboxError,
    SandboxInfo,
    _core,
)
from branchbox import sandbox_async, sandbox_sync
from conftest import BASE, SANDBOX, SID, FakeDaemon

NETWORK = BASE + "/network"
ADDRESS = "10.213.0.2"
ENTRIES = ["api.example.com", "*.example.org", "10.0.0.0/8:443", "192.168.1.7:8000-8010"]
#: The daemon's proxy as a sandbox created with ``proxy=True`` sees it.
PROXY = "http://127.0.0.1:3128"

#: A SandboxInfo of a daemon with network modes (mode allowlist).
SANDBOX_NET = dict(
    SANDBOX, network="allowlist", allow=ENTRIES[:2], address=ADDRESS, net_rx_bytes=2_000_123, net_tx_bytes=4096
)
#: A SandboxInfo of a sandbox with the daemon's proxy, in mode none (the proxy is its only way out).
SANDBOX_PROXY = dict(SANDBOX, allow=["allowed.test"], proxy=PROXY, net_rx_bytes=0, net_tx_bytes=0)


#: Limits as the daemon answers them (``NetworkInfo.limits``).
LIMITS = {"max_connections": 64, "bandwidth_mbps": 2.5}


def net_info(network: str = "allowlist", allow: Optional[List[str]] = None, address: Optional[str] = ADDRESS,
             rx: int = 0, tx: int = 0, proxy: Optional[str] = None, limits: Optional[dict] = None) -> dict:
    return {"sandbox": SID, "network": network, "allow": list(allow or []), "address": address,
            "rx_bytes": rx, "tx_bytes": tx, "proxy": proxy, "limits": dict(limits or {})}


def error(code: str, message: str, status: int) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


class Network:
    """The daemon's network of sandbox ``SID``: the daemon's rules (an unknown mode, a bad
    entry or ``none`` with entries answer 400 and change nothing; ``none`` alone clears the
    entries; an address while the mode has egress; ``proxy``: the sandbox's proxy URL, if any,
    which no update changes; ``limits``, replaced as a whole by an update that gives them, a bad
    one answering 400)."""

    def __init__(self, network: str = "none", allow: Optional[List[str]] = None) -> None:
        self.network = network
        self.allow = list(allow or [])
        self.rx, self.tx = 1500, 700
        self.proxy: Optional[str] = None
        self.limits: dict = {}

    def info(self) -> dict:
        address = ADDRESS if self.network != "none" else None
        return net_info(self.network, self.allow, address, self.rx, self.tx, self.proxy, self.limits)

    def get(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=self.info())

    def put(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        network = body.get("network", self.network)
        allow = body.get("allow")
        if network not in ("none", "allowlist", "open"):
            return error("bad_request", "network mode %r is unknown: use \"none\" (loopback only), \"allowlist\" or \"open\"" % network, 400)
        if allow is None:
            allow = [] if "network" in body and network == "none" else self.allow
        for entry in allow:
            if " " in entry or not entry:
                return error("bad_request", "allow entry %r: not a name, an IPv4 address or a CIDR" % entry, 400)
        if network == "none" and allow and self.proxy is None:
            return error("bad_request", "network mode \"none\" takes no allow entries: use \"allowlist\"", 400)
        limits = body.get("limits", self.limits)
        if set(limits) - {"max_connections", "bandwidth_mbps"}:
            return error("bad_request", "limits: unknown field", 400)
        if not 1 <= limits.get("max_connections", 1) <= 65536:
            return error("bad_request", "network limits: max_connections must be from 1 to 65536", 400)
        self.network, self.allow, self.limits = network, list(allow), dict(limits)
        return httpx.Response(200, json=self.info())


def routes(fake: FakeDaemon, network: str = "none", allow: Optional[List[str]] = None) -> Network:
    net = Network(network, allow)
    fake.on("GET", NETWORK, net.get)
    fake.on("PUT", NETWORK, net.put)
    return net


@pytest.fixture
def net(fake: FakeDaemon) -> Network:
    return routes(fake)


@pytest.fixture
def sbx(fake: FakeDaemon, net: Network) -> Sandbox:
    s = Sandbox.create(transport=fake.transport())
    yield s
    s.close()


@pytest.fixture
async def asbx(fake: FakeDaemon, net: Network) -> AsyncSandbox:
    s = await AsyncSandbox.create(transport=fake.transport())
    yield s
    await s.close()



def fork_answer(*children: dict) -> dict:
    return {"snapshot": "sn-000000000001", "sandboxes": list(children), "sessions_restarted": False, "took_ms": 8.0}


# ----------------------------------------------------------------------------- models


def test_network_info_parsing() -> None:
    data = net_info("allowlist", ENTRIES, ADDRESS, 2_000_123, 4096)
    info = NetworkInfo.from_dict(data)
    assert (info.sandbox, info.network, info.allow, info.address, info.rx_bytes, info.tx_bytes) == (
        SID, "allowlist", ENTRIES, ADDRESS, 2_000_123, 4096,
    )
    assert info.raw == data and "raw" not in repr(info)
    assert info.allow is not data["allow"], "a list of its own"
    assert info == NetworkInfo(SID, "allowlist", ENTRIES, ADDRESS, 2_000_123, 4096)
    none = NetworkInfo.from_dict(net_info("none", address=None))
    assert (none.network, none.allow, none.address, none.proxy) == ("none", [], None, None)
    proxied = NetworkInfo.from_dict(net_info("none", ["allowed.test"], None, proxy=PROXY))
    assert (proxied.network, proxied.allow, proxied.address, proxied.proxy) == ("none", ["allowed.test"], None, PROXY)


def test_network_info_tolerates_missing_null_and_unknown_fields() -> None:
    info = NetworkInfo.from_dict({"network": "open", "allow": None, "future": {"x": 1}})
    assert (info.sandbox, info.network, info.allow, info.address, info.rx_bytes, info.tx_bytes, info.proxy) == (
        "", "open", [], None, 0, 0, None,
    )
    assert info.raw == {"network": "open", "allow": None, "future": {"x": 1}}
    assert NetworkInfo.from_dict(None) == NetworkInfo() and NetworkInfo.from_dict([]) == NetworkInfo()


def test_sandbox_info_network_fields() -> None:
    info = SandboxInfo.from_dict(SANDBOX_NET)
    assert (info.network, info.allow, info.address, info.net_rx_bytes, info.net_tx_bytes) == (
        "allowlist", ENTRIES[:2], ADDRESS, 2_000_123, 4096,
    )
    assert info.raw == SANDBOX_NET and info.id == SID and info.env == {"K": "V"} and info.proxy is None
    proxied = SandboxInfo.from_dict(SANDBOX_PROXY)
    assert (proxied.network, proxied.allow, proxied.address, proxied.proxy) == ("none", ["allowed.test"], None, PROXY)
    assert SandboxInfo.from_dict(dict(SANDBOX, proxy=None)).proxy is None


def test_sandbox_info_of_an_older_daemon_or_mode_none() -> None:
    # An older daemon (and mode none: allow and address are left out) sends none of them.
    assert not {"allow", "address", "net_rx_bytes", "net_tx_bytes", "proxy"} & set(SANDBOX)
    info = SandboxInfo.from_dict(SANDBOX)
    assert (info.network, info.allow, info.address, info.net_rx_bytes, info.net_tx_bytes) == ("none", [], None, 0, 0)
    assert info.proxy is None
    bare = SandboxInfo.from_dict({"id": SID})
    assert (bare.network, bare.allow, bare.address, bare.net_rx_bytes) == (None, [], None, 0)
    assert SandboxInfo.from_dict({"allow": None}).allow == []
    a, b = SandboxInfo.from_dict({}), SandboxInfo.from_dict({})
    a.allow.append("x")
    assert b.allow == [], "no shared default list"


# ----------------------------------------------------------------------------- _core calls


def test_core_network_call_shapes() -> None:
    get = _core.get_network(SID)
    assert (get.method, get.path, get.json, get.params) == ("GET", NETWORK, None, None)
    assert not get.unbounded and get.op_timeout is None
    assert get.parse(net_info()) == NetworkInfo.from_dict(net_info())
    assert _core.get_network("a/b").path == "/v1/sandboxes/a%2Fb/network"
    cases = [
        ({"network": "open"}, {"network": "open"}),
        ({"allow": ENTRIES}, {"allow": ENTRIES}),
        ({"allow": []}, {"allow": []}),
        ({"allow": ("a.test", "b.test")}, {"allow": ["a.test", "b.test"]}),
        ({"network": "allowlist", "allow": ["a.test"]}, {"network": "allowlist", "allow": ["a.test"]}),
        ({"network": "none"}, {"network": "none"}),
    ]
    for kwargs, body in cases:
        call = _core.update_network(SID, **kwargs)
        assert (call.method, call.path, call.json) == ("PUT", NETWORK, body), kwargs
        assert call.parse(net_info()) == NetworkInfo.from_dict(net_info())


def test_core_update_with_nothing_to_change_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="network, allow and/or limits") as ei:
        _core.update_network(SID)
    assert isinstance(ei.value, ValueError) and ei.value.status_code is None


@pytest.mark.parametrize("bad", ["wide", "", "None", "OPEN", 1, True, ["open"]])
def test_network_mode_bad(bad) -> None:
    with pytest.raises(InvalidArgumentError, match='"none", "allowlist" or "open"') as ei:
        _core.network_mode(bad)
    assert isinstance(ei.value, ValueError) and ei.value.code == "bad_request" and ei.value.status_code is None
    for build in (
        lambda: _core.update_network(SID, network=bad),
        lambda: _core.create_sandbox(network=bad),
        lambda: _core.fork(SID, 1, network=bad),
    ):
        with pytest.raises(InvalidArgumentError):
            build()


@pytest.mark.parametrize("bad, needle", [
    ("api.example.com", "not a single string"),
    (b"api.example.com", "not a single string"),
    ({"api.example.com"}, "list of entries"),
    ({"api.example.com": 443}, "list of entries"),
    (443, "list of entries"),
    (["api.example.com", 443], "every allow entry must be a string"),
    ([None], "every allow entry must be a string"),
])
def test_allow_entries_bad(bad, needle) -> None:
    with pytest.raises(InvalidArgumentError, match=needle) as ei:
        _core.allow_entries(bad)
    assert isinstance(ei.value, ValueError)
    for build in (
        lambda: _core.update_network(SID, allow=bad),
        lambda: _core.create_sandbox(network="allowlist", allow=bad),
        lambda: _core.fork(SID, 1, allow=bad),
    ):
        with pytest.raises(InvalidArgumentError, match=needle):
            build()


def test_allow_entries_good() -> None:
    assert _core.allow_entries(ENTRIES) == ENTRIES and _core.allow_entries(ENTRIES) is not ENTRIES
    assert _core.allow_entries(()) == [] and _core.allow_entries(("a.test",)) == ["a.test"]
    # The entries' syntax is the daemon's to check.
    assert _core.allow_entries(["not a name", "", "::1"]) == ["not a name", "", "::1"]
    assert _core.NETWORK_MODES == ("none", "allowlist", "open")


def test_core_create_bodies() -> None:
    body = lambda **kw: _core.create_sandbox(**kw).json  # noqa: E731
    # Without network: "none" (the daemon's default), or with a snapshot the snapshot's.
    assert body() == {"image": "base", "timeout": 300, "network": "none"}
    assert body(network="allowlist", allow=ENTRIES) == {
        "image": "base", "timeout": 300, "network": "allowlist", "allow": ENTRIES,
    }
    assert body(network="open") == {"image": "base", "timeout": 300, "network": "open"}
    assert body(network="open", allow=[]) == {"image": "base", "timeout": 300, "network": "open", "allow": []}
    assert body(image=None, template="py") == {"template": "py", "timeout": 300}, "the template's network applies"
    assert body(image=None, snapshot="sn-000000000001") == {"snapshot": "sn-000000000001", "timeout": 300}
    assert body(image=None, snapshot="sn-000000000001", network="none") == {
        "snapshot": "sn-000000000001", "timeout": 300, "network": "none",
    }, "an explicit none is sent: the snapshot's mode may be another"
    assert body(image=None, snapshot="sn-000000000001", allow=["a.test"]) == {
        "snapshot": "sn-000000000001", "timeout": 300, "allow": ["a.test"],
    }, "entries alone keep the snapshot's mode"
    # Entries without a mode go to the daemon, which says "none" takes none (unless with a proxy).
    assert body(allow=["a.test"]) == {"image": "base", "timeout": 300, "network": "none", "allow": ["a.test"]}


def test_core_create_bodies_with_a_proxy() -> None:
    body = lambda **kw: _core.create_sandbox(**kw).json  # noqa: E731
    assert body(proxy=True) == {"image": "base", "timeout": 300, "network": "none", "proxy": True}
    assert body(proxy=False) == body() and "proxy" not in body(), "sent only when True"
    assert body(allow=["allowed.test"], proxy=True) == {
        "image": "base", "timeout": 300, "network": "none", "allow": ["allowed.test"], "proxy": True,
    }, "allow with mode none: the proxy's entries"
    assert body(network="open", proxy=True) == {"image": "base", "timeout": 300, "network": "open", "proxy": True}
    assert body(image=None, snapshot="sn-000000000001", proxy=True) == {
        "snapshot": "sn-000000000001", "timeout": 300, "proxy": True,
    }
    assert body(image=None, template="py", proxy=True) == {"template": "py", "timeout": 300, "proxy": True}


def test_core_create_bodies_with_proxy_record() -> None:
    body = lambda **kw: _core.create_sandbox(**kw).json  # noqa: E731
    assert body(proxy=True, proxy_record=True) == {
        "image": "base", "timeout": 300, "network": "none", "proxy": True, "proxy_record": True,
    }
    assert "proxy_record" not in body(proxy=True), "sent only when given"
    assert body(image=None, snapshot="sn-000000000001", proxy_record=False) == {
        "snapshot": "sn-000000000001", "timeout": 300, "proxy_record": False,
    }, "False turns a snapshot's recording off"
    for bad in ("yes", 1, 0):
        with pytest.raises(InvalidArgumentError, match="proxy_record must be True, False or None"):
            _core.create_sandbox(proxy=True, proxy_record=bad)


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "true"])
def test_core_create_proxy_must_be_a_bool(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="proxy must be True or False") as ei:
        _core.create_sandbox(proxy=bad)
    assert isinstance(ei.value, ValueError) and ei.value.status_code is None


def test_core_fork_bodies() -> None:
    body = lambda *a, **kw: _core.fork(SID, *a, **kw).json  # noqa: E731
    assert body(2) == {"count": 2}, "the children's network defaults to the parent's: nothing sent"
    assert body(2, network="open") == {"count": 2, "network": "open"}
    assert body(1, allow=["a.test"]) == {"count": 1, "allow": ["a.test"]}
    assert body(1, allow=[]) == {"count": 1, "allow": []}
    assert body(3, "sn-000000000001", 60, True, "allowlist", ("a.test",)) == {
        "count": 3, "snapshot": "sn-000000000001", "timeout": 60, "isolated": True,
        "network": "allowlist", "allow": ["a.test"],
    }


# ----------------------------------------------------------------------------- sync Sandbox


def test_create_sends_network_and_allow(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", SANDBOX_NET, 201)
    sbx = Sandbox.create(network="allowlist", allow=ENTRIES, transport=fake.transport())
    assert fake.shape() == ("POST", "/v1/sandboxes", {
        "image": "base", "timeout": 300, "network": "allowlist", "allow": ENTRIES,
    })
    info = sbx._info
    assert (info.network, info.allow, info.address, info.net_rx_bytes) == ("allowlist", ENTRIES[:2], ADDRESS, 2_000_123)
    sbx.close()
    Sandbox.create(network="open", transport=fake.transport()).close()
    assert fake.body() == {"image": "base", "timeout": 300, "network": "open"}
    Sandbox.create(transport=fake.transport()).close()
    assert fake.body() == {"image": "base", "timeout": 300, "network": "none"}, "unchanged default"
    Sandbox.create(snapshot="sn-000000000001", allow=["a.test"], transport=fake.transport()).close()
    assert fake.body() == {"snapshot": "sn-000000000001", "timeout": 300, "allow": ["a.test"]}


def test_create_with_a_proxy(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", SANDBOX_PROXY, 201)
    sbx = Sandbox.create(network="none", allow=["allowed.test"], proxy=True, transport=fake.transport())
    assert fake.shape() == ("POST", "/v1/sandboxes", {
        "image": "base", "timeout": 300, "network": "none", "allow": ["allowed.test"], "proxy": True,
    })
    assert (sbx._info.proxy, sbx._info.network, sbx._info.allow) == (PROXY, "none", ["allowed.test"])
    sbx.close()
    Sandbox.create(proxy=False, transport=fake.transport()).close()
    assert fake.body() == {"image": "base", "timeout": 300, "network": "none"}


def test_proxy_shows_in_info_and_network(fake: FakeDaemon, net: Network) -> None:
    fake.on("POST", "/v1/sandboxes", SANDBOX_PROXY, 201)
    fake.on("GET", BASE, SANDBOX_PROXY)
    net.proxy = PROXY
    sbx = Sandbox.create(allow=["allowed.test"], proxy=True, transport=fake.transport())
    assert sbx.info().proxy == PROXY
    info = sbx.network.get()
    assert (info.network, info.proxy, info.address) == ("none", PROXY, None)
    # Entries in mode none govern the proxy; the proxy stays through updates (read-only).
    n = sbx.network.update(allow=["allowed.test", "also.allowed.test"])
    assert fake.body() == {"allow": ["allowed.test", "also.allowed.test"]}, "the proxy is not sent"
    assert (n.network, n.allow, n.proxy) == ("none", ["allowed.test", "also.allowed.test"], PROXY)
    assert sbx.network.update(network="open").proxy == PROXY
    sbx.close()


def test_fork_children_inherit_the_proxy(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", SANDBOX_PROXY, 201)
    sbx = Sandbox.create(proxy=True, allow=["allowed.test"], transport=fake.transport())
    fake.on("POST", BASE + "/fork", fork_answer(dict(SANDBOX_PROXY, id="sb-child0000001")), 201)
    (c,) = sbx.fork(1)
    assert fake.body() == {"count": 1}, "nothing new in the fork request"
    assert c._info.proxy == PROXY
    assert "proxy" not in inspect.signature(Sandbox.fork).parameters
    c.close()
    sbx.close()


def test_create_bad_network_sends_nothing(fake: FakeDaemon) -> None:
    for kwargs in ({"network": "wide"}, {"allow": "api.example.com"}, {"network": "allowlist", "allow": [1]},
                   {"proxy": "yes"}):
        with pytest.raises(InvalidArgumentError):
            Sandbox.create(transport=fake.transport(), **kwargs)
    assert fake.requests == []


def test_create_daemon_400_is_an_invalid_argument_error(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", error("bad_request", "allow entry \"bad name\": not a name", 400))
    with pytest.raises(InvalidArgumentError, match="bad name") as ei:
        Sandbox.create(network="allowlist", allow=["bad name"], transport=fake.transport())
    assert ei.value.status_code == 400


def test_fork_passes_network_and_allow(sbx: Sandbox, fake: FakeDaemon) -> None:
    child = dict(SANDBOX_NET, id="sb-child0000001", network="open", allow=[], address="10.213.0.3")
    fake.on("POST", BASE + "/fork", fork_answer(child), 201)
    (c,) = sbx.fork(1, network="open", allow=[])
    assert fake.shape() == ("POST", BASE + "/fork", {"count": 1, "network": "open", "allow": []})
    assert c.id == "sb-child0000001" and c._info.network == "open" and c._info.address == "10.213.0.3"
    c.close()
    children, result = sbx.fork_info(2, allow=["a.test"])
    assert fake.body() == {"count": 2, "allow": ["a.test"]} and result.took_ms == 8.0
    for c in children:
        c.close()
    sbx.fork(1)
    assert fake.body() == {"count": 1}
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError):
        sbx.fork(1, network="bridge")
    with pytest.raises(InvalidArgumentError):
        sbx.fork(1, allow="a.test")
    assert len(fake.requests) == before


def test_network_get_and_update(sbx: Sandbox, fake: FakeDaemon, net: Network) -> None:
    assert isinstance(sbx.network, sandbox_sync.Network) and repr(sbx.network) == "Network(sandbox=%r)" % SID
    info = sbx.network.get()
    assert fake.shape() == ("GET", NETWORK, None)
    assert isinstance(info, NetworkInfo)
    assert (info.sandbox, info.network, info.allow, info.address, info.rx_bytes, info.tx_bytes) == (
        SID, "none", [], None, 1500, 700,
    )
    n = sbx.network.update(network="allowlist")
    assert fake.shape() == ("PUT", NETWORK, {"network": "allowlist"})
    assert (n.network, n.allow, n.address) == ("allowlist", [], ADDRESS)
    n = sbx.network.update(allow=["allowed.test"])
    assert fake.shape() == ("PUT", NETWORK, {"allow": ["allowed.test"]})
    assert (n.network, n.allow) == ("allowlist", ["allowed.test"])
    n = sbx.network.update("open")  # positional: the mode
    assert fake.body() == {"network": "open"} and n.allow == ["allowed.test"], "entries left as they were"
    n = sbx.network.update(network="allowlist", allow=[])
    assert fake.body() == {"network": "allowlist", "allow": []} and n.allow == []
    sbx.network.update(allow=ENTRIES)
    n = sbx.network.update(network="none")
    assert fake.body() == {"network": "none"} and (n.network, n.allow, n.address) == ("none", [], None)
    assert sbx.network.get() == n


def test_network_update_refusals(sbx: Sandbox, fake: FakeDaemon, net: Network) -> None:
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError, match="network, allow and/or limits"):
        sbx.network.update()
    with pytest.raises(ValueError, match="not a single string"):
        sbx.network.update(allow="allowed.test")
    with pytest.raises(ValueError, match='"none", "allowlist" or "open"'):
        sbx.network.update(network="wide")
    assert len(fake.requests) == before, "refused before any request"
    # The daemon's own refusals: nothing changed.
    sbx.network.update(network="open")
    with pytest.raises(InvalidArgumentError, match="not a name") as ei:
        sbx.network.update(allow=["not a name"])
    assert ei.value.status_code == 400 and isinstance(ei.value, SandboxError)
    with pytest.raises(InvalidArgumentError, match="takes no allow entries"):
        sbx.network.update(network="none", allow=["a.test"])
    assert sbx.network.get().network == "open" and net.allow == []


def test_network_errors_map(sbx: Sandbox, fake: FakeDaemon) -> None:
    gone = Sandbox("sb-gone", _http=sbx._http)
    for method, call in (("GET", gone.network.get), ("PUT", lambda: gone.network.update(network="open"))):
        fake.on(method, "/v1/sandboxes/sb-gone/network", error("not_found", "sandbox sb-gone not found", 404))
        with pytest.raises(NotFoundError, match="sb-gone"):
            call()
    fake.on("PUT", NETWORK, error("unavailable", "nftables is not available", 503))
    with pytest.raises(SandboxError, match="nftables") as ei:
        sbx.network.update(network="open")
    assert ei.value.status_code == 503


def test_each_sandbox_has_its_network(fake: FakeDaemon, net: Network) -> None:
    a = Sandbox.create(transport=fake.transport())
    b = Sandbox("sb-other0000001", _http=a._http)
    fake.on("GET", "/v1/sandboxes/sb-other0000001/network", net_info("open"))
    assert a.network.get().network == "none" and b.network.get().network == "open"
    assert fake.last.url.path == "/v1/sandboxes/sb-other0000001/network"
    a.close()


# ----------------------------------------------------------------------------- async


async def test_async_create_and_fork(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", SANDBOX_NET, 201)
    s = await AsyncSandbox.create(network="allowlist", allow=ENTRIES[:2], transport=fake.transport())
    assert fake.shape() == ("POST", "/v1/sandboxes", {
        "image": "base", "timeout": 300, "network": "allowlist", "allow": ENTRIES[:2],
    })
    assert s._info.address == ADDRESS and s._info.net_tx_bytes == 4096
    fake.on("POST", BASE + "/fork", fork_answer(dict(SANDBOX_NET, id="sb-child0000001")), 201)
    (c,) = await s.fork(1, network="none")
    assert fake.body() == {"count": 1, "network": "none"} and c.id == "sb-child0000001"
    await c.close()
    _, result = await s.fork_info(1, allow=["a.test"])
    assert fake.body() == {"count": 1, "allow": ["a.test"]} and result.snapshot == "sn-000000000001"
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError):
        await AsyncSandbox.create(allow="a.test", transport=fake.transport())
    with pytest.raises(InvalidArgumentError, match="proxy must be True or False"):
        await AsyncSandbox.create(proxy=1, transport=fake.transport())
    with pytest.raises(InvalidArgumentError):
        await s.fork(1, network="wide")
    assert len(fake.requests) == before
    await s.close()


async def test_async_create_with_a_proxy(fake: FakeDaemon, net: Network) -> None:
    fake.on("POST", "/v1/sandboxes", SANDBOX_PROXY, 201)
    net.proxy = PROXY
    s = await AsyncSandbox.create(allow=["allowed.test"], proxy=True, transport=fake.transport())
    assert fake.shape() == ("POST", "/v1/sandboxes", {
        "image": "base", "timeout": 300, "network": "none", "allow": ["allowed.test"], "proxy": True,
    })
    assert s._info.proxy == PROXY and (await s.network.get()).proxy == PROXY
    await s.close()
    await (await AsyncSandbox.create(transport=fake.transport())).close()
    assert "proxy" not in fake.body()


async def test_async_network(asbx: AsyncSandbox, fake: FakeDaemon, net: Network) -> None:
    assert isinstance(asbx.network, sandbox_async.AsyncNetwork)
    info = await asbx.network.get()
    assert fake.shape() == ("GET", NETWORK, None) and info == NetworkInfo.from_dict(net.info())
    n = await asbx.network.update(network="allowlist", allow=["allowed.test"])
    assert fake.shape() == ("PUT", NETWORK, {"network": "allowlist", "allow": ["allowed.test"]})
    assert (n.network, n.allow, n.address) == ("allowlist", ["allowed.test"], ADDRESS)
    n = await asbx.network.update(allow=[])
    assert fake.body() == {"allow": []} and n.allow == [] and n.network == "allowlist"
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError):
        await asbx.network.update()
    with pytest.raises(ValueError):
        await asbx.network.update(allow="allowed.test")
    assert len(fake.requests) == before
    with pytest.raises(InvalidArgumentError, match="not a name"):
        await asbx.network.update(allow=["not a name"])
    fake.on("GET", NETWORK, error("not_found", "no sandbox", 404))
    with pytest.raises(NotFoundError):
        await asbx.network.get()


# ----------------------------------------------------------------------------- parity


def test_network_objects_mirror() -> None:
    s, a = sandbox_sync.Network, sandbox_async.AsyncNetwork
    for name in ("get", "update"):
        sp, ap = inspect.signature(getattr(s, name)), inspect.signature(getattr(a, name))
        assert list(sp.parameters) == list(ap.parameters)
        assert inspect.iscoroutinefunction(getattr(a, name)) and not inspect.iscoroutinefunction(getattr(s, name))
        assert getattr(s, name).__doc__ and getattr(a, name).__doc__
    assert list(inspect.signature(s.update).parameters) == ["self", "network", "allow", "limits"]
    assert {n for n in dir(s) if not n.startswith("_")} == {n for n in dir(a) if not n.startswith("_")} == {"get", "update"}


@pytest.mark.parametrize("name", ["create", "fork", "fork_info"])
def test_network_parameters_on_both_sandboxes(name: str) -> None:
    for cls in (Sandbox, AsyncSandbox):
        params = inspect.signature(getattr(cls, name)).parameters
        assert params["network"].default is None and params["allow"].default is None, (cls, name)


def test_proxy_parameter_on_both_creates() -> None:
    for cls in (Sandbox, AsyncSandbox):
        params = inspect.signature(cls.create).parameters
        assert params["proxy"].default is False and params["proxy"].kind is inspect.Parameter.KEYWORD_ONLY, cls
        assert params["proxy_record"].default is None and params["proxy_record"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(Sandbox.create).parameters) == list(inspect.signature(AsyncSandbox.create).parameters)


# ----------------------------------------------------------------------------- limits


def test_net_limits_model() -> None:
    import branchbox

    assert "NetLimits" in branchbox.__all__ and branchbox.NetLimits is NetLimits
    assert NetLimits() == NetLimits(None, None) and (NetLimits().max_connections, NetLimits().bandwidth_mbps) == (None, None)
    lim = NetLimits.from_dict(dict(LIMITS, future=1))
    assert lim == NetLimits(64, 2.5) and lim.raw == dict(LIMITS, future=1) and "raw" not in repr(lim)
    assert NetLimits.from_dict(None) == NetLimits() == NetLimits.from_dict({})


def test_network_info_limits() -> None:
    info = NetworkInfo.from_dict(net_info(limits=LIMITS))
    assert isinstance(info.limits, NetLimits) and info.limits == NetLimits(max_connections=64, bandwidth_mbps=2.5)
    assert NetworkInfo.from_dict(net_info(limits={"max_connections": 8})).limits == NetLimits(max_connections=8)
    # {} (no limits), null, or left out by an older daemon: empty.
    for data in (net_info(), dict(net_info(), limits=None), {k: v for k, v in net_info().items() if k != "limits"}):
        assert NetworkInfo.from_dict(data).limits == NetLimits(), data
    a, b = NetworkInfo(), NetworkInfo()
    a.limits.max_connections = 1
    assert b.limits == NetLimits(), "no shared default"
    assert NetworkInfo.from_dict(None) == NetworkInfo()


def test_net_limits_body_good() -> None:
    f = _core.net_limits_body
    assert f(NetLimits(64, 2.5)) == {"max_connections": 64, "bandwidth_mbps": 2.5}
    assert f(NetLimits(max_connections=8)) == {"max_connections": 8}, "None keys dropped"
    assert f(NetLimits(bandwidth_mbps=100)) == {"bandwidth_mbps": 100.0}
    assert isinstance(f({"bandwidth_mbps": 100})["bandwidth_mbps"], float)
    assert f({"max_connections": 64, "bandwidth_mbps": None}) == {"max_connections": 64}
    assert f({}) == {} and f(NetLimits()) == {}, "no limits"
    assert f({"max_connections": 1, "bandwidth_mbps": 0.1}) == {"max_connections": 1, "bandwidth_mbps": 0.1}
    assert f({"max_connections": 65536, "bandwidth_mbps": 100000}) == {"max_connections": 65536, "bandwidth_mbps": 100000.0}
    assert (_core.MAX_CONNECTIONS, _core.BANDWIDTH_MBPS) == ((1, 65536), (0.1, 100000.0))


@pytest.mark.parametrize("bad, needle", [
    ({"max_connections": 0}, "max_connections must be an int from 1 to 65536"),
    ({"max_connections": 65537}, "max_connections must be an int"),
    ({"max_connections": -1}, "max_connections must be an int"),
    ({"max_connections": True}, "max_connections must be an int"),
    ({"max_connections": 64.0}, "max_connections must be an int"),
    ({"max_connections": "64"}, "max_connections must be an int"),
    (NetLimits(max_connections=0), "max_connections must be an int"),
    ({"bandwidth_mbps": 0.05}, "bandwidth_mbps must be a number from 0.1 to 100000"),
    ({"bandwidth_mbps": 0}, "bandwidth_mbps must be a number"),
    ({"bandwidth_mbps": 100000.5}, "bandwidth_mbps must be a number"),
    ({"bandwidth_mbps": math.nan}, "bandwidth_mbps must be a number"),
    ({"bandwidth_mbps": math.inf}, "bandwidth_mbps must be a number"),
    ({"bandwidth_mbps": False}, "bandwidth_mbps must be a number"),
    ({"bandwidth_mbps": "100"}, "bandwidth_mbps must be a number"),
    (NetLimits(bandwidth_mbps=-3.0), "bandwidth_mbps must be a number"),
    ({"max_connections": 64, "bandwidth": 10}, "takes the keys max_connections and bandwidth_mbps, not bandwidth"),
    ({"rate": 1, "conns": 2}, "not conns, rate"),
    ([("max_connections", 64)], "must be a NetLimits or a dict"),
    (64, "must be a NetLimits or a dict"),
    ("64", "must be a NetLimits or a dict"),
])
def test_net_limits_bad(bad, needle) -> None:
    with pytest.raises(InvalidArgumentError, match=needle) as ei:
        _core.net_limits_body(bad)
    assert isinstance(ei.value, ValueError) and ei.value.status_code is None
    for build in (
        lambda: _core.create_sandbox(net_limits=bad),
        lambda: _core.update_network(SID, limits=bad),
        lambda: _core.update_network(SID, network="open", limits=bad),
    ):
        with pytest.raises(InvalidArgumentError, match=needle):
            build()


def test_net_limits_refusals_name_the_parameter() -> None:
    for bad in (64, {"rate": 1}):
        with pytest.raises(InvalidArgumentError, match="^net_limits "):
            _core.create_sandbox(net_limits=bad)
        with pytest.raises(InvalidArgumentError, match="^limits "):
            _core.update_network(SID, limits=bad)


def test_core_create_bodies_with_limits() -> None:
    body = lambda **kw: _core.create_sandbox(**kw).json  # noqa: E731
    assert "net_limits" not in body(), "not sent unless given"
    assert body(net_limits=NetLimits(64, 2.5)) == {
        "image": "base", "timeout": 300, "network": "none", "net_limits": {"max_connections": 64, "bandwidth_mbps": 2.5},
    }
    assert body(network="open", net_limits={"bandwidth_mbps": 10}) == {
        "image": "base", "timeout": 300, "network": "open", "net_limits": {"bandwidth_mbps": 10.0},
    }
    assert body(net_limits={"max_connections": 8, "bandwidth_mbps": None})["net_limits"] == {"max_connections": 8}
    # From a snapshot or a template: theirs unless given; {} lifts them.
    assert body(image=None, snapshot="sn-000000000001") == {"snapshot": "sn-000000000001", "timeout": 300}
    assert body(image=None, snapshot="sn-000000000001", net_limits={}) == {
        "snapshot": "sn-000000000001", "timeout": 300, "net_limits": {},
    }
    assert body(image=None, template="py", net_limits=NetLimits()) == {"template": "py", "timeout": 300, "net_limits": {}}
    assert body(image=None, template="py", net_limits=NetLimits(max_connections=4)) == {
        "template": "py", "timeout": 300, "net_limits": {"max_connections": 4},
    }


def test_core_update_network_limits_shapes() -> None:
    cases = [
        ({"limits": NetLimits(64, 2.5)}, {"limits": {"max_connections": 64, "bandwidth_mbps": 2.5}}),
        ({"limits": {"max_connections": 8}}, {"limits": {"max_connections": 8}}),
        ({"limits": {"bandwidth_mbps": 1, "max_connections": None}}, {"limits": {"bandwidth_mbps": 1.0}}),
        ({"limits": {}}, {"limits": {}}),
        ({"limits": NetLimits()}, {"limits": {}}),
        ({"network": "open", "allow": [], "limits": {"max_connections": 2}},
         {"network": "open", "allow": [], "limits": {"max_connections": 2}}),
    ]
    for kwargs, body in cases:
        call = _core.update_network(SID, **kwargs)
        assert (call.method, call.path, call.json) == ("PUT", NETWORK, body), kwargs
    assert "limits" not in _core.update_network(SID, network="open").json, "left out: unchanged"
    assert _core.update_network(SID, None, None, {"max_connections": 3}).json == {"limits": {"max_connections": 3}}


def test_create_sends_net_limits(fake: FakeDaemon) -> None:
    Sandbox.create(network="open", net_limits=NetLimits(max_connections=64, bandwidth_mbps=2.5), transport=fake.transport()).close()
    assert fake.shape() == ("POST", "/v1/sandboxes", {
        "image": "base", "timeout": 300, "network": "open", "net_limits": {"max_connections": 64, "bandwidth_mbps": 2.5},
    })
    Sandbox.create(net_limits={"bandwidth_mbps": 100}, transport=fake.transport()).close()
    assert fake.body()["net_limits"] == {"bandwidth_mbps": 100.0}
    Sandbox.create(snapshot="sn-000000000001", net_limits={}, transport=fake.transport()).close()
    assert fake.body() == {"snapshot": "sn-000000000001", "timeout": 300, "net_limits": {}}
    Sandbox.create(transport=fake.transport()).close()
    assert "net_limits" not in fake.body()


def test_create_bad_net_limits_sends_nothing(fake: FakeDaemon) -> None:
    for bad in ({"max_connections": 0}, {"bandwidth_mbps": 1e9}, {"conns": 1}, [64], NetLimits(max_connections=1.5)):
        with pytest.raises(InvalidArgumentError):
            Sandbox.create(net_limits=bad, transport=fake.transport())
    assert fake.requests == []


def test_create_daemon_refusing_net_limits(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", error("bad_request", "unknown field `net_limits`", 400))
    with pytest.raises(InvalidArgumentError, match="net_limits") as ei:
        Sandbox.create(net_limits={"max_connections": 4}, transport=fake.transport())
    assert ei.value.status_code == 400


def test_network_update_limits(sbx: Sandbox, fake: FakeDaemon, net: Network) -> None:
    assert sbx.network.get().limits == NetLimits()
    n = sbx.network.update(limits=NetLimits(64, 2.5))
    assert fake.shape() == ("PUT", NETWORK, {"limits": {"max_connections": 64, "bandwidth_mbps": 2.5}})
    assert n.limits == NetLimits(64, 2.5) and n.network == "none"
    n = sbx.network.update(network="open")
    assert fake.body() == {"network": "open"} and n.limits == NetLimits(64, 2.5), "limits left as they were"
    n = sbx.network.update(limits={"bandwidth_mbps": 10})
    assert fake.body() == {"limits": {"bandwidth_mbps": 10.0}}
    assert n.limits == NetLimits(bandwidth_mbps=10.0), "replaced as a whole"
    n = sbx.network.update("allowlist", ["a.test"], {"max_connections": 5})
    assert fake.body() == {"network": "allowlist", "allow": ["a.test"], "limits": {"max_connections": 5}}
    n = sbx.network.update(limits={})
    assert fake.body() == {"limits": {}} and n.limits == NetLimits(), "{} lifts them"
    assert sbx.network.get() == n
    before = len(fake.requests)
    for bad in ({"max_connections": 65537}, {"bandwidth_mbps": 0.01}, {"x": 1}, "fast"):
        with pytest.raises(InvalidArgumentError):
            sbx.network.update(limits=bad)
    assert len(fake.requests) == before, "refused before any request"


async def test_async_net_limits(fake: FakeDaemon, net: Network) -> None:
    s = await AsyncSandbox.create(network="open", net_limits={"max_connections": 16}, transport=fake.transport())
    assert fake.body() == {"image": "base", "timeout": 300, "network": "open", "net_limits": {"max_connections": 16}}
    n = await s.network.update(limits=NetLimits(bandwidth_mbps=0.5))
    assert fake.shape() == ("PUT", NETWORK, {"limits": {"bandwidth_mbps": 0.5}}) and n.limits == NetLimits(bandwidth_mbps=0.5)
    n = await s.network.update(limits={})
    assert fake.body() == {"limits": {}} and (await s.network.get()).limits == NetLimits()
    before = len(fake.requests)
    with pytest.raises(InvalidArgumentError, match="max_connections"):
        await AsyncSandbox.create(net_limits={"max_connections": 0}, transport=fake.transport())
    with pytest.raises(InvalidArgumentError, match="bandwidth_mbps"):
        await s.network.update(limits={"bandwidth_mbps": math.inf})
    assert len(fake.requests) == before
    await s.close()


def test_net_limits_parameter_on_both_creates() -> None:
    for cls in (Sandbox, AsyncSandbox):
        param = inspect.signature(cls.create).parameters["net_limits"]
        assert param.default is None and param.kind is inspect.Parameter.KEYWORD_ONLY, cls
    for cls in (sandbox_sync.Network, sandbox_async.AsyncNetwork):
        assert inspect.signature(cls.update).parameters["limits"].default is None
