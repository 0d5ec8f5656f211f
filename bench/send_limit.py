"""A durable send() beside the commit rate of a one-row INSERT with the same durability, in one run.

``send_limit`` (issue 25, part 4: a single durable send at least 0.9x that INSERT's rate,
sync and async). One producer process, no worker; every kind commits durably (fsync'd WAL,
the server's synchronous_commit), one statement and one commit per call, one call at a
time. The kinds run in interleaved blocks (A/B/C, A/B/C, ...) so the machine's drift (a
shared VM moves by tens of percent within minutes) is shared by all, and each block of
sends is compared with the INSERT block just before it:

- ``insert``: ``INSERT INTO bench_one_row (id) VALUES (%s)`` on one psycopg connection in
  autocommit (an ordinary, logged table of two columns and no index: the cheapest durable
  commit one client gets from this server);
- ``task_row``: the same, into ``tether_tasks`` itself (the columns a plain send sets, as
  literals): what the task table's width and indexes cost, without tether's statement;
- ``send``: ``noop.send()`` on the app's pool.

The async part does the same with ``psycopg.AsyncConnection`` and ``await noop.send_async()``,
one at a time (``send_async_concurrent`` measures 16 in flight).

Figure: per kind, tasks (rows) per second over all its blocks; the ratio send / insert per
block pair, median and range. Target: median >= 0.9. Context: the client's CPU per call of each
kind (this process's CPU time over the block, median of the blocks): what the Python of tether
and psycopg costs a send, a figure the machine's load moves much less than the rates.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from bench.apps import make_app
from bench.scenarios import Context, Outcome, Row
from tether.ids import new_task_id

RATIO_TARGET = 0.9
TABLE = "bench_one_row"
INSERT = f"INSERT INTO {TABLE} (id) VALUES (%s)"
# The columns a plain noop.send() sets (the others take their defaults), as literals, with a
# time-ordered id as a send's (tether.ids): a random one would scatter the primary key's
# inserts over its leaf pages, which no send does.
TASK_ROW = (
    "INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries, run_at, enqueued_at)"
    " VALUES (%s, 'noop', 'default', 0, '[]'::jsonb, '{}'::jsonb, 0, now(), now())"
)


def send_limit(ctx: Context) -> Outcome:
    per_block = 200 if ctx.quick else 1_000
    blocks, warmup = (3, 100) if ctx.quick else (8, 200)
    ctx.db.reset_tasks()
    with psycopg.connect(ctx.db.url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigint, at timestamptz DEFAULT now())")
    try:
        sync = _sync(ctx.db.url, per_block, blocks, warmup)
        ctx.db.reset_tasks()
        asynchronous = asyncio.run(_async(ctx.db.url, per_block, blocks, warmup))
    finally:
        with psycopg.connect(ctx.db.url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    rows, parts, detail = [], [], {"per_block": per_block, "blocks": blocks}
    for label, blocks_s in (("sync", sync), ("async", asynchronous)):
        walls = {kind: [wall for wall, _ in times] for kind, times in blocks_s.items()}
        cpu_us = {
            kind: statistics.median(cpu for _, cpu in times) / per_block * 1e6
            for kind, times in blocks_s.items()
        }
        rate = {kind: per_block * len(times) / sum(times) for kind, times in walls.items()}
        ratios = [i / s for s, i in zip(walls["send"], walls["insert"], strict=True)]
        ratio = statistics.median(ratios)
        detail[label] = {
            "rates": rate,
            "block_seconds": walls,
            "client_cpu_us_per_call": cpu_us,
            "send_over_insert": ratios,
        }
        parts.append(
            f"{label}: one-row INSERT {rate['insert']:,.0f}/s, the same into tether_tasks "
            f"{rate['task_row']:,.0f}/s, send {rate['send']:,.0f}/s; send/INSERT per block pair "
            f"median {ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f}); client CPU per call "
            f"{cpu_us['insert']:.0f} / {cpu_us['task_row']:.0f} / {cpu_us['send']:.0f} us"
        )
        rows += [
            Row("send_limit", f"{label}: one-row INSERT, durable, commits/s", rate["insert"], ""),
            Row("send_limit", f"{label}: one-row INSERT into tether_tasks, commits/s", rate["task_row"], ""),
            Row("send_limit", f"{label}: send(), durable, tasks/s", rate["send"], ""),
            Row("send_limit", f"{label}: client CPU per one-row INSERT", cpu_us["insert"], "us"),
            Row("send_limit", f"{label}: client CPU per send()", cpu_us["send"], "us"),
            Row(
                "send_limit",
                f"{label}: send / INSERT, median of {blocks} block pairs",
                ratio,
                "x",
                f">= {RATIO_TARGET:g}x",
                ratio >= RATIO_TARGET,
            ),
        ]
    return Outcome("; ".join(parts), rows, detail)


# Per kind, one (wall seconds, client CPU seconds) per block.
Blocks = dict[str, list[tuple[float, float]]]


def _sync(url: str, per_block: int, blocks: int, warmup: int) -> Blocks:
    app = make_app(url)
    noop = app.tasks["noop"]
    conn = psycopg.connect(url, autocommit=True)
    counter = iter(range(10**9))
    kinds: dict[str, Callable[[], Any]] = {
        "insert": lambda: conn.execute(INSERT, (next(counter),)),
        "task_row": lambda: conn.execute(TASK_ROW, (new_task_id(),)),
        "send": noop.send,
    }
    seconds: Blocks = {kind: [] for kind in kinds}
    try:
        for call in kinds.values():  # psycopg prepares each statement on its 6th run
            for _ in range(warmup):
                call()
        for _ in range(blocks):
            for kind, call in kinds.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(per_block):
                    call()
                seconds[kind].append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        conn.close()
        app.close()
    return seconds


async def _async(url: str, per_block: int, blocks: int, warmup: int) -> Blocks:
    app = make_app(url)
    noop = app.tasks["noop"]
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    counter = iter(range(10**9))

    async def insert() -> None:
        await conn.execute(INSERT, (next(counter),))

    async def task_row() -> None:
        await conn.execute(TASK_ROW, (new_task_id(),))

    async def send() -> None:
        await noop.send_async()

    kinds: dict[str, Callable[[], Awaitable[None]]] = {"insert": insert, "task_row": task_row, "send": send}
    seconds: Blocks = {kind: [] for kind in kinds}
    try:
        for call in kinds.values():
            for _ in range(warmup):
                await call()
        for _ in range(blocks):
            for kind, call in kinds.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(per_block):
                    await call()
                seconds[kind].append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        await conn.close()
        aclose = getattr(app.broker, "aclose", None)
        if aclose is not None:
            await aclose()
        await asyncio.to_thread(app.close)
    return seconds


SEND_LIMIT_SCENARIOS = {"send_limit": send_limit}
