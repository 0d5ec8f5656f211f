"""The network lets the workers down: every one of their connections is terminated, again and
again (pg_terminate_backend), while they work through 200 short tasks.

Every connection a worker has drops at once: its pool, its listener, its reaper, each
child's recorder, the tasks' own (the chaos ledger). A write cut off around its COMMIT is
ambiguous; the worker retries it and tells "already done by us" from "lost". In the end
every task is COMPLETED, its code ran exactly once, and nothing is left CLAIMED or RUNNING.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tests.chaos.conftest import APP, FAST, check_history, token, wait_all
from tests.conftest import WorkerFactory, wait_until

TASKS = 200
# The workers' connections are named by their job (tether-worker, -heartbeat, -reaper,
# -listener); the test's own connections, named 'tether', are spared.
WORKER_ENV = FAST

TERMINATE = """
SELECT application_name, pg_terminate_backend(pid) AS terminated FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'tether%%'
  AND application_name <> 'tether' AND pid <> pg_backend_pid()
"""


def finished(db: Any) -> int:
    row = db.execute(
        "SELECT count(*) AS n FROM tether_tasks WHERE status IN ('COMPLETED', 'FAILED')"
    ).fetchone()
    return int(row["n"])


def test_terminated_connections_lose_no_task_and_run_none_twice(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    started = [workers.start(APP, "--processes", "2", env=WORKER_ENV) for _ in range(2)]
    toks = [token() for _ in range(TASKS)]
    handles = chaos.app.tasks["work"].send_many([(t, 20) for t in toks])
    ids = [h.id for h in handles]

    rounds: list[dict[str, int]] = []
    wait_until(lambda: finished(db) >= 10, timeout=30, message="the workers to get going")
    while finished(db) < TASKS and len(rounds) < 20:
        killed: dict[str, int] = {}
        for row in db.execute(TERMINATE).fetchall():
            if row["terminated"]:
                # A work listener's name ends with its worker's id ('tether-listener <id>').
                kind = row["application_name"].split(" ")[0]
                killed[kind] = killed.get(kind, 0) + 1
        rounds.append(killed)
        done = finished(db)
        # Let them make progress (they must reconnect to do so) before the next blow.
        wait_until(
            lambda done=done: finished(db) >= min(TASKS, done + 15),
            timeout=30,
            message=f"progress after terminating {killed}",
        )

    assert len(rounds) >= 3, rounds  # the blows really landed mid-run
    first = rounds[0]
    # The first blow hit every kind of connection the workers hold.
    for name in ("tether-worker", "tether-reaper", "tether-heartbeat", "tether-listener"):
        assert first.get(name, 0) >= 2, first

    wait_all(db, ids, {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"}, timeout=60)
    rows = db.execute(
        "SELECT t.id, t.status, t.error_code, t.args->>0 AS token,"
        " (SELECT count(*) FROM tether_chaos_ledger l WHERE l.token = t.args->>0) AS runs"
        " FROM tether_tasks t"
    ).fetchall()
    assert len(rows) == TASKS
    bad = [
        (r["id"], r["status"], r["error_code"], r["runs"])
        for r in rows
        if r["status"] != "COMPLETED" or r["runs"] != 1
    ]
    fences = [line for w in started for line in w.log().splitlines() if "isolating itself" in line]
    assert not bad, f"{len(bad)} task(s) not COMPLETED once: {bad[:10]}; self-fencing: {fences}"
    for task_id in ids:
        check_history(db, task_id)
    in_flight = db.execute(
        "SELECT count(*) AS n FROM tether_tasks WHERE status IN ('PENDING', 'CLAIMED', 'RUNNING')"
    ).fetchone()
    assert in_flight["n"] == 0
    for w in started:
        assert w.proc.poll() is None, w.log()
        assert "Traceback" not in w.log(), w.log()
    print(f"\n{len(rounds)} rounds of pg_terminate_backend: {rounds}")
