"""Module-level shortcuts for images: ``branchbox.images.list()`` etc.

Each call opens a short-lived :class:`branchbox.Images` client; use ``Images`` (or
``AsyncImages``) directly to reuse a connection or for async code.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, Optional, Sequence

from .models import ImageInfo, ImageProgress
from .sandbox_sync import Images

__all__ = ["list", "build", "import_", "remove"]

ProgressCallback = Optional[Callable[[ImageProgress], Any]]


def list(  # noqa: A001 - mirrors E2B-style naming
    *, daemon: Optional[str] = None, token: Optional[str] = None, request_timeout: Optional[float] = 120
) -> "builtins.list[ImageInfo]":
    """All images known to the daemon."""
    with Images(daemon=daemon, token=token, request_timeout=request_timeout) as images:
        return images.list()


def build(
    name: str = "base",
    *,
    suite: Optional[str] = None,
    packages: Optional[Sequence[str]] = None,
    on_progress: ProgressCallback = None,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 120,
) -> ImageInfo:
    """Build an image, calling ``on_progress(ImageProgress)`` per progress event."""
    with Images(daemon=daemon, token=token, request_timeout=request_timeout) as images:
        return images.build(name, suite=suite, packages=packages, on_progress=on_progress)


def import_(
    name: str,
    path: str,
    *,
    on_progress: ProgressCallback = None,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 120,
) -> ImageInfo:
    """Import an OCI/docker image tarball at ``path`` (a path on the daemon's host)."""
    with Images(daemon=daemon, token=token, request_timeout=request_timeout) as images:
        return images.import_(name, path, on_progress=on_progress)


def remove(
    name: str, *, daemon: Optional[str] = None, token: Optional[str] = None, request_timeout: Optional[float] = 120
) -> bool:
    """Remove an image (:class:`branchbox.ConflictError` if a sandbox uses it)."""
    with Images(daemon=daemon, token=token, request_timeout=request_timeout) as images:
        return images.remove(name)
