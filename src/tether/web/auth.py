"""Who may act on the dashboard: one shared token, sent in a header with every action.

Without a token the dashboard is read-only: every action is refused. With one, an action
is a POST that carries it in ``Authorization: Bearer <token>`` or ``X-Tether-Token``,
compared in constant time. The token never travels in a URL (where browser history,
proxies and access logs would keep it) and is never logged. A POST whose Origin header
names another site is refused too: a page elsewhere cannot act through a visitor's
browser (it could not send the header without the token anyway; this is the second lock).

A dashboard that listens beyond the loopback interface must have a token: anyone who can
reach the port could otherwise read every task's arguments and errors.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

TOKEN_ENV = "TETHER_DASHBOARD_TOKEN"
TOKEN_HEADER = "X-Tether-Token"
READ_ONLY_NOTE = f"read-only: start with --token / {TOKEN_ENV} to act"


class TokenError(ValueError):
    """A token that cannot be used (empty, unreadable file, two sources at once)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request may not act: the HTTP status and the message sent back."""

    code: int
    message: str


def read_token(token: str | None, token_file: str | Path | None) -> str | None:
    """The token given on the command line (or its environment variable), or the first line
    of ``token_file``; None when neither is given."""
    if token is not None and token_file is not None:
        raise TokenError(f"give the token once: --token (or {TOKEN_ENV}) or --token-file, not both")
    if token_file is not None:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise TokenError(f"cannot read the token file {token_file}: {exc.strerror or exc}") from None
        token = lines[0] if lines else ""
    if token is None:
        return None
    token = token.strip()
    if not token:
        raise TokenError("the dashboard token is empty")
    if not token.isprintable() or not token.isascii():
        raise TokenError("the dashboard token must be printable ASCII (it travels in an HTTP header)")
    return token


def is_loopback(host: str) -> bool:
    """Does ``host`` (an address or a name) reach this machine only? Names are resolved;
    a name that does not resolve counts as not loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)


def environment_token() -> str | None:
    return os.environ.get(TOKEN_ENV)


class Access:
    """The dashboard's token (None: read-only), and the checks of requests that read or act.

    ``private_reads``: reads need the token too. The command sets it when the dashboard
    listens beyond loopback: there, the token is what keeps task arguments and errors from
    whoever can reach the port.
    """

    def __init__(self, token: str | None, *, private_reads: bool = False) -> None:
        if private_reads and token is None:
            raise TokenError("a dashboard whose reads are private needs a token")
        self._token = None if token is None else token.encode()
        self.private_reads = private_reads

    @property
    def can_act(self) -> bool:
        return self._token is not None

    def refusal(self, headers: Message) -> Refusal | None:
        """None if a POST with these headers may act; else why not."""
        if self._token is None:
            return Refusal(403, READ_ONLY_NOTE)
        origin = headers.get("Origin")
        if origin is not None and not same_origin(origin, headers.get("Host")):
            return Refusal(403, "the request comes from another site (its Origin is not this dashboard)")
        return self._token_refusal(headers, "this action")

    def read_refusal(self, headers: Message) -> Refusal | None:
        """None if a GET of data with these headers may read; else why not."""
        if not self.private_reads:
            return None
        return self._token_refusal(headers, "this dashboard listens beyond loopback: reading")

    def _token_refusal(self, headers: Message, what: str) -> Refusal | None:
        assert self._token is not None
        given = presented_token(headers)
        if given is None:
            return Refusal(
                401, f"{what} needs the dashboard token (Authorization: Bearer, or {TOKEN_HEADER})"
            )
        if not hmac.compare_digest(given.encode(), self._token):
            return Refusal(403, "wrong dashboard token")
        return None


def presented_token(headers: Message) -> str | None:
    authorization = headers.get("Authorization")
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    header = headers.get(TOKEN_HEADER)
    return header.strip() if header and header.strip() else None


def same_origin(origin: str, host: str | None) -> bool:
    """Is ``origin`` (a browser's Origin header) this server, as the request's Host names it?
    https counts too: the dashboard may sit behind a TLS proxy."""
    if not host:
        return False
    return origin.strip().lower() in (f"http://{host}".lower(), f"https://{host}".lower())
