"""The flow-control test app (docs/limits.md): queues with limits declared in code, and tasks
that take their concurrency key from an argument.

- ``keyed``: at most 2 in flight per key.
- ``serial``: one at a time per key (FIFO per key).
- ``capped``: at most 3 in flight in the whole queue.
- ``fair``: no limit, keys served round-robin.
- ``rated``: at most 10 claims a second, burst 10.
- ``keyrated``: at most 10 claims a second per key, burst 10 per key.
"""

from __future__ import annotations

import asyncio
import time

import psycopg

from tests.apps.basic import ledger
from tests.apps.support import machinery_url
from tether import AppConfig, ErrorCode, QueueLimits, RetryPolicy, TaskError, TaskResult, Tether

app = Tether(
    AppConfig(
        queues=["default", "keyed", "serial", "capped", "fair", "rated", "keyrated"],
        queue_limits={
            "keyed": QueueLimits(per_key=2),
            "serial": QueueLimits(per_key=1),
            "capped": QueueLimits(max_in_flight=3),
            "fair": QueueLimits(),
            "rated": QueueLimits(rate_limit=10, rate_period_s=1.0),
            "keyrated": QueueLimits(key_rate_limit=10, key_rate_period_s=1.0),
        },
    )
)


@app.task("tenant_work", queue="keyed", concurrency_key="tenant")
def tenant_work(tenant: str, seconds: float, token: str = "") -> TaskResult[str, TaskError]:
    if token:
        ledger(token)
    time.sleep(seconds)
    return TaskResult(ok=tenant)


@app.task("tenant_work_async", queue="keyed", concurrency_key="tenant")
async def tenant_work_async(tenant: str, seconds: float, token: str = "") -> TaskResult[str, TaskError]:
    if token:
        ledger(token)
    await asyncio.sleep(seconds)
    return TaskResult(ok=tenant)


@app.task("plain_work")
def plain_work(seconds: float, token: str = "") -> TaskResult[float, TaskError]:
    if token:
        ledger(token)
    time.sleep(seconds)
    return TaskResult(ok=seconds)


@app.task(
    "tenant_crashy",
    queue="keyed",
    concurrency_key="tenant",
    retry_policy=RetryPolicy.fixed(0.1, max_retries=2, auto_retry_for=[ErrorCode.WORKER_CRASHED], jitter=0),
)
def tenant_crashy(tenant: str, seconds: float, token: str = "") -> TaskResult[str, TaskError]:
    """A task a test kills its worker under (retried after a crash: nothing is lost). Runs
    ``seconds`` the first time its token is seen, at once when retried."""
    first = not token or not ran_before(token)
    if token:
        ledger(token)
    time.sleep(seconds if first else 0.0)
    return TaskResult(ok=tenant)


def ran_before(token: str) -> bool:
    with psycopg.connect(machinery_url(), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM tether_test_ledger WHERE token = %s", (token,)).fetchone()
    return bool(row and row[0])
