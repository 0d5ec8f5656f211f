"""kill -9 of a worker holding limited slots (docs/limits.md): the slots come back only when
recovery settles the dead worker's tasks, at once then, and nothing is lost."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from tests.apps.support import ensure_ledger, load_app_module
from tests.chaos.conftest import FAST
from tests.conftest import WorkerFactory, wait_until
from tests.limit_sampler import InFlightSampler

APP = "tests.apps.limited:app"
QUEUES = "keyed,serial,capped,fair,rated,default"


def _statuses(db: psycopg.Connection[Any], ids: list[Any]) -> dict[str, int]:
    rows = db.execute(
        "SELECT status, count(*) AS n FROM tether_tasks WHERE id = ANY(%s) GROUP BY status", (ids,)
    ).fetchall()
    return {r["status"]: r["n"] for r in rows}


@pytest.mark.timeout(120)
def test_slots_of_a_killed_worker_return_only_when_recovery_settles_its_tasks(
    db: psycopg.Connection[Any], database_url: str, direct_url: str, workers: WorkerFactory
) -> None:
    limited = load_app_module("limited", database_url)
    ensure_ledger(db)
    prefix = uuid.uuid4().hex
    # --prefetch 0: A, busy with two long tasks, must not hold other keys' tasks in its buffer.
    a = workers.start(APP, "--processes", "2", "--prefetch", "0", "--queues", QUEUES, env=FAST)
    # A takes both slots of key k with long tasks.
    held = [limited.tenant_crashy.send("k", 60, f"{prefix}-held-{i}").id for i in range(2)]
    wait_until(lambda: _statuses(db, held) == {"RUNNING": 2}, message="A to run both tasks of k")
    with InFlightSampler(direct_url, "keyed") as sampler:
        workers.start(APP, "--processes", "4", "--queues", QUEUES, env=FAST)
        waiting = [limited.tenant_work.send("k", 0.05).id for _ in range(4)]
        others = [limited.tenant_work.send(f"other-{i % 2}", 0.05).id for i in range(8)]
        # B claims the other keys' tasks instead of sleeping, and none of k's.
        wait_until(lambda: _statuses(db, others) == {"COMPLETED": 8}, message="B to run the other keys")
        assert _statuses(db, waiting) == {"PENDING": 4}
        a.kill()  # SIGKILL to A's whole process group
        wait_until(lambda: _statuses(db, waiting + held) == {"COMPLETED": 6}, timeout=60, message="all of k")
    assert sampler.max_per_key["k"] == 2  # never more, with a dead worker's rows in between
    # The crashed attempts were settled by recovery (WORKER_CRASHED, retried: nothing lost)...
    settled = db.execute(
        "SELECT min(finished_at) AS first, max(finished_at) AS last, count(*) AS n FROM tether_task_attempts "
        "WHERE task_id = ANY(%s) AND attempt = 1 AND error_code = 'WORKER_CRASHED'",
        (held,),
    ).fetchone()
    assert settled is not None and settled["n"] == 2
    # ...and no task of k was claimed before the first of them freed its slot, then at once.
    first_claim = db.execute(
        "SELECT min(claimed_at) AS at FROM tether_tasks WHERE id = ANY(%s)", (waiting,)
    ).fetchone()
    assert first_claim is not None
    assert first_claim["at"] >= settled["first"]
    assert (first_claim["at"] - settled["first"]).total_seconds() < 0.5
    runs = db.execute(
        "SELECT count(*) AS n FROM tether_test_ledger WHERE token LIKE %s", (prefix + "-held-%",)
    ).fetchone()
    assert runs == {"n": 4}  # each held task ran twice: killed once, retried once
