"""The tether database of a Django backend: a DATABASES alias turned into a postgresql:// URL.

tether's own connections (a worker's, and a web process's reads) go to the same server
and database as Django's connection of that alias, with the same user, password, host,
port and libpq options, so there is one database to configure and one to back up.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

#: Keys of a PostgreSQL alias's OPTIONS that are Django's, not libpq's: never put in the URL.
DJANGO_ONLY_OPTIONS = frozenset(
    {
        "assume_role",
        "context",
        "cursor_factory",
        "isolation_level",
        "pool",
        "prepare_threshold",
        "server_side_binding",
    }
)


def database_url(alias: str, where: str) -> str:
    """The URL of Django's database ``alias``; ``where`` names the setting that chose it."""
    if alias not in connections.settings:
        known = ", ".join(repr(a) for a in connections.settings) or "none"
        raise ImproperlyConfigured(
            f"{where}: {alias!r} is not a database alias in settings.DATABASES (aliases: {known})"
        )
    settings: dict[str, Any] = connections.settings[alias]
    # The wrapper's vendor, not the ENGINE string: PostGIS and other PostgreSQL engines count too.
    if connections[alias].vendor != "postgresql":
        raise ImproperlyConfigured(
            f"{where}: DATABASES[{alias!r}] uses ENGINE {settings.get('ENGINE')!r}, which is not "
            "PostgreSQL; tether stores its tasks in PostgreSQL: name a PostgreSQL alias"
        )
    return url_from_settings(settings)


def url_from_settings(settings: dict[str, Any]) -> str:
    """A postgresql:// URL from a DATABASES entry (NAME, USER, PASSWORD, HOST, PORT, OPTIONS)."""
    options: dict[str, Any] = dict(settings.get("OPTIONS") or {})
    user = str(settings.get("USER") or "")
    password = str(settings.get("PASSWORD") or "")
    host = str(settings.get("HOST") or "")
    port = str(settings.get("PORT") or "")
    name = settings.get("NAME")
    query: dict[str, str] = {}
    if name is None:
        name = "postgres"  # what Django connects to when NAME is None
        options.pop("service", None)
    for key, value in options.items():
        if key in DJANGO_ONLY_OPTIONS or isinstance(value, dict | list | tuple) or value is None:
            continue
        query[key] = str(value).lower() if isinstance(value, bool) else str(value)
    userinfo = ""
    if user:
        userinfo = quote(user, safe="")
        if password:
            userinfo += ":" + quote(password, safe="")
        userinfo += "@"
    elif password:
        query["password"] = password
    netloc_host = host
    if host.startswith("/"):
        # A Unix socket directory cannot sit in the URL's host part: libpq takes it as a parameter.
        query["host"] = host
        netloc_host = ""
    elif ":" in host and not host.startswith("["):
        netloc_host = f"[{host}]"  # an IPv6 address
    netloc = userinfo + netloc_host + (f":{port}" if port else "")
    path = "/" + quote(str(name), safe="") if name else "/"
    return f"postgresql://{netloc}{path}" + (f"?{urlencode(query)}" if query else "")
