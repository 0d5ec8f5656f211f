"""A producer (web process, cron script, notebook) exits at once and silently, closed or not.

On Python 3.13 a script that sent a few tasks without closing its app took ~20 s to
exit and printed "couldn't stop thread 'tether-worker-0' within 5.0 seconds" once per
pool thread: the pool was left to the garbage collector after its threads were frozen.
CI runs this file on every supported Python (see .ci/run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import psycopg
import pytest

from tests.conftest import REPO

# On every supported Python (the smoke set), as how an interpreter exits differs between
# versions; not on the external server (--subset server): nothing of it is the server's.
pytestmark = [pytest.mark.smoke, pytest.mark.server_agnostic]

EXIT_WITHIN_S = 2.0  # the whole script, interpreter start and imports included
# From the script's last statement to the process being gone (on 3.13 without the fix: ~20 s).
SHUTDOWN_WITHIN_S = 1.0

PRODUCER = """
import sys
import time
from tether import AppConfig, PostgresConfig, TaskResult, Tether

def make_app() -> Tether:
    app = Tether(AppConfig(broker=PostgresConfig(database_url=sys.argv[1])))

    @app.task("exit.noop")
    def noop(n: int) -> TaskResult[int, str]:
        return TaskResult(ok=n)

    return app

mode = sys.argv[2]
if mode == "with":
    with make_app() as app:
        app.tasks["exit.noop"].send(1)
        app.tasks["exit.noop"].send_many([(2,), (3,)])
else:
    app = make_app()
    noop = app.tasks["exit.noop"]
    noop.send(1)
    noop.send_many([(2,), (3,)])
    if mode == "wait":  # get() starts the result listener's thread and connection too
        print(noop.send(4).get(timeout=0.2).err.code, flush=True)
    if mode == "close":
        app.close()
print(time.monotonic(), flush=True)  # CLOCK_MONOTONIC: the same clock in the test's process
"""


@pytest.mark.timing
@pytest.mark.parametrize("mode", ["no-close", "close", "with", "wait"])
def test_producer_sends_and_exits_at_once(
    database_url: str, db: psycopg.Connection[Any], tmp_path: Any, mode: str
) -> None:
    script = tmp_path / "producer.py"
    script.write_text(textwrap.dedent(PRODUCER))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), database_url, mode],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    ended = time.monotonic()
    python = sys.version.split()[0]
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", f"{python}: stderr not empty:\n{done.stderr}"
    *printed, last_statement = done.stdout.split()
    shutdown = ended - float(last_statement)
    assert shutdown < SHUTDOWN_WITHIN_S, f"{python}: {shutdown:.2f}s from the last statement to the exit"
    assert ended - started < EXIT_WITHIN_S, f"{python}: the producer took {ended - started:.2f}s in all"
    sent = db.execute("SELECT count(*) AS n FROM tether_tasks WHERE name = 'exit.noop'").fetchone()
    assert sent is not None and sent["n"] == (4 if mode == "wait" else 3)
    assert printed == (["WAIT_TIMEOUT"] if mode == "wait" else [])


def test_close_twice_and_context_manager_close_the_pool(database_url: str) -> None:
    from tether import AppConfig, PostgresConfig, Tether

    with Tether(AppConfig(broker=PostgresConfig(database_url=database_url))) as app:
        pool = app.broker.pool
        assert not pool.closed
    assert pool.closed
    app.close()  # a second close is harmless
    assert pool.closed
