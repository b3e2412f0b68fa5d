"""Exceptions raised by the branchbox SDK.

Every error derives from :class:`SandboxError`; HTTP errors are mapped from the daemon's
stable JSON error ``code``::

    SandboxError                      (code "internal" and anything unknown)
    ├── NotFoundError                 not_found          404
    ├── InvalidArgumentError          bad_request        400
    │   └── PathEscapeError           path_escape        400
    ├── AuthenticationError           unauthorized       401
    ├── ConflictError                 conflict           409
    ├── PayloadTooLargeError          payload_too_large  413
    ├── QuotaExceededError            quota_exceeded     507
    ├── TimeoutError                  timeout            408, or the client-side request timeout
    ├── DaemonUnavailableError        unavailable        503, or the daemon cannot be reached
    ├── CorruptDataError              corrupt            502, data from the object store failed authentication
    └── CommandExitError              CommandResult.check() on a nonzero exit

``branchbox.TimeoutError`` is *not* the builtin :class:`TimeoutError`.  A command or code
run that exceeds its own ``timeout`` is not an error: its result has ``timed_out=True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Type

if TYPE_CHECKING:  # pragma: no cover
    from .models import CommandResult

__all__ = [
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
    "error_from_response",
]


class SandboxError(Exception):
    """Root of all branchbox errors.

    ``code`` is the daemon's stable error code (or a client-side one such as
    ``"connect"``), ``status_code`` the HTTP status when there was a response.
    """

    default_code = "internal"

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        status_code: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status_code = status_code

    def __str__(self) -> str:
        return self.message


class NotFoundError(SandboxError):
    """The sandbox, process, session, file or image does not exist (404)."""

    default_code = "not_found"


class InvalidArgumentError(SandboxError):
    """The request was rejected as invalid (400)."""

    default_code = "bad_request"


class PathEscapeError(InvalidArgumentError):
    """A path tried to leave the sandbox root through ``..`` or a symlink (400)."""

    default_code = "path_escape"


class AuthenticationError(SandboxError):
    """Missing or wrong bearer token (401)."""

    default_code = "unauthorized"


class ConflictError(SandboxError):
    """The operation conflicts with the current state, e.g. removing an image in use (409)."""

    default_code = "conflict"


class PayloadTooLargeError(SandboxError):
    """The request body exceeds the daemon's limit (413)."""

    default_code = "payload_too_large"


class QuotaExceededError(SandboxError):
    """A write would take a volume beyond its ``quota_mb`` (507)."""

    default_code = "quota_exceeded"


class TimeoutError(SandboxError):  # noqa: A001 - deliberately shadows the builtin name
    """The HTTP request to the daemon timed out (client side) or the daemon answered 408."""

    default_code = "timeout"


class DaemonUnavailableError(SandboxError):
    """The daemon cannot be reached or answered 503."""

    default_code = "unavailable"


class CorruptDataError(SandboxError):
    """The daemon answered 502: an object it read back from the object store failed
    authentication (changed, cut short, or sealed with another key). Nothing of it was served
    or kept; the message names the object."""

    default_code = "corrupt"


class CommandExitError(SandboxError):
    """A command exited nonzero (raised by :meth:`CommandResult.check`)."""

    default_code = "command_exit"

    def __init__(self, result: "CommandResult") -> None:
        self.result = result
        if result.timed_out:
            what = "timed out"
        elif result.exit_code is None and result.signal is not None:
            what = "was killed by signal %d" % result.signal
        else:
            what = "exited with code %s" % result.exit_code
        message = "command %s" % what
        tail = (result.stderr or "").strip().splitlines()[-3:]
        if tail:
            message += ": " + " | ".join(tail)
        super().__init__(message)

    @property
    def exit_code(self) -> Optional[int]:
        return self.result.exit_code

    @property
    def stdout(self) -> str:
        return self.result.stdout

    @property
    def stderr(self) -> str:
        return self.result.stderr


_BY_CODE: Dict[str, Type[SandboxError]] = {
    "bad_request": InvalidArgumentError,
    "path_escape": PathEscapeError,
    "unauthorized": AuthenticationError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "payload_too_large": PayloadTooLargeError,
    "quota_exceeded": QuotaExceededError,
    "timeout": TimeoutError,
    "unavailable": DaemonUnavailableError,
    "corrupt": CorruptDataError,
    "internal": SandboxError,
}

_BY_STATUS: Dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "unauthorized",
    404: "not_found",
    408: "timeout",
    409: "conflict",
    413: "payload_too_large",
    502: "corrupt",
    503: "unavailable",
    507: "quota_exceeded",
}


def error_from_response(status_code: int, body: Any) -> SandboxError:
    """Build the exception for an error answer (``body`` is decoded JSON, text or None)."""
    code: Optional[str] = None
    message: Optional[str] = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            code = err.get("code") if isinstance(err.get("code"), str) else None
            message = err.get("message") if isinstance(err.get("message"), str) else None
        elif isinstance(err, str):
            message = err
    elif isinstance(body, str) and body.strip():
        message = body.strip()[:500]
    if code is None:
        code = _BY_STATUS.get(status_code, "internal")
    cls = _BY_CODE.get(code)
    if cls is None:  # an unknown code: fall back on the status
        cls = _BY_CODE.get(_BY_STATUS.get(status_code, "internal"), SandboxError)
    if not message:
        message = "daemon answered HTTP %d (%s)" % (status_code, code)
    return cls(message, code=code, status_code=status_code)
