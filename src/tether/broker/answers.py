"""Answers of requests that change things (answers.sql, migration 0010).

``PostgresBroker.run_request`` records a request's answer in the request's own
transaction, so a repeat after a lost connection returns what the first attempt answered
instead of answering again for the state that attempt left. The answer travels as JSON
made by a pydantic ``TypeAdapter`` of its type (``Answer``), one per type, named next to it.
"""

from __future__ import annotations

import uuid
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter

from tether.broker.queries import q
from tether.broker.types import Conn

T = TypeVar("T")


class Answer(Generic[T]):
    """How the answers of one type are recorded: JSON through a pydantic TypeAdapter, which is
    built on first use (building one costs ~1 ms, and every process imports these modules)."""

    def __init__(self, of: Any) -> None:
        self._of = of
        self._adapter: TypeAdapter[T] | None = None

    def _get(self) -> TypeAdapter[T]:
        if self._adapter is None:
            self._adapter = TypeAdapter(self._of)
        return self._adapter

    def dump(self, value: T) -> str:
        return self._get().dump_json(value).decode()

    def load(self, text: str) -> T:
        return self._get().validate_json(text)


#: The answer of a request that says whether it changed something.
CHANGED: Answer[bool] = Answer(bool)


def record_answer(conn: Conn, request_id: uuid.UUID, answer: str) -> bool:
    """Record ``answer`` (JSON) for ``request_id`` in the caller's transaction; False if an
    earlier attempt of the request recorded one first (roll this attempt back)."""
    row = conn.execute(q("record_answer"), {"id": request_id, "answer": answer}).fetchone()
    return row is not None


def recorded_answer(conn: Conn, request_id: uuid.UUID) -> str | None:
    """The answer (JSON) an attempt of ``request_id`` committed, or None if none did."""
    row = conn.execute(q("recorded_answer"), {"id": request_id}).fetchone()
    return None if row is None else str(row["answer"])
