"""Big arguments pushed ahead to a busy sync child never stall the worker's main process.

A task's arguments travel to its child through a pipe whose buffer holds about 200 KB.
When the sync child is busy, the next claimed task is pushed ahead to it and waits in its
pipe; with 1 MB or 20 MB of arguments the pipe fills long before the child reads. The
main process must go on meanwhile: its heartbeats (the registry row and the claimer
heartbeat of the waiting task) keep coming, and it claims and hands out other tasks,
which another child (the worker's async child) runs. Once the busy child is free it reads
the big task and runs it with its arguments intact.

Real worker, real PostgreSQL; "busy" is a task waiting for the test to let it go
(tests/apps/gates.py), not a guessed sleep.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import ensure_ledger, load_app_module, runs, task_row
from tests.conftest import WorkerFactory, wait_until

APP = "tests.apps.gates:app"
# A beat a second, so three beats take three seconds (the stale thresholds stay at their defaults).
BEAT_EVERY_S = 1.0
BEATS = {"TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000", "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000"}
WAIT = 30.0

Conn = psycopg.Connection[Any]


@pytest.fixture
def gates(database_url: str, db: Conn) -> ModuleType:
    ensure_ledger(db)
    return load_app_module("gates", database_url)


def token() -> str:
    return uuid.uuid4().hex


def beats_of(db: Conn, worker_id: str, task_id: Any) -> tuple[Any, int]:
    """The registry row's last heartbeat, and how many claimer heartbeats the task has."""
    row = db.execute(
        "SELECT (SELECT last_heartbeat_at FROM tether_workers WHERE id = %s) AS at,"
        " (SELECT count(*) FROM tether_heartbeats WHERE task_id = %s AND role = 'claimer') AS n",
        (worker_id, task_id),
    ).fetchone()
    assert row is not None
    return row["at"], int(row["n"])


@pytest.mark.parametrize("size", [1_000_000, 20_000_000], ids=["1MB", "20MB"])
def test_big_arguments_pushed_to_a_busy_child_stall_neither_heartbeats_nor_claims(
    gates: ModuleType, database_url: str, db: Conn, workers: WorkerFactory, size: int
) -> None:
    from tests.apps.gate_locks import hold_gate

    # One sync child (and the app's async child): the big task is pushed to the busy one.
    worker = workers.start(APP, "--processes", "1", env=BEATS)
    assert worker.worker_id is not None
    blob = secrets.token_hex(size // 2)
    key = secrets.randbits(62)
    with hold_gate(database_url, key) as gate:
        # The sync child busy, with a task that waits for its gate.
        t_gated = token()
        gated = gates.gated.send(key, t_gated)
        wait_until(lambda: runs(db, t_gated) == 1, WAIT, message="the gated task to run")

        # The big task is claimed and pushed ahead to the busy child: it fills that pipe.
        big = gates.digest.send(blob)
        wait_until(lambda: task_row(db, big.id)["status"] == "CLAIMED", WAIT, message="the big task claimed")
        at_0, n_0 = beats_of(db, worker.worker_id, big.id)

        # Heartbeats go on: three more beats of the registry row and of the big task's claim.
        def three_more_beats() -> bool:
            at, n = beats_of(db, worker.worker_id, big.id)
            return n >= n_0 + 3 and at - at_0 >= timedelta(seconds=2 * BEAT_EVERY_S)

        wait_until(three_more_beats, 15 * BEAT_EVERY_S, 0.1, "three more heartbeats while the pipe is full")

        # Claims go on: another task is claimed and handed to the other child, which runs it.
        other_token = token()
        other = gates.record_async.send(other_token)
        assert other.get(timeout=WAIT).ok == other_token, worker.log_tail()
        assert task_row(db, big.id)["status"] == "CLAIMED"  # still waiting behind the gated task

        # The busy child is let go: it reads the big task and runs it, arguments intact.
        gate.open()
        assert gated.get(timeout=WAIT).ok == t_gated
        result = big.get(timeout=WAIT)
        assert result.is_ok, result
        assert result.ok == {"length": size, "sha256": hashlib.sha256(blob.encode()).hexdigest()}

    row = task_row(db, big.id)
    assert (row["status"], row["attempt"]) == ("COMPLETED", 1)
    assert worker.stop() == 0, worker.log_tail()
    assert "Traceback" not in worker.log(), worker.log_tail()
