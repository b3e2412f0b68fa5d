"""Daemon address/token resolution and httpx client construction.

Address: the ``daemon=`` argument, else ``$BRANCHBOX_URL``, else
``unix:///run/branchbox/branchboxd.sock``. Accepted forms: ``unix:///path/to.sock``,
a bare absolute socket path, ``http://host:port`` and ``https://host:port``.
Token: ``token=``, else ``$BRANCHBOX_TOKEN``; sent as ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Union

import httpx

from ._version import __version__
from .exceptions import InvalidArgumentError

__all__ = [
    "DEFAULT_SOCKET",
    "DEFAULT_URL",
    "DaemonAddress",
    "ConnectionConfig",
    "resolve_address",
    "resolve_token",
]

DEFAULT_SOCKET = "/run/branchbox/branchboxd.sock"
DEFAULT_URL = "unix://" + DEFAULT_SOCKET
URL_ENV = "BRANCHBOX_URL"
TOKEN_ENV = "BRANCHBOX_TOKEN"
_UDS_BASE_URL = "http://branchboxd"

USER_AGENT = "branchbox-python/%s" % __version__


@dataclass(frozen=True)
class DaemonAddress:
    """Where the daemon listens: ``uds`` is set for unix sockets."""

    url: str
    base_url: str
    uds: Optional[str] = None

    @property
    def is_unix(self) -> bool:
        return self.uds is not None


def resolve_address(daemon: Optional[str] = None) -> DaemonAddress:
    """Resolve ``daemon`` / ``$BRANCHBOX_URL`` / the default socket into an address."""
    url = daemon or os.environ.get(URL_ENV) or DEFAULT_URL
    url = url.strip()
    if url.startswith("unix://"):
        path = url[len("unix://") :]
        if not path.startswith("/"):
            raise InvalidArgumentError(
                "daemon URL %r: unix socket paths must be absolute (unix:///path/to.sock)" % url
            )
        return DaemonAddress(url=url, base_url=_UDS_BASE_URL, uds=path)
    if url.startswith("/"):
        return DaemonAddress(url="unix://" + url, base_url=_UDS_BASE_URL, uds=url)
    if url.startswith(("http://", "https://")):
        return DaemonAddress(url=url, base_url=url.rstrip("/"))
    raise InvalidArgumentError(
        "daemon URL %r is not understood: use unix:///path/to.sock or http://host:port" % url
    )


def resolve_token(token: Optional[str] = None) -> Optional[str]:
    return token or os.environ.get(TOKEN_ENV) or None


TransportT = Union[httpx.BaseTransport, httpx.AsyncBaseTransport]


class ConnectionConfig:
    """Resolved connection settings shared by a sandbox and its sub-clients.

    ``transport`` replaces the network transport (e.g. ``httpx.MockTransport`` in tests).
    """

    def __init__(
        self,
        daemon: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = 120,
        transport: Optional[TransportT] = None,
    ) -> None:
        self.address = resolve_address(daemon)
        self.token = resolve_token(token)
        self.request_timeout = request_timeout
        self.transport = transport

    @property
    def url(self) -> str:
        return self.address.url

    def headers(self) -> Dict[str, str]:
        h = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token:
            h["Authorization"] = "Bearer %s" % self.token
        return h

    def _timeout(self) -> httpx.Timeout:
        t = self.request_timeout
        return httpx.Timeout(t, connect=None if t is None else min(t, 10.0))

    def _plain(self) -> bool:
        # A unix socket or http:// carries no TLS: skip building an SSL context (loading the CA
        # bundle costs ~20-30 ms per client, more than creating a sandbox).
        return self.address.is_unix or not self.address.base_url.startswith("https")

    def sync_client(self) -> httpx.Client:
        transport = self.transport
        if transport is None and self._plain():
            transport = httpx.HTTPTransport(uds=self.address.uds, verify=False)
        return httpx.Client(
            base_url=self.address.base_url,
            headers=self.headers(),
            timeout=self._timeout(),
            transport=transport,  # type: ignore[arg-type]
            trust_env=False,  # the daemon is local or explicit: never route it via a proxy
        )

    def async_client(self) -> httpx.AsyncClient:
        transport = self.transport
        if transport is None and self._plain():
            transport = httpx.AsyncHTTPTransport(uds=self.address.uds, verify=False)
        return httpx.AsyncClient(
            base_url=self.address.base_url,
            headers=self.headers(),
            timeout=self._timeout(),
            transport=transport,  # type: ignore[arg-type]
            trust_env=False,  # the daemon is local or explicit: never route it via a proxy
        )
