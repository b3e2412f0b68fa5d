"""Request building and response parsing shared by the sync and async SDKs.

Everything that knows about the daemon's HTTP API lives here: each endpoint is a
function returning a :class:`Call` (method, path, query, JSON body, how to parse the
answer, how long it may take).  ``sandbox_sync`` and ``sandbox_async`` only execute
calls, so their surfaces stay mirrored without duplicating API knowledge.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import socket
import stat as stat_mod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import httpx

from . import exceptions as exc
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
    ProcessInfo,
    PauseResult,
    OffloadResult,
    PullResult,
    PushResult,
    RemotePausedInfo,
    RemoteSnapshotInfo,
    StoreGcResult,
    ResumeResult,
    RollbackResult,
    SandboxInfo,
    SessionInfo,
    ShellResult,
    SnapshotInfo,
    TemplateInfo,
    TemplateProgress,
    VolumeInfo,
    VolumeMount,
    VolumeSnapshotInfo,
)

# Extra seconds the HTTP read timeout allows beyond an operation's own timeout, so the
# daemon has time to kill the command and report ``timed_out``.
TIMEOUT_GRACE = 15.0
# Read timeout between two events of an image build/import progress stream.
IMAGE_STREAM_TIMEOUT = 900.0
CHUNK_SIZE = 1 << 20
# Most children one fork may create (the daemon answers 400 above).
MAX_FORK = 64
# The TCP ports a sandbox port may be (the daemon answers 400 outside them).
MIN_PORT, MAX_PORT = 1, 65535
# Seconds a template recipe's commands and code may each take unless the recipe says
# otherwise (the daemon's default); the build stream may be silent that long.
TEMPLATE_STEP_TIMEOUT = 600.0

StdinT = Union[str, bytes, None]
CmdT = Union[str, Sequence[str]]
#: ``Sandbox.create(volumes=...)``: ``{path: volume}`` or a list of mounts (:func:`volume_mounts`).
VolumesT = Union[Mapping[str, Any], Sequence[Any], None]
Callback = Callable[[str], Any]


@dataclass
class Call:
    """One HTTP request to the daemon and how to interpret its answer.

    ``op_timeout`` is the operation's own timeout (the HTTP read timeout becomes at least
    ``op_timeout + TIMEOUT_GRACE``); ``unbounded`` disables the read timeout.
    """

    method: str
    path: str
    params: Optional[Dict[str, Any]] = None
    json: Any = None
    parse: Optional[Callable[[Any], Any]] = None
    op_timeout: Optional[float] = None
    unbounded: bool = False
    headers: Dict[str, str] = field(default_factory=dict)
    content: Any = None

    def http_timeout(self, request_timeout: Optional[float]) -> Any:
        """The ``timeout=`` to give httpx for this call."""
        if self.unbounded:
            return None
        if self.op_timeout is not None:
            if self.op_timeout <= 0 or request_timeout is None:
                return None
            t = max(float(request_timeout), float(self.op_timeout) + TIMEOUT_GRACE)
            return httpx.Timeout(t, connect=min(t, 10.0))
        return httpx.USE_CLIENT_DEFAULT


# ----------------------------------------------------------------------------- errors


def parse_json(content: bytes) -> Any:
    if not content:
        return None
    try:
        return json.loads(content)
    except ValueError:
        raise exc.SandboxError(
            "daemon sent an invalid JSON answer: %r" % content[:200], code="protocol"
        ) from None


def error_for_status(status_code: int, content: bytes) -> exc.SandboxError:
    try:
        body: Any = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    return exc.error_from_response(status_code, body)


class SocketConnectError(ConnectionError):
    """The daemon's unix socket did not take a connection (the SDK's unix-socket fast path;
    the cause is chained)."""


def transport_error(err: Exception, url: str) -> exc.SandboxError:
    """Map a transport failure (httpx's, or the standard library's on the unix-socket fast
    path: a socket timeout, a refused connection, a closed one) to a branchbox exception."""
    if isinstance(err, (httpx.TimeoutException, TimeoutError, socket.timeout)):
        return exc.TimeoutError(
            "request to branchboxd at %s timed out (%s); raise request_timeout if the "
            "operation is expected to take longer" % (url, type(err).__name__),
            code="timeout",
        )
    if isinstance(err, (httpx.ConnectError, SocketConnectError)):
        return exc.DaemonUnavailableError(
            "cannot reach branchboxd at %s (%s): run `branchbox daemon start` or set "
            "BRANCHBOX_URL to where the daemon listens" % (url, err),
            code="connect",
        )
    return exc.DaemonUnavailableError(
        "connection to branchboxd at %s failed: %s: %s" % (url, type(err).__name__, err),
        code="connection_lost",
    )


# ----------------------------------------------------------------------------- NDJSON


class NDJSONDecoder:
    """Incremental decoder for ``application/x-ndjson`` bodies."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> List[Any]:
        self._buf += chunk
        if b"\n" not in chunk:
            return []
        *lines, rest = bytes(self._buf).split(b"\n")
        self._buf = bytearray(rest)
        return [self._decode(line) for line in lines if line.strip()]

    def close(self) -> List[Any]:
        rest, self._buf = bytes(self._buf), bytearray()
        return [self._decode(rest)] if rest.strip() else []

    @staticmethod
    def _decode(line: bytes) -> Any:
        try:
            return json.loads(line)
        except ValueError:
            raise exc.SandboxError(
                "daemon sent a malformed stream line: %r" % line[:200], code="protocol"
            ) from None


def _stream_error(event: Mapping[str, Any]) -> exc.SandboxError:
    return exc.error_from_response(int(event.get("status") or 500), dict(event))


class CommandStream:
    """Folds ``/commands/stream`` events into a :class:`CommandResult`.

    :meth:`handle` returns ``(callback, data)`` when a user callback must be invoked
    (the sync/async layers call or await it).
    """

    def __init__(self, on_stdout: Optional[Callback] = None, on_stderr: Optional[Callback] = None):
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.pid: Optional[int] = None
        self._stdout: List[str] = []
        self._stderr: List[str] = []
        self.result: Optional[CommandResult] = None

    def handle(self, event: Any) -> Optional[Tuple[Callback, str]]:
        if not isinstance(event, dict):
            return None
        kind = event.get("type")
        if kind == "start":
            self.pid = event.get("pid")
        elif kind in ("stdout", "stderr"):
            data = event.get("data") or ""
            if kind == "stdout":
                self._stdout.append(data)
                cb = self.on_stdout
            else:
                self._stderr.append(data)
                cb = self.on_stderr
            if cb is not None and data:
                return cb, data
        elif kind == "exit":
            fields = {k: v for k, v in event.items() if k != "type"}
            fields.setdefault("pid", self.pid)
            if self._stdout or not fields.get("stdout"):
                fields["stdout"] = "".join(self._stdout)
            if self._stderr or not fields.get("stderr"):
                fields["stderr"] = "".join(self._stderr)
            self.result = CommandResult.from_dict(fields)
        elif kind == "error":
            raise _stream_error(event)
        return None

    def finish(self) -> CommandResult:
        if self.result is None:
            raise exc.SandboxError(
                "command stream ended without an exit event", code="connection_lost"
            )
        return self.result


class ImageStream:
    """Folds an image build/import progress stream into the final :class:`ImageInfo`."""

    def __init__(self) -> None:
        self.image: Optional[ImageInfo] = None

    def handle(self, event: Any) -> Optional[ImageProgress]:
        if not isinstance(event, dict):
            return None
        kind = event.get("type")
        if kind == "progress":
            return ImageProgress.from_dict(event)
        if kind == "done":
            self.image = ImageInfo.from_dict(event.get("image"))
        elif kind == "error":
            raise _stream_error(event)
        return None

    def finish(self) -> ImageInfo:
        if self.image is None:
            raise exc.SandboxError("image stream ended without a done event", code="connection_lost")
        return self.image


class TemplateStream:
    """Folds a template build's progress stream into the final :class:`TemplateInfo`."""

    def __init__(self) -> None:
        self.template: Optional[TemplateInfo] = None

    def handle(self, event: Any) -> Optional[TemplateProgress]:
        if not isinstance(event, dict):
            return None
        kind = event.get("type")
        if kind == "progress":
            return TemplateProgress.from_dict(event)
        if kind == "done":
            self.template = TemplateInfo.from_dict(event.get("template"))
        elif kind == "error":
            raise _stream_error(event)
        return None

    def finish(self) -> TemplateInfo:
        if self.template is None:
            raise exc.SandboxError("template build stream ended without a done event", code="connection_lost")
        return self.template


# ----------------------------------------------------------------------------- helpers


def _seg(value: Any) -> str:
    return quote(str(value), safe="")


def _sbx(sandbox_id: str) -> str:
    if not sandbox_id:
        raise exc.InvalidArgumentError("sandbox id must not be empty")
    return "/v1/sandboxes/" + _seg(sandbox_id)


def _compact(body: Mapping[str, Any]) -> Dict[str, Any]:
    """Drop unset (None) fields so the daemon applies its defaults."""
    return {k: v for k, v in body.items() if v is not None}


def _list_of(key: str, model: Any) -> Callable[[Any], List[Any]]:
    def parse(data: Any) -> List[Any]:
        items = (data or {}).get(key) or []
        return [model.from_dict(x) for x in items]

    return parse


def _flag(key: str) -> Callable[[Any], bool]:
    def parse(data: Any) -> bool:
        return bool((data or {}).get(key, True))

    return parse


def parse_run_result(data: Any) -> Union[Execution, ShellResult]:
    """A session run of unknown kind: a ShellResult if it has an exit code, else an Execution."""
    if isinstance(data, dict) and "exit_code" in data and "result" not in data:
        return ShellResult.from_dict(data)
    return Execution.from_dict(data)


def _env(env: Optional[Mapping[str, Any]]) -> Optional[Dict[str, str]]:
    if env is None:
        return None
    return {str(k): str(v) for k, v in env.items()}


def user_name(user: Any) -> Optional[str]:
    """``user`` (a user of the sandbox's /etc/passwd, e.g. ``"user"``) if it is a non-empty
    string, None for None (root: the field is not sent), else :class:`InvalidArgumentError`.
    Whether the sandbox has that user is the daemon's to check (it answers 400 naming it)."""
    if user is None:
        return None
    if not isinstance(user, str) or not user.strip():
        raise exc.InvalidArgumentError("user must be a non-empty user name (str), not %r" % (user,))
    return user


def format_mode(mode: Union[int, str, None]) -> Optional[str]:
    """``0o644`` / ``"644"`` / ``"0644"`` -> ``"0644"`` (octal, as the API expects)."""
    if mode is None:
        return None
    if isinstance(mode, bool):
        raise exc.InvalidArgumentError("mode must be an int like 0o644 or an octal string")
    if isinstance(mode, int):
        value = mode
    else:
        try:
            value = int(str(mode), 8)
        except ValueError:
            raise exc.InvalidArgumentError("mode %r is not an octal permission string" % (mode,)) from None
    if not 0 <= value <= 0o7777:
        raise exc.InvalidArgumentError("mode %o is out of range (0..07777)" % value)
    return "%04o" % value


# ----------------------------------------------------------------------------- daemon


def health() -> Call:
    return Call("GET", "/v1/health")


# ----------------------------------------------------------------------------- sandboxes


def create_sandbox(
    image: Optional[str] = "base",
    cpu: Optional[float] = None,
    memory_mb: Optional[int] = None,
    pids: Optional[int] = None,
    env: Optional[Mapping[str, Any]] = None,
    cwd: Optional[str] = None,
    timeout: Optional[float] = 300,
    network: Optional[str] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    template: Any = None,
    lifecycle: Optional[Mapping[str, Any]] = None,
    snapshot: Any = None,
    volumes: VolumesT = None,
    allow: Optional[Sequence[str]] = None,
    proxy: bool = False,
    net_limits: Any = None,
    proxy_record: Optional[bool] = None,
    sudo: Optional[bool] = None,
) -> Call:
    """``image=None`` means ``"base"``, or the template's image when ``template`` is given
    (the daemon refuses an image other than the template's); with ``snapshot``, the
    snapshot's image, limits and cwd are kept (giving them is an error). ``volumes`` (see
    :func:`volume_mounts`) is sent only when given.

    ``network=None`` means ``"none"``, or with ``snapshot`` or ``template`` the snapshot's or
    template's mode (not sent); ``allow`` (see :func:`allow_entries`) is sent only when given.
    ``proxy`` (the daemon's HTTP(S) proxy in the sandbox) is sent only when True,
    ``proxy_record`` only when given. ``net_limits``
    (see :func:`net_limits_body`) is sent only when given (``{}``: none, e.g. not the snapshot's
    or template's). ``sudo`` is sent only when given."""
    if not isinstance(proxy, bool):
        raise _NetworkError("proxy must be True or False, not %r" % (proxy,))
    if proxy_record is not None and not isinstance(proxy_record, bool):
        raise _NetworkError("proxy_record must be True, False or None, not %r" % (proxy_record,))
    if sudo is not None and not isinstance(sudo, bool):
        raise exc.InvalidArgumentError("sudo must be True, False or None, not %r" % (sudo,))
    limits = net_limits_body(net_limits, "net_limits") if net_limits is not None else None
    name = template_name(template) if template is not None else None
    sid = snapshot_id(snapshot) if snapshot is not None else None
    if image is None and name is None and sid is None:
        image = "base"
    if network is not None:
        network = network_mode(network)
    elif sid is None and name is None:
        network = "none"
    body = _compact(
        {
            "image": image,
            "template": name,
            "snapshot": sid,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "pids": pids,
            "env": _env(env),
            "cwd": cwd,
            "timeout": timeout,
            "network": network,
            "allow": allow_entries(allow) if allow is not None else None,
            "proxy": True if proxy else None,
            "proxy_record": proxy_record,
            "net_limits": limits,
            "metadata": _env(metadata),
            "lifecycle": dict(lifecycle) if lifecycle is not None else None,
            "volumes": volume_mounts(volumes) if volumes is not None else None,
            "sudo": sudo,
        }
    )
    return Call("POST", "/v1/sandboxes", json=body, parse=SandboxInfo.from_dict)


def list_sandboxes(metadata: Optional[Mapping[str, Any]] = None) -> Call:
    params = {"metadata.%s" % k: str(v) for k, v in (metadata or {}).items()} or None
    return Call("GET", "/v1/sandboxes", params=params, parse=_list_of("sandboxes", SandboxInfo))


def get_sandbox(sandbox_id: str) -> Call:
    return Call("GET", _sbx(sandbox_id), parse=SandboxInfo.from_dict)


def set_timeout(sandbox_id: str, seconds: float) -> Call:
    return Call(
        "POST", _sbx(sandbox_id) + "/timeout", json={"timeout": seconds}, parse=SandboxInfo.from_dict
    )


PAUSE_MODES = ("full", "filesystem")


def pause_sandbox(sandbox_id: str, push: bool = False, mode: str = "full") -> Call:
    if not isinstance(push, bool):
        raise exc.InvalidArgumentError("push must be True or False, not %r" % (push,))
    if mode not in PAUSE_MODES:
        raise exc.InvalidArgumentError("mode must be one of %s, not %r" % (", ".join(PAUSE_MODES), mode))
    body = _compact({"push": True if push else None, "mode": mode if mode != "full" else None}) or None
    return Call("POST", _sbx(sandbox_id) + "/pause", json=body, parse=PauseResult.from_dict, unbounded=push)


def resume_sandbox(sandbox_id: str, timeout: Optional[float] = None, reboot: bool = False) -> Call:
    if not isinstance(reboot, bool):
        raise exc.InvalidArgumentError("reboot must be True or False, not %r" % (reboot,))
    body = _compact({"timeout": timeout, "reboot": True if reboot else None})
    return Call("POST", _sbx(sandbox_id) + "/resume", json=body, parse=ResumeResult.from_dict)


def kill_sandbox(sandbox_id: str) -> Call:
    return Call("DELETE", _sbx(sandbox_id), parse=_flag("killed"))


# ----------------------------------------------------------------------------- commands


def command_body(
    cmd: CmdT,
    background: bool = False,
    cwd: Optional[str] = None,
    env: Optional[Mapping[str, Any]] = None,
    timeout: Optional[float] = 60,
    stdin: StdinT = None,
    user: Optional[str] = None,
) -> Dict[str, Any]:
    """``user``: run as that user of the sandbox (its uid/gid, HOME/USER/LOGNAME, its home as
    the default cwd); sent only when given (default: root)."""
    body: Dict[str, Any] = {}
    if isinstance(cmd, str):
        if not cmd.strip():
            raise exc.InvalidArgumentError("cmd must not be empty")
        body["cmd"] = cmd
    elif isinstance(cmd, (list, tuple)):
        if not cmd:
            raise exc.InvalidArgumentError("cmd argv list must not be empty")
        body["args"] = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in cmd]
    else:
        raise exc.InvalidArgumentError("cmd must be a string or a list of arguments")
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = _env(env)
    if timeout is not None:
        body["timeout"] = timeout
    if isinstance(stdin, str):
        body["stdin"] = stdin
    elif isinstance(stdin, (bytes, bytearray, memoryview)):
        body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode("ascii")
    elif stdin is not None:
        raise exc.InvalidArgumentError("stdin must be str or bytes")
    name = user_name(user)
    if name is not None:
        body["user"] = name
    if background:
        body["background"] = True
    return body


def run_command(sandbox_id: str, body: Dict[str, Any]) -> Call:
    if body.get("background"):
        return Call(
            "POST", _sbx(sandbox_id) + "/commands", json=body, parse=lambda d: int(d["pid"])
        )
    return Call(
        "POST",
        _sbx(sandbox_id) + "/commands",
        json=body,
        parse=CommandResult.from_dict,
        op_timeout=body.get("timeout"),
    )


def stream_command(sandbox_id: str, body: Dict[str, Any]) -> Call:
    return Call(
        "POST",
        _sbx(sandbox_id) + "/commands/stream",
        json={k: v for k, v in body.items() if k != "background"},
        op_timeout=body.get("timeout"),
        headers={"Accept": "application/x-ndjson"},
    )


def list_processes(sandbox_id: str) -> Call:
    return Call("GET", _sbx(sandbox_id) + "/commands", parse=_list_of("processes", ProcessInfo))


def wait_process(sandbox_id: str, pid: int, timeout: Optional[float] = None) -> Call:
    return Call(
        "POST",
        "%s/commands/%d/wait" % (_sbx(sandbox_id), int(pid)),
        json=_compact({"timeout": timeout}),
        parse=CommandResult.from_dict,
        op_timeout=timeout,
        unbounded=timeout is None,
    )


def kill_process(sandbox_id: str, pid: int, signal: int = 9) -> Call:
    return Call(
        "POST",
        "%s/commands/%d/kill" % (_sbx(sandbox_id), int(pid)),
        json={"signal": int(signal)},
        parse=_flag("killed"),
    )


# ----------------------------------------------------------------------------- sessions & code


#: Session kinds: a python interpreter, a shell, node (the image needs it), node compiling
#: typescript (the image needs node and the ``typescript`` package).
SESSION_KINDS = ("python", "shell", "javascript", "typescript")


def create_session(
    sandbox_id: str,
    kind: str = "python",
    cwd: Optional[str] = None,
    env: Optional[Mapping[str, Any]] = None,
) -> Call:
    if kind not in SESSION_KINDS:
        raise exc.InvalidArgumentError(
            "session kind must be 'python', 'shell', 'javascript' or 'typescript', not %r" % (kind,)
        )
    body = {"kind": kind, "cwd": cwd, "env": _env(env) or {}}
    return Call("POST", _sbx(sandbox_id) + "/sessions", json=body, parse=SessionInfo.from_dict)


def list_sessions(sandbox_id: str) -> Call:
    return Call("GET", _sbx(sandbox_id) + "/sessions", parse=_list_of("sessions", SessionInfo))


def kill_session(sandbox_id: str, session_id: str) -> Call:
    return Call("DELETE", "%s/sessions/%s" % (_sbx(sandbox_id), _seg(session_id)), parse=_flag("killed"))


def run_env(env: Optional[Mapping[str, str]]) -> Optional[Dict[str, str]]:
    """A run's env, checked: str names and values (the daemon checks the names are shell
    identifiers)."""
    if env is None:
        return None
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise exc.InvalidArgumentError("env must map str names to str values, not %r" % (env,))
    return dict(env) or None


def run_session(
    sandbox_id: str,
    session_id: str,
    code: str,
    timeout: Optional[float] = 60,
    kind: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Call:
    parse: Callable[[Any], Any] = parse_run_result
    if kind == "shell":
        parse = ShellResult.from_dict
    elif kind in SESSION_KINDS:  # the kinds whose runs answer as python's do
        parse = Execution.from_dict
    return Call(
        "POST",
        "%s/sessions/%s/run" % (_sbx(sandbox_id), _seg(session_id)),
        json=_compact({"code": code, "timeout": timeout, "env": run_env(env)}),
        parse=parse,
        op_timeout=timeout,
    )


def run_code(
    sandbox_id: str,
    code: str,
    language: str = "python",
    timeout: Optional[float] = 60,
    env: Optional[Mapping[str, str]] = None,
) -> Call:
    return Call(
        "POST",
        _sbx(sandbox_id) + "/code",
        json=_compact({"code": code, "language": language, "timeout": timeout, "env": run_env(env)}),
        parse=Execution.from_dict,
        op_timeout=timeout,
    )


# ----------------------------------------------------------------------------- ports


class _PortError(exc.InvalidArgumentError, ValueError):
    """A port outside 1..65535, refused before any request: an :class:`InvalidArgumentError`
    like the SDK's other client-side checks, and a ``ValueError``."""


def port_number(port: Any) -> int:
    """``port`` if it is a TCP port (an int in 1..65535), else :class:`InvalidArgumentError`
    (also a ``ValueError``)."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise _PortError("port must be an int from %d to %d, not %r" % (MIN_PORT, MAX_PORT, port))
    if not MIN_PORT <= port <= MAX_PORT:
        raise _PortError("port must be from %d to %d, got %d" % (MIN_PORT, MAX_PORT, port))
    return int(port)


def _port(sandbox_id: str, port: Any) -> str:
    return "%s/ports/%d" % (_sbx(sandbox_id), port_number(port))


def open_port(sandbox_id: str, port: Any) -> Call:
    """Opens the port's forwarder on first ask; later asks give the same answer."""
    return Call("GET", _port(sandbox_id, port), parse=PortInfo.from_dict)


def list_ports(sandbox_id: str) -> Call:
    return Call("GET", _sbx(sandbox_id) + "/ports", parse=_list_of("ports", PortInfo))


def close_port(sandbox_id: str, port: Any) -> Call:
    # {"removed": false}: the port was not open.
    return Call("DELETE", _port(sandbox_id, port), parse=_flag("removed"))


# ----------------------------------------------------------------------------- network

#: A sandbox's network modes: loopback only (the default), only what its allow entries list,
#: or anything but the host, the daemon, other sandboxes and link-local/metadata addresses.
NETWORK_MODES = ("none", "allowlist", "open")


class _NetworkError(exc.InvalidArgumentError, ValueError):
    """A network mode, allow list or proxy flag of the wrong shape, refused before any request: an
    :class:`InvalidArgumentError` like the SDK's other client-side checks, and a ``ValueError``."""


def network_mode(network: Any) -> str:
    """``network`` if it is one of :data:`NETWORK_MODES`, else :class:`InvalidArgumentError`
    (also a ``ValueError``)."""
    if not isinstance(network, str) or network not in NETWORK_MODES:
        raise _NetworkError('network must be "none", "allowlist" or "open", not %r' % (network,))
    return network


def allow_entries(allow: Any) -> List[str]:
    """``allow`` as a list of strings (a list or tuple of them; ``[]`` clears), else
    :class:`InvalidArgumentError` (also a ``ValueError``). The entries' syntax (names,
    ``*.`` wildcards, IPv4 addresses or CIDRs, ``:port`` or ``:low-high``) is the daemon's to
    check: it answers 400 naming the bad entry."""
    if isinstance(allow, (str, bytes)):
        raise _NetworkError("allow must be a list of entries, not a single string: give [%r]" % (allow,))
    if not isinstance(allow, (list, tuple)):
        raise _NetworkError("allow must be a list of entries (str), not %s" % type(allow).__name__)
    for entry in allow:
        if not isinstance(entry, str):
            raise _NetworkError("every allow entry must be a string, got %r" % (entry,))
    return list(allow)


def network_body(network: Any = None, allow: Any = None) -> Dict[str, Any]:
    """``{"network", "allow"}`` with the fields given (None: not sent)."""
    return _compact(
        {
            "network": network_mode(network) if network is not None else None,
            "allow": allow_entries(allow) if allow is not None else None,
        }
    )


#: Bounds of :attr:`NetLimits.max_connections` and :attr:`NetLimits.bandwidth_mbps` (the daemon
#: answers 400 outside them).
MAX_CONNECTIONS = (1, 65536)
BANDWIDTH_MBPS = (0.1, 100000.0)
NET_LIMIT_KEYS = ("max_connections", "bandwidth_mbps")


def net_limits_body(limits: Any, what: str = "limits") -> Dict[str, Any]:
    """A :class:`NetLimits` or a dict of its keys as the API's limits object: keys that are None
    are left out (``{}``: no limits). A wrong type, an unknown key or a value out of
    :data:`MAX_CONNECTIONS` / :data:`BANDWIDTH_MBPS` is :class:`InvalidArgumentError` (also a
    ``ValueError``)."""
    if isinstance(limits, NetLimits):
        items: Dict[str, Any] = {"max_connections": limits.max_connections, "bandwidth_mbps": limits.bandwidth_mbps}
    elif isinstance(limits, Mapping):
        unknown = sorted(str(k) for k in limits if k not in NET_LIMIT_KEYS)
        if unknown:
            raise _NetworkError(
                "%s takes the keys max_connections and bandwidth_mbps, not %s" % (what, ", ".join(unknown))
            )
        items = dict(limits)
    else:
        raise _NetworkError(
            "%s must be a NetLimits or a dict (max_connections, bandwidth_mbps), not %s" % (what, type(limits).__name__)
        )
    conns, mbps = items.get("max_connections"), items.get("bandwidth_mbps")
    if conns is not None:
        lo, hi = MAX_CONNECTIONS
        if isinstance(conns, bool) or not isinstance(conns, int) or not lo <= conns <= hi:
            raise _NetworkError("max_connections must be an int from %d to %d, not %r" % (lo, hi, conns))
    if mbps is not None:
        lo, hi = BANDWIDTH_MBPS
        if (
            isinstance(mbps, bool)
            or not isinstance(mbps, (int, float))
            or not math.isfinite(mbps)
            or not lo <= mbps <= hi
        ):
            raise _NetworkError("bandwidth_mbps must be a number from %g to %g (Mbit/s), not %r" % (lo, hi, mbps))
        mbps = float(mbps)
    return _compact({"max_connections": conns, "bandwidth_mbps": mbps})


def get_network(sandbox_id: str) -> Call:
    return Call("GET", _sbx(sandbox_id) + "/network", parse=NetworkInfo.from_dict)


def update_network(sandbox_id: str, network: Any = None, allow: Any = None, limits: Any = None) -> Call:
    """Fields left None stay as they are; ``allow=[]`` clears the entries; ``network="none"``
    alone clears them too (the daemon's rule). ``limits`` (see :func:`net_limits_body`) replaces
    the limits as a whole (a cap it leaves out is lifted; ``{}`` lifts them all)."""
    body = network_body(network, allow)
    if limits is not None:
        body["limits"] = net_limits_body(limits)
    if not body:
        raise _NetworkError("give network, allow and/or limits to change (sbx.network.get() reads them)")
    return Call("PUT", _sbx(sandbox_id) + "/network", json=body, parse=NetworkInfo.from_dict)


# ----------------------------------------------------------------------------- files

# The file builders take the files API's URL prefix (:func:`sandbox_files` or
# :func:`volume_files`): sandboxes and volumes share its shapes and query parameters.


def sandbox_files(sandbox_id: str) -> str:
    """URL prefix of a sandbox's files API."""
    return _sbx(sandbox_id) + "/files"


def read_file(files: str, path: str) -> Call:
    return Call(
        "GET",
        files,
        params={"path": path},
        headers={"Accept": "application/octet-stream"},
    )


def write_file(
    files: str,
    path: str,
    content: Any,
    mode: Union[int, str, None] = None,
    length: Optional[int] = None,
    user: Optional[str] = None,
) -> Call:
    """``user``: the file (and parent directories made) belong to that sandbox user; sent only
    when given (sandbox files only: the daemon answers 400 for a volume's)."""
    params = {"path": path}
    m = format_mode(mode)
    if m is not None:
        params["mode"] = m
    name = user_name(user)
    if name is not None:
        params["user"] = name
    headers = {"Content-Type": "application/octet-stream"}
    if length is not None:
        headers["Content-Length"] = str(length)
    return Call(
        "PUT",
        files,
        params=params,
        headers=headers,
        content=content,
        parse=EntryInfo.from_dict,
    )


def list_dir(files: str, path: str, depth: int = 1) -> Call:
    return Call(
        "GET",
        files + "/list",
        params={"path": path, "depth": int(depth)},
        parse=_list_of("entries", EntryInfo),
    )


def stat(files: str, path: str) -> Call:
    return Call("GET", files + "/stat", params={"path": path}, parse=EntryInfo.from_dict)


def make_dir(files: str, path: str, parents: bool = True, user: Optional[str] = None) -> Call:
    """``user``: as for :func:`write_file`."""
    return Call(
        "POST",
        files + "/mkdir",
        json=_compact({"path": path, "parents": bool(parents), "user": user_name(user)}),
        parse=EntryInfo.from_dict,
    )


def rename(files: str, src: str, dst: str) -> Call:
    return Call(
        "POST",
        files + "/rename",
        json={"from": src, "to": dst},
        parse=EntryInfo.from_dict,
    )


def remove(files: str, path: str, recursive: bool = False) -> Call:
    return Call(
        "DELETE",
        files,
        params={"path": path, "recursive": "true" if recursive else "false"},
        parse=_flag("removed"),
    )


def bytes_payload(data: Any) -> Optional[bytes]:
    """``data`` as bytes if it is str/bytes-like, else None (it is streamed)."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return None


def remaining_length(fileobj: Any) -> Optional[int]:
    """Bytes left in a regular binary file object (for Content-Length), else None."""
    if isinstance(fileobj, io.TextIOBase):
        return None
    try:
        st = os.fstat(fileobj.fileno())
        if not stat_mod.S_ISREG(st.st_mode):
            return None
        return max(st.st_size - fileobj.tell(), 0)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def iter_file(fileobj: Any, chunk_size: int = CHUNK_SIZE) -> Iterable[bytes]:
    while True:
        chunk = fileobj.read(chunk_size)
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


def iter_chunks(data: Iterable[Any]) -> Iterable[bytes]:
    for chunk in data:
        if chunk:
            yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


def is_filelike(data: Any) -> bool:
    return callable(getattr(data, "read", None))


# ----------------------------------------------------------------------------- images


def list_images() -> Call:
    return Call("GET", "/v1/images", parse=_list_of("images", ImageInfo))


def build_image(name: str = "base", suite: Optional[str] = None, packages: Optional[Sequence[str]] = None) -> Call:
    body = _compact({"name": name, "suite": suite, "packages": list(packages) if packages is not None else None})
    return Call(
        "POST",
        "/v1/images/build",
        json=body,
        op_timeout=IMAGE_STREAM_TIMEOUT,
        headers={"Accept": "application/x-ndjson"},
    )


def import_image(name: str, path: str) -> Call:
    return Call(
        "POST",
        "/v1/images/import",
        json={"name": name, "path": os.fspath(path)},
        op_timeout=IMAGE_STREAM_TIMEOUT,
        headers={"Accept": "application/x-ndjson"},
    )


def remove_image(name: str) -> Call:
    return Call("DELETE", "/v1/images/" + _seg(name), parse=_flag("removed"))


# ----------------------------------------------------------------------------- snapshots


def _id_string(value: Any, what: str, expected: str) -> str:
    """``value`` if it is a non-blank string; ``expected`` says what else it may have been."""
    if not isinstance(value, str):
        raise exc.InvalidArgumentError("%s must be %s, not %s" % (what, expected, type(value).__name__))
    if not value.strip():
        raise exc.InvalidArgumentError("%s id must not be empty" % what)
    return value


def snapshot_id(snapshot: Any, what: str = "snapshot") -> str:
    """The id of ``snapshot`` (an id string or a :class:`SnapshotInfo`)."""
    if isinstance(snapshot, SnapshotInfo):
        snapshot = snapshot.id
    return _id_string(snapshot, what, "a snapshot id (str) or a SnapshotInfo")


def _own_id(obj: Any) -> Any:
    """``obj.id`` when it is a string (a client object or an info model), else ``obj``."""
    oid = getattr(obj, "id", None)
    return oid if isinstance(oid, str) else obj


def sandbox_ref(sandbox: Any, what: str = "sandbox") -> str:
    """The id of ``sandbox`` (an id string, a Sandbox/AsyncSandbox or a SandboxInfo)."""
    return _id_string(_own_id(sandbox), what, "a sandbox id (str) or a Sandbox")


def _snap(sid: Any) -> str:
    return "/v1/snapshots/" + _seg(snapshot_id(sid))


PROCESSES = ("sessions", "all", "keepable", "none")


def _check_processes(processes: Optional[str]) -> bool:
    """Whether ``processes`` (checked) keeps background processes (a slow call: no read timeout)."""
    if processes is not None and processes not in PROCESSES:
        raise exc.InvalidArgumentError(
            'processes must be "sessions", "all", "keepable" or "none", not %r' % (processes,)
        )
    return processes in ("all", "keepable")


def checkpoint(sandbox_id: str, label: Optional[str] = None, processes: Optional[str] = None) -> Call:
    if label is not None and not isinstance(label, str):
        raise exc.InvalidArgumentError("label must be a string, not %s" % type(label).__name__)
    return Call(
        "POST",
        _sbx(sandbox_id) + "/checkpoint",
        json=_compact({"label": label, "processes": processes}),
        parse=SnapshotInfo.from_dict,
        unbounded=_check_processes(processes),
    )


def rollback(sandbox_id: str, snapshot: Any, lazy_pages: Optional[bool] = None) -> Call:
    if lazy_pages is not None and not isinstance(lazy_pages, bool):
        raise exc.InvalidArgumentError("lazy_pages must be True, False or None, not %r" % (lazy_pages,))
    body = _compact({"snapshot": snapshot_id(snapshot), "lazy_pages": lazy_pages})
    return Call("POST", _sbx(sandbox_id) + "/rollback", json=body, parse=RollbackResult.from_dict)


def fork(
    sandbox_id: str,
    count: int = 1,
    snapshot: Any = None,
    timeout: Optional[float] = None,
    isolated: bool = False,
    network: Optional[str] = None,
    allow: Optional[Sequence[str]] = None,
    replay_inflight: bool = False,
    processes: Optional[str] = None,
) -> Call:
    """``network``/``allow``: the children's (see :func:`network_body`; default: the parent's
    at the fork, or with ``snapshot`` the snapshot's). ``replay_inflight``: the children get the
    answers to the parent's proxied requests in flight at the checkpoint (not with ``snapshot``).
    ``processes``: what the checkpoint taken for the fork keeps (not with ``snapshot``)."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise exc.InvalidArgumentError("n (the number of children) must be an int, not %r" % (count,))
    if not 1 <= count <= MAX_FORK:
        raise exc.InvalidArgumentError("n (the number of children) must be in 1..%d, got %d" % (MAX_FORK, count))
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise exc.InvalidArgumentError("timeout (the children's TTL) must be a number >= 0 (0 = none), got %r" % (timeout,))
    if not isinstance(isolated, bool):
        raise exc.InvalidArgumentError("isolated must be True or False, not %r" % (isolated,))
    if not isinstance(replay_inflight, bool):
        raise exc.InvalidArgumentError("replay_inflight must be True or False, not %r" % (replay_inflight,))
    if replay_inflight and snapshot is not None:
        raise exc.InvalidArgumentError(
            "replay_inflight hands on the requests in flight at a checkpoint the fork takes now: leave snapshot out"
        )
    trees = _check_processes(processes)
    if trees and snapshot is not None:
        raise exc.InvalidArgumentError(
            "processes is for a checkpoint the fork takes now (a named snapshot gives the children the processes "
            "it kept): leave snapshot or processes out"
        )
    body = _compact(
        {
            "count": count,
            "snapshot": snapshot_id(snapshot) if snapshot is not None else None,
            "timeout": timeout,
            # Sent only when set: the default (live copies of the sessions) is the daemon's.
            "isolated": True if isolated else None,
            "replay_inflight": True if replay_inflight else None,
            "processes": processes,
            **network_body(network, allow),
        }
    )
    return Call("POST", _sbx(sandbox_id) + "/fork", json=body, parse=ForkResult.from_dict, unbounded=trees)


def evaluate(sandbox_id: str, body: Dict[str, Any]) -> Call:
    """``body`` is a :func:`command_body` (foreground, no stdin)."""
    return Call(
        "POST",
        _sbx(sandbox_id) + "/evaluate",
        json=body,
        parse=CommandResult.from_dict,
        op_timeout=body.get("timeout"),
    )


def sandbox_snapshots(sandbox_id: str) -> Call:
    return Call("GET", _sbx(sandbox_id) + "/snapshots", parse=_list_of("snapshots", SnapshotInfo))


def list_snapshots() -> Call:
    return Call("GET", "/v1/snapshots", parse=_list_of("snapshots", SnapshotInfo))


def get_snapshot(sid: Any) -> Call:
    return Call("GET", _snap(sid), parse=SnapshotInfo.from_dict)


def delete_snapshot(sid: Any, subtree: bool = False) -> Call:
    # The contract answers 204 (no body): _flag then reads True.
    return Call(
        "DELETE",
        _snap(sid),
        params={"subtree": "true" if subtree else "false"},
        parse=_flag("removed"),
    )


def offload_snapshot(sid: Any) -> Call:
    return Call("POST", _snap(sid) + "/offload", parse=OffloadResult.from_dict, unbounded=True)


def push_snapshot(sid: Any) -> Call:
    return Call("POST", _snap(sid) + "/push", parse=PushResult.from_dict, unbounded=True)


def pull_snapshot(sid: Any) -> Call:
    return Call("POST", _snap(sid) + "/pull", parse=PullResult.from_dict, unbounded=True)


def list_remote_snapshots() -> Call:
    return Call("GET", "/v1/remote/snapshots", parse=_list_of("snapshots", RemoteSnapshotInfo))


def list_remote_paused() -> Call:
    return Call("GET", "/v1/remote/snapshots", parse=_list_of("paused", RemotePausedInfo))


def delete_remote_snapshot(sid: Any) -> Call:
    return Call("DELETE", "/v1/remote/snapshots/" + _seg(snapshot_id(sid)), parse=_flag("removed"))


def store_gc(grace_seconds: Optional[float] = None) -> Call:
    if grace_seconds is not None and (not isinstance(grace_seconds, (int, float)) or grace_seconds < 0):
        raise exc.InvalidArgumentError("grace_seconds must be a number >= 0")
    body = _compact({"grace_seconds": grace_seconds})
    return Call("POST", "/v1/remote/gc", json=body, parse=StoreGcResult.from_dict, unbounded=True)


def gc_snapshots(keep: Any, sandbox: Any = None) -> Call:
    if keep is None:
        raise exc.InvalidArgumentError(
            "keep must list the snapshots to keep (an empty list deletes every snapshot in scope)"
        )
    if isinstance(keep, (str, SnapshotInfo)):
        keep = [keep]
    try:
        items = list(keep)
    except TypeError:
        raise exc.InvalidArgumentError(
            "keep must be a list of snapshot ids or SnapshotInfo, not %s" % type(keep).__name__
        ) from None
    body = _compact(
        {
            "keep": [snapshot_id(k, "keep entry") for k in items],
            "sandbox": sandbox_ref(sandbox) if sandbox is not None else None,
        }
    )
    return Call("POST", "/v1/snapshots/gc", json=body, parse=GcResult.from_dict)


# ----------------------------------------------------------------------------- warm pool


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise exc.InvalidArgumentError("%s must be an int >= 0, not %r" % (what, value))
    return value


def pool_stats() -> Call:
    return Call("GET", "/v1/pool", parse=PoolStats.from_dict)


def set_pool(image: str, min: int, max: Optional[int] = None) -> Call:  # noqa: A002 - the API's names
    """Keep ``min`` ready sandboxes of ``image``; recycle killed ones while fewer than ``max``
    (default: the daemon's, ``min``) are ready. ``min = max = 0`` drains the pool."""
    if not isinstance(image, str) or not image.strip():
        raise exc.InvalidArgumentError("image must be a non-empty image name, not %r" % (image,))
    lo = _count(min, "min")
    hi = _count(max, "max") if max is not None else None
    if hi is not None and lo > hi:
        raise exc.InvalidArgumentError("min (%d) must not exceed max (%d)" % (lo, hi))
    return Call("PUT", "/v1/pool/" + _seg(image), json=_compact({"min": lo, "max": hi}), parse=PoolStats.from_dict)


# ----------------------------------------------------------------------------- templates

#: Keys of a template recipe (the body of ``POST /v1/templates``).
RECIPE_KEYS = (
    "name", "image", "run", "code", "env", "cwd", "cpu", "memory_mb", "pids", "metadata", "timeout", "shells", "volumes",
    "network", "allow",
)


def template_name(template: Any, what: str = "template") -> str:
    """The name of ``template`` (a name or a :class:`TemplateInfo`)."""
    if isinstance(template, TemplateInfo):
        template = template.name
    if not isinstance(template, str):
        raise exc.InvalidArgumentError(
            "%s must be a template name (str) or a TemplateInfo, not %s" % (what, type(template).__name__)
        )
    if not template.strip():
        raise exc.InvalidArgumentError("%s name must not be empty" % what)
    return template


def template_recipe(
    name: str,
    image: Optional[str] = None,
    run: Union[str, Sequence[str], None] = None,
    code: Optional[str] = None,
    env: Optional[Mapping[str, Any]] = None,
    cwd: Optional[str] = None,
    cpu: Optional[float] = None,
    memory_mb: Optional[int] = None,
    pids: Optional[int] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    timeout: Optional[float] = None,
    shells: Optional[int] = None,
    volumes: VolumesT = None,
    network: Optional[str] = None,
    allow: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """The JSON body of a template build (unset fields are left to the daemon's defaults).

    ``run`` is a list of shell commands (a single string is one command). ``volumes`` (see
    :func:`volume_mounts`) is sent only when given. ``network``/``allow`` (see
    :func:`network_body`: checked as for ``create_sandbox``) are the recipe's sandbox's and the
    default of sandboxes created from the template; sent only when given.
    """
    name = template_name(name)
    if isinstance(run, str):
        run = [run]
    if run is not None:
        try:
            cmds = list(run)
        except TypeError:
            raise exc.InvalidArgumentError("run must be a list of shell commands, not %s" % type(run).__name__) from None
        for c in cmds:
            if not isinstance(c, str) or not c.strip():
                raise exc.InvalidArgumentError("every run entry must be a non-empty shell command string, got %r" % (c,))
        run = cmds
    if code is not None and not isinstance(code, str):
        raise exc.InvalidArgumentError("code must be a string of python code, not %s" % type(code).__name__)
    if shells is not None:
        _count(shells, "shells")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise exc.InvalidArgumentError("timeout (seconds per recipe step) must be a number > 0, got %r" % (timeout,))
    return _compact(
        {
            "name": name,
            "image": image,
            "run": run,
            "code": code,
            "env": _env(env),
            "cwd": cwd,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "pids": pids,
            "metadata": _env(metadata),
            "timeout": timeout,
            "shells": shells,
            "volumes": volume_mounts(volumes) if volumes is not None else None,
            **network_body(network, allow),
        }
    )


def build_template(recipe: Mapping[str, Any]) -> Call:
    """``recipe`` is a :func:`template_recipe` body."""
    step = float(recipe.get("timeout") or TEMPLATE_STEP_TIMEOUT)
    return Call(
        "POST",
        "/v1/templates",
        json=dict(recipe),
        # Between two events the daemon may run one recipe step (up to its timeout).
        op_timeout=max(IMAGE_STREAM_TIMEOUT, step),
        headers={"Accept": "application/x-ndjson"},
    )


def list_templates() -> Call:
    return Call("GET", "/v1/templates", parse=_list_of("templates", TemplateInfo))


def get_template(template: Any) -> Call:
    return Call("GET", "/v1/templates/" + _seg(template_name(template)), parse=TemplateInfo.from_dict)


def remove_template(template: Any) -> Call:
    return Call("DELETE", "/v1/templates/" + _seg(template_name(template)), parse=_flag("removed"))


# ----------------------------------------------------------------------------- volumes

#: A volume's access modes: mounted by one sandbox at a time ("rwo"), by any number read-only
#: ("rox"), or by any number read-write, all sharing one copy that never branches ("rwx").
VOLUME_ACCESS = ("rwo", "rox", "rwx")
_MOUNT_KEYS = ("volume", "path", "read_only", "branch")


def volume_ref(volume: Any, what: str = "volume") -> str:
    """The id (or name) of ``volume``: a string, a Volume/AsyncVolume or a VolumeInfo."""
    return _id_string(_own_id(volume), what, "a volume id or name (str) or a Volume")


def volume_snapshot_id(snapshot: Any, what: str = "snapshot") -> str:
    """The id of a volume snapshot (an id string or a :class:`VolumeSnapshotInfo`)."""
    if isinstance(snapshot, VolumeSnapshotInfo):
        snapshot = snapshot.id
    return _id_string(snapshot, what, "a volume snapshot id (str) or a VolumeSnapshotInfo")


def _vol(volume: Any) -> str:
    return "/v1/volumes/" + _seg(volume_ref(volume))


def volume_files(volume: Any) -> str:
    """URL prefix of a volume's files API (the sandbox files API's shapes)."""
    return _vol(volume) + "/files"


def _volume_name(name: Optional[str]) -> Optional[str]:
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise exc.InvalidArgumentError("a volume name must be a non-empty string, not %r" % (name,))
    return name


def _mount(volume: Any, path: Any, read_only: Any = False, branch: Any = True) -> Dict[str, Any]:
    """One entry of a create body's ``volumes``."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise exc.InvalidArgumentError("a volume's mount path must be an absolute path, not %r" % (path,))
    for key, value in (("read_only", read_only), ("branch", branch)):
        if not isinstance(value, bool):
            raise exc.InvalidArgumentError("%s of the mount at %s must be True or False, not %r" % (key, path, value))
    return {"volume": volume_ref(volume, "volume (mounted at %s)" % path), "path": path, "read_only": read_only, "branch": branch}


def _mount_at(path: Any, volume: Any) -> Dict[str, Any]:
    """``{path: volume}``: a VolumeMount's own path, when set, must be ``path``."""
    if not isinstance(volume, VolumeMount):
        return _mount(volume, path)
    if volume.path and volume.path != path:
        raise exc.InvalidArgumentError("the VolumeMount under %r says path %r: give one path" % (path, volume.path))
    return _mount(volume.volume, path, volume.read_only, volume.branch)


def _mount_item(item: Any) -> Dict[str, Any]:
    """One item of a list of mounts: a VolumeMount, or a dict of its keys (``volume`` and
    ``path`` required)."""
    if isinstance(item, VolumeMount):
        return _mount(item.volume, item.path, item.read_only, item.branch)
    if not isinstance(item, Mapping):
        raise exc.InvalidArgumentError("a mount must be a VolumeMount or a dict, not %s" % type(item).__name__)
    unknown = sorted(set(item) - set(_MOUNT_KEYS))
    if unknown or "volume" not in item or "path" not in item:
        raise exc.InvalidArgumentError(
            "a mount dict has the keys volume, path (both required), read_only and branch; got %s" % sorted(item)
        )
    return _mount(item["volume"], item["path"], item.get("read_only", False), item.get("branch", True))


def volume_mounts(volumes: Any) -> List[Dict[str, Any]]:
    """The ``volumes`` of a sandbox create body from ``{path: volume}`` (a Volume, an id or
    name, a VolumeInfo or a :class:`VolumeMount`) or from a list of VolumeMount / dicts of its
    keys. Mounts are read-write (``read_only=False``) and ``branch=True`` unless they say
    otherwise; two mounts at one path are an error."""
    if isinstance(volumes, Mapping):
        mounts = [_mount_at(path, volume) for path, volume in volumes.items()]
    elif isinstance(volumes, (list, tuple)):
        mounts = [_mount_item(item) for item in volumes]
    else:
        raise exc.InvalidArgumentError(
            "volumes must be a {path: volume} dict or a list of VolumeMount, not %s" % type(volumes).__name__
        )
    paths = [m["path"] for m in mounts]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise exc.InvalidArgumentError("more than one volume mounted at %s" % ", ".join(twice))
    return mounts


def create_volume(name: Optional[str] = None, access: str = "rwo", quota_mb: Optional[int] = None) -> Call:
    if access not in VOLUME_ACCESS:
        raise exc.InvalidArgumentError(
            'access must be "rwo" (one sandbox mounts it at a time), "rox" (read-only mounts) or "rwx" '
            "(read-write mounts sharing one copy), not %r" % (access,)
        )
    if quota_mb is not None and (isinstance(quota_mb, bool) or not isinstance(quota_mb, int) or quota_mb < 1):
        raise exc.InvalidArgumentError("quota_mb must be an int >= 1 (MiB) or None (no quota), not %r" % (quota_mb,))
    body = _compact({"name": _volume_name(name), "access": access, "quota_mb": quota_mb})
    return Call("POST", "/v1/volumes", json=body, parse=VolumeInfo.from_dict)


def list_volumes() -> Call:
    return Call("GET", "/v1/volumes", parse=_list_of("volumes", VolumeInfo))


def get_volume(volume: Any) -> Call:
    return Call("GET", _vol(volume), parse=VolumeInfo.from_dict)


def delete_volume(volume: Any) -> Call:
    return Call("DELETE", _vol(volume), parse=_flag("removed"))


def volume_snapshot(volume: Any, label: Optional[str] = None) -> Call:
    if label is not None and not isinstance(label, str):
        raise exc.InvalidArgumentError("label must be a string, not %s" % type(label).__name__)
    return Call("POST", _vol(volume) + "/snapshots", json=_compact({"label": label}), parse=VolumeSnapshotInfo.from_dict)


def list_volume_snapshots(volume: Any) -> Call:
    return Call("GET", _vol(volume) + "/snapshots", parse=_list_of("snapshots", VolumeSnapshotInfo))


def delete_volume_snapshot(volume: Any, snapshot: Any) -> Call:
    path = "%s/snapshots/%s" % (_vol(volume), _seg(volume_snapshot_id(snapshot)))
    return Call("DELETE", path, parse=_flag("removed"))


def restore_volume(volume: Any, snapshot: Any) -> Call:
    body = {"snapshot": volume_snapshot_id(snapshot)}
    return Call("POST", _vol(volume) + "/restore", json=body, parse=VolumeInfo.from_dict)


def fork_volume(volume: Any, name: Optional[str] = None, snapshot: Any = None) -> Call:
    body = _compact(
        {
            "name": _volume_name(name),
            "snapshot": volume_snapshot_id(snapshot) if snapshot is not None else None,
        }
    )
    return Call("POST", _vol(volume) + "/fork", json=body, parse=VolumeInfo.from_dict)


def sync_volume(volume: Any) -> Call:
    # Uploads everything written since the last sync: no read timeout.
    return Call("POST", _vol(volume) + "/sync", parse=VolumeInfo.from_dict, unbounded=True)
