"""``tracing_path``: what tracing adds to one run of a no-op task in the async executor, in process.

    .venv/bin/python -m bench.tracing_path [--runs 2000] [--repeats 40] [--ratio 0.01] [--kinds async,sync]

No database and no worker: the async child's own path for a run (``Executor.run_async`` in an
asyncio task of its own, ``--concurrency`` of them at a time, as ``AsyncChild`` starts them) timed
here with the OpenTelemetry SDK installed (a batch processor whose exporter drops the spans,
bench/otel_sdk.py), for payloads whose stored trace context is

- off: tracing off (``AppConfig.tracing`` False), no context stored;
- unsampled: tracing on, the send not sampled (flags 00): what 99 % of runs are at 1 % sampling;
- sampled: tracing on, the send sampled (flags 01): a recorded CONSUMER span;
- mix: tracing on, ``--ratio`` of the payloads sampled (the bench's ``sampled`` mode).

``--kinds sync`` (or ``async,sync``) times the sync child's path too (``Executor.run``, one run
after the other in this thread).

It prints the CPU time per run (this process, the batch processor's thread included), min over
``--repeats`` interleaved repeats, and each mode's cost over off. The figure is the per-run
code path alone: bench.observability gives what it weighs against a whole no-op task.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from bench import otel_sdk
from tether import AppConfig, PostgresConfig, Tether, tracing
from tether.broker.claims import TaskPayload
from tether.worker.execute import Executor

TRACE = "00-{:032x}-{:016x}-{:02x}"


def app(traced: bool) -> Tether:
    # No connection is opened: the executor only looks tasks up.
    a = Tether(AppConfig(broker=PostgresConfig(database_url="postgresql://unused/none"), tracing=traced))

    @a.task("anoop")
    async def anoop() -> None:
        return None

    @a.task("noop")
    def noop() -> None:
        return None

    return a


def payloads(n: int, sampled_ratio: float | None, name: str = "anoop") -> list[TaskPayload]:
    rnd = random.Random(7)
    out = []
    for i in range(n):
        stored = None
        if sampled_ratio is not None:
            flags = 1 if rnd.random() < sampled_ratio else 0
            stored = TRACE.format(rnd.getrandbits(128) | 1, rnd.getrandbits(64) | 1, flags)
        out.append(TaskPayload(f"id-{i}", name, "default", "[]", "{}", 1, 0, 0, None, None, None, stored))
    return out


async def drain(executor: Executor, batch: list[TaskPayload], concurrency: int) -> None:
    """Each run in an asyncio task of its own (its own copy of the context), ``concurrency``
    at a time: what AsyncChild does for the runs it starts."""
    loop = asyncio.get_running_loop()
    if executor.traced and hasattr(tracing, "follow_runs"):
        tracing.follow_runs()  # what AsyncChild.serve does first (absent before issue 24)
    for i in range(0, len(batch), concurrency):
        tasks = [loop.create_task(executor.run_async(p)) for p in batch[i : i + concurrency]]
        for t in tasks:
            outcome = await t
            assert outcome.error_code is None, outcome


def drain_sync(executor: Executor, batch: list[TaskPayload]) -> None:
    """One run after the other, as a sync child runs them."""
    for p in batch:
        outcome = executor.run(p)
        assert outcome.error_code is None, outcome


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_path")
    p.add_argument("--runs", type=int, default=2_000)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--kinds", default="async", help="comma-separated: async, sync")
    a = p.parse_args(argv)
    otel_sdk.install(1.0)  # the worker's SDK: a run follows the stored decision (ParentBased)
    kinds = a.kinds.split(",")
    modes: dict[str, tuple[str, Executor, list[TaskPayload]]] = {}
    for kind in kinds:
        task = "noop" if kind == "sync" else "anoop"
        modes[f"{kind} off"] = (kind, Executor(app(False)), payloads(a.runs, None, task))
        modes[f"{kind} unsampled"] = (kind, Executor(app(True)), payloads(a.runs, 0.0, task))
        modes[f"{kind} sampled"] = (kind, Executor(app(True)), payloads(a.runs, 1.0, task))
        modes[f"{kind} mix {a.ratio:g}"] = (kind, Executor(app(True)), payloads(a.runs, a.ratio, task))
    best: dict[str, float] = {}
    loop = asyncio.new_event_loop()
    try:
        for _ in range(a.repeats):
            for name, (kind, executor, batch) in modes.items():
                if kind == "sync":
                    drain_sync(executor, batch[:200])  # warm
                    began = time.process_time()
                    drain_sync(executor, batch)
                else:
                    loop.run_until_complete(drain(executor, batch[:200], a.concurrency))  # warm
                    began = time.process_time()
                    loop.run_until_complete(drain(executor, batch, a.concurrency))
                us = 1e6 * (time.process_time() - began) / a.runs
                best[name] = min(best.get(name, us), us)
    finally:
        loop.close()
    print(f"load {os.getloadavg()[0]:.1f}; CPU us per run, min of {a.repeats} (runs {a.runs:,}):")
    for name, us in best.items():
        off = best[name.split()[0] + " off"]
        extra = "" if name.endswith(" off") else f"  (+{us - off:.2f} us over off)"
        print(f"  {name:16} {us:7.2f}{extra}")


if __name__ == "__main__":
    main()
