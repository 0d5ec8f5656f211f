"""An app whose tasks log, fail and crash, for the tests of the worker's JSON log lines.

``say`` logs a line of its own (a user's logger, inside the task); ``say_async`` logs before
and after an await, so that two of them overlapping in one async child each log under their
own task; ``fail`` raises; ``die`` ends its process mid-task (a crash the worker records).
"""

from __future__ import annotations

import asyncio
import logging
import os

from tether import AppConfig, TaskError, TaskResult, Tether

app = Tether(AppConfig(queues=["default", "loud"]))

log = logging.getLogger("tests.apps.logs")


@app.task("say")
def say(words: str) -> TaskResult[str, TaskError]:
    log.info("the task says %s", words)
    return TaskResult(ok=words)


@app.task("say_async")
async def say_async(words: str, pause_s: float) -> TaskResult[str, TaskError]:
    log.info("before the pause: %s", words)
    await asyncio.sleep(pause_s)
    log.info("after the pause: %s", words)
    return TaskResult(ok=words)


@app.task("fail")
def fail(why: str) -> None:
    raise ValueError(f"failing on purpose:\n{why}")


@app.task("die")
def die() -> None:
    os._exit(7)
