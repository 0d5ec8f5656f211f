"""A second app on the same database: it sends a task the basic app's workers do not know."""

from __future__ import annotations

from tether import AppConfig, TaskError, TaskResult, Tether

app = Tether(AppConfig(queues=["default", "images", "low"]))


@app.task("only_in_other")
def only_in_other(x: int) -> TaskResult[int, TaskError]:
    return TaskResult(ok=x)
