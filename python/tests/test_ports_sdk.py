"""Sandbox ports in the sync and async SDKs (``sbx.get_host`` / ``open_port`` / ``ports`` /
``close_port``) against the contract of ``/v1/sandboxes/{id}/ports``."""

from __future__ import annotations

import inspect
import re
from typing import Dict

import httpx
import pytest

from branchbox import (
    AsyncSandbox,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    PortInfo,
    Sandbox,
    SandboxError,
    _core,
)
from conftest import BASE, SID, FakeDaemon

PORTS = BASE + "/ports"
OPENED_AT = 1732250001.5


def port_info(port: int, host_port: int) -> dict:
    host = "127.0.0.1:%d" % host_port
    return {"sandbox": SID, "port": port, "host": host, "url": "http://" + host, "opened_at": OPENED_AT}


P8000 = port_info(8000, 41234)
P8001 = port_info(8001, 41235)


def error(code: str, message: str, status: int) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


class Ports:
    """The daemon's ports of sandbox ``SID``: opened on first ask (the same answer after),
    listed by port, closed with ``{"removed": bool}``."""

    def __init__(self) -> None:
        self.open: Dict[int, dict] = {}
        self.next_host_port = 41234

    def port(self, request: httpx.Request) -> int:
        return int(request.url.path.rsplit("/", 1)[1])

    def get(self, request: httpx.Request) -> httpx.Response:
        port = self.port(request)
        if not 1 <= port <= 65535:
            return error("bad_request", "port %d: use a TCP port from 1 to 65535" % port, 400)
        if port not in self.open:
            self.open[port] = port_info(port, self.next_host_port)
            self.next_host_port += 1
        return httpx.Response(200, json=self.open[port])

    def list(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ports": [self.open[p] for p in sorted(self.open)]})

    def delete(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"removed": self.open.pop(self.port(request), None) is not None})


def routes(fake: FakeDaemon) -> Ports:
    ports = Ports()
    fake.on("GET", PORTS + r"/\d+", ports.get)
    fake.on("GET", PORTS, ports.list)
    fake.on("DELETE", PORTS + r"/\d+", ports.delete)
    return ports


@pytest.fixture
def ports(fake: FakeDaemon) -> Ports:
    return routes(fake)


@pytest.fixture
def sbx(fake: FakeDaemon, ports: Ports) -> Sandbox:
    s = Sandbox.create(transport=fake.transport())
    yield s
    s.close()


@pytest.fixture
async def asbx(fake: FakeDaemon, ports: Ports) -> AsyncSandbox:
    s = await AsyncSandbox.create(transport=fake.transport())
    yield s
    await s.close()



# ----------------------------------------------------------------------------- model


def test_port_info_parsing() -> None:
    info = PortInfo.from_dict(P8000)
    assert (info.sandbox, info.port, info.host, info.url, info.opened_at) == (
        SID, 8000, "127.0.0.1:41234", "http://127.0.0.1:41234", OPENED_AT,
    )
    assert info.raw == P8000 and "raw" not in repr(info)
    assert info == PortInfo(SID, 8000, "127.0.0.1:41234", "http://127.0.0.1:41234", OPENED_AT)


def test_port_info_tolerates_missing_and_unknown_fields() -> None:
    info = PortInfo.from_dict({"port": 80, "future": True})
    assert (info.sandbox, info.port, info.host, info.url, info.opened_at) == ("", 80, "", "", None)
    assert info.raw == {"port": 80, "future": True}
    assert PortInfo.from_dict(None) == PortInfo()


# ----------------------------------------------------------------------------- _core calls


def test_core_call_shapes() -> None:
    cases = [
        (_core.open_port(SID, 8000), "GET", PORTS + "/8000"),
        (_core.open_port(SID, 1), "GET", PORTS + "/1"),
        (_core.open_port(SID, 65535), "GET", PORTS + "/65535"),
        (_core.list_ports(SID), "GET", PORTS),
        (_core.close_port(SID, 8000), "DELETE", PORTS + "/8000"),
    ]
    for call, method, path in cases:
        assert (call.method, call.path, call.json, call.params) == (method, path, None, None)
        assert not call.unbounded and call.op_timeout is None
    assert _core.open_port("a/b", 80).path == "/v1/sandboxes/a%2Fb/ports/80"
    assert _core.open_port(SID, 80).parse(P8000) == PortInfo.from_dict(P8000)
    assert _core.list_ports(SID).parse({"ports": [P8000, P8001]}) == [PortInfo.from_dict(P8000), PortInfo.from_dict(P8001)]
    assert _core.list_ports(SID).parse({"ports": []}) == [] and _core.list_ports(SID).parse(None) == []
    # Like every other {"removed": ...} answer: false when nothing was there.
    removed = _core.close_port(SID, 80).parse
    assert removed({"removed": True}) is True and removed({"removed": False}) is False


@pytest.mark.parametrize("bad", [0, -1, 65536, 10**6, True, False, None, "8000", 80.0, [80]])
def test_port_number_bad(bad) -> None:
    with pytest.raises(ValueError, match="port must be") as ei:
        _core.port_number(bad)
    # One of the SDK's client-side checks too.
    assert isinstance(ei.value, InvalidArgumentError) and ei.value.code == "bad_request"
    assert ei.value.status_code is None
    assert re.search(r"1 to 65535", str(ei.value))
    for build in (_core.open_port, _core.close_port):
        with pytest.raises(InvalidArgumentError):
            build(SID, bad)


def test_port_number_good() -> None:
    assert [_core.port_number(p) for p in (1, 80, 8000, 65535)] == [1, 80, 8000, 65535]
    with pytest.raises(InvalidArgumentError, match="empty"):
        _core.list_ports("")


# ----------------------------------------------------------------------------- sync Sandbox


def test_get_host_opens_the_port(sbx: Sandbox, fake: FakeDaemon) -> None:
    assert sbx.get_host(8000) == "127.0.0.1:41234"
    assert fake.shape() == ("GET", PORTS + "/8000", None)
    assert sbx.get_host(8000) == "127.0.0.1:41234", "asked again: the same host"
    assert sbx.get_host(8001) == "127.0.0.1:41235"


def test_open_port_list_and_close(sbx: Sandbox, fake: FakeDaemon) -> None:
    info = sbx.open_port(8001)
    assert isinstance(info, PortInfo) and fake.shape() == ("GET", PORTS + "/8001", None)
    assert (info.sandbox, info.port, info.host, info.url) == (SID, 8001, "127.0.0.1:41234", "http://127.0.0.1:41234")
    assert info.opened_at == OPENED_AT and info.raw["port"] == 8001
    sbx.open_port(8000)
    listed = sbx.ports()
    assert fake.shape() == ("GET", PORTS, None)
    assert [p.port for p in listed] == [8000, 8001] and all(isinstance(p, PortInfo) for p in listed)
    assert listed[1] == info
    assert sbx.close_port(8001) is True
    assert fake.shape() == ("DELETE", PORTS + "/8001", None)
    assert sbx.close_port(8001) is False, "not open any more"
    assert [p.port for p in sbx.ports()] == [8000]


def test_bad_ports_send_nothing(sbx: Sandbox, fake: FakeDaemon) -> None:
    before = len(fake.requests)
    for bad in (0, 65536, -80, "80", None, 80.5, True):
        for method in (sbx.get_host, sbx.open_port, sbx.close_port):
            with pytest.raises(ValueError, match="port must be"):
                method(bad)
    assert len(fake.requests) == before


def test_errors_map(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/sandboxes/sb-gone/ports/80", error("not_found", "sandbox sb-gone not found", 404))
    gone = Sandbox("sb-gone", _http=sbx._http)  # killed since: its ports are gone too
    with pytest.raises(NotFoundError, match="sb-gone"):
        gone.get_host(80)
    fake.on("GET", PORTS + "/9000", error("conflict", "sandbox %s has 32 ports open" % SID, 409))
    with pytest.raises(ConflictError, match="32 ports") as ei:
        sbx.open_port(9000)
    assert ei.value.status_code == 409 and ei.value.code == "conflict"
    fake.on("GET", PORTS + "/9001", httpx.Response(409, text="paused"))  # the status alone
    with pytest.raises(ConflictError):
        sbx.get_host(9001)
    fake.on("GET", PORTS, error("not_found", "no sandbox", 404))
    with pytest.raises(NotFoundError):
        sbx.ports()
    fake.on("DELETE", PORTS + "/80", error("not_found", "no sandbox", 404))
    with pytest.raises(NotFoundError):
        sbx.close_port(80)  # an unknown sandbox is an error, not False
    fake.on("GET", PORTS + "/70000", error("bad_request", "port 70000", 400))  # never sent: checked first
    with pytest.raises(InvalidArgumentError) as bad:
        sbx.open_port(70000)
    assert bad.value.status_code is None


def test_a_daemon_400_is_an_invalid_argument_error(sbx: Sandbox, fake: FakeDaemon) -> None:
    fake.on("GET", PORTS + "/8000", error("bad_request", "\"x\" is not a port: give a TCP port from 1 to 65535", 400))
    with pytest.raises(InvalidArgumentError, match="not a port") as ei:
        sbx.get_host(8000)
    assert ei.value.status_code == 400 and isinstance(ei.value, SandboxError)


# ----------------------------------------------------------------------------- async


async def test_async_ports(asbx: AsyncSandbox, fake: FakeDaemon) -> None:
    assert await asbx.get_host(8000) == "127.0.0.1:41234"
    assert fake.shape() == ("GET", PORTS + "/8000", None)
    info = await asbx.open_port(8000)
    assert info == PortInfo.from_dict(P8000) and fake.last.url.path == PORTS + "/8000"
    await asbx.open_port(22)
    assert [p.port for p in await asbx.ports()] == [22, 8000] and fake.shape() == ("GET", PORTS, None)
    assert await asbx.close_port(22) is True and fake.shape() == ("DELETE", PORTS + "/22", None)
    assert await asbx.close_port(22) is False
    assert [p.host for p in await asbx.ports()] == ["127.0.0.1:41234"]


async def test_async_bad_ports_and_errors(asbx: AsyncSandbox, fake: FakeDaemon) -> None:
    before = len(fake.requests)
    for bad in (0, 65536, "80", None):
        for method in (asbx.get_host, asbx.open_port, asbx.close_port):
            with pytest.raises(ValueError, match="port must be"):
                await method(bad)
    assert len(fake.requests) == before
    fake.on("GET", PORTS + "/9000", error("conflict", "sandbox is paused", 409))
    with pytest.raises(ConflictError, match="paused"):
        await asbx.get_host(9000)
    fake.on("GET", PORTS, error("not_found", "no sandbox", 404))
    with pytest.raises(NotFoundError):
        await asbx.ports()


# ----------------------------------------------------------------------------- parity

PORT_METHODS = ["get_host", "open_port", "ports", "close_port"]


@pytest.mark.parametrize("name", PORT_METHODS)
def test_port_methods_mirror(name: str) -> None:
    s, a = getattr(Sandbox, name), getattr(AsyncSandbox, name)
    assert list(inspect.signature(s).parameters) == list(inspect.signature(a).parameters)
    assert list(inspect.signature(s).parameters) == (["self"] if name == "ports" else ["self", "port"])
    assert inspect.iscoroutinefunction(a) and not inspect.iscoroutinefunction(s)
    assert s.__doc__ and a.__doc__
