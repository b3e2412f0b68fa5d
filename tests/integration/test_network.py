"""Network modes: ``none`` reaches nothing but lo; ``allowlist`` reaches the names (and the
addresses they resolved to), addresses and ports it lists, nothing else; ``open`` reaches the
outside but never the host, other sandboxes or link-local/metadata addresses unless listed.
Rules change on a running sandbox and hold across pause/resume, rollback and fork. Limits cap
the connections open at once and the bandwidth each way.

All traffic stays on this machine: the "outside" is a network namespace the tests make
(networld.py); the suite's daemon forwards DNS there (--net-dns in conftest.py).
"""
import json
import os
import signal
import socket
import uuid

import pytest

from branchbox import InvalidArgumentError, Pool, Sandbox, Templates
from helpers import NET_BRIDGE, URL, host_server, wait_until

from branchbox_bench import networld
from branchbox_bench.networld import ALLOWED, HOST_ADDR, METADATA, OTHER

PROBE = r"""
import socket, sys
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    addr = socket.gethostbyname(host)
except OSError as e:
    print("dns", e); sys.exit(3)
try:
    with socket.create_connection((addr, port), timeout=3) as s:
        s.sendall(("GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" % (path, host)).encode())
        data = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            data += b
    print(data.split(b"\r\n\r\n", 1)[1].decode()[:200])
except ConnectionRefusedError:
    print("refused"); sys.exit(4)
except socket.timeout:
    print("timeout"); sys.exit(5)
except OSError as e:
    print("error", e); sys.exit(6)
"""


def fetch(sbx, host, port=80, path="/"):
    """What a GET of http://host:port/path from inside ``sbx`` got: ("ok", body), ("dns", why),
    ("refused", ...), ("timeout", ...) or ("error", why)."""
    sbx.files.write("/tmp/probe.py", PROBE)
    r = sbx.commands.run("python3 /tmp/probe.py %s %d %s" % (host, port, path), timeout=30)
    kind = {0: "ok", 3: "dns", 4: "refused", 5: "timeout", 6: "error"}.get(r.exit_code, "exit %d" % r.exit_code)
    return kind, r.stdout.strip()


def ok(sbx, host, port=80):
    kind, out = fetch(sbx, host, port)
    assert kind == "ok", "%s:%d from %s: %s %s" % (host, port, sbx.id, kind, out)
    return out


def blocked(sbx, host, port=80, how=("refused",)):
    kind, out = fetch(sbx, host, port)
    assert kind in how, "%s:%d from %s should be refused (%s): %s %s" % (host, port, sbx.id, how, kind, out)


@pytest.fixture(scope="module")
def world(daemon):
    with networld.world():
        yield


def interfaces(sbx):
    """The interfaces of the sandbox's network namespace (/proc/net/dev is the reader's own; a
    nested fork child's /sys is its parent's)."""
    out = sbx.commands.run("tail -n +3 /proc/net/dev").stdout
    return sorted(line.split(":")[0].strip() for line in out.splitlines() if ":" in line)


def test_none_reaches_nothing_but_loopback(world, make_sandbox):
    sbx = make_sandbox()
    assert interfaces(sbx) == ["lo"]
    info = sbx.info()
    assert info.network == "none" and info.address is None
    blocked(sbx, ALLOWED, how=("error",))
    blocked(sbx, "allowed.test", how=("dns",))


def test_allowlist_reaches_what_it_lists_and_nothing_else(world, make_sandbox):
    sbx = make_sandbox(network="allowlist", allow=["allowed.test", "*.allowed.test:80", "rebind.test"])
    info = sbx.info()
    assert info.network == "allowlist" and info.address and interfaces(sbx) == ["eth0", "lo"]
    # A hard-coded address is refused until an allowed name resolved to it.
    blocked(sbx, ALLOWED)
    # A wildcard entry for port 80: its answer opens that port only.
    assert ok(sbx, "also.allowed.test").startswith("/ " + ALLOWED)
    blocked(sbx, ALLOWED, 8080)
    # The exact name, all ports: now the address is open on 8080 too.
    assert ok(sbx, "allowed.test", 8080).startswith("/ " + ALLOWED + ":8080")
    # A name not listed does not resolve; its address is refused by IP too.
    blocked(sbx, "other.test", how=("dns",))
    blocked(sbx, OTHER)
    # An allowed name answering a forbidden address (DNS rebinding to the metadata service).
    blocked(sbx, "rebind.test")
    blocked(sbx, METADATA)
    # Not the host either (its address toward the world, the bridge's gateway).
    blocked(sbx, HOST_ADDR, 22)
    # Bytes are counted.
    ok(sbx, "allowed.test", 80)
    kind, _ = fetch(sbx, "allowed.test", 80, "/bytes/2000000")
    assert kind == "ok"
    after = sbx.info()
    assert after.net_rx_bytes > 2_000_000 and after.net_tx_bytes > 0, (after.net_rx_bytes, after.net_tx_bytes)


def test_open_reaches_out_but_not_the_host_other_sandboxes_or_metadata(world, make_sandbox):
    a = make_sandbox(network="open")
    b = make_sandbox(network="open")
    assert a.info().address != b.info().address
    ok(a, "allowed.test")
    ok(a, "other.test", 8080)
    ok(a, OTHER)
    blocked(a, METADATA)
    blocked(a, "rebind.test")
    blocked(a, "nosuch.test", how=("dns",))
    # Host services: on the host's address toward the world and on the bridge's gateway.
    gateway = a.info().address.rsplit(".", 1)[0] + ".1"
    for addr in (HOST_ADDR, "0.0.0.0"):
        with host_server(addr) as port:
            blocked(a, HOST_ADDR, port)
            blocked(a, gateway, port)
    # Another sandbox's server.
    b.commands.run("python3 -m http.server 8000 --bind 0.0.0.0", background=True)
    b.commands.run("for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))' 2>/dev/null && break; sleep 0.05; done")
    blocked(a, b.info().address, 8000, how=("refused", "timeout", "error"))
    # Listed explicitly, the metadata address is let through.
    c = make_sandbox(network="open", allow=[METADATA + ":80"])
    assert ok(c, METADATA).startswith("/ " + METADATA)
    blocked(c, METADATA, 8080)


def test_rules_change_on_a_running_sandbox(world, make_sandbox):
    sbx = make_sandbox(network="allowlist")
    blocked(sbx, "allowed.test", how=("dns",))
    n = sbx.network.update(allow=["allowed.test"])
    assert n.network == "allowlist" and n.allow == ["allowed.test"] and n.address
    ok(sbx, "allowed.test")
    blocked(sbx, "other.test", how=("dns",))
    n2 = sbx.network.update(network="open")
    assert n2.network == "open" and n2.address == n.address and n2.allow == ["allowed.test"]
    ok(sbx, "other.test")
    # Taken away: the address the earlier answer opened is closed again.
    n3 = sbx.network.update(network="allowlist", allow=[])
    assert n3.allow == []
    blocked(sbx, OTHER)
    blocked(sbx, ALLOWED)
    # To none: the interface goes; and back.
    assert sbx.network.update(network="none").address is None
    assert interfaces(sbx) == ["lo"] and sbx.info().network == "none"
    back = sbx.network.update(network="open")
    assert back.address and interfaces(sbx) == ["eth0", "lo"]
    ok(sbx, "other.test")
    with pytest.raises(InvalidArgumentError):
        sbx.network.update(allow=["not a name"])
    with pytest.raises(InvalidArgumentError):
        sbx.network.update(network="wide")
    assert sbx.network.get().network == "open", "a refused change changed nothing"


def test_fork_children_get_their_own_address_and_the_parents_rules(world, make_sandbox):
    parent = make_sandbox(network="allowlist", allow=["allowed.test"])
    ok(parent, "allowed.test")
    # A session: the fork is live (children nested in the parent, shells kept for the next).
    assert parent.run_code("x = 41").error is None
    children = parent.fork(3)
    try:
        addrs = {c.info().address for c in children} | {parent.info().address}
        assert len(addrs) == 4 and None not in addrs, addrs
        for c in children:
            assert c.info().network == "allowlist" and c.info().allow == ["allowed.test"]
            ok(c, "allowed.test")
            blocked(c, "other.test", how=("dns",))
            blocked(c, OTHER)
        # The parent's next children have their shells wired ahead (parent, 3 children, 3
        # shells on the bridge): a fork then only sets their rules, whatever it says.
        ports = "/sys/class/net/%s/brif" % NET_BRIDGE
        wait_until(lambda: len(os.listdir(ports)) >= 7, timeout=30, what="the parent's fork shells wired ahead")
        (again,) = parent.fork(1)
        children.append(again)
        assert again.info().address not in addrs
        assert again.run_code("x + 1").text == "42"
        ok(again, "allowed.test")
        blocked(again, "other.test", how=("dns",))
        blocked(again, OTHER)
        # A fork can say otherwise.
        (opened,) = parent.fork(1, network="open")
        children.append(opened)
        ok(opened, "other.test")
        (closed,) = parent.fork(1, network="none")
        children.append(closed)
        assert interfaces(closed) == ["lo"] and closed.info().address is None
    finally:
        for c in children:
            c.kill()
    # The parent's rules did not move.
    blocked(parent, "other.test", how=("dns",))
    ok(parent, "allowed.test")


def test_rules_and_address_hold_across_rollback_and_pause(world, make_sandbox):
    sbx = make_sandbox(network="allowlist", allow=["allowed.test"], timeout=0)
    addr = sbx.info().address
    snap = sbx.checkpoint()
    sbx.network.update(allow=["allowed.test", "other.test"])
    ok(sbx, "other.test")
    sbx.rollback(snap)
    info = sbx.info()
    # A rollback restores files and processes; the network is the sandbox's, as it is now.
    assert info.address == addr and info.allow == ["allowed.test", "other.test"]
    ok(sbx, "other.test")
    sbx.network.update(allow=["allowed.test"])
    sbx.pause()
    sbx.resume()
    info = sbx.info()
    assert info.address == addr and info.network == "allowlist" and info.allow == ["allowed.test"]
    ok(sbx, "allowed.test")
    blocked(sbx, "other.test", how=("dns",))
    blocked(sbx, OTHER)


def test_bad_network_requests_say_what_to_change(world, make_sandbox, raw):
    for body, needle in [
        ({"network": "wide"}, "allowlist"),
        ({"network": "none", "allow": ["a.test"]}, "none"),
        ({"network": "allowlist", "allow": ["bad name"]}, "bad name"),
        ({"network": "allowlist", "allow": ["a.test:70000"]}, "port"),
        ({"network": "allowlist", "allow": ["::1"]}, "IPv6"),
    ]:
        r = raw.post("/v1/sandboxes", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    assert raw.put("/v1/sandboxes/sb-nosuch/network", json={"network": "open"}).status_code == 404
    # A fork's network is checked before its checkpoint is taken: a refused fork leaves nothing.
    parent = make_sandbox()
    parent.files.write("/root/changed", "so that a checkpoint would be new")
    before = raw.get("/v1/sandboxes/%s/snapshots" % parent.id).json()
    r = raw.post("/v1/sandboxes/%s/fork" % parent.id, json={"count": 2, "network": "allowlist", "allow": ["bad name"]})
    assert r.status_code == 400 and "bad name" in r.json()["error"]["message"], r.text
    assert raw.get("/v1/sandboxes/%s/snapshots" % parent.id).json() == before


def test_a_recycled_pool_shell_has_only_loopback(world, make_sandbox):
    pool = Pool(daemon=URL)
    pool.set("base", 0, 1)  # no refill; a killed sandbox is recycled
    try:
        a = make_sandbox(network="open")
        a_init, a_addr = a.info().init_pid, a.info().address
        ok(a, "other.test")
        a.kill()
        b = make_sandbox()
        assert b.info().init_pid == a_init, "B must run on A's recycled init"
        assert interfaces(b) == ["lo"] and b.info().address is None
        blocked(b, OTHER, how=("error",))
        c = make_sandbox(network="allowlist", allow=["allowed.test"])
        assert c.info().address, "A's address is free again"
        ok(c, "allowed.test")
        blocked(c, "other.test", how=("dns",))
        assert a_addr
    finally:
        pool.set("base", 0, 0)
        pool.close()


def test_pool_shells_are_wired_ahead_for_creates_with_egress(world, make_sandbox):
    pool = Pool(daemon=URL)
    pool.set("base", 1, 2)
    try:
        wired = lambda: pool.stats().images["base"].wired  # noqa: E731
        ready = lambda: pool.stats().images["base"].ready  # noqa: E731
        wait_until(lambda: ready() >= 1, timeout=30, what="a ready shell")
        assert wired() == 0, "nothing is wired before a create asks for egress"
        # The first create with egress is wired on its path; its kill (recycled) or the refill
        # leaves a shell wired ahead.
        first = make_sandbox(network="allowlist", allow=["allowed.test"])
        first.kill()
        wait_until(lambda: wired() >= 1, timeout=30, what="a shell wired ahead")
        hits = pool.stats().hits
        # Names only: the chain made ahead is kept.
        a = make_sandbox(network="allowlist", allow=["allowed.test"])
        assert pool.stats().hits == hits + 1, "served from the pool"
        assert a.info().address and interfaces(a) == ["eth0", "lo"]
        ok(a, "allowed.test")
        blocked(a, "other.test", how=("dns",))
        blocked(a, OTHER)
        blocked(a, METADATA)
        a.kill()
        # An address entry and a connection cap on a shell wired ahead (its chain is replaced).
        wait_until(lambda: wired() >= 1, timeout=30, what="a shell wired ahead again")
        b = make_sandbox(network="allowlist", allow=[ALLOWED + ":80"], net_limits={"max_connections": 3})
        assert b.network.get().raw["limits"] == {"max_connections": 3}
        assert ok(b, ALLOWED).startswith("/ " + ALLOWED)
        blocked(b, ALLOWED, 8080)
        blocked(b, "allowed.test", how=("dns",))
        b.kill()
        # Mode open on a shell wired ahead: its chain is kept, its sets opened.
        wait_until(lambda: wired() >= 1, timeout=30, what="a shell wired ahead for mode open")
        hits = pool.stats().hits
        o = make_sandbox(network="open")
        assert pool.stats().hits == hits + 1, "served from the pool"
        ok(o, "other.test", 8080)
        ok(o, OTHER)
        blocked(o, METADATA)
        o.kill()
        # Recycled, the shell is parked again: names alone reach nothing else.
        wait_until(lambda: wired() >= 1, timeout=30, what="a shell wired ahead after mode open")
        p = make_sandbox(network="allowlist", allow=["allowed.test"])
        ok(p, "allowed.test")
        blocked(p, OTHER)
        p.kill()
        # Creates in mode none take unwired shells first; once only wired ones are ready (the
        # refill wires while recent creates had egress), one takes a wired shell, made unwired:
        # each has only loopback.
        for _ in range(6):
            wait_until(lambda: ready() >= 1, timeout=30, what="a ready shell")
            st = pool.stats().images["base"]
            c = make_sandbox()
            assert interfaces(c) == ["lo"] and c.info().address is None
            blocked(c, ALLOWED, how=("error",))
            if st.wired == st.ready:
                break
        else:
            pytest.fail("no create in mode none was given a shell wired ahead")
    finally:
        pool.set("base", 0, 0)
        pool.close()
    # Drained: the shells wired ahead gave their veths back (no sandbox with egress is left).
    ports = "/sys/class/net/%s/brif" % NET_BRIDGE
    wait_until(lambda: os.listdir(ports) == [], timeout=10, what="no veth left on the bridge")


def test_a_daemon_restart_keeps_every_sandboxs_rules(world, daemon, make_sandbox):
    listed = make_sandbox(network="allowlist", allow=["allowed.test"])
    opened = make_sandbox(network="open")
    addrs = {listed.info().address, opened.info().address}
    ok(listed, "allowed.test")
    try:
        daemon.stop(signal.SIGKILL)
    finally:
        daemon.ensure_running()
    # The table was made afresh; each sandbox's rules and address are back.
    info = listed.info()
    assert info.network == "allowlist" and info.allow == ["allowed.test"] and info.address in addrs
    ok(listed, "allowed.test")
    blocked(listed, "other.test", how=("dns",))
    blocked(listed, OTHER)
    ok(opened, "other.test")
    blocked(opened, METADATA)
    # A new sandbox does not take an address in use.
    new = make_sandbox(network="open")
    assert new.info().address not in addrs
    ok(new, "other.test")


def test_a_template_builds_with_its_network_and_hands_it_to_its_sandboxes(world, make_sandbox):
    templates = Templates(daemon=URL)
    name = "net-%s" % uuid.uuid4().hex[:8]
    # The recipe fetches from the allowed upstream while it builds.
    fetch_cmd = "python3 -c 'import urllib.request as u; open(\"/root/got\", \"w\").write(u.urlopen(\"http://allowed.test/recipe\", timeout=5).read().decode())'"
    try:
        templates.build(name, run=[fetch_cmd], network="allowlist", allow=["allowed.test"], shells=0)
        sbx = make_sandbox(template=name)
        assert sbx.files.read("/root/got").startswith("/recipe " + ALLOWED)
        info = sbx.info()
        assert info.network == "allowlist" and info.allow == ["allowed.test"] and info.address
        ok(sbx, "allowed.test")
        blocked(sbx, "other.test", how=("dns",))
        # The request's own network wins.
        plain = make_sandbox(template=name, network="none")
        assert interfaces(plain) == ["lo"] and plain.info().address is None
        wide = make_sandbox(template=name, network="open")
        ok(wide, "other.test")
    finally:
        for s in list(Sandbox.list(daemon=URL)):
            if s.metadata.get("branchbox.from_template") == name:
                Sandbox.connect(s.id, daemon=URL, resume=False).kill()
        templates.remove(name)
        templates.close()


HOLD = r"""
import json, os, socket, sys, time
host, phases = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]
held = []
def attempt():
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, 80))
    except ConnectionRefusedError:
        s.close()
        return "refused"
    except OSError as e:
        s.close()
        return "error %s" % e
    held.append(s)
    return "ok"
for i, n in enumerate(phases):
    if i:
        while not os.path.exists("/tmp/go%d" % i):
            time.sleep(0.02)
    print(json.dumps([attempt() for _ in range(n)]), flush=True)
    open("/tmp/done%d" % i, "w").close()
"""


def test_a_connection_cap_resets_connections_past_it_and_changes_on_a_running_sandbox(world, make_sandbox):
    sbx = make_sandbox(network="allowlist", allow=[ALLOWED + ":80"], net_limits={"max_connections": 3})
    assert sbx.network.get().raw["limits"] == {"max_connections": 3}
    sbx.files.write("/tmp/hold.py", HOLD)
    # The connections are held open: four attempts, the fourth past the cap.
    h = sbx.commands.run("python3 /tmp/hold.py %s 4,1,6" % ALLOWED, background=True, timeout=60)

    def phase(i):
        if i:
            sbx.files.write("/tmp/go%d" % i, "")
        wait_until(lambda: sbx.files.exists("/tmp/done%d" % i), timeout=30, what="attempts of phase %d" % i)

    phase(0)
    # A change of the allow entries keeps the count: the three held still count.
    sbx.network.update(allow=[ALLOWED + ":80", OTHER + ":80"])
    phase(1)
    # A new cap counts the connections made from then on: five more fit, the sixth does not.
    net = sbx.network.update(limits={"max_connections": 5})
    assert net.raw["limits"] == {"max_connections": 5} and net.allow == [ALLOWED + ":80", OTHER + ":80"], net
    phase(2)
    r = h.wait(timeout=60)
    got = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert got == [["ok", "ok", "ok", "refused"], ["refused"], ["ok"] * 5 + ["refused"]], r.stdout
    # The cap is kept by a fork child.
    (child,) = sbx.fork(1)
    try:
        assert child.network.get().raw["limits"] == {"max_connections": 5}
    finally:
        child.kill()


SPEED = r"""
import socket, sys, time
host, way, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.create_connection((host, 80), timeout=60)
t0 = time.monotonic()
if way == "down":
    s.sendall(b"GET /bytes/%d HTTP/1.0\r\nHost: w\r\n\r\n" % n)
    while s.recv(1 << 16):
        pass
else:
    s.sendall(b"POST /up HTTP/1.0\r\nHost: w\r\nContent-Length: %d\r\n\r\n" % n)
    chunk, left = b"x" * 65536, n
    while left > 0:
        s.sendall(chunk[:left])
        left -= len(chunk)
    while s.recv(1 << 16):
        pass
print(n * 8 / 1e6 / (time.monotonic() - t0))
"""


def test_a_bandwidth_cap_holds_each_way_and_lifts(world, make_sandbox):
    sbx = make_sandbox(network="allowlist", allow=[ALLOWED + ":80"], net_limits={"bandwidth_mbps": 40})
    sbx.files.write("/tmp/speed.py", SPEED)

    def mbps(way, n):
        r = sbx.commands.run("python3 /tmp/speed.py %s %s %d" % (ALLOWED, way, n), timeout=120)
        assert r.exit_code == 0, r
        return float(r.stdout)

    # 4 MB each way at 40 Mbit/s: about 0.8 s; a cap that held lets no more than its burst past.
    for way in ("down", "up"):
        got = mbps(way, 4_000_000)
        assert got < 60, "%s at %.0f Mbit/s under a 40 Mbit/s cap" % (way, got)
    # Lifted: far past it (the same transfer runs at memory speed here).
    sbx.network.update(limits={})
    assert sbx.network.get().raw["limits"] == {}
    for way in ("down", "up"):
        got = mbps(way, 32_000_000)
        assert got > 200, "%s at %.0f Mbit/s with no cap" % (way, got)
