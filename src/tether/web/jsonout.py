"""The dashboard's JSON: how values are written, and the error every endpoint can answer with."""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from datetime import date, datetime
from decimal import Decimal
from typing import Any


class ApiError(Exception):
    """Answer the request with this HTTP status and ``{"error": message}``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID | Decimal):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def encode(value: Any) -> bytes:
    """``value`` as JSON: dataclasses as objects, times in ISO 8601, UUIDs as text."""
    return json.dumps(value, default=_default, ensure_ascii=False).encode()
