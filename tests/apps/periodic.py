"""An app with periodic tasks, for tests/integration/test_periodic.py.

Its schedules come from TETHER_TEST_SCHEDULES, a JSON list of ``app.periodic`` keyword
sets (with ``cron`` and ``task``), so each worker a test starts can run other code: a
deploy that adds, changes or removes a schedule.
"""

from __future__ import annotations

import json
import os
import time

from tether import AppConfig, Tether

app = Tether(AppConfig(queues=["default", "other"]))


@app.task("beat")
def beat(label: str) -> str:
    return label


@app.task("keyed_beat", concurrency_key="label")
def keyed_beat(label: str) -> str:
    return label


@app.task("slow_beat")
def slow_beat(label: str, seconds: float) -> str:
    time.sleep(seconds)
    return label


for _spec in json.loads(os.environ.get("TETHER_TEST_SCHEDULES", "[]")):
    _options = dict(_spec)
    _task = app.tasks[_options.pop("task")]
    app.periodic(_options.pop("cron"), _task, **_options)
