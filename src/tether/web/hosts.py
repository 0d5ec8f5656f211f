"""Which ``Host`` names the dashboard answers to: its guard against DNS rebinding.

A page on any site can point a name it controls at 127.0.0.1 once the visitor's browser
has loaded it (DNS rebinding). The browser then sends that page's requests to the
dashboard on the visitor's own machine and lets the page read the answers, since to the
browser they come from the page's own site. A dashboard on loopback needs no token to
read, so without a check such a page could read every task's arguments and errors. The
browser still names the page's site in each request's ``Host`` header, and that is what
is checked: every request, of any path and method, must name the dashboard.

Accepted: ``localhost`` and loopback addresses (``127.0.0.1``, ``[::1]``), with any port
or none (an SSH tunnel forwards another port); the address the dashboard listens on;
and every name given with ``--allowed-host`` (a reverse proxy's public name, say). A
dashboard that listens beyond loopback and was given no ``--allowed-host`` accepts any
Host: there the token guards every read and every action, and a page cannot have it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tether.web.auth import Refusal

_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")  # DNS names, and container names with _
_PORT = re.compile(r"[0-9]{1,5}")
_UNSPECIFIED = frozenset({"0.0.0.0", "::", ""})  # every interface: no one name


class HostNameError(ValueError):
    """An --allowed-host value that is not a host name or an address."""


def host_of(header: str) -> str | None:
    """The host of a ``Host`` header value, lower case and without its port (an IPv6 address
    without its brackets); None if the value is not a host with an optional port."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1 :]
        if end < 0 or not _is_ip(host, 6):
            return None
    else:
        host, colon, port = value.partition(":")
        rest = colon + port
        if not (_is_ip(host, 4) or _NAME.fullmatch(host)):
            return None
    if rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:])):
        return None
    return host


def allowed_host(value: str) -> str:
    """An ``--allowed-host`` value as it is compared: a host name or an address, without a
    port, lower case (an IPv6 address with or without brackets). Raises HostNameError."""
    text = value.strip().lower()
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not (_is_ip(host, 4) or _is_ip(host, 6) or _NAME.fullmatch(host)):
        raise HostNameError(
            f"--allowed-host {value!r} is not a host name or an IP address (give the name alone, "
            "without a scheme, port or path: dash.example.com)"
        )
    return host


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class HostCheck:
    """The Host names one dashboard answers to (see the module's docstring)."""

    names: frozenset[str]  # besides localhost and loopback addresses
    any_host: bool = False

    @classmethod
    def for_bind(cls, bind: str, allowed: Sequence[str], *, loopback: bool) -> HostCheck:
        """The check of a dashboard listening on ``bind`` (``loopback``: only reachable from
        this machine), given ``allowed`` (``--allowed-host`` values, checked)."""
        names = {allowed_host(name) for name in allowed}
        bound = bind.strip("[]").lower()
        if bound not in _UNSPECIFIED:
            names.add(bound)
        return cls(frozenset(names), any_host=not loopback and not allowed)

    def refusal(self, headers: Sequence[str]) -> Refusal | None:
        """None if a request with these ``Host`` headers (all of them) may be answered."""
        if len(headers) != 1:
            return Refusal(400, f"a request needs exactly one Host header, this one has {len(headers)}")
        if self.any_host:
            return None
        host = host_of(headers[0])
        if host is not None and (_is_loopback_host(host) or host in self.names):
            return None
        others = sorted(f"[{n}]" if ":" in n else n for n in self.names if not _is_loopback_host(n))
        shown = ", ".join(["localhost", "127.0.0.1", "[::1]", *others])
        return Refusal(
            421,
            f"this dashboard does not answer to the Host {headers[0]!r}; it answers to {shown} "
            "(a page of another site that points its name at this machine must not read it: "
            "DNS rebinding). Behind a proxy or under another name, start it with "
            "--allowed-host NAME",
        )
