"""The rules for the names a caller or an operator gives tether: queue names, task names and
``by`` (who asks for a cancel, a retry, a pause or a resume). One rule each, and one error
style that names the argument: ``<argument> must be <rule>; got <value>``.

The Python API, the CLI, the dashboard's actions and the configuration all check here, so
a name one of them accepts, every other accepts too. Checked before anything is written.
"""

from __future__ import annotations

import re
from typing import Any

from tether.errors import InvalidOptionError, TetherError

MAX_QUEUE_NAME_LENGTH = 64
MAX_TASK_NAME_LENGTH = 200
MAX_BY_LENGTH = 200

# Always used with fullmatch: with match, `$` would let a final newline through.
_QUEUE_NAME = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_QUEUE_NAME_LENGTH}}}")
_TASK_NAME = re.compile(rf"[A-Za-z_][A-Za-z0-9_.:-]{{0,{MAX_TASK_NAME_LENGTH - 1}}}")

QUEUE_NAME_RULE = f"a queue name: 1 to {MAX_QUEUE_NAME_LENGTH} characters from A-Z a-z 0-9 _ . : -"
TASK_NAME_RULE = (
    f"a task name: 1 to {MAX_TASK_NAME_LENGTH} characters from A-Z a-z 0-9 _ . : -, the first a letter or _"
)
BY_RULE = (
    f"who asks: 1 to {MAX_BY_LENGTH} printable characters, not only spaces "
    "(no newline, tab or other control character)"
)


def is_queue_name(value: object) -> bool:
    return isinstance(value, str) and _QUEUE_NAME.fullmatch(value) is not None


def is_task_name(value: object) -> bool:
    return isinstance(value, str) and _TASK_NAME.fullmatch(value) is not None


def check_queue_name(value: Any, what: str = "queue") -> str:
    """``value`` if it is a well-formed queue name (declared or not), else InvalidOptionError."""
    if not is_queue_name(value):
        raise refusal(what, QUEUE_NAME_RULE, value)
    return str(value)


def check_task_name(value: Any, what: str = "name", error: type[TetherError] = InvalidOptionError) -> str:
    """``value`` if it is a well-formed task name, else ``error`` (app.task raises
    TaskDefinitionError)."""
    if not is_task_name(value):
        raise refusal(what, TASK_NAME_RULE, value, error)
    return str(value)


def check_by(value: Any, what: str = "by") -> str | None:
    """Who asks for an operator's action (stored with a cancel or a pause, logged with each):
    None (not said), or text that a log line and a table cell show as it is."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_BY_LENGTH
        or not value.isprintable()  # control, format and separator characters but the space
        or value.isspace()
    ):
        raise refusal(what, BY_RULE, value)
    return value


def refusal(
    what: str, rule: str, value: object, error: type[TetherError] = InvalidOptionError
) -> TetherError:
    """The error for ``value`` given as ``what`` against ``rule``, in the one style of this module."""
    return error(f"{what} must be {rule}; got {shown(value)}")


def shown(value: object, limit: int = 40) -> str:
    """``value`` as an error message shows it: a str by its repr (control characters visible),
    cut after ``limit`` characters; anything else with its type."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{text} ({type(value).__name__})"


def check_storable_text(key: str, what: str) -> str:
    """``key`` if PostgreSQL text can store it (no NUL, no lone surrogate); the error names ``what``."""
    if "\x00" in key:
        raise InvalidOptionError(f"{what} must not contain a NUL character (PostgreSQL text cannot store it)")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidOptionError(f"{what} must be valid Unicode text (it has a lone surrogate)") from None
    return key
