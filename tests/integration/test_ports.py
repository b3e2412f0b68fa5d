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
