"""Unique sends (unique.sql): create a task only if no task of its name holds its key.

Plain sends never come here (tasks.insert_task stays as fast as it was); a send with
``unique_key`` runs one of these statements instead. See docs/tasks.md#unique-sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from tether.broker.queries import q
from tether.broker.tasks import SendSpec
from tether.broker.types import AsyncConn, Conn, Row


@dataclass(frozen=True, slots=True)
class UniqueKey:
    """What a unique send asks for: the key, and the window (None: only live tasks hold it)."""

    key: str
    window: timedelta | None


def insert_unique_task(
    conn: Conn, spec: SendSpec, unique: UniqueKey, task_id: UUID, args: str, kwargs: str
) -> UUID:
    """Insert task ``task_id`` unless the key is held; returns the id of the task holding it now.

    The result is ``task_id`` itself when this call created the task.
    """
    row = conn.execute(
        q("insert_unique_task"), _unique_params(spec, unique, task_id, args, kwargs)
    ).fetchone()
    return _holder(row)


async def insert_unique_task_async(
    conn: AsyncConn, spec: SendSpec, unique: UniqueKey, task_id: UUID, args: str, kwargs: str
) -> UUID:
    """insert_unique_task on an async connection (inside the caller's async transaction)."""
    cursor = await conn.execute(q("insert_unique_task"), _unique_params(spec, unique, task_id, args, kwargs))
    return _holder(await cursor.fetchone())


def _unique_params(
    spec: SendSpec, unique: UniqueKey, task_id: UUID, args: str, kwargs: str
) -> dict[str, Any]:
    return {
        **spec.params(),
        "id": task_id,
        "args": args,
        "kwargs": kwargs,
        "unique_key": unique.key,
        "unique_for": unique.window,
    }


def _holder(row: Row | None) -> UUID:
    assert row is not None  # the key insert returns its row whether it created or not
    holder: UUID = row["task_id"]
    return holder


def insert_unique_tasks(
    conn: Conn,
    spec: SendSpec,
    window: timedelta | None,
    keys: Sequence[str],
    ids: Sequence[UUID],
    args: Sequence[str],
    kwargs: Sequence[str],
    *,
    chunk: int,
) -> dict[str, UUID]:
    """Propose task ``ids[i]`` for key ``keys[i]`` (distinct keys, sorted); the caller owns the
    transaction that makes the chunks all or none.

    Returns, for every key, the id of the task that holds it now: ``ids[i]`` where this
    call created the task. ``args[i]`` and ``kwargs[i]`` are task ``ids[i]``'s, as JSON text.
    """
    statement = q("insert_unique_tasks")
    holders: dict[str, UUID] = {}
    for params in _unique_batches(spec, window, keys, ids, args, kwargs, chunk):
        for row in conn.execute(statement, params).fetchall():
            holders[row["unique_key"]] = row["task_id"]
    return holders


async def insert_unique_tasks_async(
    conn: AsyncConn,
    spec: SendSpec,
    window: timedelta | None,
    keys: Sequence[str],
    ids: Sequence[UUID],
    args: Sequence[str],
    kwargs: Sequence[str],
    *,
    chunk: int,
) -> dict[str, UUID]:
    """insert_unique_tasks on an async connection (inside the caller's async transaction)."""
    statement = q("insert_unique_tasks")
    holders: dict[str, UUID] = {}
    for params in _unique_batches(spec, window, keys, ids, args, kwargs, chunk):
        cursor = await conn.execute(statement, params)
        for row in await cursor.fetchall():
            holders[row["unique_key"]] = row["task_id"]
    return holders


def _unique_batches(
    spec: SendSpec,
    window: timedelta | None,
    keys: Sequence[str],
    ids: Sequence[UUID],
    args: Sequence[str],
    kwargs: Sequence[str],
    chunk: int,
) -> Iterator[dict[str, Any]]:
    base = {**spec.params(), "unique_for": window}
    for start in range(0, len(ids), chunk):
        end = start + chunk
        yield {
            **base,
            "ids": ",".join(map(str, ids[start:end])),
            "keys": json.dumps(list(keys[start:end])),
            "args": "[" + ",".join(args[start:end]) + "]",
            "kwargs": "[" + ",".join(kwargs[start:end]) + "]",
        }
