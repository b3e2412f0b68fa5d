"""Ports: a server listening inside a sandbox reached from the host (``sbx.get_host(port)``,
``GET /v1/sandboxes/{id}/ports/{port}``), whatever the sandbox's network mode (here ``none``,
the default: the sandbox itself has only ``lo``)."""

import socket

import httpx
import pytest

from branchbox import InvalidArgumentError, NotFoundError


def serve(sbx, port, text):
    """Start an HTTP server on 127.0.0.1:``port`` in ``sbx`` serving ``text`` at /index.html;
    return its process handle once it accepts connections."""
    sbx.files.write("/srv/%d/index.html" % port, text)
    h = sbx.commands.run("cd /srv/%d && exec python3 -m http.server %d --bind 127.0.0.1" % (port, port), background=True)
    ready = sbx.commands.run(
        "python3 -c 'import socket, time\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        socket.create_connection((\"127.0.0.1\", %d)).close(); break\n"
        "    except OSError:\n"
        "        time.sleep(0.05)\n"
        "else:\n"
        "    raise SystemExit(1)'" % port
    )
    assert ready.exit_code == 0, "the server in the sandbox did not start listening"
    return h


def get(host):
    return httpx.get("http://%s/index.html" % host, timeout=20)


def refused(host):
    addr, port = host.rsplit(":", 1)
    s = socket.socket()
    try:
        s.connect((addr, int(port)))
    except ConnectionRefusedError:
        return True
    finally:
        s.close()
    return False


def test_port_reaches_the_server_of_its_own_sandbox_and_closes_with_it(make_sandbox):
    a, b = make_sandbox(), make_sandbox()
    server_a = serve(a, 8000, "from a")
    serve(b, 8000, "from b")
    ha, hb = a.get_host(8000), b.get_host(8000)
    assert ha.startswith("127.0.0.1:") and hb.startswith("127.0.0.1:") and ha != hb
    assert get(ha).text == "from a" and get(hb).text == "from b"
    assert a.get_host(8000) == ha, "asked again: the same address"
    assert [(p.port, p.host, p.url) for p in a.ports()] == [(8000, ha, "http://" + ha)]
    # Many connections at once, each joined to the sandbox's server.
    with httpx.Client(timeout=20) as c:
        assert all(c.get("http://%s/index.html" % ha).text == "from a" for _ in range(20))

    # A port nothing listens on: the connection is closed at once (not left hanging).
    h1 = a.get_host(8001)
    with pytest.raises(httpx.TransportError):
        get(h1)
    assert a.close_port(8001) is True and a.close_port(8001) is False
    assert refused(h1), "a closed port still accepts connections"
    assert [p.port for p in a.ports()] == [8000]

    # The server dies: its port answers nothing, the other sandbox's is untouched.
    server_a.kill()
    with pytest.raises(httpx.TransportError):
        get(ha)
    assert get(hb).text == "from b"

    # The sandbox is killed: its listeners are closed by then.
    b.kill()
    assert refused(hb), "the port of a killed sandbox still accepts connections"
    with pytest.raises(NotFoundError):
        b.get_host(8000)


def test_forks_have_ports_of_their_own_and_pause_keeps_the_port(make_sandbox):
    a = make_sandbox()
    serve(a, 8080, "parent")
    ha = a.get_host(8080)
    (child,) = a.fork(1)
    try:
        # The child's network namespace is its own: the parent's server is not behind its port.
        hc = child.get_host(8080)
        assert hc != ha
        with pytest.raises(httpx.TransportError):
            get(hc)
        serve(child, 8080, "child")
        assert get(hc).text == "child" and get(ha).text == "parent"
        assert [p.port for p in a.ports()] == [8080], "a fork carries no ports into its parent's list"
    finally:
        child.kill()
    # Paused: connections are closed; resumed (processes back, maybe at a new host pid): served.
    a.pause()
    with pytest.raises(httpx.TransportError):
        get(ha)
    a.resume()
    assert get(ha).text == "parent"


def test_bad_ports_are_refused_with_the_range(sbx, raw):
    for bad in ("0", "65536", "http", "-1"):
        r = raw.get("/v1/sandboxes/%s/ports/%s" % (sbx.id, bad))
        assert r.status_code == 400 and "1 to 65535" in r.json()["error"]["message"], (bad, r.text)
    with pytest.raises((InvalidArgumentError, ValueError)):
        sbx.get_host(0)
    r = raw.get("/v1/sandboxes/sb-nope/ports/80")
    assert r.status_code == 404, r.text
    assert raw.get("/v1/sandboxes/%s/ports" % sbx.id).json() == {"ports": []}


UPGRADE_ECHO = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(4)
while True:
    c, _ = srv.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        data = c.recv(4096)
        if not data:
            break
        head += data
    if b"\r\n\r\n" not in head:  # the readiness probe
        c.close()
        continue
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
    while True:
        data = c.recv(4096)
        if not data:
            break
        c.sendall(data.upper())
    c.close()
"""


def test_the_host_header_form_on_the_tcp_listener_reaches_any_port_without_the_token(daemon, make_sandbox):
    # `{port}-{sandbox}.{domain}` (--port-domain, default localhost) on the daemon's TCP listener.
    a, b = make_sandbox(), make_sandbox()
    serve(a, 8000, "from a")
    serve(b, 8000, "from b")
    tcp = "127.0.0.1:%d" % daemon.tcp_port
    with httpx.Client(base_url="http://" + tcp, timeout=20) as c:
        for sbx, text in ((a, "from a"), (b, "from b")):
            r = c.get("/index.html", headers={"Host": "8000-%s.localhost:%d" % (sbx.id, daemon.tcp_port)})
            assert r.status_code == 200 and r.text == text, r.text
        # No listener opened for it: the port's info names the form too, once asked.
        assert a.get_host(8000) and [p.domain_host for p in a.ports()] == ["8000-%s.localhost:%d" % (a.id, daemon.tcp_port)]
        # Nothing listening there: an error saying so; an unknown sandbox: 404; the API itself
        # still wants the token.
        r = c.get("/", headers={"Host": "8001-%s.localhost" % a.id})
        assert r.status_code == 503 and "nothing answers on port 8001" in r.json()["error"]["message"], r.text
        r = c.get("/", headers={"Host": "8000-sb-nonexistent.localhost"})
        assert r.status_code == 404, r.text
        assert c.get("/v1/health").status_code == 401
        assert c.get("/v1/health", headers={"Authorization": "Bearer " + daemon.tcp_token}).status_code == 200
    # An upgrade the server agrees to is joined both ways (WebSocket's mechanism).
    a.files.write("/root/upgrade.py", UPGRADE_ECHO)
    a.commands.run("python3 /root/upgrade.py 8100", background=True)
    serve_ready = a.commands.run(
        "python3 -c 'import socket, time\nfor _ in range(200):\n    try:\n        socket.create_connection((\"127.0.0.1\", 8100)).close(); break\n"
        "    except OSError:\n        time.sleep(0.05)'"
    )
    assert serve_ready.exit_code == 0
    s = socket.create_connection(("127.0.0.1", daemon.tcp_port), timeout=20)
    try:
        s.sendall(b"GET /chat HTTP/1.1\r\nHost: 8100-%s.localhost\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n" % a.id.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head
        s.sendall(b"hello")
        got = b""
        while len(got) < 5:
            got += s.recv(4096)
        assert got == b"HELLO"
    finally:
        s.close()
    # Killed: the form answers 404 for it.
    a.kill()
    with httpx.Client(base_url="http://" + tcp, timeout=20) as c:
        assert c.get("/index.html", headers={"Host": "8000-%s.localhost" % a.id}).status_code == 404
