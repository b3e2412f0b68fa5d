"""Module-level shortcuts for warm templates: ``branchbox.templates.build(...)`` etc.

Each call opens a short-lived :class:`branchbox.Templates` client; use ``Templates`` (or
``AsyncTemplates``) directly to reuse a connection or for async code.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from . import _core
from .models import TemplateInfo, TemplateProgress
from .sandbox_sync import Templates

__all__ = ["list", "get", "build", "remove"]

ProgressCallback = Optional[Callable[[TemplateProgress], Any]]


def list(  # noqa: A001 - mirrors branchbox.images
    *, daemon: Optional[str] = None, token: Optional[str] = None, request_timeout: Optional[float] = 120
) -> "builtins.list[TemplateInfo]":
    """All templates known to the daemon."""
    with Templates(daemon=daemon, token=token, request_timeout=request_timeout) as templates:
        return templates.list()


def get(
    name: Union[str, TemplateInfo],
    *,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 120,
) -> TemplateInfo:
    """One template (:class:`branchbox.NotFoundError` if unknown)."""
    with Templates(daemon=daemon, token=token, request_timeout=request_timeout) as templates:
        return templates.get(name)


def build(
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
    on_progress: ProgressCallback = None,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 120,
) -> TemplateInfo:
    """Build a template (see :meth:`branchbox.Templates.build`). ``volumes`` (as for
    ``Sandbox.create``) are mounted while the recipe runs; sandboxes created from the
    template get copy-on-write forks of the branching ones. ``network``/``allow`` (as for
    ``Sandbox.create``) are the recipe's sandbox's network and the default of sandboxes
    created from the template."""
    with Templates(daemon=daemon, token=token, request_timeout=request_timeout) as templates:
        return templates.build(
            name,
            image=image,
            run=run,
            code=code,
            env=env,
            cwd=cwd,
            cpu=cpu,
            memory_mb=memory_mb,
            pids=pids,
            metadata=metadata,
            timeout=timeout,
            shells=shells,
            volumes=volumes,
            network=network,
            allow=allow,
            on_progress=on_progress,
        )


def remove(
    name: Union[str, TemplateInfo],
    *,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 120,
) -> bool:
    """Remove a template (sandboxes created from it keep running)."""
    with Templates(daemon=daemon, token=token, request_timeout=request_timeout) as templates:
        return templates.remove(name)
