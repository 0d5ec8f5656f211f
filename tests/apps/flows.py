"""The app the workflow tests run: small tasks that pass data along, fail on demand, or hang.

Tasks that take a ``token`` write it to the ledger (tests.apps.basic.ledger),
so tests can count how many times each step's code ran.

Fault injection for the reconciliation tests: with TETHER_TEST_FAULT=
die_before_advance in a worker's environment, a child process exits right
after it has recorded a workflow step's outcome and before the workflow
advances: the exact window that reconciliation exists for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tests.apps.basic import ledger
from tether import AppConfig, ErrorCode, RetryPolicy, TaskError, TaskResult, Tether, current_task

app = Tether(AppConfig(queues=["default", "other"]))


@dataclass
class Box:
    label: str
    size: int


@app.task("wf.number")
def number(value: int, token: str = "") -> TaskResult[int, TaskError]:
    if token:
        ledger(token)
    return TaskResult(ok=value)


@app.task("wf.add")
def add(a: int, b: int = 0, token: str = "") -> TaskResult[int, TaskError]:
    if token:
        ledger(token)
    return TaskResult(ok=a + b)


@app.task("wf.box")
def box(label: str, size: int) -> TaskResult[Box, TaskError]:
    return TaskResult(ok=Box(label, size))


@app.task("wf.measure")
def measure(item: Box) -> TaskResult[str, TaskError]:
    assert isinstance(item, Box), type(item)
    return TaskResult(ok=f"{item.label}:{item.size}")


@app.task("wf.fail")
def fail(code: str = "BROKEN", token: str = "") -> TaskResult[int, TaskError]:
    if token:
        ledger(token)
    return TaskResult(err=TaskError(code, "failed on purpose"))


@app.task("wf.report")
def report(upstream: TaskResult[int, TaskError], token: str = "") -> TaskResult[str, TaskError]:
    """Runs anyway: says what its dependency did."""
    if token:
        ledger(token)
    if upstream.is_ok:
        return TaskResult(ok=f"ok {upstream.ok}")
    err = upstream.err
    assert err is not None
    return TaskResult(ok=f"err {err.code}")


@app.task("wf.first")
def first(a: int | None = None, b: int | None = None) -> TaskResult[int, TaskError]:
    """join='any': whichever dependency completed first feeds it."""
    return TaskResult(ok=a if a is not None else b if b is not None else -1)


@app.task("wf.sleep")
def sleep(seconds: float, token: str = "") -> TaskResult[float, TaskError]:
    if token:
        ledger(token)
    time.sleep(seconds)
    return TaskResult(ok=seconds)


@app.task(
    "wf.crash_retry",
    retry_policy=RetryPolicy.fixed(0.1, max_retries=2, auto_retry_for=[ErrorCode.WORKER_CRASHED], jitter=0),
)
def crash_retry(seconds: float, token: str, later_seconds: float | None = None) -> TaskResult[str, TaskError]:
    """A long step whose crash is retried (WORKER_CRASHED in its policy); ``later_seconds``
    (default ``seconds``): how long the attempts after the first take."""
    ledger(token)
    running = current_task()
    first = running is None or running.attempt == 1
    time.sleep(seconds if first or later_seconds is None else later_seconds)
    return TaskResult(ok=token)


if os.environ.get("TETHER_TEST_FAULT") == "die_before_advance":
    from tether.worker.recorder import Recorder

    def _die(self: Recorder, task: object, outcome: object) -> None:
        os._exit(17)

    Recorder.after_outcome = _die  # type: ignore[method-assign,assignment]
