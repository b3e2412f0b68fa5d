"""branchbox: sandboxes for AI agents, driven through the local ``branchboxd`` daemon.

    from branchbox import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.commands.run("echo hi").stdout)
        print(sbx.run_code("1 + 1").text)
"""

from __future__ import annotations

from . import images, pool, templates
from ._version import __version__
from .exceptions import (
    AuthenticationError,
    CommandExitError,
    ConflictError,
    CorruptDataError,
    DaemonUnavailableError,
    InvalidArgumentError,
    NotFoundError,
    PathEscapeError,
    PayloadTooLargeError,
    QuotaExceededError,
    SandboxError,
    TimeoutError,
)
from .models import (
    CommandResult,
    EntryInfo,
    Execution,
    ExecutionError,
    ForkResult,
    GcResult,
    ImageInfo,
    ImageProgress,
    NetLimits,
    NetworkInfo,
    PoolImageStats,
    PoolStats,
    PortInfo,
    ProcessInfo,
    RollbackResult,
    PauseResult,
    OffloadResult,
    PullResult,
    PushResult,
    RemotePausedInfo,
    RemoteSnapshotInfo,
    StoreGcResult,
    ResumeResult,
    SandboxInfo,
    SessionInfo,
    ShellResult,
    SnapshotInfo,
    SnapshotSession,
    TemplateInfo,
    TemplateProgress,
    VolumeInfo,
    VolumeMount,
    VolumeSnapshotInfo,
)
from .sandbox_async import (
    AsyncByteStream,
    AsyncCommandHandle,
    AsyncImages,
    AsyncPool,
    AsyncSandbox,
    AsyncSession,
    AsyncSnapshots,
    AsyncTemplates,
    AsyncVolume,
)
from .sandbox_sync import ByteStream, CommandHandle, Images, Pool, Sandbox, Session, Snapshots, Templates, Volume

__all__ = [
    # sandboxes
    "Sandbox",
    "AsyncSandbox",
    "CommandHandle",
    "AsyncCommandHandle",
    "Session",
    "AsyncSession",
    "ByteStream",
    "AsyncByteStream",
    # images
    "images",
    "Images",
    "AsyncImages",
    # snapshots
    "Snapshots",
    "AsyncSnapshots",
    # volumes
    "Volume",
    "AsyncVolume",
    # templates and the warm pool
    "templates",
    "Templates",
    "AsyncTemplates",
    "pool",
    "Pool",
    "AsyncPool",
    # models
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
    "SnapshotInfo",
    "SnapshotSession",
    "RollbackResult",
    "PauseResult",
    "OffloadResult",
    "PullResult",
    "PushResult",
    "RemotePausedInfo",
    "RemoteSnapshotInfo",
    "StoreGcResult",
    "ResumeResult",
    "ForkResult",
    "GcResult",
    "PoolStats",
    "PoolImageStats",
    "TemplateInfo",
    "TemplateProgress",
    "VolumeInfo",
    "VolumeSnapshotInfo",
    "VolumeMount",
    # exceptions
    "SandboxError",
    "NotFoundError",
    "InvalidArgumentError",
    "PathEscapeError",
    "AuthenticationError",
    "ConflictError",
    "PayloadTooLargeError",
    "QuotaExceededError",
    "TimeoutError",
    "DaemonUnavailableError",
    "CorruptDataError",
    "CommandExitError",
    "__version__",
]
