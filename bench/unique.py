"""What a unique send costs against a plain one (docs/tasks.md#unique-sends).

One producer, no worker, the same app and connection pool for every kind; the kinds run in
interleaved blocks (A/B/C/D, A/B/C/D, ...) so the machine's drift is shared by all:

- ``plain``: ``noop.send()``, the statement every send without a key runs;
- ``unique_new``: ``with_options(unique_key=<new key>).send()``: the key is free, the send
  creates a task and its key row (the cost a deduplicating producer pays on its normal path);
- ``unique_dup``: ``with_options(unique_key=<one key>).send()`` while that key's task is
  PENDING: the send creates nothing and returns the holder (the key row is rewritten);
- ``unique_window``: ``with_options(unique_key=<new key>, unique_for=3600)``: a free key with a
  window (the window costs nothing more when the key was never sent).

Then ``send_many`` of 10,000 plain tasks against 10,000 with distinct keys, interleaved.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.apps import make_app
from bench.infra import count_by_status
from bench.scenarios import Context, Outcome, Row


def unique_sends(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 12_000
    blocks, warmup = 6, 200
    batches, batch = (2 if ctx.quick else 6), 10_000
    ctx.db.reset_tasks()
    app = make_app(ctx.db.url)
    noop = app.tasks["noop"]
    prefix = uuid.uuid4().hex
    counter = iter(range(10**9))
    held = noop.with_options(unique_key=f"{prefix}-held")
    kinds: dict[str, Callable[[], Any]] = {
        "plain": noop.send,
        "unique_new": lambda: noop.with_options(unique_key=f"{prefix}-{next(counter)}").send(),
        "unique_dup": held.send,
        "unique_window": lambda: noop.with_options(
            unique_key=f"{prefix}-{next(counter)}", unique_for=3600
        ).send(),
    }
    seconds = dict.fromkeys(kinds, 0.0)
    many_seconds = {"plain": 0.0, "unique": 0.0}
    try:
        for send in kinds.values():
            for _ in range(warmup):  # pool connection, schema check, prepared statements
                send()
        for _ in range(blocks):
            for kind, send in kinds.items():
                t0 = time.perf_counter()
                for _ in range(n // blocks):
                    send()
                seconds[kind] += time.perf_counter() - t0
        noop.send_many([()] * 100, unique_keys=[f"{prefix}-warm-{i}" for i in range(100)])
        for b in range(batches):
            keys = [f"{prefix}-many-{b}-{i}" for i in range(batch)]
            t0 = time.perf_counter()
            noop.send_many([()] * batch)
            many_seconds["plain"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            noop.send_many([()] * batch, unique_keys=keys)
            many_seconds["unique"] += time.perf_counter() - t0
    finally:
        app.close()
    # plain: warm-up + n; unique_new, unique_window: one task each; unique_dup: one task in all.
    expected = 3 * (n + warmup) + 1 + 100 + 2 * batches * batch
    stored = sum(count_by_status(ctx.db).values())
    if stored != expected:
        raise RuntimeError(f"expected {expected} rows, found {stored}")
    rate = {kind: n / s for kind, s in seconds.items()}
    many = {kind: batches * batch / s for kind, s in many_seconds.items()}
    base = rate["plain"]
    line = (
        f"{n:,} sends each, {blocks} interleaved blocks: plain {base:,.0f}/s ({1e6 / base:.0f} us); "
        + "; ".join(
            f"{kind} {r:,.0f}/s ({1e6 / r:.0f} us, {r / base:.0%} of plain)"
            for kind, r in rate.items()
            if kind != "plain"
        )
        + f". send_many({batch:,}) x {batches}: plain {many['plain']:,.0f}/s, "
        f"distinct keys {many['unique']:,.0f}/s ({many['unique'] / many['plain']:.0%})"
    )
    rows = [Row("unique_sends", f"{kind} sends/s", r, "") for kind, r in rate.items()]
    rows += [Row("unique_sends", f"send_many {kind} tasks/s", r, "") for kind, r in many.items()]
    return Outcome(
        line,
        rows,
        {
            "sends_per_kind": n,
            "blocks": blocks,
            "seconds": seconds,
            "sends_per_s": rate,
            "us_per_send": {kind: 1e6 / r for kind, r in rate.items()},
            "send_many_batches": batches,
            "send_many_batch_size": batch,
            "send_many_seconds": many_seconds,
            "send_many_tasks_per_s": many,
        },
    )


UNIQUE_SCENARIOS: dict[str, Callable[[Context], Outcome]] = {"unique_sends": unique_sends}
