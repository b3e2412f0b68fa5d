"""An "outside world" for the network tests (tests/integration/test_network.py) and ``branchbox
bench net``, all on this machine: a network namespace reached from the host through a veth,
holding an HTTP server on two addresses, a DNS server for a few test names, and (as if it were a
cloud's metadata service) 169.254.169.254. The suite's daemon forwards sandboxes' DNS to it
(--net-dns) and routes their egress to it through the host. Making it needs root.

    host  bbw-h 198.18.0.254/24  ──veth──  bbw-w (netns bbworld): 198.18.0.1 ("allowed"),
                                                  198.18.0.2 ("other"), 169.254.169.254
Names: allowed.test, also.allowed.test -> 198.18.0.1; other.test -> 198.18.0.2;
rebind.test -> 169.254.169.254; loop.test -> 127.0.0.1; anything else NXDOMAIN.

HTTP paths: ``/bytes/N`` answers N bytes, ``/slow...`` answers after 2 s, anything else answers
"<path> <address>:<port>".

Run as a program inside the namespace (``python3 networld.py serve``, by path: it needs no
package) it is the servers.
"""
import contextlib
import http.server
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

NETNS = "bbworld"
HOST_IF, WORLD_IF = "bbw-h", "bbw-w"
HOST_ADDR = "198.18.0.254"
ALLOWED, OTHER, METADATA = "198.18.0.1", "198.18.0.2", "169.254.169.254"
DNS = ALLOWED + ":53"
NAMES = {
    "allowed.test": ALLOWED,
    "also.allowed.test": ALLOWED,
    "other.test": OTHER,
    "rebind.test": METADATA,
    "loop.test": "127.0.0.1",
}
HTTP_PORTS = (80, 8080)


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def down():
    sh("ip", "netns", "del", NETNS, check=False)
    sh("ip", "link", "del", HOST_IF, check=False)
    sh("ip", "route", "del", METADATA + "/32", check=False)


@contextlib.contextmanager
def world():
    """The world, up for the ``with`` block."""
    down()
    sh("ip", "netns", "add", NETNS)
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", WORLD_IF, "netns", NETNS)
    sh("ip", "addr", "add", HOST_ADDR + "/24", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    # The metadata address sits in the world, routed there like any upstream address: only the
    # daemon's rules keep sandboxes from it.
    sh("ip", "route", "add", METADATA + "/32", "via", ALLOWED, "dev", HOST_IF)
    for cmd in (
        ["ip", "addr", "add", ALLOWED + "/24", "dev", WORLD_IF],
        ["ip", "addr", "add", OTHER + "/24", "dev", WORLD_IF],
        ["ip", "addr", "add", METADATA + "/32", "dev", "lo"],
        ["ip", "link", "set", WORLD_IF, "up"],
        ["ip", "link", "set", "lo", "up"],
    ):
        sh("ip", "netns", "exec", NETNS, *cmd)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", NETNS, sys.executable, os.path.abspath(__file__), "serve"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == b"ready", "the test world's servers did not start"
        yield
    finally:
        proc.kill()
        proc.wait()
        down()


# ---- the servers (inside the namespace) ----


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/slow"):
            time.sleep(2)
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            while n > 0:
                self.wfile.write(chunk[: min(n, len(chunk))])
                n -= len(chunk)
            return
        body = ("%s %s:%d" % (self.path, self.server.server_address[0], self.server.server_address[1])).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class _HTTP(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _dns_answer(packet):
    """A reply to a DNS query: an A record for a known name (TTL 60), NXDOMAIN otherwise."""
    ident, _flags, qd = struct.unpack("!HHH", packet[:6])
    i, labels = 12, []
    while packet[i]:
        n = packet[i]
        labels.append(packet[i + 1:i + 1 + n].decode().lower())
        i += 1 + n
    qtype = struct.unpack("!H", packet[i + 1:i + 3])[0]
    question = packet[12:i + 5]
    addr = NAMES.get(".".join(labels))
    if addr is None:
        return struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question
    if qtype != 1:  # not A: no records
        return struct.pack("!HHHHHH", ident, 0x8180, 1, 0, 0, 0) + question
    answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(addr)
    return struct.pack("!HHHHHH", ident, 0x8180, 1, 1, 0, 0) + question + answer


def serve():
    for addr in (ALLOWED, OTHER, METADATA):
        for port in HTTP_PORTS:
            srv = _HTTP((addr, port), _Handler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind((ALLOWED, 53))
    print("ready", flush=True)
    while True:
        packet, peer = dns.recvfrom(4096)
        try:
            dns.sendto(_dns_answer(packet), peer)
        except Exception:
            pass


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
