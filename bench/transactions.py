"""What a send inside the caller's own transaction costs (docs/transactions.md), beside a plain send.

One producer, no worker, the same app for every kind; the kinds run in interleaved blocks
(A/B/C, A/B/C, ...) so the machine's drift is shared by all. Every kind commits durably.

- ``plain``: ``noop.send()`` on the app's pool: one statement, its own transaction;
- ``in_tx_1``: one ``with_options(connection=conn).send()`` per transaction of the caller's
  own psycopg connection, then ``conn.commit()``: the price of "the task commits with my rows";
- ``in_tx_100``: 100 such sends per transaction, then one commit (a request that sends many).

A send inside the caller's transaction always NOTIFYs at commit (tasks.sql says why);
with no worker waiting, a plain send does not, so this is the costlier case for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from bench.apps import make_app
from bench.infra import count_by_status
from bench.scenarios import Context, Outcome, Row


def caller_transaction_sends(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 12_000
    blocks, warmup, per_tx = 6, 200, 100
    ctx.db.reset_tasks()
    app = make_app(ctx.db.url)
    noop = app.tasks["noop"]
    conn = psycopg.connect(ctx.db.url)  # the application's connection: not autocommit
    in_tx = noop.with_options(connection=conn)

    def plain(count: int) -> None:
        for _ in range(count):
            noop.send()

    def one_per_tx(count: int) -> None:
        for _ in range(count):
            in_tx.send()
            conn.commit()

    def hundred_per_tx(count: int) -> None:
        for _ in range(count // per_tx):
            for _ in range(per_tx):
                in_tx.send()
            conn.commit()

    kinds: dict[str, Callable[[int], None]] = {
        "plain": plain,
        "in_tx_1": one_per_tx,
        f"in_tx_{per_tx}": hundred_per_tx,
    }
    seconds = dict.fromkeys(kinds, 0.0)
    try:
        for run in kinds.values():
            run(warmup)  # pool connection, schema and database checks, prepared statements
        for _ in range(blocks):
            for kind, run in kinds.items():
                t0 = time.perf_counter()
                run(n // blocks)
                seconds[kind] += time.perf_counter() - t0
    finally:
        conn.close()
        app.close()
    expected = len(kinds) * (warmup + n // blocks * blocks)
    stored = sum(count_by_status(ctx.db).values())
    if stored != expected:
        raise RuntimeError(f"expected {expected} rows, found {stored}")
    rate = {kind: (n // blocks * blocks) / s for kind, s in seconds.items()}
    base = rate["plain"]
    line = (
        f"{n:,} sends each, {blocks} interleaved blocks: plain {base:,.0f}/s ({1e6 / base:.0f} us); "
        + "; ".join(
            f"{kind} {r:,.0f}/s ({1e6 / r:.0f} us, {r / base:.0%} of plain)"
            for kind, r in rate.items()
            if kind != "plain"
        )
    )
    rows = [Row("caller_transaction_sends", f"{kind} sends/s", r, "") for kind, r in rate.items()]
    return Outcome(
        line,
        rows,
        {
            "sends_per_kind": n,
            "blocks": blocks,
            "sends_per_transaction": per_tx,
            "seconds": seconds,
            "sends_per_s": rate,
            "us_per_send": {kind: 1e6 / r for kind, r in rate.items()},
        },
    )


TRANSACTION_SCENARIOS: dict[str, Callable[[Context], Outcome]] = {
    "caller_transaction_sends": caller_transaction_sends
}
