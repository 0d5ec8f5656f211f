"""The app the benchmarks run: workers load ``bench.apps:app``; producers call ``make_app``.

Four tasks: ``noop`` (returns at once), ``hold(seconds)`` (sleeps: the long task the
recovery scenarios kill; no retry policy, so a crash FAILS it with WORKER_CRASHED) and
``stepper(k)`` (k checkpointed no-op steps, bench/steps.py); ``napper(wake_at)`` sleeps durably
until then (bench/sleeps.py).
With TETHER_BENCH_SCHEDULE set (a cron expression), the app also sends ``noop`` by that
schedule, named "bench" (the periodic_lateness scenario).

The worker's copy reads its database from TETHER_DATABASE_URL (set by the
benchmark for the worker subprocess). Building a Tether opens nothing, so
importing this module is free.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench import otel_sdk as bench_otel_sdk
from tether import AppConfig, PostgresConfig, TaskError, TaskResult, Tether, current_task


def _register(app: Tether) -> Tether:
    @app.task("noop")
    def noop() -> TaskResult[None, TaskError]:
        return TaskResult(ok=None)

    @app.task("hold")
    def hold(seconds: float) -> TaskResult[None, TaskError]:
        time.sleep(seconds)
        return TaskResult(ok=None)

    @app.task("stepper")
    def stepper(k: int) -> TaskResult[None, TaskError]:
        running = current_task()
        assert running is not None
        for i in range(k):
            running.step("s", _step_value, i)
        return TaskResult(ok=None)

    @app.task("napper")
    def napper(wake_at: float) -> TaskResult[None, TaskError]:
        """One durable sleep until ``wake_at`` (epoch seconds, this machine's clock), then done."""
        running = current_task()
        assert running is not None
        running.sleep(max(0.0, wake_at - time.time()))
        return TaskResult(ok=None)

    schedule = os.environ.get("TETHER_BENCH_SCHEDULE")
    if schedule:
        app.periodic(schedule, noop, name="bench")
    return app


def _step_value(i: int) -> int:
    return i


def make_app(database_url: str | None = None, *, pool_max_size: int | None = None) -> Tether:
    """A producer-side app on ``database_url`` (pool sized by ``pool_max_size`` when given)."""
    broker: dict[str, Any] = {}
    # Only explicit values: passing None would override TETHER_* from the environment.
    if database_url is not None:
        broker["database_url"] = database_url
    if pool_max_size is not None:
        broker["pool_max_size"] = pool_max_size
    return _register(Tether(AppConfig(broker=PostgresConfig(**broker))))


bench_otel_sdk.install_if_asked()  # tracing's cost: bench/observability.py
app = make_app()
noop = app.tasks["noop"]
hold = app.tasks["hold"]
