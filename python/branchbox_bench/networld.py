"""An "outside world" for the network tests (tests/integration/test_network.py) and ``branchbox
bench net``, all on this machine: a network namespace reached from the host through a veth,
holding an HTTP server on two addresses, a DNS server for a few test names, and (as if it were a
cloud's metadata service) 169.254.169.254. The suite's daemon forwards sandboxes' DNS to it
(--net-dns) and routes their egress to it through the host. Making it needs root.

    host  bbw-h 198.18.0.254/24  ──veth──  bbw-w (netns bbworld): 198.18.0.1 ("allowed"),
                                                  198.18.0.2 ("other"), 169.254.169.254
Names: allowed.test, also.allowed.test -> 198.18.0.1; other.test -> 198.18.0.2;
rebind.test -> 169.254.169.254; loop.test -> 127.0.0.1; anything else NXDOMAIN.

HTTP servers on ports 80 and 8080 of the three addresses; HTTPS servers on port 443 of
"allowed" and "other", with a certificate for allowed.test, also.allowed.test, other.test,
198.18.0.1 and 198.18.0.2 signed by a test CA (``CA_PEM``). Paths: ``/bytes/N`` answers N bytes,
``/slow...`` answers after 2 s, ``/headers`` answers the request's headers as a JSON object
(names lowercased; a repeated header's values as a list) with ``"_scheme"`` ("http" or "https")
and ``"_server"`` ("<address>:<port>") added (``/headers?sha256``: each value's sha256 in hex
instead, for values the asker must not see), ``/sni`` answers the JSON list of the server names
(null: none) of every TLS ClientHello the HTTPS servers got so far, ``/count`` answers "count N"
(N: how many requests to ``/count`` the servers got so far; a POST: "count N got <body length>";
``/count?wait=S``: N taken on arrival, answered after S seconds), ``/counted`` answers "count N"
without counting itself;
anything else answers "<path> <address>:<port>".

The certificates are files of the repository (tests/integration/data), found from this file's
own place (python/branchbox_bench): ``CA_PEM``, ``SERVER_CERT`` and ``SERVER_KEY`` are their
paths, or None in a copy of the package without the repository around it (then there is no
HTTPS server).

Run as a program inside the namespace (``python3 networld.py serve``, by path: it needs no
package) it is the servers.
"""
import contextlib
import hashlib
import http.server
import json
import os
import socket
import socketserver
import ssl
import struct
import subprocess
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit

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
HTTPS_PORT = 443
HTTPS_ADDRS = (ALLOWED, OTHER)

# The repository's test data: <repo>/python/branchbox_bench/networld.py -> <repo>/tests/integration/data.
DATA_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "integration", "data"
)


def _data_file(name):
    path = os.path.join(DATA_DIR, name)
    return path if os.path.isfile(path) else None


CA_PEM = _data_file("test-ca.pem")  # the CA that signed SERVER_CERT
SERVER_CERT = _data_file("world-cert.pem")
SERVER_KEY = _data_file("world-key.pem")


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


# Server names (None: no SNI) of the ClientHellos the HTTPS servers got, in order.
SNI_SEEN = []
# Requests to /count so far (every server), under its lock.
COUNT = [0]
COUNT_LOCK = threading.Lock()


def _next_count():
    with COUNT_LOCK:
        COUNT[0] += 1
        return COUNT[0]


def _note_sni(sock, name, ctx):
    SNI_SEEN.append(name)


class _Handler(http.server.BaseHTTPRequestHandler):
    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        # Any path: the body is read and dropped; the answer is its length (upload tests).
        left = int(self.headers.get("Content-Length") or 0)
        got = 0
        while left > 0:
            b = self.rfile.read(min(left, 1 << 16))
            if not b:
                break
            got += len(b)
            left -= len(b)
        body = ("got %d" % got).encode()
        if urlsplit(self.path).path == "/count":
            body = b"count %d " % _next_count() + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/headers":
            hashed = url.query == "sha256"
            out = {}
            for name, value in self.headers.items():
                if hashed:
                    value = hashlib.sha256(value.encode("latin-1")).hexdigest()
                name = name.lower()
                if name in out:
                    out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [value]
                else:
                    out[name] = value
            out["_scheme"] = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
            out["_server"] = "%s:%d" % self.server.server_address[:2]
            return self._json(out)
        if url.path == "/sni":
            return self._json(list(SNI_SEEN))
        if url.path in ("/count", "/counted"):
            if url.path == "/counted":
                with COUNT_LOCK:
                    body = b"count %d" % COUNT[0]
            else:
                body = b"count %d" % _next_count()
                wait = parse_qs(url.query).get("wait")
                if wait:
                    time.sleep(float(wait[0]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
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


class _HTTPS(_HTTP):
    """_HTTP over TLS; the handshake runs in the connection's own thread (a client that says
    nothing holds up no other)."""

    def __init__(self, addr, handler, ctx):
        super().__init__(addr, handler)
        self.ctx = ctx

    def get_request(self):
        sock, peer = self.socket.accept()
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), peer

    def finish_request(self, request, client_address):
        request.settimeout(10)
        try:
            request.do_handshake()
        except OSError:
            return
        request.settimeout(30)
        super().finish_request(request, client_address)

    def shutdown_request(self, request):
        # A close_notify, so that a client reading to the end sees a clean end of the stream.
        try:
            request.settimeout(1)
            request.unwrap()
        except (OSError, ValueError):
            pass
        super().shutdown_request(request)


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
    if SERVER_CERT and SERVER_KEY:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(SERVER_CERT, SERVER_KEY)
        ctx.sni_callback = _note_sni
        for addr in HTTPS_ADDRS:
            srv = _HTTPS((addr, HTTPS_PORT), _Handler, ctx)
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
