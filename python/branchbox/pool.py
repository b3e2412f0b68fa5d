"""Module-level shortcuts for the warm pool: ``branchbox.pool.stats()``, ``set``, ``drain``.

Each call opens a short-lived :class:`branchbox.Pool` client; use ``Pool`` (or
``AsyncPool``) directly to reuse a connection or for async code.
"""

from __future__ import annotations

from typing import Optional

from .models import PoolStats
from .sandbox_sync import Pool

__all__ = ["stats", "set", "drain"]


def stats(
    *, daemon: Optional[str] = None, token: Optional[str] = None, request_timeout: Optional[float] = 120
) -> PoolStats:
    """The pool's configuration, ready counts and counters."""
    with Pool(daemon=daemon, token=token, request_timeout=request_timeout) as pool:
        return pool.stats()


def set(  # noqa: A001 - the natural name; builtins.set is not needed here
    image: str,
    min: int,  # noqa: A002
    max: Optional[int] = None,  # noqa: A002
    *,
    daemon: Optional[str] = None,
    token: Optional[str] = None,
    request_timeout: Optional[float] = 120,
) -> PoolStats:
    """Keep ``min`` sandboxes of ``image`` ready, recycle while fewer than ``max`` are ready."""
    with Pool(daemon=daemon, token=token, request_timeout=request_timeout) as pool:
        return pool.set(image, min, max)


def drain(
    image: str, *, daemon: Optional[str] = None, token: Optional[str] = None, request_timeout: Optional[float] = 120
) -> PoolStats:
    """Remove ``image``'s pool (``min = max = 0``)."""
    with Pool(daemon=daemon, token=token, request_timeout=request_timeout) as pool:
        return pool.drain(image)
