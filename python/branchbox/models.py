"""Plain data returned by the SDK (dataclasses built from the daemon's JSON).

Every model has ``from_dict`` (unknown keys are ignored, missing ones default) and keeps
the original JSON object in ``raw`` (excluded from repr and equality).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Type, TypeVar

from .exceptions import CommandExitError

__all__ = [
    "SandboxInfo",
    "CommandResult",
    "ProcessInfo",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "ShellResult",
    "SessionInfo",
    "PortInfo",
    "NetworkInfo",
    "NetLimits",
    "ImageInfo",
    "ImageProgress",
    "SnapshotSession",
    "SnapshotInfo",
    "RollbackResult",
    "PauseResult",
    "OffloadResult",
    "ResumeResult",
    "ForkResult",
    "GcResult",
    "PoolImageStats",
    "PoolStats",
    "TemplateInfo",
    "TemplateProgress",
    "VolumeMount",
    "VolumeInfo",
    "VolumeSnapshotInfo",
]

T = TypeVar("T", bound="_Model")


class _Model:
    @classmethod
    def from_dict(cls: Type[T], data: Optional[Dict[str, Any]]) -> T:
        data = data if isinstance(data, dict) else {}
        kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data and f.name != "raw"}  # type: ignore[arg-type]
        obj = cls(**kwargs)
        object.__setattr__(obj, "raw", dict(data))
        return obj


def _raw() -> Any:
    return field(default_factory=dict, repr=False, compare=False)


@dataclass
class VolumeMount(_Model):
    """A volume mounted in a sandbox: an entry of ``Sandbox.create(volumes=[...])``, of
    :attr:`SandboxInfo.volumes`, of :attr:`TemplateInfo.volumes` and of :attr:`VolumeInfo.mounts`.

    ``volume`` is the volume's id (a name is accepted in a create) and ``path`` an absolute
    path in the sandbox. With ``branch`` (the default) the volume branches with the sandbox: a
    checkpoint snapshots it, a rollback restores it, a fork gives each child a copy-on-write
    fork of it; ``branch=False`` shares it as it is (e.g. a cache). ``sandbox`` is set in
    :attr:`VolumeInfo.mounts` only: the sandbox that mounts it.
    """

    volume: str = ""
    path: str = ""
    read_only: bool = False
    branch: bool = True
    sandbox: Optional[str] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class SandboxInfo(_Model):
    """``GET /v1/sandboxes/{id}``. ``state`` is ``"running"``, ``"paused"`` or ``"dead"``."""

    id: str = ""
    image: str = ""
    state: str = ""
    created_at: Optional[float] = None
    expires_at: Optional[float] = None
    cpu: Optional[float] = None
    memory_mb: Optional[int] = None
    pids: Optional[int] = None
    #: Its network mode now: ``"none"`` (loopback only), ``"allowlist"`` or ``"open"``
    #: (``sbx.network``; see :class:`NetworkInfo`).
    network: Optional[str] = None
    #: Its allow entries now (``Sandbox.create(allow=...)``, ``sbx.network.update(allow=...)``).
    allow: List[str] = field(default_factory=list)
    #: Its IPv4 address on the sandboxes' bridge (None in mode ``"none"``).
    address: Optional[str] = None
    #: The URL of the daemon's HTTP(S) proxy as seen inside it (``"http://127.0.0.1:3128"``,
    #: also in its ``HTTP_PROXY``/``HTTPS_PROXY``), or None without one (``Sandbox.create(proxy=True)``).
    proxy: Optional[str] = None
    #: Bytes it received and sent through its network interface (loopback and ports reached
    #: from the host are not counted).
    net_rx_bytes: int = 0
    net_tx_bytes: int = 0
    env: Dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    metadata: Dict[str, str] = field(default_factory=dict)
    init_pid: Optional[int] = None
    oom_killed: bool = False
    memory_bytes: Optional[int] = None
    pids_current: Optional[int] = None
    #: A fork child whose sessions are live copies: the sandbox it is nested in.
    nested_in: Optional[str] = None
    #: ``{"on_timeout": "kill" | "pause", "auto_resume": bool}``.
    lifecycle: Dict[str, Any] = field(default_factory=dict)
    #: When the sandbox was paused (state ``"paused"``).
    paused_at: Optional[float] = None
    #: The volumes mounted in it (``Sandbox.create(volumes=...)``).
    volumes: List[VolumeMount] = field(default_factory=list)
    #: Setuid programs (``sudo``) work for its other users (``Sandbox.create(sudo=True)``).
    sudo: bool = False
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "SandboxInfo":
        obj = super().from_dict(data)
        obj.allow = list(obj.allow or [])
        obj.volumes = [m if isinstance(m, VolumeMount) else VolumeMount.from_dict(m) for m in obj.volumes or []]
        return obj

    @property
    def is_running(self) -> bool:
        return self.state == "running"

    @property
    def is_paused(self) -> bool:
        return self.state == "paused"


@dataclass
class CommandResult(_Model):
    """Result of a foreground command (or of waiting for a background one).

    ``exit_code`` is None when the command was killed by a signal or timed out.
    """

    pid: Optional[int] = None
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    oom_killed: bool = False
    duration: Optional[float] = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    raw: Dict[str, Any] = _raw()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> "CommandResult":
        """Return self, or raise :class:`CommandExitError` unless the exit code is 0."""
        if not self.ok:
            raise CommandExitError(self)
        return self


@dataclass
class ProcessInfo(_Model):
    """A background process started with ``commands.run(..., background=True)``."""

    pid: int = 0
    cmd: str = ""
    running: bool = False
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    started_at: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class EntryInfo(_Model):
    """A filesystem entry. ``type`` is ``file``, ``dir``, ``symlink`` or ``other``.

    ``uid``/``gid`` are its owner and group as ids inside the sandbox (0 from a daemon that
    does not send them)."""

    name: str = ""
    path: str = ""
    type: str = ""
    size: int = 0
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime: Optional[float] = None
    #: Last access and last status change (seconds since the epoch; None from a daemon that
    #: does not send them).
    atime: Optional[float] = None
    ctime: Optional[float] = None
    symlink_target: Optional[str] = None
    raw: Dict[str, Any] = _raw()

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @property
    def is_file(self) -> bool:
        return self.type == "file"


@dataclass
class ExecutionError(_Model):
    """An exception raised by code run in a python session."""

    name: str = ""
    value: str = ""
    traceback: str = ""
    raw: Dict[str, Any] = _raw()

    def __str__(self) -> str:
        return "%s: %s" % (self.name, self.value) if self.value else self.name


@dataclass
class Execution(_Model):
    """Result of ``run_code`` / a python session run.

    ``result`` is the ``repr`` of the last expression (None if there was none or it was
    None); ``text`` is an alias. ``error`` is set when the code raised.
    """

    stdout: str = ""
    stderr: str = ""
    result: Optional[str] = None
    error: Optional[ExecutionError] = None
    timed_out: bool = False
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "Execution":
        obj = super().from_dict(data)
        if isinstance(obj.error, dict):
            obj.error = ExecutionError.from_dict(obj.error)
        elif obj.error is not None and not isinstance(obj.error, ExecutionError):
            obj.error = ExecutionError(name="Error", value=str(obj.error))
        return obj

    @property
    def text(self) -> Optional[str]:
        return self.result


@dataclass
class ShellResult(_Model):
    """Result of a shell session run."""

    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = None
    timed_out: bool = False
    raw: Dict[str, Any] = _raw()


@dataclass
class SessionInfo(_Model):
    """A stateful session (``kind`` is ``python``, ``shell``, ``javascript`` or ``typescript``)."""

    id: str = ""
    kind: str = ""
    pid: Optional[int] = None
    created_at: Optional[float] = None
    alive: Optional[bool] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class PortInfo(_Model):
    """A port of a sandbox reached from the host (``sbx.open_port(port)``): connections to
    ``host`` (``"127.0.0.1:41234"``: the daemon's ``--port-bind`` address, 127.0.0.1 unless
    set, at a port the kernel picked) are joined to a server listening on ``port`` inside
    sandbox ``sandbox``; ``url`` is ``"http://" + host``. ``opened_at`` is when the forwarder
    was opened; it stays open until ``sbx.close_port(port)`` or until the sandbox is killed.
    ``domain_host`` (``"8000-<sandbox>.localhost:7070"``) reaches the same port through the
    daemon's TCP listener by Host header (``--listen``, ``--port-domain``); None without one."""

    sandbox: str = ""
    port: int = 0
    host: str = ""
    url: str = ""
    opened_at: Optional[float] = None
    domain_host: Optional[str] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class NetLimits(_Model):
    """Caps on a sandbox's traffic: ``Sandbox.create(net_limits=...)``,
    ``sbx.network.update(limits=...)`` and :attr:`NetworkInfo.limits` (a dict of the same keys
    is accepted wherever one is given). None leaves a cap off; ``NetLimits()`` is no limits.

    ``max_connections`` (1..65536) is the most TCP connections the sandbox may have open at once
    through its ``eth0`` (a new one past it is reset) and, counted apart, through its proxy.
    ``bandwidth_mbps`` (0.1..100000) is megabits per second each way on its ``eth0`` (modes
    ``"allowlist"`` and ``"open"``)."""

    max_connections: Optional[int] = None
    bandwidth_mbps: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class NetworkInfo(_Model):
    """A sandbox's network (``sbx.network.get()``, ``GET /v1/sandboxes/{id}/network``).

    ``network`` is the mode: ``"none"`` (loopback only), ``"allowlist"`` (only what ``allow``
    lists) or ``"open"`` (anything but the host, the daemon, other sandboxes and
    link-local/metadata addresses, unless ``allow`` lists them). ``allow`` entries are names
    (``"api.example.com"``), wildcards (``"*.example.org"``), IPv4 addresses or CIDRs, each with
    an optional ``:port`` or ``:low-high``. ``address`` is the sandbox's IPv4 address on the
    daemon's bridge (None in mode ``"none"``); ``rx_bytes``/``tx_bytes`` the bytes it received
    and sent through it. ``proxy`` (read-only) is the URL of the daemon's HTTP(S) proxy as seen
    inside the sandbox (``"http://127.0.0.1:3128"``), or None without one; the proxy lets through
    what ``allow`` lists (in mode ``"open"`` also any public destination), in every mode.
    ``limits`` are the caps on its traffic (:class:`NetLimits`; ``NetLimits()``: none)."""

    sandbox: str = ""
    network: str = ""
    allow: List[str] = field(default_factory=list)
    address: Optional[str] = None
    rx_bytes: int = 0
    tx_bytes: int = 0
    proxy: Optional[str] = None
    limits: NetLimits = field(default_factory=NetLimits)
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "NetworkInfo":
        obj = super().from_dict(data)
        obj.allow = list(obj.allow or [])
        if not isinstance(obj.limits, NetLimits):
            obj.limits = NetLimits.from_dict(obj.limits)
        return obj


@dataclass
class ImageInfo(_Model):
    """A root filesystem image the daemon can start sandboxes from."""

    name: str = ""
    id: str = ""
    layers: List[str] = field(default_factory=list)
    size_bytes: int = 0
    created_at: Optional[float] = None
    source: Optional[str] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class ImageProgress(_Model):
    """One progress event of an image build/import (``total`` may be None)."""

    stage: str = ""
    done: Optional[float] = None
    total: Optional[float] = None
    message: str = ""
    raw: Dict[str, Any] = _raw()


@dataclass
class SnapshotSession(_Model):
    """A session captured in a snapshot.

    ``template`` is False when the session's live template was evicted or died: rollback
    and fork then start that session fresh (its in-memory state is lost).
    """

    id: str = ""
    kind: str = ""
    default: bool = False
    template: bool = False
    raw: Dict[str, Any] = _raw()


@dataclass
class SnapshotInfo(_Model):
    """A snapshot (``sn-<12 hex>``) taken by ``sbx.checkpoint()``.

    ``size_bytes`` counts the bytes only this snapshot holds (0 when it shares its
    parent's state, see ``lightweight``); ``depth`` is the number of snapshot layers in
    its chain (image layers excluded). ``took_ms`` is only set in a checkpoint answer.
    """

    id: str = ""
    sandbox_id: str = ""
    parent: Optional[str] = None
    children: List[str] = field(default_factory=list)
    created_at: Optional[float] = None
    label: Optional[str] = None
    size_bytes: int = 0
    depth: int = 0
    lightweight: bool = False
    sessions: List[SnapshotSession] = field(default_factory=list)
    #: Background processes kept (``processes="all"``): ``{"pid": ..., "cmd": ...}`` each.
    processes: List[Dict[str, Any]] = field(default_factory=list)
    #: ``"node-local"`` (on this node's disk) or ``"durable"`` (pushed: in the object store
    #: and the metadata store, it outlives this node).
    durability: str = "node-local"
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "SnapshotInfo":
        obj = super().from_dict(data)
        obj.children = list(obj.children or [])
        obj.sessions = [
            s if isinstance(s, SnapshotSession) else SnapshotSession.from_dict(s) for s in obj.sessions or []
        ]
        return obj


@dataclass
class OffloadResult(_Model):
    """Result of ``snapshots.offload(sid)``: the snapshot's session templates are in process
    images on disk; a rollback or fork to it restores them."""

    snapshot: str = ""
    #: Templates that were in memory and were dumped by this call.
    offloaded: int = 0
    #: The snapshot's sessions a process image holds.
    images: int = 0
    image_bytes: int = 0
    #: Sessions whose state is lost, each "<session id>: <why>".
    lost: List[str] = field(default_factory=list)
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class PushResult(_Model):
    """Result of ``snapshots.push(sid)``: the snapshot is durable (its layers and process
    images in the object store, its record in the metadata store)."""

    snapshot: str = ""
    durability: str = "durable"
    #: It was pushed before: nothing was uploaded.
    already: bool = False
    layers_pushed: int = 0
    images_pushed: int = 0
    #: Bytes written to the object store (compressed, encrypted) and file bytes read.
    uploaded_bytes: int = 0
    read_bytes: int = 0
    #: Sessions whose state the snapshot does not hold, each "<session id>: <why>".
    lost: List[str] = field(default_factory=list)
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class PullResult(_Model):
    """Result of ``snapshots.pull(sid)``: a pushed snapshot is now on this daemon."""

    snapshot: str = ""
    #: The daemon had it already.
    already: bool = False
    layers_pulled: int = 0
    images_pulled: int = 0
    downloaded_bytes: int = 0
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class RemoteSnapshotInfo(_Model):
    """A snapshot recorded in the metadata store (``snapshots.list_remote()``)."""

    id: str = ""
    sandbox_id: str = ""
    parent: Optional[str] = None
    label: Optional[str] = None
    created_at: Optional[float] = None
    pushed_at: Optional[float] = None
    #: The daemon that pushed it.
    node: str = ""
    image: str = ""
    sessions: List[str] = field(default_factory=list)
    bytes: int = 0
    #: This daemon has it (taken here, or pulled).
    local: bool = False
    raw: Dict[str, Any] = _raw()


@dataclass
class RemotePausedInfo(_Model):
    """A sandbox paused with ``pause(push=True)``: any daemon sharing the stores resumes it
    under its id (``Sandbox.connect(id)``)."""

    id: str = ""
    snapshot: str = ""
    image: str = ""
    paused_at: Optional[float] = None
    node: str = ""
    raw: Dict[str, Any] = _raw()


@dataclass
class StoreGcResult(_Model):
    """Result of ``snapshots.store_gc()``: objects no snapshot record reaches, deleted."""

    objects: int = 0
    reachable: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    #: Unreachable objects kept because they are younger than the grace period.
    young: int = 0
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class PauseResult(_Model):
    """Result of ``sbx.pause()``: the sandbox's processes are in process images on disk."""

    sandbox: Optional[SandboxInfo] = None
    #: Process trees dumped (sessions, background commands, orphans).
    processes: int = 0
    sessions: int = 0
    image_bytes: int = 0
    took_ms: Optional[float] = None
    #: ``"full"`` (files and processes) or ``"filesystem"`` (files only: the resume cold-boots).
    mode: str = "full"
    #: ``"node-local"`` (kept on the daemon's disk) or ``"durable"`` (``pause(push=True)``).
    durability: str = "node-local"
    #: With ``push=True``: the snapshot holding the sandbox's state.
    snapshot: Optional[str] = None
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "PauseResult":
        obj = super().from_dict(data)
        object.__setattr__(obj, "sandbox", SandboxInfo.from_dict(obj.sandbox) if obj.sandbox else None)
        return obj


@dataclass
class ResumeResult(_Model):
    """Result of ``sbx.resume()``: processes restored under their pids, sessions re-attached."""

    sandbox: Optional[SandboxInfo] = None
    processes: int = 0
    sessions: int = 0
    took_ms: Optional[float] = None
    #: The processes ran before their memory was all copied in (it follows in the background).
    lazy_pages: bool = False
    #: The sandbox was cold-booted (files only, a new boot id): ``reboot=True`` or a
    #: ``mode="filesystem"`` pause.
    rebooted: bool = False
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "ResumeResult":
        obj = super().from_dict(data)
        object.__setattr__(obj, "sandbox", SandboxInfo.from_dict(obj.sandbox) if obj.sandbox else None)
        return obj


@dataclass
class RollbackResult(_Model):
    """Result of ``sbx.rollback()``.

    ``sessions_restarted`` is True when some session had no live template and was started
    fresh; ``killed`` lists the pids of the non-session processes that were killed.
    """

    snapshot: str = ""
    sessions_restarted: bool = False
    killed: List[int] = field(default_factory=list)
    #: Background processes the snapshot kept, restored under their pids.
    restored_processes: List[int] = field(default_factory=list)
    #: Those that could not be, each "<pid> (<command>): <why>".
    processes_not_restored: List[str] = field(default_factory=list)
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()


@dataclass
class ForkResult(_Model):
    """Answer of ``POST /v1/sandboxes/{id}/fork`` (``sbx.fork()`` returns the sandboxes)."""

    snapshot: str = ""
    sandboxes: List[SandboxInfo] = field(default_factory=list)
    sessions_restarted: bool = False
    inflight_handed: int = 0
    #: Background processes of the snapshot that did not come back in a child, each naming the
    #: child and why (the child runs on without them).
    processes_not_restored: List[str] = field(default_factory=list)
    took_ms: Optional[float] = None
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "ForkResult":
        obj = super().from_dict(data)
        obj.sandboxes = [
            s if isinstance(s, SandboxInfo) else SandboxInfo.from_dict(s) for s in obj.sandboxes or []
        ]
        return obj


@dataclass
class GcResult(_Model):
    """Result of a snapshot garbage collection: the deleted ids and the bytes freed."""

    deleted: List[str] = field(default_factory=list)
    freed_bytes: int = 0
    raw: Dict[str, Any] = _raw()


@dataclass
class PoolImageStats(_Model):
    """One image's warm pool: ``min`` ready sandboxes are kept by the background refill,
    killed sandboxes are recycled while fewer than ``max`` are ready; ``ready`` now, of which
    ``wired`` have their network made ahead for creates with egress (their share follows the
    recent creates of the image)."""

    min: int = 0
    max: int = 0
    ready: int = 0
    wired: int = 0
    raw: Dict[str, Any] = _raw()


@dataclass
class PoolStats(_Model):
    """``GET /v1/pool``: the warm pool's configuration and counters since the daemon started.

    ``hits`` are creates served from the pool, ``misses`` creates that started cold,
    ``recycled`` killed sandboxes cleaned and returned to the pool, ``created`` sandboxes built
    by the background refill, ``failures`` refills that failed (``last_error`` says why;
    creates then start cold). ``cgroup_placement`` is ``"migrate"`` (cgroup v1) or
    ``"clone_into_cgroup"`` (v2).
    """

    images: Dict[str, PoolImageStats] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    recycled: int = 0
    created: int = 0
    failures: int = 0
    last_error: Optional[str] = None
    refill_ms_p50: Optional[float] = None
    refill_ms_p99: Optional[float] = None
    cgroup_placement: Optional[str] = None
    cgroup_placement_ms_p50: Optional[float] = None
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "PoolStats":
        obj = super().from_dict(data)
        images = obj.images if isinstance(obj.images, dict) else {}
        obj.images = {
            str(k): v if isinstance(v, PoolImageStats) else PoolImageStats.from_dict(v) for k, v in images.items()
        }
        return obj

    def ready(self, image: str) -> int:
        """Sandboxes of ``image`` ready now (0 for an image without a pool)."""
        s = self.images.get(image)
        return s.ready if s is not None else 0


@dataclass
class TemplateInfo(_Model):
    """A warm template (``branchbox template ls``): sandboxes created with ``template=name``
    are live forks of ``snapshot``, nested in the template's hidden sandbox ``sandbox_id``.

    ``shells`` sandboxes are kept ready to hand out (``ready_shells`` now); ``alive`` is False
    when the frozen sessions died (sandboxes then start with fresh sessions);
    ``memory_bytes`` is the memory charged to the template's sandbox. ``volumes`` are the
    template's mounts (``Templates.build(volumes=...)``; ``volume`` is the id of the volume the
    template holds): each sandbox created from it gets a copy-on-write fork of every ``branch``
    volume at the same path.
    """

    name: str = ""
    image: str = ""
    snapshot: str = ""
    sandbox_id: str = ""
    created_at: Optional[float] = None
    shells: int = 0
    ready_shells: int = 0
    alive: bool = False
    memory_bytes: int = 0
    volumes: List[VolumeMount] = field(default_factory=list)
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "TemplateInfo":
        obj = super().from_dict(data)
        obj.volumes = [m if isinstance(m, VolumeMount) else VolumeMount.from_dict(m) for m in obj.volumes or []]
        return obj


@dataclass
class TemplateProgress(ImageProgress):
    """One progress event of a template build (``stage``: create, run, code, snapshot,
    shells; ``message`` names the recipe command being run)."""


@dataclass
class VolumeInfo(_Model):
    """A persistent volume (``vol-<16 hex>``): files that outlive the sandboxes mounting them.

    ``access`` is ``"rwo"`` (mounted by one sandbox at a time), ``"rox"`` (by any number,
    read-only; written through the files API while none mounts it) or ``"rwx"`` (by any number
    of this daemon's sandboxes, read-write, one copy for all; it never branches); ``quota_mb`` (None: no
    quota) bounds the MiB it may hold beyond what it was created or forked with.
    ``size_bytes`` is what it takes on the daemon's disk. ``mounts`` lists the sandboxes mounting it now (each
    mount's ``volume`` is this volume's id). ``version`` is the head committed in the metadata
    store (0: never synced); ``durability`` is ``"durable"`` when nothing changed since the
    last ``sync()``, else ``"node-local"``, with ``backlog_bytes`` written since then (not yet
    in the object store). ``source`` is the volume it was forked from.
    ``encrypted_at_rest``: its files on the daemon's disk are encrypted (the daemon's
    ``--volume-encryption``, on by default). ``cached`` is False once the daemon let layers of
    the volume go from its bounded cache (``--volume-cache-mb``; only a durable volume no
    sandbox uses): they are pulled back from the object store when it is next mounted or read.
    """

    id: str = ""
    name: Optional[str] = None
    access: str = "rwo"
    quota_mb: Optional[int] = None
    created_at: Optional[float] = None
    size_bytes: int = 0
    layers: int = 0
    snapshots: int = 0
    mounts: List[VolumeMount] = field(default_factory=list)
    version: int = 0
    durability: str = "node-local"
    backlog_bytes: int = 0
    source: Optional[str] = None
    encrypted_at_rest: bool = False
    cached: bool = True
    raw: Dict[str, Any] = _raw()

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "VolumeInfo":
        obj = super().from_dict(data)
        mounts = [m if isinstance(m, VolumeMount) else VolumeMount.from_dict(m) for m in obj.mounts or []]
        for m in mounts:
            m.volume = m.volume or obj.id
        obj.mounts = mounts
        return obj


@dataclass
class VolumeSnapshotInfo(_Model):
    """A snapshot of a volume (``vs-...``, ``vol.snapshot()``): its files at that moment, for
    ``vol.restore()`` and ``vol.fork(snapshot=...)``. ``layers`` is the length of its chain;
    ``durable``: in the volume's committed head (the next ``vol.sync()`` or background upload
    puts a volume's own snapshots there), so restorable on any daemon sharing the stores."""

    id: str = ""
    volume: str = ""
    created_at: Optional[float] = None
    layers: int = 0
    label: Optional[str] = None
    durable: bool = False
    raw: Dict[str, Any] = _raw()
