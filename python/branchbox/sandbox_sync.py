"""Synchronous SDK: :class:`Sandbox` and its ``commands`` / ``files`` / ``sessions``.

``sandbox_async`` mirrors this module method for method; all API knowledge lives in
``_core``.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import select
import socket
import threading
import urllib.parse
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import httpx

from . import _core
from ._transport import ConnectionConfig
from .exceptions import InvalidArgumentError, NotFoundError, SandboxError
from .models import (
    CommandResult,
    EntryInfo,
    Execution,
    ForkResult,
    GcResult,
    ImageInfo,
    ImageProgress,
    NetLimits,
    NetworkInfo,
    PoolStats,
    PortInfo,
    PauseResult,
    OffloadResult,
    PullResult,
    PushResult,
    RemotePausedInfo,
    RemoteSnapshotInfo,
    StoreGcResult,
    ProcessInfo,
    ResumeResult,
    RollbackResult,
    SandboxInfo,
    SessionInfo,
    ShellResult,
    SnapshotInfo,
    TemplateInfo,
    TemplateProgress,
    VolumeInfo,
    VolumeSnapshotInfo,
)

__all__ = [
    "Sandbox",
    "Commands",
    "CommandHandle",
    "Files",
    "ByteStream",
    "Network",
    "Sessions",
    "Session",
    "Images",
    "Snapshots",
    "Volume",
    "Templates",
    "Pool",
    "health",
]


class _UnixConnection(http.client.HTTPConnection):
    """``http.client`` over a unix socket."""

    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("branchboxd", timeout=timeout)
        self.uds = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.uds)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _UnixCalls:
    """Plain request/answer calls to a daemon on a unix socket, over keep-alive HTTP/1.1
    connections of the standard library's ``http.client``: a fraction of the client CPU per
    call that httpx takes (its URL and header models, h11, httpcore; BENCHMARKS.md has the
    figures), which the SDK keeps for streams, uploads of file objects and custom transports. Every call of
    an agent's loop pays it, and 16 threads creating sandboxes at once share one GIL.

    Thread-safe: a connection serves one call at a time; idle ones are kept for reuse (at
    most :attr:`KEEP`). A connection the daemon closed while idle is noticed before reuse
    (readable with nothing to read), so a request is never written to a dead connection and
    retried. An answer the daemon sent before reading the whole body is read, not lost to
    the broken pipe. In a forked child, the parent's connections are left alone.
    """

    KEEP = 32

    def __init__(self, path: str, headers: Dict[str, str]) -> None:
        self.path = path
        self.headers = headers
        self.lock = threading.Lock()
        self.idle: List[_UnixConnection] = []
        self.pid = os.getpid()

    def _take(self, timeout: Optional[float]) -> _UnixConnection:
        with self.lock:
            if self.pid != os.getpid():
                self.idle, self.pid = [], os.getpid()
            while self.idle:
                conn = self.idle.pop()
                sock = conn.sock
                if sock is not None and not select.select([sock], [], [], 0)[0]:
                    conn.timeout = timeout
                    sock.settimeout(timeout)
                    return conn
                conn.close()  # closed by the daemon while idle (or unexpected bytes)
        conn = _UnixConnection(self.path, timeout)
        try:
            conn.connect()
        except OSError as err:
            raise _core.SocketConnectError(str(err)) from err
        return conn

    def _give_back(self, conn: _UnixConnection) -> None:
        with self.lock:
            if self.pid == os.getpid() and len(self.idle) < self.KEEP:
                self.idle.append(conn)
                return
        conn.close()

    def request(
        self, method: str, target: str, body: Optional[bytes], headers: Dict[str, str], timeout: Optional[float]
    ) -> Tuple[int, bytes]:
        conn = self._take(timeout)
        try:
            try:
                conn.request(method, target, body=body, headers={**self.headers, **headers})
            except (BrokenPipeError, ConnectionResetError) as err:
                # The daemon may answer a request before reading its body (a refused path, a
                # body over a limit) and close the connection: http.client sends the body
                # after the headers, and that send then fails. The answer is already
                # waiting on the socket; without one, the send's error is the one to report.
                try:
                    resp = conn.getresponse()
                except (OSError, http.client.HTTPException):
                    raise err from None
            else:
                resp = conn.getresponse()
            content = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return resp.status, content

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for conn in idle:
                conn.close()


def _unix_call_parts(call: _core.Call, request_timeout: Optional[float]) -> Optional[Tuple[str, Optional[bytes], Dict[str, str], Optional[float]]]:
    """(target, body, headers, read timeout) of ``call`` for :class:`_UnixCalls`, or None when
    it needs httpx (a body that is a file object or an iterator)."""
    headers = dict(call.headers)
    if call.content is not None:
        if isinstance(call.content, str):
            body: Optional[bytes] = call.content.encode("utf-8")
        elif isinstance(call.content, (bytes, bytearray, memoryview)):
            body = bytes(call.content)
        else:
            return None
    elif call.json is not None:
        body = json.dumps(call.json).encode("utf-8")
        headers.setdefault("Content-Type", "application/json")
    else:
        body = None
    target = call.path  # its segments are quoted already (_core._seg)
    if call.params:
        target += "?" + urllib.parse.urlencode(call.params, quote_via=urllib.parse.quote)
    t = call.http_timeout(request_timeout)
    if t is httpx.USE_CLIENT_DEFAULT:
        timeout = request_timeout
    elif isinstance(t, httpx.Timeout):
        timeout = t.read
    else:
        timeout = t
    return target, body, headers, timeout


class _SharedClients:
    """One ``httpx.Client`` (and one :class:`_UnixCalls` for a unix socket) per daemon address,
    token and timeout, shared by every sandbox of this process: a client costs ~0.4 ms to
    build and a connection to open, more than claiming a sandbox from the warm pool. Clients
    are thread-safe; one made before an ``os.fork()`` is never used by the child (its
    connections belong to the parent). Closed at exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clients: Dict[Any, httpx.Client] = {}
        self.unix: Dict[Any, _UnixCalls] = {}
        self.pid = os.getpid()
        atexit.register(self.close_all)

    def _fork_check(self) -> None:
        if self.pid != os.getpid():
            self.clients, self.unix, self.pid = {}, {}, os.getpid()

    def get(self, config: ConnectionConfig) -> httpx.Client:
        key = (config.url, config.token, config.request_timeout)
        with self.lock:
            self._fork_check()
            client = self.clients.get(key)
            if client is None or client.is_closed:
                client = self.clients[key] = config.sync_client()
            return client

    def unix_calls(self, config: ConnectionConfig) -> Optional[_UnixCalls]:
        if config.transport is not None or config.address.uds is None:
            return None
        key = (config.url, config.token)
        with self.lock:
            self._fork_check()
            calls = self.unix.get(key)
            if calls is None:
                calls = self.unix[key] = _UnixCalls(config.address.uds, config.headers())
            return calls

    def close_all(self) -> None:
        with self.lock:
            clients, self.clients = self.clients, {}
            unix, self.unix = self.unix, {}
        if self.pid == os.getpid():
            for c in clients.values():
                c.close()
            for u in unix.values():
                u.close()


_SHARED = _SharedClients()


class _HTTP:
    """Executes :class:`_core.Call` objects with an ``httpx.Client`` (shared between sandboxes
    unless a custom transport is given); plain calls to a unix socket go through the
    daemon-wide :class:`_UnixCalls` instead."""

    def __init__(self, config: ConnectionConfig) -> None:
        self.config = config
        self.shared = config.transport is None
        self.client = _SHARED.get(config) if self.shared else config.sync_client()
        self.unix = _SHARED.unix_calls(config) if self.shared else None

    def close(self) -> None:
        if not self.shared:
            self.client.close()

    def __enter__(self) -> "_HTTP":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def send(self, call: _core.Call, stream: bool = False) -> httpx.Response:
        request = self.client.build_request(
            call.method,
            call.path,
            params=call.params,
            json=call.json,
            content=call.content,
            headers=call.headers or None,
            timeout=call.http_timeout(self.config.request_timeout),
        )
        try:
            response = self.client.send(request, stream=stream)
        except httpx.TransportError as err:
            raise _core.transport_error(err, self.config.url) from None
        if response.status_code >= 400:
            try:
                content = response.read()
            except httpx.TransportError as err:
                raise _core.transport_error(err, self.config.url) from None
            finally:
                response.close()
            raise _core.error_for_status(response.status_code, content)
        return response

    def call(self, call: _core.Call) -> Any:
        parts = _unix_call_parts(call, self.config.request_timeout) if self.unix is not None else None
        if parts is None:
            content = self.send(call).content
        else:
            target, body, headers, timeout = parts
            try:
                status, content = self.unix.request(call.method, target, body, headers, timeout)  # type: ignore[union-attr]
            except (OSError, http.client.HTTPException) as err:
                raise _core.transport_error(err, self.config.url) from None
            if status >= 400:
                raise _core.error_for_status(status, content)
        data = _core.parse_json(content)
        return call.parse(data) if call.parse else data

    @contextlib.contextmanager
    def events(self, call: _core.Call) -> Iterator[Iterator[Any]]:
        """``with http.events(call) as events: for event in events: ...`` (NDJSON)."""
        response = self.send(call, stream=True)

        def gen() -> Iterator[Any]:
            decoder = _core.NDJSONDecoder()
            try:
                for chunk in response.iter_bytes():
                    yield from decoder.feed(chunk)
            except httpx.TransportError as err:
                raise _core.transport_error(err, self.config.url) from None
            yield from decoder.close()

        try:
            yield gen()
        finally:
            response.close()


def health(
    *,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 10,
    transport: Optional[httpx.BaseTransport] = None,
) -> Dict[str, Any]:
    """``GET /v1/health`` of the daemon."""
    with _HTTP(ConnectionConfig(daemon, token, request_timeout, transport)) as http:
        return http.call(_core.health())


# ----------------------------------------------------------------------------- sandbox


class Sandbox:
    """A running sandbox. Create with :meth:`create`, attach with :meth:`connect`.

    Used as a context manager the sandbox is killed on exit::

        with Sandbox.create() as sbx:
            print(sbx.commands.run("echo hi").stdout)
    """

    def __init__(self, sandbox_id: str, *, _http: _HTTP, info: Optional[SandboxInfo] = None) -> None:
        self.id = sandbox_id
        self._http = _http
        self._info = info
        self.commands = Commands(self)
        self.files = Files(_http, _core.sandbox_files(sandbox_id))
        self.sessions = Sessions(self)
        self.network = Network(self)

    @property
    def sandbox_id(self) -> str:
        """Alias of :attr:`id` (E2B naming)."""
        return self.id

    @classmethod
    def create(
        cls,
        image: Optional[str] = None,
        *,
        cpu: Optional[float] = None,
        memory_mb: Optional[int] = None,
        pids: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = 300,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        proxy: bool = False,
        proxy_record: Optional[bool] = None,
        net_limits: Union[NetLimits, Mapping[str, Any], None] = None,
        metadata: Optional[Mapping[str, str]] = None,
        template: Union[str, TemplateInfo, None] = None,
        lifecycle: Optional[Mapping[str, Any]] = None,
        snapshot: Union[str, SnapshotInfo, None] = None,
        volumes: _core.VolumesT = None,
        sudo: Optional[bool] = None,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> "Sandbox":
        """Start a sandbox. ``timeout`` is its time to live in seconds (0 = none).

        ``image`` defaults to ``"base"``. With ``template=name`` (see :class:`Templates`) the
        sandbox is a live fork of the template: its files and its python session's state
        (e.g. imported modules) are there from the start; limits, ``env``, ``cwd``,
        ``metadata`` and ``timeout`` still apply, and ``image`` may only repeat the
        template's. A warm pool (:class:`Pool`) makes plain creates claim a ready sandbox.

        With ``snapshot=sid`` the sandbox starts from a snapshot: its files and its
        sessions' state (restored from their templates or process images). A snapshot pushed
        by another daemon sharing this one's object store and metadata store is pulled first.
        The snapshot's image, limits and cwd are kept; ``env``, ``metadata`` and ``timeout``
        apply.

        ``lifecycle`` (as E2B's): ``{"on_timeout": "pause"}`` pauses the sandbox at its
        timeout instead of killing it (see :meth:`pause`); with ``"auto_resume": True`` a
        paused sandbox resumes by itself when a command, code, a file or a session request
        reaches it.

        ``volumes`` mounts persistent volumes (:class:`Volume`): ``{"/workspace": vol}`` where
        ``vol`` is a Volume, a volume id or name, or a :class:`VolumeMount` (to set
        ``read_only``, or ``branch=False`` for a volume that does not branch with the sandbox's
        checkpoints, rollbacks and forks); or a list of VolumeMount (or dicts of its keys).

        ``network`` is the sandbox's network mode: ``"none"`` (the default: loopback only),
        ``"allowlist"`` (only what ``allow`` lists) or ``"open"`` (anything but the host, the
        daemon, other sandboxes and link-local/metadata addresses, unless ``allow`` lists
        them). ``allow`` is a list of entries: names (``"api.example.com"``), wildcards
        (``"*.example.org"``), IPv4 addresses or CIDRs, each with an optional ``:port`` or
        ``:low-high`` (``"10.0.0.0/8:443"``). With ``snapshot`` or ``template``, both default
        to the snapshot's or template's (``allow`` alone keeps its mode). Change them later with ``sbx.network.update(...)`` (:class:`Network`).

        ``proxy=True`` gives the sandbox the daemon's HTTP(S) forwarding proxy, listening in its
        own network namespace on ``127.0.0.1:3128`` (:attr:`SandboxInfo.proxy`), with
        ``HTTP_PROXY``/``HTTPS_PROXY`` (and ``http_proxy``/``https_proxy``) set to it and
        ``NO_PROXY`` to ``localhost,127.0.0.1,::1`` unless ``env`` sets them. The proxy lets
        through what ``allow`` lists (in mode ``"open"`` also any public destination), in every
        mode: with ``network="none"`` it is the sandbox's only way out, and ``allow`` then governs
        the proxy alone. Credentials configured on the daemon are added to plaintext requests for
        their host on the way out (the sandbox never sees them). Fork children keep the proxy.

        ``proxy_record=True`` (with ``proxy=True``) records the proxy's answers to the sandbox's
        plaintext requests (plain HTTP, and HTTPS the proxy opens itself for a host with
        credentials; not ``CONNECT`` tunnels): after a rollback to a snapshot, in its fork
        children and in sandboxes created from it, the same requests in the same order get the
        answers recorded after that snapshot, without reaching the upstream (deterministic
        replays for tree search); a request that differs goes upstream and is recorded in turn.
        Kept in the daemon's memory (lost at its restart). With ``snapshot`` or ``template``:
        theirs unless given.

        ``net_limits`` caps the sandbox's traffic: a :class:`NetLimits` or a dict of its keys,
        ``{"max_connections": 64, "bandwidth_mbps": 100}`` (each optional). ``max_connections``
        (1..65536) is the most TCP connections open at once through its ``eth0`` (a new one past
        it is reset) and, counted apart, through its proxy; ``bandwidth_mbps`` (0.1..100000) is
        megabits per second each way on its ``eth0`` (modes ``"allowlist"`` and ``"open"``). Not
        given: no limits, or with ``snapshot`` or ``template`` theirs (``{}`` lifts them). Fork
        children inherit them; change them with ``sbx.network.update(limits=...)``. A wrong type,
        key or value is refused before any request (:class:`InvalidArgumentError`).

        ``sudo=True`` lets commands run as another user (``user="user"``) use setuid programs
        such as ``sudo`` (the image's ``/etc/sudoers`` decides who may; ``base`` lets ``user``):
        their processes start without ``no_new_privs``, so they can become root of the
        sandbox's user namespace (what ``user="root"`` gives), never root of the host; seccomp
        and the capability set stay. Default off; with ``snapshot`` or ``template`` theirs
        unless given; fork children inherit it.

        ``daemon``/``token`` default to ``$BRANCHBOX_URL``/``$BRANCHBOX_TOKEN``;
        ``request_timeout`` bounds each HTTP request; ``transport`` replaces the
        network transport (tests).
        """
        http = _HTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            info = http.call(
                _core.create_sandbox(
                    image, cpu, memory_mb, pids, env, cwd, timeout, network, metadata, template, lifecycle, snapshot,
                    volumes, allow, proxy, net_limits, proxy_record, sudo,
                )
            )
        except BaseException:
            http.close()
            raise
        return cls(info.id, _http=http, info=info)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        timeout: Optional[float] = None,
        resume: bool = True,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> "Sandbox":
        """Attach to an existing sandbox (raises :class:`NotFoundError` if unknown). A paused
        sandbox (here, or paused into the object store by any daemon sharing it) is resumed first (its timeout then restarts: ``timeout`` seconds, or the one it
        was created with) unless ``resume=False``; on a running one, ``timeout`` restarts its
        time to live."""
        http = _HTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            try:
                info = http.call(_core.get_sandbox(sandbox_id))
            except NotFoundError:
                if not resume:
                    raise
                # Not on this daemon: maybe paused into the object store by another
                # (``pause(push=True)``); the daemon resumes it here, or says not found.
                info = (http.call(_core.resume_sandbox(sandbox_id, timeout))).sandbox
            if info.state == "paused" and resume:
                info = (http.call(_core.resume_sandbox(sandbox_id, timeout))).sandbox or info
            elif timeout is not None and info.state == "running":
                info = http.call(_core.set_timeout(sandbox_id, timeout))
        except BaseException:
            http.close()
            raise
        return cls(info.id or sandbox_id, _http=http, info=info)

    @classmethod
    def list(
        cls,
        *,
        metadata: Optional[Mapping[str, str]] = None,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> List[SandboxInfo]:
        """All sandboxes, optionally only those whose metadata match ``metadata``."""
        with _HTTP(ConnectionConfig(daemon, token, request_timeout, transport)) as http:
            return http.call(_core.list_sandboxes(metadata))

    def info(self) -> SandboxInfo:
        info = self._http.call(_core.get_sandbox(self.id))
        self._info = info
        return info

    def pause(self, push: bool = False, mode: str = "full") -> PauseResult:
        """Pause the sandbox: every process (sessions, background commands) is dumped to disk
        and freed; files stay. Its id stays; :meth:`resume` or :meth:`connect` brings it back
        with its processes (same pids), sessions, files and env. Needs CRIU on the daemon.

        ``mode="filesystem"`` keeps the files only: every process ends, nothing is dumped, and
        the resume is a cold boot (no sessions or background processes, a new boot id). Needs
        no CRIU.

        ``push=True`` makes it durable and frees the daemon of it: its state (files, sessions,
        background processes) is checkpointed and pushed to the daemon's object store, and
        any daemon sharing that store and metadata store resumes it under the same id
        (``Sandbox.connect(id, daemon=...)``), with its sessions' state; background processes
        come back with their state too (under new pids)."""
        result = self._http.call(_core.pause_sandbox(self.id, push, mode))
        if result.sandbox is not None:
            self._info = result.sandbox
        return result

    def resume(self, timeout: Optional[float] = None, reboot: bool = False) -> ResumeResult:
        """Resume a paused sandbox. ``timeout``: its new time to live in seconds (0 = none;
        default: the one it was created with). ``reboot=True`` cold-boots it instead of
        restoring its processes: files only, a new boot id (a ``mode="filesystem"`` pause always
        resumes so)."""
        result = self._http.call(_core.resume_sandbox(self.id, timeout, reboot))
        if result.sandbox is not None:
            self._info = result.sandbox
        return result

    def set_timeout(self, seconds: float) -> SandboxInfo:
        """Restart the time to live from now (0 = no TTL)."""
        info = self._http.call(_core.set_timeout(self.id, seconds))
        self._info = info
        return info

    def is_running(self) -> bool:
        try:
            return self.info().state == "running"
        except NotFoundError:
            return False

    def kill(self) -> bool:
        """Kill the sandbox. Returns False if it did not exist (anymore)."""
        try:
            return self._http.call(_core.kill_sandbox(self.id))
        except NotFoundError:
            return False

    def run_code(
        self,
        code: str,
        *,
        timeout: Optional[float] = 60,
        language: str = "python",
        env: Optional[Mapping[str, str]] = None,
    ) -> Execution:
        """Run code in the sandbox's default python session (created on first use). ``env``:
        environment variables for this run only (``os.environ``), put back after it."""
        return self._http.call(_core.run_code(self.id, code, language, timeout, env))

    # -- snapshots

    def checkpoint(self, label: Optional[str] = None, processes: Optional[str] = None) -> str:
        """Snapshot the sandbox (filesystem and live sessions); returns the snapshot id.
        ``processes="all"`` also keeps background processes (servers, watchers, a build) as
        process images, restored by a rollback to it and in forks of it (needs CRIU; slower:
        they are dumped); one that cannot be kept fails the checkpoint. ``"keepable"`` leaves
        such a one out instead (``checkpoint_info().processes`` lists those kept). Commands
        started through the E2B endpoint are kept too (with new pipes or a new terminal where
        they are restored, reached through that endpoint by the sandbox's id). ``"none"``
        keeps the files alone: a rollback to it, a fork of it or a sandbox made from it starts
        without sessions (they start afresh when used), as after a cold boot."""
        return self.checkpoint_info(label, processes).id

    def checkpoint_info(self, label: Optional[str] = None, processes: Optional[str] = None) -> SnapshotInfo:
        """:meth:`checkpoint`, returning the daemon's whole answer: the new snapshot's
        :class:`SnapshotInfo`, whose ``took_ms`` is the time the checkpoint took in the daemon."""
        return self._http.call(_core.checkpoint(self.id, label, processes))

    def rollback(
        self, snapshot: Union[str, SnapshotInfo], lazy_pages: Optional[bool] = None
    ) -> RollbackResult:
        """Return the sandbox to ``snapshot``; non-session processes are killed, and those the
        snapshot kept (``processes="all"``) come back.

        Processes restored from process images run before their memory is copied in (lazy
        pages, the daemon's default where it can); ``lazy_pages=False`` reads it all first."""
        return self._http.call(_core.rollback(self.id, snapshot, lazy_pages))

    def fork(
        self,
        n: int = 1,
        snapshot: Union[str, SnapshotInfo, None] = None,
        timeout: Optional[float] = None,
        isolated: bool = False,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        replay_inflight: bool = False,
        processes: Optional[str] = None,
    ) -> List["Sandbox"]:
        """Start ``n`` (1..64) new sandboxes from ``snapshot`` (default: a checkpoint taken
        now). ``timeout`` is the children's time to live in seconds (0 = none).

        By default children get live copies of the sessions and are nested in this sandbox's
        namespaces (``info().nested_in``); ``isolated=True`` makes independent children with
        their own top-level namespaces and fresh sessions.

        Children have addresses of their own and this sandbox's network mode and allow entries
        as they are at the fork (with ``snapshot``: the snapshot's); ``network`` and ``allow``
        (see :meth:`create`) set theirs instead (``allow`` alone keeps the mode).

        ``replay_inflight=True`` hands the answers to this sandbox's proxied requests in flight
        at the checkpoint to every child: a child's first request matching one of them (same
        method, URL and body; its copy of the connection to the proxy is reset, so a client that
        retries sends it again) gets the parent's answer instead of going upstream. Needs the
        sandbox's proxy (``proxy=True``) and a checkpoint taken now (no ``snapshot``).

        ``processes="all"`` (or ``"keepable"``, see :meth:`checkpoint`) makes the checkpoint
        keep background processes (servers, watchers) too: each child gets them under the same
        pids, restored from process images (needs CRIU; each child costs a restore, ~0.1 s per
        tree). A ``snapshot`` that kept them gives them to the children anyway; those that did
        not come back are named in :meth:`fork_info`'s ``processes_not_restored``.
        ``processes="none"``: the children get the files alone (no sessions).

        Each child has its own connection with this sandbox's settings: close (or kill)
        them when done, e.g. ``with child: ...``.
        """
        return self.fork_info(n, snapshot, timeout, isolated, network, allow, replay_inflight, processes)[0]

    def fork_info(
        self,
        n: int = 1,
        snapshot: Union[str, SnapshotInfo, None] = None,
        timeout: Optional[float] = None,
        isolated: bool = False,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        replay_inflight: bool = False,
        processes: Optional[str] = None,
    ) -> Tuple[List["Sandbox"], ForkResult]:
        """:meth:`fork`, also returning the daemon's whole answer: the :class:`ForkResult`
        (the snapshot forked from, ``sessions_restarted``, ``inflight_handed``, ``took_ms``)."""
        call = _core.fork(self.id, n, snapshot, timeout, isolated, network, allow, replay_inflight, processes)
        result = self._http.call(call)
        return [Sandbox(info.id, _http=_HTTP(self._http.config), info=info) for info in result.sandboxes], result

    def snapshots(self) -> List[SnapshotInfo]:
        """The snapshot tree this sandbox belongs to (its own snapshots and its ancestors'),
        ordered by creation time."""
        return self._http.call(_core.sandbox_snapshots(self.id))

    def evaluate(
        self,
        cmd: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> CommandResult:
        """Run ``cmd`` like ``commands.run`` but leave no side effect on the sandbox
        (its filesystem and sessions are as before the call)."""
        body = _core.command_body(cmd, False, cwd, env, timeout, None)
        return self._http.call(_core.evaluate(self.id, body))

    # -- ports

    def get_host(self, port: int) -> str:
        """The address on the host (``"127.0.0.1:41234"``) whose connections reach a server
        listening on ``port`` inside the sandbox: open ``http://{host}/``. E2B's name; the
        forwarder is opened on first ask (see :meth:`open_port`)."""
        return self.open_port(port).host

    def open_port(self, port: int) -> PortInfo:
        """Open ``port`` (an int in 1..65535; else :class:`InvalidArgumentError`, also a
        ``ValueError``, and nothing is sent) to the host: the daemon listens on a port of its
        host (``--port-bind``, 127.0.0.1 unless set) and joins each connection to the server
        on ``port`` inside the sandbox, in every network mode (``"none"`` too). Asking again
        returns the same :class:`PortInfo` (``host``, ``url``). Nothing needs to listen yet: a
        connection made while nothing does (or while the sandbox is paused) is closed at once.

        :class:`ConflictError` when the port is not open yet and the sandbox is paused or has
        32 ports open already. A port stays open until :meth:`close_port` or until the
        sandbox is killed (a pause keeps it); a fork child has ports of its own."""
        return self._http.call(_core.open_port(self.id, port))

    def ports(self) -> List[PortInfo]:
        """The ports open to the host, by port."""
        return self._http.call(_core.list_ports(self.id))

    def close_port(self, port: int) -> bool:
        """Close the forwarder of ``port``; False if it was not open."""
        return self._http.call(_core.close_port(self.id, port))

    def close(self) -> None:
        """Release the HTTP connection (the sandbox keeps running)."""
        self._http.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.kill()
        except SandboxError:
            if exc_type is None:
                raise
        finally:
            self.close()

    def __repr__(self) -> str:
        return "Sandbox(id=%r)" % self.id


# ----------------------------------------------------------------------------- network


class Network:
    """``sbx.network``: the sandbox's network mode, allow entries and limits (see
    :meth:`Sandbox.create`), read and changed while it runs."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def get(self) -> NetworkInfo:
        """The sandbox's network now: mode, allow entries, address, proxy, limits, bytes received and sent."""
        return self._sbx._http.call(_core.get_network(self._sbx.id))

    def update(
        self,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        limits: Union[NetLimits, Mapping[str, Any], None] = None,
    ) -> NetworkInfo:
        """Change the mode, the allow entries and/or the limits (None: unchanged; ``allow=[]``
        clears the entries, ``network="none"`` too); connections made from then on follow the
        new rules. ``limits`` (a :class:`NetLimits` or a dict of its keys, see
        :meth:`Sandbox.create`'s ``net_limits``) replaces the limits as a whole: a cap it leaves
        out is lifted, ``{}`` lifts them all. Returns the network as it now is. A bad mode, a
        non-list ``allow`` or bad limits are refused before any request
        (:class:`InvalidArgumentError`, also a ``ValueError``); a bad entry by the daemon
        (:class:`InvalidArgumentError`, nothing changed)."""
        return self._sbx._http.call(_core.update_network(self._sbx.id, network, allow, limits))

    def __repr__(self) -> str:
        return "Network(sandbox=%r)" % self._sbx.id


# ----------------------------------------------------------------------------- commands


class CommandHandle:
    """A background command: ``wait()`` for its result or ``kill()`` it."""

    def __init__(self, sandbox: Sandbox, pid: int) -> None:
        self.sandbox = sandbox
        self.pid = pid

    def wait(self, timeout: Optional[float] = None) -> CommandResult:
        """Wait for exit (``timed_out`` is set if it still runs after ``timeout``)."""
        return self.sandbox.commands.wait(self.pid, timeout=timeout)

    def kill(self, signal: int = 9) -> bool:
        return self.sandbox.commands.kill(self.pid, signal=signal)

    def __repr__(self) -> str:
        return "CommandHandle(sandbox=%r, pid=%d)" % (self.sandbox.id, self.pid)


class Commands:
    """``sbx.commands``: run and manage processes in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def run(
        self,
        cmd: Union[str, Sequence[str]],
        *,
        background: bool = False,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = 60,
        stdin: Union[str, bytes, None] = None,
        on_stdout: Optional[_core.Callback] = None,
        on_stderr: Optional[_core.Callback] = None,
        user: Optional[str] = None,
    ) -> Any:
        """Run ``cmd`` (a ``/bin/sh -c`` string, or an argv list).

        Returns a :class:`CommandResult` (a nonzero exit is not an error: use
        ``.check()``), or a :class:`CommandHandle` with ``background=True``. With
        ``on_stdout``/``on_stderr`` output is streamed and the callbacks get each chunk.
        ``user`` runs it as that user of the sandbox (e.g. ``"user"``; its uid/gid,
        HOME/USER/LOGNAME, its home as the default cwd); default root.
        """
        body = _core.command_body(cmd, background, cwd, env, timeout, stdin, user)
        http = self._sbx._http
        if background:
            if on_stdout is not None or on_stderr is not None:
                raise InvalidArgumentError(
                    "on_stdout/on_stderr stream foreground commands only; "
                    "get a background command's output with handle.wait()"
                )
            return CommandHandle(self._sbx, http.call(_core.run_command(self._sbx.id, body)))
        if on_stdout is None and on_stderr is None:
            return http.call(_core.run_command(self._sbx.id, body))
        stream = _core.CommandStream(on_stdout, on_stderr)
        with http.events(_core.stream_command(self._sbx.id, body)) as events:
            for event in events:
                todo = stream.handle(event)
                if todo is not None:
                    todo[0](todo[1])
        return stream.finish()

    def list(self) -> List[ProcessInfo]:
        """Background processes started through the API."""
        return self._sbx._http.call(_core.list_processes(self._sbx.id))

    def kill(self, pid: int, signal: int = 9) -> bool:
        return self._sbx._http.call(_core.kill_process(self._sbx.id, pid, signal))

    def wait(self, pid: int, timeout: Optional[float] = None) -> CommandResult:
        return self._sbx._http.call(_core.wait_process(self._sbx.id, pid, timeout))


# ----------------------------------------------------------------------------- files


class ByteStream:
    """Iterator over a file's content in chunks; close it (or use ``with``) when done early."""

    def __init__(self, response: httpx.Response, http: _HTTP, chunk_size: Optional[int] = None) -> None:
        self._response = response
        self._http = http
        self._it = response.iter_bytes(chunk_size)

    def __iter__(self) -> "ByteStream":
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._it)
        except StopIteration:
            self.close()
            raise
        except httpx.TransportError as err:
            self.close()
            raise _core.transport_error(err, self._http.config.url) from None

    def read(self) -> bytes:
        """The rest of the content at once."""
        return b"".join(self)

    def close(self) -> None:
        self._response.close()

    def __enter__(self) -> "ByteStream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class Files:
    """A filesystem reached through the daemon's files API: ``sbx.files`` (a sandbox's, paths
    resolved inside the sandbox root) or ``vol.files`` (a volume's, paths inside the volume)."""

    def __init__(self, http: _HTTP, prefix: str) -> None:
        self._http = http
        self._prefix = prefix

    def read(self, path: str, format: str = "text") -> Any:
        """Content of ``path`` as ``str`` (``"text"``), ``bytes`` or a :class:`ByteStream`."""
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentError("format must be 'text', 'bytes' or 'stream'")
        response = self._http.send(_core.read_file(self._prefix, path), stream=True)
        stream = ByteStream(response, self._http)
        if format == "stream":
            return stream
        with stream:
            data = stream.read()
        return data.decode("utf-8", "replace") if format == "text" else data

    def write(
        self, path: str, data: Any, mode: Union[int, str, None] = None, *, user: Optional[str] = None
    ) -> EntryInfo:
        """Write ``data`` (str, bytes, a binary/text file object or an iterable of chunks).

        File objects and iterables are streamed. Parent directories are created. ``user``:
        the file (and parent directories made) belong to that sandbox user (default root;
        sandbox files only, the daemon refuses it for a volume's).
        """
        payload = _core.bytes_payload(data)
        if payload is not None:
            content: Any = payload
            length: Optional[int] = len(payload)
        elif _core.is_filelike(data):
            content, length = _core.iter_file(data), _core.remaining_length(data)
        elif hasattr(data, "__iter__"):
            content, length = _core.iter_chunks(data), None
        else:
            raise InvalidArgumentError("data must be str, bytes, a file object or an iterable of bytes")
        return self._http.call(_core.write_file(self._prefix, path, content, mode, length, user))

    def list(self, path: str = "/", depth: int = 1) -> List[EntryInfo]:
        return self._http.call(_core.list_dir(self._prefix, path, depth))

    def stat(self, path: str) -> EntryInfo:
        return self._http.call(_core.stat(self._prefix, path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except NotFoundError:
            return False
        return True

    def make_dir(self, path: str, parents: bool = True, *, user: Optional[str] = None) -> EntryInfo:
        """Create ``path`` (with ``parents``, missing parents too and no error if it exists);
        ``user``: new directories belong to that sandbox user (default root)."""
        return self._http.call(_core.make_dir(self._prefix, path, parents, user))

    def remove(self, path: str, recursive: bool = False) -> bool:
        return self._http.call(_core.remove(self._prefix, path, recursive))

    def rename(self, src: str, dst: str) -> EntryInfo:
        return self._http.call(_core.rename(self._prefix, src, dst))

    def upload(
        self,
        local_path: Union[str, "os.PathLike[str]"],
        remote_path: str,
        mode: Union[int, str, None] = None,
        *,
        user: Optional[str] = None,
    ) -> EntryInfo:
        """Stream a local file to ``remote_path`` (``user``: as for :meth:`write`)."""
        with open(local_path, "rb") as f:
            return self.write(remote_path, f, mode=mode, user=user)

    def download(self, remote_path: str, local_path: Union[str, "os.PathLike[str]"]) -> str:
        """Stream ``remote_path`` to ``local_path``; returns the local path."""
        with self.read(remote_path, format="stream") as stream, open(local_path, "wb") as f:
            for chunk in stream:
                f.write(chunk)
        return os.fspath(local_path)


# ----------------------------------------------------------------------------- sessions


class Session:
    """A stateful interpreter (``python``) or shell (``shell``) inside the sandbox."""

    def __init__(self, sandbox: Sandbox, info: SessionInfo) -> None:
        self.sandbox = sandbox
        self.info = info
        self.id = info.id
        self.kind = info.kind

    @property
    def pid(self) -> Optional[int]:
        return self.info.pid

    def run(
        self, code: str, *, timeout: Optional[float] = 60, env: Optional[Mapping[str, str]] = None
    ) -> Union[Execution, ShellResult]:
        """Run code; python sessions return an :class:`Execution`, shells a
        :class:`ShellResult`. A timed-out run kills the session (``timed_out=True``).
        ``env``: environment variables for this run only, put back as they were after it."""
        return self.sandbox._http.call(_core.run_session(self.sandbox.id, self.id, code, timeout, self.kind, env))

    def kill(self) -> bool:
        try:
            return self.sandbox._http.call(_core.kill_session(self.sandbox.id, self.id))
        except NotFoundError:
            return False

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.kill()

    def __repr__(self) -> str:
        return "Session(id=%r, kind=%r)" % (self.id, self.kind)


class Sessions:
    """``sbx.sessions``: create and list stateful sessions."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def create(
        self, kind: str = "python", *, cwd: Optional[str] = None, env: Optional[Mapping[str, str]] = None
    ) -> Session:
        info = self._sbx._http.call(_core.create_session(self._sbx.id, kind, cwd, env))
        if not info.kind:
            info.kind = kind
        return Session(self._sbx, info)

    def list(self) -> List[SessionInfo]:
        return self._sbx._http.call(_core.list_sessions(self._sbx.id))


# ----------------------------------------------------------------------------- volumes


class Volume:
    """A persistent volume: files that outlive sandboxes, mounted with
    ``Sandbox.create(volumes={"/workspace": vol})`` and reached directly through
    :attr:`files`. Create with :meth:`create`, attach with :meth:`connect`.

    Writes are node-local (on the daemon's disk) until :meth:`sync` makes them durable (in
    the object store, the head recorded in the metadata store). Used as a context manager the
    connection is released on exit; the volume stays (:meth:`delete` removes it).
    """

    def __init__(self, volume_id: str, *, _http: _HTTP, info: Optional[VolumeInfo] = None) -> None:
        self.id = volume_id
        self._http = _http
        self._info = info
        self.files = Files(_http, _core.volume_files(volume_id))

    @classmethod
    def create(
        cls,
        name: Optional[str] = None,
        access: str = "rwo",
        quota_mb: Optional[int] = None,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> "Volume":
        """Create an empty volume. ``name`` (optional, unique) may stand for its id anywhere;
        ``access`` is ``"rwo"`` (mounted by one sandbox at a time), ``"rox"`` (by any number,
        read-only; written through :attr:`files` while none mounts it) or ``"rwx"`` (by any
        number of this daemon's sandboxes, read-write, one copy for all); ``quota_mb`` bounds
        what it may hold (writes beyond fail with :class:`QuotaExceededError`). Connection
        arguments as :meth:`Sandbox.create`'s."""
        http = _HTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            info = http.call(_core.create_volume(name, access, quota_mb))
        except BaseException:
            http.close()
            raise
        return cls(info.id, _http=http, info=info)

    @classmethod
    def connect(
        cls,
        id_or_name: str,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> "Volume":
        """Attach to an existing volume by id or name (:class:`NotFoundError` if unknown)."""
        http = _HTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            info = http.call(_core.get_volume(id_or_name))
        except BaseException:
            http.close()
            raise
        return cls(info.id or id_or_name, _http=http, info=info)

    @classmethod
    def list(
        cls,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> List[VolumeInfo]:
        """All volumes."""
        with _HTTP(ConnectionConfig(daemon, token, request_timeout, transport)) as http:
            return http.call(_core.list_volumes())

    def info(self) -> VolumeInfo:
        info = self._http.call(_core.get_volume(self.id))
        self._info = info
        return info

    def delete(self) -> bool:
        """Delete the volume and its snapshots (:class:`ConflictError` while it is mounted)."""
        return self._http.call(_core.delete_volume(self.id))

    def snapshot(self, label: Optional[str] = None) -> VolumeSnapshotInfo:
        """Record the volume's files as they are now (metadata only: no file is copied)."""
        return self._http.call(_core.volume_snapshot(self.id, label))

    def snapshots(self) -> List[VolumeSnapshotInfo]:
        return self._http.call(_core.list_volume_snapshots(self.id))

    def delete_snapshot(self, snapshot: Union[str, VolumeSnapshotInfo]) -> bool:
        return self._http.call(_core.delete_volume_snapshot(self.id, snapshot))

    def restore(self, snapshot: Union[str, VolumeSnapshotInfo]) -> VolumeInfo:
        """Return the volume's files to ``snapshot``."""
        info = self._http.call(_core.restore_volume(self.id, snapshot))
        self._info = info
        return info

    def fork(self, name: Optional[str] = None, snapshot: Union[str, VolumeSnapshotInfo, None] = None) -> "Volume":
        """A new volume with this one's files now (or ``snapshot``'s), copy-on-write: the two
        change independently. It has its own connection with this volume's settings."""
        info = self._http.call(_core.fork_volume(self.id, name, snapshot))
        return Volume(info.id, _http=_HTTP(self._http.config), info=info)

    def sync(self) -> VolumeInfo:
        """Make what was written so far durable: uploaded to the object store and committed
        as the volume's head in the metadata store (``durability`` is then ``"durable"``)."""
        info = self._http.call(_core.sync_volume(self.id))
        self._info = info
        return info

    def close(self) -> None:
        """Release the HTTP connection (the volume stays)."""
        self._http.close()

    def __enter__(self) -> "Volume":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Volume(id=%r)" % self.id


# ----------------------------------------------------------------------------- daemon-wide clients

_D = TypeVar("_D", bound="_DaemonClient")


class _DaemonClient:
    """What the daemon-wide clients (images, snapshots, templates, pool) share: a connection,
    released by :meth:`close` or at the end of a ``with`` block."""

    def __init__(
        self,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> None:
        self._http = _HTTP(ConnectionConfig(daemon, token, request_timeout, transport))

    def _follow(self, call: _core.Call, stream: Any, on_progress: Optional[Callable[[Any], Any]]) -> Any:
        """Follow a build's progress events (``stream``: an image or template stream) to its
        result, handing each progress to ``on_progress``."""
        with self._http.events(call) as events:
            for event in events:
                progress = stream.handle(event)
                if progress is not None and on_progress is not None:
                    on_progress(progress)
        return stream.finish()

    def close(self) -> None:
        self._http.close()

    def __enter__(self: _D) -> _D:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------- images


class Images(_DaemonClient):
    """Root filesystem images known to the daemon.

    ``on_progress`` receives an :class:`ImageProgress` per progress event.
    """

    def list(self) -> List[ImageInfo]:
        return self._http.call(_core.list_images())

    def build(
        self,
        name: str = "base",
        *,
        suite: Optional[str] = None,
        packages: Optional[Sequence[str]] = None,
        on_progress: Optional[Callable[[ImageProgress], Any]] = None,
    ) -> ImageInfo:
        """Build a Debian image (debootstrap) and return it when done."""
        return self._follow(_core.build_image(name, suite, packages), _core.ImageStream(), on_progress)

    def import_(self, name: str, path: str, *, on_progress: Optional[Callable[[ImageProgress], Any]] = None) -> ImageInfo:
        """Import an OCI/docker image tarball found at ``path`` on the daemon's host."""
        return self._follow(_core.import_image(name, path), _core.ImageStream(), on_progress)

    def remove(self, name: str) -> bool:
        return self._http.call(_core.remove_image(name))


# ----------------------------------------------------------------------------- snapshots


class Snapshots(_DaemonClient):
    """Snapshots known to the daemon (take them with :meth:`Sandbox.checkpoint`)."""

    def list(self, sandbox: Union[str, Sandbox, None] = None) -> List[SnapshotInfo]:
        """All snapshots, or the tree ``sandbox`` belongs to; ordered by creation time."""
        if sandbox is None:
            return self._http.call(_core.list_snapshots())
        return self._http.call(_core.sandbox_snapshots(_core.sandbox_ref(sandbox)))

    def get(self, sid: Union[str, SnapshotInfo]) -> SnapshotInfo:
        return self._http.call(_core.get_snapshot(sid))

    def delete(self, sid: Union[str, SnapshotInfo], subtree: bool = False) -> bool:
        """Delete a snapshot; ``subtree=True`` also deletes its descendants."""
        return self._http.call(_core.delete_snapshot(sid, subtree))

    def offload(self, sid: Union[str, SnapshotInfo]) -> OffloadResult:
        """Move the snapshot's live sessions (held in memory) into process images on disk now,
        giving their memory back; a rollback or fork to it restores them. Needs CRIU."""
        return self._http.call(_core.offload_snapshot(sid))

    def push(self, sid: Union[str, SnapshotInfo]) -> PushResult:
        """Make the snapshot durable: its layers and session state (process images; live
        sessions are dumped first, as :meth:`offload` does) go to the daemon's object store,
        deduplicated against what is there, and its record to the metadata store. Any daemon
        sharing both can then ``pull`` it or ``Sandbox.create(snapshot=sid)`` from it. Pushing
        again is a no-op."""
        return self._http.call(_core.push_snapshot(sid))

    def pull(self, sid: Union[str, SnapshotInfo]) -> PullResult:
        """Bring a pushed snapshot onto this daemon (``Sandbox.create(snapshot=sid)`` does
        this by itself)."""
        return self._http.call(_core.pull_snapshot(sid))

    def list_remote(self) -> List[RemoteSnapshotInfo]:
        """The snapshots recorded in the metadata store (pushed by any daemon)."""
        return self._http.call(_core.list_remote_snapshots())

    def list_paused_remote(self) -> List[RemotePausedInfo]:
        """The sandboxes paused with ``pause(push=True)`` on any daemon, waiting to be resumed."""
        return self._http.call(_core.list_remote_paused())

    def delete_remote(self, sid: Union[str, SnapshotInfo]) -> bool:
        """Delete a pushed snapshot's record; its objects go with the next :meth:`store_gc`.
        A local copy stays (node-local again)."""
        return self._http.call(_core.delete_remote_snapshot(sid))

    def store_gc(self, grace_seconds: Optional[float] = None) -> StoreGcResult:
        """Delete the object store's objects no snapshot record reaches and that are older
        than ``grace_seconds`` (default: the daemon's ``--store-gc-grace``)."""
        return self._http.call(_core.store_gc(grace_seconds))

    def gc(
        self, keep: Sequence[Union[str, SnapshotInfo]], sandbox: Union[str, Sandbox, None] = None
    ) -> GcResult:
        """Delete every snapshot (of ``sandbox``'s tree, or all) that is neither in ``keep``
        nor an ancestor of a kept one. Layers a kept snapshot or a live sandbox needs stay."""
        return self._http.call(_core.gc_snapshots(keep, sandbox))


# ----------------------------------------------------------------------------- templates


class Templates(_DaemonClient):
    """Warm templates: a recipe (image, shell commands, python code) run once and frozen with
    its live python session; ``Sandbox.create(template=name)`` then starts a copy-on-write
    fork of it, imports included.

    ``on_progress`` receives a :class:`TemplateProgress` per progress event.
    """

    def build(
        self,
        name: str,
        *,
        image: Optional[str] = None,
        run: Union[str, Sequence[str], None] = None,
        code: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        cpu: Optional[float] = None,
        memory_mb: Optional[int] = None,
        pids: Optional[int] = None,
        metadata: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        shells: Optional[int] = None,
        volumes: _core.VolumesT = None,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        on_progress: Optional[Callable[[TemplateProgress], Any]] = None,
    ) -> TemplateInfo:
        """Build (or replace) template ``name``: start a sandbox of ``image`` (default
        ``base``), run each ``run`` command (``/bin/sh -c``; a non-zero exit fails the build),
        run ``code`` in its python session, and freeze it. ``timeout`` bounds each step
        (seconds, daemon default 600); ``shells`` sandboxes are kept ready to hand out
        (daemon default 4). Returns when the template is usable.

        ``volumes`` (same forms as ``Sandbox.create(volumes=...)``) are mounted while the
        recipe runs (e.g. to ``git clone`` into ``/workspace``); each sandbox created from the
        template gets a copy-on-write fork of every branching volume at the same path (``rox``
        volumes are shared read-only), unless its own ``volumes`` mount another there.

        ``network``/``allow`` (as for :meth:`Sandbox.create`; not sent unless given: daemon
        default ``"none"``) are the network of the recipe's sandbox while ``run`` and ``code``
        execute (e.g. ``network="allowlist", allow=["pypi.org", "files.pythonhosted.org"]``
        for ``pip install``), and the default of sandboxes created from the template
        (``Sandbox.create(template=...)`` without ``network``; ``allow`` alone keeps the
        template's mode). A bad mode or a non-list ``allow`` is refused before any request."""
        recipe = _core.template_recipe(
            name, image, run, code, env, cwd, cpu, memory_mb, pids, metadata, timeout, shells, volumes,
            network=network, allow=allow,
        )
        return self._follow(_core.build_template(recipe), _core.TemplateStream(), on_progress)

    def list(self) -> List[TemplateInfo]:
        return self._http.call(_core.list_templates())

    def get(self, name: Union[str, TemplateInfo]) -> TemplateInfo:
        """The template (:class:`NotFoundError` if unknown)."""
        return self._http.call(_core.get_template(name))

    def remove(self, name: Union[str, TemplateInfo]) -> bool:
        """Remove a template (sandboxes created from it keep running)."""
        return self._http.call(_core.remove_template(name))


# ----------------------------------------------------------------------------- warm pool


class Pool(_DaemonClient):
    """The daemon's warm pool: sandboxes started ahead of time per image, claimed by
    ``Sandbox.create`` in milliseconds; killed sandboxes are cleaned and recycled into it."""

    def stats(self) -> PoolStats:
        """Configuration, ready counts and counters (hits, misses, recycled, ...)."""
        return self._http.call(_core.pool_stats())

    def set(self, image: str, min: int, max: Optional[int] = None) -> PoolStats:  # noqa: A002
        """Keep ``min`` sandboxes of ``image`` ready (built in the background) and recycle
        killed ones while fewer than ``max`` (default ``min``) are ready. Persisted by the
        daemon. ``set(image, 0, 0)`` (or :meth:`drain`) removes the pool."""
        return self._http.call(_core.set_pool(image, min, max))

    def drain(self, image: str) -> PoolStats:
        """Remove ``image``'s pool (``min = max = 0``); its ready sandboxes are torn down."""
        return self.set(image, 0, 0)
