"""`tether demo`, the README's first command, end to end on the test database.

It starts its own workers, kills one mid-task and must exit 0 only when the batch
completed, the crash-retried workflow step completed (and its workflow with it), and
the task without crash retries failed with WORKER_CRASHED.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import psycopg
import pytest

from tests.conftest import REPO

# Left out of the external-server run (--subset server, tests/conftest.py):
# `tether demo` as a new user runs it; nothing of it is specific to a server.
pytestmark = pytest.mark.server_agnostic


@pytest.mark.smoke
def test_demo_runs_the_main_job_and_shows_the_recovery(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    env = {**os.environ, "TETHER_DATABASE_URL": database_url, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "tether", "demo", "--tasks", "50"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "50 of 50 finished" in out
    assert "demo.charge: TaskError(code=<ErrorCode.WORKER_CRASHED" in out
    assert "workflow demo.video: COMPLETED (plan COMPLETED, render COMPLETED, publish COMPLETED)" in out
    assert "its result: published (rendered 40 frames)" in out
    # Its workers were stopped: none is left active.
    row = db.execute("SELECT count(*) AS n FROM tether_workers WHERE status = 'active'").fetchone()
    assert row is not None and row["n"] == 0
