"""The app of the many-host tests (tests/chaos/test_hosts_*.py): the chaos app's tasks, a queue
per host, and two tasks of their own.

Every run still writes its ledger row first (tests/apps/chaos.py), over the host's link.
A worker serves ``--queues default,<host>`` so a test can send a task to one host.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from tests.apps.chaos import build as build_chaos
from tests.apps.chaos import ledger
from tether import AppConfig, RetryPolicy, TaskError, TaskResult, Tether

QUEUES = ["default", "a", "b", "c"]
RETRY_DELAY_S = 2.0
#: fail_once's one retry, RETRY_DELAY_S after its first run failed (no jitter: run_at is exact).
RETRY_ONCE = RetryPolicy.fixed(RETRY_DELAY_S, max_retries=1, auto_retry_for=["FIRST_RUN"], jitter=0)


def build(config: AppConfig | None = None) -> Tether:
    app = build_chaos(config if config is not None else AppConfig(queues=QUEUES))

    @app.task("wall_clock")
    def wall_clock(token: str) -> TaskResult[dict[str, Any], TaskError]:
        """What the host running it says the time is (its wall clock), and its name."""
        ledger(token)
        return TaskResult(ok={"time": time.time(), "hostname": socket.gethostname()})

    @app.task("hold_until_file")
    def hold_until_file(token: str, path: str) -> TaskResult[str, TaskError]:
        """Runs until the file ``path`` exists, then completes at once. The file system is
        shared by every host: the test ends the task at a moment it chooses (as it cuts the
        host's link, say) without any message over the network."""
        ledger(token)
        while not os.path.exists(path):
            time.sleep(0.01)
        return TaskResult(ok=token)

    @app.task("fail_once", retry_policy=RETRY_ONCE)
    def fail_once(token: str) -> TaskResult[int, TaskError]:
        """Fails its first run with FIRST_RUN (retried after RETRY_DELAY_S); later runs complete."""
        runs = ledger(token)
        if runs == 1:
            return TaskResult(err=TaskError("FIRST_RUN", "the first run fails on purpose"))
        return TaskResult(ok=runs)

    return app


app = build()
