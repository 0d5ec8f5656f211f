"""The app of the async executor's benchmarks: workers load ``bench.async_apps:app``.

Only ``async def`` tasks, so a worker started on it runs one async child and no sync
child by default (worker/lanes.py). ``anoop`` returns at once; ``asleep(seconds)``
awaits ``asyncio.sleep``: the I/O-bound task the executor exists for; ``astepper(k)``
awaits k checkpointed no-op steps (bench/steps.py). Producers call
``make_app``; the worker's copy reads TETHER_DATABASE_URL.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench import otel_sdk as bench_otel_sdk
from tether import AppConfig, PostgresConfig, Tether, current_task


def _register(app: Tether) -> Tether:
    @app.task("anoop")
    async def anoop() -> None:
        return None

    @app.task("asleep")
    async def asleep(seconds: float) -> None:
        await asyncio.sleep(seconds)

    @app.task("astepper")
    async def astepper(k: int) -> None:
        running = current_task()
        assert running is not None
        for i in range(k):
            await running.step_async("s", _step_value, i)

    return app


async def _step_value(i: int) -> int:
    return i


def make_app(database_url: str | None = None) -> Tether:
    broker: dict[str, Any] = {} if database_url is None else {"database_url": database_url}
    return _register(Tether(AppConfig(broker=PostgresConfig(**broker))))


bench_otel_sdk.install_if_asked()  # tracing's cost: bench/observability.py
app = make_app()
