"""How tether's processes write log lines: the human format (the default) or one JSON object a line.

``setup_logging`` is called by every long-running command (the ``tether`` group, ``tether
worker``, ``tether dashboard``, Django's ``manage.py tether_worker``) and by each child
process of a worker, which receives its parent's ``LogSetup`` so that a worker's lines all
come out in one format. The format comes from ``--log-format``, else
``LoggingConfig.format`` (``TETHER_LOG_FORMAT``), else ``human``.

Why a Formatter subclass of the standard library and not python-json-logger: the whole
format is one ``json.dumps`` of a dict with fixed keys (about forty lines here), and it must
run in every worker child, so a dependency of every install would buy nothing but another
set of defaults to configure away (its timestamp is off and its keys follow a %-format
string by default). What a log pipeline relies on, the keys and their types, is written
down in docs/configuration.md#log-format and tested.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tether.config import LogFormat
from tether.log_fields import TASK_FIELDS, TaskFieldsFilter

#: The human format: today's lines, unchanged. A child's lines also name it and its pid.
HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def human_format(label: str | None = None) -> str:
    if label is None:
        return HUMAN_FORMAT
    return f"%(asctime)s %(levelname)s [{label} {os.getpid()}] %(name)s: %(message)s"


# The attributes every LogRecord has (3.12 added taskName): anything else was given by the
# line (``extra=``) or by a filter, and goes into the JSON object under its own name.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``timestamp`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, ``pid``, ``process_name``; the task fields of tether.log_fields when the line
    is about a task; any other ``extra=`` field; ``exception`` (its traceback) and ``stack``
    when there are. Values JSON has no type for are written as text; a message's newlines are
    escaped, so a line is always one object."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "process_name": record.processName,
        }
        given = record.__dict__
        for key in TASK_FIELDS:
            if key in given:
                entry[key] = given[key]
        for key, value in given.items():
            if key not in _STANDARD and key not in entry and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def formatter(log_format: LogFormat, label: str | None = None) -> logging.Formatter:
    """The formatter of ``log_format``; ``label`` names a worker's child in the human format."""
    if log_format == "json":
        return JsonFormatter()
    return logging.Formatter(human_format(label))


@dataclass(frozen=True, slots=True)
class LogSetup:
    """A process's logging, as a worker hands it to its children (it pickles)."""

    level: int
    format: LogFormat = "human"

    @classmethod
    def current(cls) -> LogSetup:
        """This process's: the root logger's level and the format setup_logging last applied."""
        return cls(logging.getLogger().getEffectiveLevel(), _applied)

    def apply(self, label: str | None = None) -> None:
        setup_logging(self.level, self.format, label=label)


_applied: LogFormat = "human"
_OURS = "_tether_handler"


def setup_logging(level: int | str, log_format: LogFormat = "human", *, label: str | None = None) -> None:
    """Log to stderr at ``level`` in ``log_format``. Called again, it changes the format of the
    handler it installed. Like logging.basicConfig, it leaves a process whose logging was
    configured by someone else (handlers on the root logger that are not tether's) alone."""
    global _applied
    _applied = log_format  # what a worker's children get, whoever formats this process's lines
    root = logging.getLogger()
    ours: list[logging.Handler] = [h for h in root.handlers if getattr(h, _OURS, False)]
    if not ours and root.handlers:
        return
    root.setLevel(level.upper() if isinstance(level, str) else level)
    if not ours:
        stream = logging.StreamHandler()
        setattr(stream, _OURS, True)
        stream.addFilter(TaskFieldsFilter())
        root.addHandler(stream)
        ours = [stream]
    for handler in ours:
        handler.setFormatter(formatter(log_format, label))
