"""Helpers to drive the in-sandbox session server (crates/bb-runtime/src/session/server.py)
the way the daemon does."""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SERVER_SOURCE = (Path(__file__).resolve().parents[2] / "crates" / "bb-runtime" / "src" / "session" / "server.py").read_text()


class SessionClient:
    """One channel to a session server: newline-delimited JSON, one response per request."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def send(self, obj, fds=()):
        data = (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"
        if fds:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self.sock.sendall(data)

    def recv(self, timeout=30.0):
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("session server closed the channel")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, obj, fds=(), timeout=30.0):
        self.send(obj, fds)
        return self.recv(timeout)

    def run(self, code, timeout=30.0):
        return self.request({"op": "run", "code": code}, timeout=timeout)

    def close(self):
        self.sock.close()


class SessionProcess(SessionClient):
    """`python3 -I -S -c <source> KIND` with a socketpair end on fd 3."""

    def __init__(self, kind, cwd=None, env=None, python=None, preexec_fn=None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = theirs.fileno()
        # BRANCHBOX_TEST_SESSION_PYTHON runs the server under another interpreter (e.g. 3.9).
        python = python or os.environ.get("BRANCHBOX_TEST_SESSION_PYTHON") or sys.executable
        # bash moves the inherited fd onto 3 before exec'ing python (what the daemon does).
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", 'exec "$@" 3<&%d %d<&-' % (fd, fd), "bash",
             python, "-I", "-S", "-c", SERVER_SOURCE, kind],
            pass_fds=(fd,),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=preexec_fn,
        )
        theirs.close()
        super().__init__(ours)

    def stop(self, timeout=10.0):
        """Close our end (EOF) and return the server's exit code."""
        self.close()
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for f in (self.proc.stdout, self.proc.stderr):
                if f:
                    f.close()
        return rc
