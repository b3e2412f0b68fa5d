"""What every command group of the ``branchbox`` CLI shares: the consoles, the context
(daemon address and token), the one-red-line error convention and small formatters."""

# No `from __future__ import annotations`: typer evaluates annotations at runtime.
import contextlib
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from branchbox import Sandbox, SandboxError

DEBUG_ENV = "BRANCHBOX_DEBUG"

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@dataclass
class Ctx:
    daemon: Optional[str] = None
    token: Optional[str] = None

    def sdk(self) -> Dict[str, Any]:
        return {"daemon": self.daemon, "token": self.token}


F = TypeVar("F", bound=Callable[..., Any])


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def fail(message: str, code: int = 1) -> "typer.Exit":
    """Print one red error line on stderr and return the Exit to raise."""
    err.print(Text("error: " + " ".join(str(message).split("\n")).strip(), style="red"))
    return typer.Exit(code)


def _is_cli_control(e: BaseException) -> bool:
    """typer/click exits and usage errors (whichever click typer bundles) pass through."""
    if isinstance(e, (typer.Exit, typer.Abort)):
        return True
    return hasattr(e, "exit_code") and callable(getattr(e, "show", None))


def cli_errors(fn: F) -> F:
    """Turn exceptions into a one-line red message and exit 1 (unless BRANCHBOX_DEBUG)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if _is_cli_control(e):
                raise
            if _debug():
                raise
            if isinstance(e, SandboxError):
                raise fail(str(e)) from None
            raise fail("%s: %s" % (type(e).__name__, e)) from None
        except KeyboardInterrupt:
            if _debug():
                raise
            raise fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


def ctx_of(ctx: typer.Context) -> Ctx:
    obj = ctx.find_object(Ctx)
    return obj if obj is not None else Ctx()


@contextlib.contextmanager
def connected(ctx: typer.Context, sandbox_id: str) -> Iterator[Sandbox]:
    """The sandbox ``sandbox_id`` (NotFoundError when unknown), its connection closed after. A
    paused sandbox stays paused (requests to it are refused unless it resumes by itself)."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **ctx_of(ctx).sdk())
    try:
        yield sbx
    finally:
        sbx.close()


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return ("%d %s" % (size, unit)) if unit == "B" else ("%.1f %s" % (size, unit))
        size /= 1024
    return str(n)


def fmt_duration(seconds: float) -> str:
    """Compact duration: 45s, 4m59s, 2h03m, 3d04h."""
    s = int(max(seconds, 0))
    if s < 60:
        return "%ds" % s
    if s < 3600:
        return "%dm%02ds" % (s // 60, s % 60)
    if s < 86400:
        return "%dh%02dm" % (s // 3600, (s % 3600) // 60)
    return "%dd%02dh" % (s // 86400, (s % 86400) // 3600)


def fmt_num(v: Any, unit: str = "", spec: str = "%.2f") -> str:
    return "-" if v is None else (spec % v) + unit


def print_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))
