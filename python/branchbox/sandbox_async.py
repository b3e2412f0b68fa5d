"""Asynchronous SDK: :class:`AsyncSandbox`, the mirror of ``sandbox_sync`` with ``await``.

Callbacks (``on_stdout``, ``on_stderr``, ``on_progress``) may be plain functions or
coroutine functions.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

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
    "AsyncSandbox",
    "AsyncCommands",
    "AsyncCommandHandle",
    "AsyncFiles",
    "AsyncByteStream",
    "AsyncNetwork",
    "AsyncSessions",
    "AsyncSession",
    "AsyncImages",
    "AsyncSnapshots",
    "AsyncVolume",
    "AsyncTemplates",
    "AsyncPool",
    "health",
]


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


class _AsyncHTTP:
    """Executes :class:`_core.Call` objects with an ``httpx.AsyncClient``."""

    def __init__(self, config: ConnectionConfig) -> None:
        self.config = config
        self.client = config.async_client()

    async def close(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> "_AsyncHTTP":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def send(self, call: _core.Call, stream: bool = False) -> httpx.Response:
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
            response = await self.client.send(request, stream=stream)
        except httpx.TransportError as err:
            raise _core.transport_error(err, self.config.url) from None
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx.TransportError as err:
                raise _core.transport_error(err, self.config.url) from None
            finally:
                await response.aclose()
            raise _core.error_for_status(response.status_code, content)
        return response

    async def call(self, call: _core.Call) -> Any:
        response = await self.send(call)
        data = _core.parse_json(response.content)
        return call.parse(data) if call.parse else data

    @contextlib.asynccontextmanager
    async def events(self, call: _core.Call) -> AsyncIterator[AsyncIterator[Any]]:
        """``async with http.events(call) as events: async for event in events: ...``"""
        response = await self.send(call, stream=True)

        async def gen() -> AsyncIterator[Any]:
            decoder = _core.NDJSONDecoder()
            try:
                async for chunk in response.aiter_bytes():
                    for event in decoder.feed(chunk):
                        yield event
            except httpx.TransportError as err:
                raise _core.transport_error(err, self.config.url) from None
            for event in decoder.close():
                yield event

        try:
            yield gen()
        finally:
            await response.aclose()


async def health(
    *,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 10,
    transport: Optional[httpx.AsyncBaseTransport] = None,
) -> Dict[str, Any]:
    """``GET /v1/health`` of the daemon."""
    async with _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport)) as http:
        return await http.call(_core.health())


# ----------------------------------------------------------------------------- sandbox


class AsyncSandbox:
    """Async sandbox::

        async with await AsyncSandbox.create() as sbx:
            print((await sbx.commands.run("echo hi")).stdout)
    """

    def __init__(self, sandbox_id: str, *, _http: _AsyncHTTP, info: Optional[SandboxInfo] = None) -> None:
        self.id = sandbox_id
        self._http = _http
        self._info = info
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(_http, _core.sandbox_files(sandbox_id))
        self.sessions = AsyncSessions(self)
        self.network = AsyncNetwork(self)

    @property
    def sandbox_id(self) -> str:
        """Alias of :attr:`id` (E2B naming)."""
        return self.id

    @classmethod
    async def create(
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
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> "AsyncSandbox":
        """Start a sandbox (see :meth:`branchbox.Sandbox.create`)."""
        http = _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            info = await http.call(
                _core.create_sandbox(
                    image, cpu, memory_mb, pids, env, cwd, timeout, network, metadata, template, lifecycle, snapshot,
                    volumes, allow, proxy, net_limits, proxy_record, sudo,
                )
            )
        except BaseException:
            await http.close()
            raise
        return cls(info.id, _http=http, info=info)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        timeout: Optional[float] = None,
        resume: bool = True,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> "AsyncSandbox":
        """Attach to an existing sandbox (raises :class:`NotFoundError` if unknown). A paused
        sandbox (here, or paused into the object store by any daemon sharing it) is resumed first (its timeout then restarts: ``timeout`` seconds, or the one it
        was created with) unless ``resume=False``; on a running one, ``timeout`` restarts its
        time to live."""
        http = _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            try:
                info = await http.call(_core.get_sandbox(sandbox_id))
            except NotFoundError:
                if not resume:
                    raise
                # Not on this daemon: maybe paused into the object store by another
                # (``pause(push=True)``); the daemon resumes it here, or says not found.
                info = (await http.call(_core.resume_sandbox(sandbox_id, timeout))).sandbox
            if info.state == "paused" and resume:
                info = (await http.call(_core.resume_sandbox(sandbox_id, timeout))).sandbox or info
            elif timeout is not None and info.state == "running":
                info = await http.call(_core.set_timeout(sandbox_id, timeout))
        except BaseException:
            await http.close()
            raise
        return cls(info.id or sandbox_id, _http=http, info=info)

    @classmethod
    async def list(
        cls,
        *,
        metadata: Optional[Mapping[str, str]] = None,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> List[SandboxInfo]:
        """All sandboxes, optionally only those whose metadata match ``metadata``."""
        async with _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport)) as http:
            return await http.call(_core.list_sandboxes(metadata))

    async def info(self) -> SandboxInfo:
        info = await self._http.call(_core.get_sandbox(self.id))
        self._info = info
        return info

    async def pause(self, push: bool = False, mode: str = "full") -> PauseResult:
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
        result = await self._http.call(_core.pause_sandbox(self.id, push, mode))
        if result.sandbox is not None:
            self._info = result.sandbox
        return result

    async def resume(self, timeout: Optional[float] = None, reboot: bool = False) -> ResumeResult:
        """Resume a paused sandbox. ``timeout``: its new time to live in seconds (0 = none;
        default: the one it was created with). ``reboot=True`` cold-boots it instead of
        restoring its processes: files only, a new boot id (a ``mode="filesystem"`` pause always
        resumes so)."""
        result = await self._http.call(_core.resume_sandbox(self.id, timeout, reboot))
        if result.sandbox is not None:
            self._info = result.sandbox
        return result

    async def set_timeout(self, seconds: float) -> SandboxInfo:
        """Restart the time to live from now (0 = no TTL)."""
        info = await self._http.call(_core.set_timeout(self.id, seconds))
        self._info = info
        return info

    async def is_running(self) -> bool:
        try:
            return (await self.info()).state == "running"
        except NotFoundError:
            return False

    async def kill(self) -> bool:
        """Kill the sandbox. Returns False if it did not exist (anymore)."""
        try:
            return await self._http.call(_core.kill_sandbox(self.id))
        except NotFoundError:
            return False

    async def run_code(
        self,
        code: str,
        *,
        timeout: Optional[float] = 60,
        language: str = "python",
        env: Optional[Mapping[str, str]] = None,
    ) -> Execution:
        """Run code in the sandbox's default python session (created on first use). ``env``:
        environment variables for this run only (``os.environ``), put back after it."""
        return await self._http.call(_core.run_code(self.id, code, language, timeout, env))

    # -- snapshots

    async def checkpoint(self, label: Optional[str] = None, processes: Optional[str] = None) -> str:
        """Snapshot the sandbox (filesystem and live sessions; ``processes="all"`` or
        ``"keepable"``: background processes too; ``"none"``: the files alone; see
        :meth:`branchbox.Sandbox.checkpoint`); returns the snapshot id."""
        return (await self.checkpoint_info(label, processes)).id

    async def checkpoint_info(self, label: Optional[str] = None, processes: Optional[str] = None) -> SnapshotInfo:
        """:meth:`checkpoint`, returning the whole :class:`SnapshotInfo` (see
        :meth:`branchbox.Sandbox.checkpoint_info`)."""
        return await self._http.call(_core.checkpoint(self.id, label, processes))

    async def rollback(
        self, snapshot: Union[str, SnapshotInfo], lazy_pages: Optional[bool] = None
    ) -> RollbackResult:
        """Return the sandbox to ``snapshot``; non-session processes are killed, and those the
        snapshot kept (``processes="all"``) come back.

        Processes restored from process images run before their memory is copied in (lazy
        pages, the daemon's default where it can); ``lazy_pages=False`` reads it all first."""
        return await self._http.call(_core.rollback(self.id, snapshot, lazy_pages))

    async def fork(
        self,
        n: int = 1,
        snapshot: Union[str, SnapshotInfo, None] = None,
        timeout: Optional[float] = None,
        isolated: bool = False,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        replay_inflight: bool = False,
        processes: Optional[str] = None,
    ) -> List["AsyncSandbox"]:
        """Start ``n`` (1..64) new sandboxes from ``snapshot`` (see :meth:`branchbox.Sandbox.fork`;
        ``network``/``allow``: the children's, default the parent's).

        Each child has its own connection with this sandbox's settings: close (or kill)
        them when done.
        """
        return (await self.fork_info(n, snapshot, timeout, isolated, network, allow, replay_inflight, processes))[0]

    async def fork_info(
        self,
        n: int = 1,
        snapshot: Union[str, SnapshotInfo, None] = None,
        timeout: Optional[float] = None,
        isolated: bool = False,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        replay_inflight: bool = False,
        processes: Optional[str] = None,
    ) -> Tuple[List["AsyncSandbox"], ForkResult]:
        """:meth:`fork`, also returning the daemon's :class:`ForkResult` (see
        :meth:`branchbox.Sandbox.fork_info`)."""
        call = _core.fork(self.id, n, snapshot, timeout, isolated, network, allow, replay_inflight, processes)
        result = await self._http.call(call)
        children = [AsyncSandbox(info.id, _http=_AsyncHTTP(self._http.config), info=info) for info in result.sandboxes]
        return children, result

    async def snapshots(self) -> List[SnapshotInfo]:
        """The snapshot tree this sandbox belongs to, ordered by creation time."""
        return await self._http.call(_core.sandbox_snapshots(self.id))

    async def evaluate(
        self,
        cmd: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> CommandResult:
        """Run ``cmd`` without leaving a side effect on the sandbox (see
        :meth:`branchbox.Sandbox.evaluate`)."""
        body = _core.command_body(cmd, False, cwd, env, timeout, None)
        return await self._http.call(_core.evaluate(self.id, body))

    # -- ports

    async def get_host(self, port: int) -> str:
        """The address on the host (``"127.0.0.1:41234"``) whose connections reach a server
        listening on ``port`` inside the sandbox: open ``http://{host}/``. E2B's name; see
        :meth:`branchbox.Sandbox.get_host`."""
        return (await self.open_port(port)).host

    async def open_port(self, port: int) -> PortInfo:
        """Open ``port`` (1..65535) to the host, or return the forwarder opened before: its
        :class:`PortInfo` (``host``, ``url``). See :meth:`branchbox.Sandbox.open_port`."""
        return await self._http.call(_core.open_port(self.id, port))

    async def ports(self) -> List[PortInfo]:
        """The ports open to the host, by port."""
        return await self._http.call(_core.list_ports(self.id))

    async def close_port(self, port: int) -> bool:
        """Close the forwarder of ``port``; False if it was not open."""
        return await self._http.call(_core.close_port(self.id, port))

    async def close(self) -> None:
        """Release the HTTP connection (the sandbox keeps running)."""
        await self._http.close()

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.kill()
        except SandboxError:
            if exc_type is None:
                raise
        finally:
            await self.close()

    def __repr__(self) -> str:
        return "AsyncSandbox(id=%r)" % self.id


# ----------------------------------------------------------------------------- network


class AsyncNetwork:
    """``sbx.network`` (async): the sandbox's network mode, allow entries and limits (see
    :class:`branchbox.sandbox_sync.Network`)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def get(self) -> NetworkInfo:
        """The sandbox's network now: mode, allow entries, address, proxy, limits, bytes received and sent."""
        return await self._sbx._http.call(_core.get_network(self._sbx.id))

    async def update(
        self,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        limits: Union[NetLimits, Mapping[str, Any], None] = None,
    ) -> NetworkInfo:
        """Change the mode, the allow entries and/or the limits (None: unchanged; ``allow=[]``
        clears the entries; ``limits`` replaces the limits as a whole, ``{}`` lifts them);
        connections made from then on follow the new rules. See
        :meth:`branchbox.sandbox_sync.Network.update`."""
        return await self._sbx._http.call(_core.update_network(self._sbx.id, network, allow, limits))

    def __repr__(self) -> str:
        return "AsyncNetwork(sandbox=%r)" % self._sbx.id


# ----------------------------------------------------------------------------- commands


class AsyncCommandHandle:
    """A background command: ``await wait()`` for its result or ``await kill()`` it."""

    def __init__(self, sandbox: AsyncSandbox, pid: int) -> None:
        self.sandbox = sandbox
        self.pid = pid

    async def wait(self, timeout: Optional[float] = None) -> CommandResult:
        return await self.sandbox.commands.wait(self.pid, timeout=timeout)

    async def kill(self, signal: int = 9) -> bool:
        return await self.sandbox.commands.kill(self.pid, signal=signal)

    def __repr__(self) -> str:
        return "AsyncCommandHandle(sandbox=%r, pid=%d)" % (self.sandbox.id, self.pid)


class AsyncCommands:
    """``sbx.commands`` (async)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def run(
        self,
        cmd: Union[str, Sequence[str]],
        *,
        background: bool = False,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = 60,
        stdin: Union[str, bytes, None] = None,
        on_stdout: Optional[Callable[[str], Any]] = None,
        on_stderr: Optional[Callable[[str], Any]] = None,
        user: Optional[str] = None,
    ) -> Any:
        """See :meth:`branchbox.sandbox_sync.Commands.run`."""
        body = _core.command_body(cmd, background, cwd, env, timeout, stdin, user)
        http = self._sbx._http
        if background:
            if on_stdout is not None or on_stderr is not None:
                raise InvalidArgumentError(
                    "on_stdout/on_stderr stream foreground commands only; "
                    "get a background command's output with handle.wait()"
                )
            return AsyncCommandHandle(self._sbx, await http.call(_core.run_command(self._sbx.id, body)))
        if on_stdout is None and on_stderr is None:
            return await http.call(_core.run_command(self._sbx.id, body))
        stream = _core.CommandStream(on_stdout, on_stderr)
        async with http.events(_core.stream_command(self._sbx.id, body)) as events:
            async for event in events:
                todo = stream.handle(event)
                if todo is not None:
                    await _maybe_await(todo[0](todo[1]))
        return stream.finish()

    async def list(self) -> List[ProcessInfo]:
        return await self._sbx._http.call(_core.list_processes(self._sbx.id))

    async def kill(self, pid: int, signal: int = 9) -> bool:
        return await self._sbx._http.call(_core.kill_process(self._sbx.id, pid, signal))

    async def wait(self, pid: int, timeout: Optional[float] = None) -> CommandResult:
        return await self._sbx._http.call(_core.wait_process(self._sbx.id, pid, timeout))


# ----------------------------------------------------------------------------- files


class AsyncByteStream:
    """Async iterator over a file's content; ``aclose()`` it (or ``async with``) when done early."""

    def __init__(self, response: httpx.Response, http: _AsyncHTTP, chunk_size: Optional[int] = None) -> None:
        self._response = response
        self._http = http
        self._it = response.aiter_bytes(chunk_size)

    def __aiter__(self) -> "AsyncByteStream":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            await self.aclose()
            raise
        except httpx.TransportError as err:
            await self.aclose()
            raise _core.transport_error(err, self._http.config.url) from None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        await self._response.aclose()

    async def __aenter__(self) -> "AsyncByteStream":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


async def _aiter_file(fileobj: Any, chunk_size: int = _core.CHUNK_SIZE) -> AsyncIterator[bytes]:
    while True:
        chunk = await _maybe_await(fileobj.read(chunk_size))
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


async def _aiter_chunks(data: Any) -> AsyncIterator[bytes]:
    if hasattr(data, "__aiter__"):
        async for chunk in data:
            if chunk:
                yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)
    else:
        for chunk in _core.iter_chunks(data):
            yield chunk


class AsyncFiles:
    """``sbx.files`` / ``vol.files`` (async; see :class:`branchbox.sandbox_sync.Files`)."""

    def __init__(self, http: _AsyncHTTP, prefix: str) -> None:
        self._http = http
        self._prefix = prefix

    async def read(self, path: str, format: str = "text") -> Any:
        """Content as ``str`` (``"text"``), ``bytes`` or an :class:`AsyncByteStream`."""
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentError("format must be 'text', 'bytes' or 'stream'")
        response = await self._http.send(_core.read_file(self._prefix, path), stream=True)
        stream = AsyncByteStream(response, self._http)
        if format == "stream":
            return stream
        async with stream:
            data = await stream.read()
        return data.decode("utf-8", "replace") if format == "text" else data

    async def write(
        self, path: str, data: Any, mode: Union[int, str, None] = None, *, user: Optional[str] = None
    ) -> EntryInfo:
        """Write str, bytes, a (sync or async) file object or an (async) iterable of chunks."""
        payload = _core.bytes_payload(data)
        if payload is not None:
            content: Any = payload
            length: Optional[int] = len(payload)
        elif _core.is_filelike(data):
            content, length = _aiter_file(data), _core.remaining_length(data)
        elif hasattr(data, "__aiter__") or hasattr(data, "__iter__"):
            content, length = _aiter_chunks(data), None
        else:
            raise InvalidArgumentError("data must be str, bytes, a file object or an iterable of bytes")
        return await self._http.call(_core.write_file(self._prefix, path, content, mode, length, user))

    async def list(self, path: str = "/", depth: int = 1) -> List[EntryInfo]:
        return await self._http.call(_core.list_dir(self._prefix, path, depth))

    async def stat(self, path: str) -> EntryInfo:
        return await self._http.call(_core.stat(self._prefix, path))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFoundError:
            return False
        return True

    async def make_dir(self, path: str, parents: bool = True, *, user: Optional[str] = None) -> EntryInfo:
        """Create ``path`` (with ``parents``, missing parents too and no error if it exists);
        ``user``: new directories belong to that sandbox user (default root)."""
        return await self._http.call(_core.make_dir(self._prefix, path, parents, user))

    async def remove(self, path: str, recursive: bool = False) -> bool:
        return await self._http.call(_core.remove(self._prefix, path, recursive))

    async def rename(self, src: str, dst: str) -> EntryInfo:
        return await self._http.call(_core.rename(self._prefix, src, dst))

    async def upload(
        self,
        local_path: Union[str, "os.PathLike[str]"],
        remote_path: str,
        mode: Union[int, str, None] = None,
        *,
        user: Optional[str] = None,
    ) -> EntryInfo:
        """Stream a local file to ``remote_path`` (``user``: as for :meth:`write`)."""
        with open(local_path, "rb") as f:
            return await self.write(remote_path, f, mode=mode, user=user)

    async def download(self, remote_path: str, local_path: Union[str, "os.PathLike[str]"]) -> str:
        """Stream ``remote_path`` to ``local_path``; returns the local path."""
        stream = await self.read(remote_path, format="stream")
        async with stream:
            with open(local_path, "wb") as f:
                async for chunk in stream:
                    f.write(chunk)
        return os.fspath(local_path)


# ----------------------------------------------------------------------------- sessions


class AsyncSession:
    """A stateful ``python`` or ``shell`` session (async)."""

    def __init__(self, sandbox: AsyncSandbox, info: SessionInfo) -> None:
        self.sandbox = sandbox
        self.info = info
        self.id = info.id
        self.kind = info.kind

    @property
    def pid(self) -> Optional[int]:
        return self.info.pid

    async def run(
        self, code: str, *, timeout: Optional[float] = 60, env: Optional[Mapping[str, str]] = None
    ) -> Union[Execution, ShellResult]:
        return await self.sandbox._http.call(_core.run_session(self.sandbox.id, self.id, code, timeout, self.kind, env))

    async def kill(self) -> bool:
        try:
            return await self.sandbox._http.call(_core.kill_session(self.sandbox.id, self.id))
        except NotFoundError:
            return False

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.kill()

    def __repr__(self) -> str:
        return "AsyncSession(id=%r, kind=%r)" % (self.id, self.kind)


class AsyncSessions:
    """``sbx.sessions`` (async)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def create(
        self, kind: str = "python", *, cwd: Optional[str] = None, env: Optional[Mapping[str, str]] = None
    ) -> AsyncSession:
        info = await self._sbx._http.call(_core.create_session(self._sbx.id, kind, cwd, env))
        if not info.kind:
            info.kind = kind
        return AsyncSession(self._sbx, info)

    async def list(self) -> List[SessionInfo]:
        return await self._sbx._http.call(_core.list_sessions(self._sbx.id))


# ----------------------------------------------------------------------------- volumes


class AsyncVolume:
    """A persistent volume (the async mirror of :class:`branchbox.Volume`)::

        async with await AsyncVolume.create("ws") as vol:
            await vol.files.write("/notes.txt", "hi")
    """

    def __init__(self, volume_id: str, *, _http: _AsyncHTTP, info: Optional[VolumeInfo] = None) -> None:
        self.id = volume_id
        self._http = _http
        self._info = info
        self.files = AsyncFiles(_http, _core.volume_files(volume_id))

    @classmethod
    async def create(
        cls,
        name: Optional[str] = None,
        access: str = "rwo",
        quota_mb: Optional[int] = None,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> "AsyncVolume":
        """Create an empty volume (see :meth:`branchbox.Volume.create`)."""
        http = _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            info = await http.call(_core.create_volume(name, access, quota_mb))
        except BaseException:
            await http.close()
            raise
        return cls(info.id, _http=http, info=info)

    @classmethod
    async def connect(
        cls,
        id_or_name: str,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> "AsyncVolume":
        """Attach to an existing volume by id or name (:class:`NotFoundError` if unknown)."""
        http = _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport))
        try:
            info = await http.call(_core.get_volume(id_or_name))
        except BaseException:
            await http.close()
            raise
        return cls(info.id or id_or_name, _http=http, info=info)

    @classmethod
    async def list(
        cls,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> List[VolumeInfo]:
        """All volumes."""
        async with _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport)) as http:
            return await http.call(_core.list_volumes())

    async def info(self) -> VolumeInfo:
        info = await self._http.call(_core.get_volume(self.id))
        self._info = info
        return info

    async def delete(self) -> bool:
        """Delete the volume and its snapshots (:class:`ConflictError` while it is mounted)."""
        return await self._http.call(_core.delete_volume(self.id))

    async def snapshot(self, label: Optional[str] = None) -> VolumeSnapshotInfo:
        """Record the volume's files as they are now (metadata only: no file is copied)."""
        return await self._http.call(_core.volume_snapshot(self.id, label))

    async def snapshots(self) -> List[VolumeSnapshotInfo]:
        return await self._http.call(_core.list_volume_snapshots(self.id))

    async def delete_snapshot(self, snapshot: Union[str, VolumeSnapshotInfo]) -> bool:
        return await self._http.call(_core.delete_volume_snapshot(self.id, snapshot))

    async def restore(self, snapshot: Union[str, VolumeSnapshotInfo]) -> VolumeInfo:
        """Return the volume's files to ``snapshot``."""
        info = await self._http.call(_core.restore_volume(self.id, snapshot))
        self._info = info
        return info

    async def fork(
        self, name: Optional[str] = None, snapshot: Union[str, VolumeSnapshotInfo, None] = None
    ) -> "AsyncVolume":
        """A copy-on-write copy of the volume (see :meth:`branchbox.Volume.fork`), with its own
        connection: close it when done."""
        info = await self._http.call(_core.fork_volume(self.id, name, snapshot))
        return AsyncVolume(info.id, _http=_AsyncHTTP(self._http.config), info=info)

    async def sync(self) -> VolumeInfo:
        """Make what was written so far durable (see :meth:`branchbox.Volume.sync`)."""
        info = await self._http.call(_core.sync_volume(self.id))
        self._info = info
        return info

    async def close(self) -> None:
        """Release the HTTP connection (the volume stays)."""
        await self._http.close()

    async def __aenter__(self) -> "AsyncVolume":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return "AsyncVolume(id=%r)" % self.id


# ----------------------------------------------------------------------------- daemon-wide clients

_D = TypeVar("_D", bound="_AsyncDaemonClient")


class _AsyncDaemonClient:
    """What the async daemon-wide clients (images, snapshots, templates, pool) share: a
    connection, released by :meth:`close` or at the end of an ``async with`` block."""

    def __init__(
        self,
        *,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        self._http = _AsyncHTTP(ConnectionConfig(daemon, token, request_timeout, transport))

    async def _follow(self, call: _core.Call, stream: Any, on_progress: Optional[Callable[[Any], Any]]) -> Any:
        """Follow a build's progress events (``stream``: an image or template stream) to its
        result, handing each progress to ``on_progress`` (awaited if it is a coroutine)."""
        async with self._http.events(call) as events:
            async for event in events:
                progress = stream.handle(event)
                if progress is not None and on_progress is not None:
                    await _maybe_await(on_progress(progress))
        return stream.finish()

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self: _D) -> _D:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


# ----------------------------------------------------------------------------- images


class AsyncImages(_AsyncDaemonClient):
    """Root filesystem images (async mirror of :class:`branchbox.Images`)."""

    async def list(self) -> List[ImageInfo]:
        return await self._http.call(_core.list_images())

    async def build(
        self,
        name: str = "base",
        *,
        suite: Optional[str] = None,
        packages: Optional[Sequence[str]] = None,
        on_progress: Optional[Callable[[ImageProgress], Any]] = None,
    ) -> ImageInfo:
        return await self._follow(_core.build_image(name, suite, packages), _core.ImageStream(), on_progress)

    async def import_(
        self, name: str, path: str, *, on_progress: Optional[Callable[[ImageProgress], Any]] = None
    ) -> ImageInfo:
        return await self._follow(_core.import_image(name, path), _core.ImageStream(), on_progress)

    async def remove(self, name: str) -> bool:
        return await self._http.call(_core.remove_image(name))


# ----------------------------------------------------------------------------- snapshots


class AsyncSnapshots(_AsyncDaemonClient):
    """Snapshots known to the daemon (the mirror of :class:`branchbox.Snapshots`)."""

    async def list(self, sandbox: Union[str, AsyncSandbox, None] = None) -> List[SnapshotInfo]:
        """All snapshots, or the tree ``sandbox`` belongs to; ordered by creation time."""
        if sandbox is None:
            return await self._http.call(_core.list_snapshots())
        return await self._http.call(_core.sandbox_snapshots(_core.sandbox_ref(sandbox)))

    async def get(self, sid: Union[str, SnapshotInfo]) -> SnapshotInfo:
        return await self._http.call(_core.get_snapshot(sid))

    async def delete(self, sid: Union[str, SnapshotInfo], subtree: bool = False) -> bool:
        """Delete a snapshot; ``subtree=True`` also deletes its descendants."""
        return await self._http.call(_core.delete_snapshot(sid, subtree))

    async def offload(self, sid: Union[str, SnapshotInfo]) -> OffloadResult:
        """Move the snapshot's live sessions into process images on disk now (see the sync
        ``Snapshots.offload``)."""
        return await self._http.call(_core.offload_snapshot(sid))

    async def push(self, sid: Union[str, SnapshotInfo]) -> PushResult:
        """Make the snapshot durable: its layers and session state (process images; live
        sessions are dumped first, as :meth:`offload` does) go to the daemon's object store,
        deduplicated against what is there, and its record to the metadata store. Any daemon
        sharing both can then ``pull`` it or ``Sandbox.create(snapshot=sid)`` from it. Pushing
        again is a no-op."""
        return await self._http.call(_core.push_snapshot(sid))

    async def pull(self, sid: Union[str, SnapshotInfo]) -> PullResult:
        """Bring a pushed snapshot onto this daemon (``Sandbox.create(snapshot=sid)`` does
        this by itself)."""
        return await self._http.call(_core.pull_snapshot(sid))

    async def list_remote(self) -> List[RemoteSnapshotInfo]:
        """The snapshots recorded in the metadata store (pushed by any daemon)."""
        return await self._http.call(_core.list_remote_snapshots())

    async def list_paused_remote(self) -> List[RemotePausedInfo]:
        """The sandboxes paused with ``pause(push=True)`` on any daemon, waiting to be resumed."""
        return await self._http.call(_core.list_remote_paused())

    async def delete_remote(self, sid: Union[str, SnapshotInfo]) -> bool:
        """Delete a pushed snapshot's record; its objects go with the next :meth:`store_gc`.
        A local copy stays (node-local again)."""
        return await self._http.call(_core.delete_remote_snapshot(sid))

    async def store_gc(self, grace_seconds: Optional[float] = None) -> StoreGcResult:
        """Delete the object store's objects no snapshot record reaches and that are older
        than ``grace_seconds`` (default: the daemon's ``--store-gc-grace``)."""
        return await self._http.call(_core.store_gc(grace_seconds))

    async def gc(
        self, keep: Sequence[Union[str, SnapshotInfo]], sandbox: Union[str, AsyncSandbox, None] = None
    ) -> GcResult:
        """Delete every snapshot (of ``sandbox``'s tree, or all) that is neither in ``keep``
        nor an ancestor of a kept one."""
        return await self._http.call(_core.gc_snapshots(keep, sandbox))


# ----------------------------------------------------------------------------- templates


class AsyncTemplates(_AsyncDaemonClient):
    """Warm templates (the async mirror of :class:`branchbox.Templates`)."""

    async def build(
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
        """Build (or replace) template ``name`` (see :meth:`branchbox.Templates.build`).
        ``volumes`` (as for ``Sandbox.create``) are mounted while the recipe runs; sandboxes
        created from the template get copy-on-write forks of the branching ones. ``network``/
        ``allow``: the recipe's sandbox's network and the default of sandboxes created from it."""
        recipe = _core.template_recipe(
            name, image, run, code, env, cwd, cpu, memory_mb, pids, metadata, timeout, shells, volumes,
            network=network, allow=allow,
        )
        return await self._follow(_core.build_template(recipe), _core.TemplateStream(), on_progress)

    async def list(self) -> List[TemplateInfo]:
        return await self._http.call(_core.list_templates())

    async def get(self, name: Union[str, TemplateInfo]) -> TemplateInfo:
        return await self._http.call(_core.get_template(name))

    async def remove(self, name: Union[str, TemplateInfo]) -> bool:
        return await self._http.call(_core.remove_template(name))


# ----------------------------------------------------------------------------- warm pool


class AsyncPool(_AsyncDaemonClient):
    """The daemon's warm pool (the async mirror of :class:`branchbox.Pool`)."""

    async def stats(self) -> PoolStats:
        return await self._http.call(_core.pool_stats())

    async def set(self, image: str, min: int, max: Optional[int] = None) -> PoolStats:  # noqa: A002
        return await self._http.call(_core.set_pool(image, min, max))

    async def drain(self, image: str) -> PoolStats:
        return await self.set(image, 0, 0)
