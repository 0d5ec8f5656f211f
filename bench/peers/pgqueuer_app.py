"""The pgqueuer app of the peers bench: ``pgq run bench.peers.pgqueuer_app:create``.

Two entrypoints, as bench/apps.py's: ``noop`` returns at once, ``hold`` awaits
``asyncio.sleep`` for the seconds in its payload. pgqueuer's worker is asyncio only, so
both are ``async def``. The database comes from PGQUEUER_BENCH_DSN (set by the runner).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
from pgqueuer import PgQueuer
from pgqueuer.models import Job


@asynccontextmanager
async def create() -> AsyncIterator[PgQueuer]:
    # pgqueuer's psycopg driver needs an autocommit connection (its own check says so).
    conn = await psycopg.AsyncConnection.connect(os.environ["PGQUEUER_BENCH_DSN"], autocommit=True)
    pgq = PgQueuer.from_psycopg_connection(conn)

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    @pgq.entrypoint("hold")
    async def hold(job: Job) -> None:
        await asyncio.sleep(float(job.payload or b"3600"))

    try:
        yield pgq
    finally:
        await conn.close()


def main() -> None:
    """``python -m bench.peers.pgqueuer_app [--batch-size N] [--heartbeat-timeout S]
    [--dequeue-timeout S]``: what ``pgq run bench.peers.pgqueuer_app:create`` does, through
    ``pgqueuer.run`` (its documented programmatic form: ``pgq run`` fails at its logger set-up
    with pgqueuer 1.6.0 here, ``'str' object has no attribute 'name'``).
    ``--heartbeat-timeout`` is pgqueuer's staleness threshold; it beats at half of it."""
    import argparse
    from datetime import timedelta

    import pgqueuer

    p = argparse.ArgumentParser(prog="python -m bench.peers.pgqueuer_app")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--dequeue-timeout", type=float, default=30.0)
    args = p.parse_args()
    asyncio.run(
        pgqueuer.run(
            create,
            batch_size=args.batch_size,
            heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
            dequeue_timeout=timedelta(seconds=args.dequeue_timeout),
        )
    )


if __name__ == "__main__":
    main()
