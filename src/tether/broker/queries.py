"""Named SQL statements, loaded once from the .sql files beside this module.

Keeping the SQL in .sql files (one statement per ``-- name:`` block) puts every
statement tether runs in one reviewable place; Python code refers to them by
name and never builds SQL.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import LiteralString

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@cache
def _all() -> dict[str, LiteralString]:
    found: dict[str, LiteralString] = {}
    for entry in resources.files("tether.broker").joinpath("sql").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text(encoding="utf-8")
        parts = _NAME.split(text)
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise RuntimeError(f"SQL statement {name!r} is defined twice ({entry.name})")
            statement = _strip_comments(body)
            # The files ship with the package; they are as trusted as this code.
            found[name] = statement
    return found


def _strip_comments(body: str) -> LiteralString:
    lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";")


def q(name: str) -> LiteralString:
    """The statement called ``name``; a KeyError names it if it does not exist."""
    try:
        return _all()[name]
    except KeyError:
        raise KeyError(f"no SQL statement named {name!r} in tether/broker/sql") from None
