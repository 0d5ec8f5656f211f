"""kill -9 of a worker running a unique task: recovery never lets a second copy of the key in.

The task's policy retries WORKER_CRASHED: the survivor's reaper records the crash and puts
it back to PENDING, then runs it again. Throughout (RUNNING on the dead worker, stale,
PENDING for its retry, RUNNING again) every send with its key must return the same task,
and no other task with that key may appear. Once it ends the key is free.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tests.apps.support import task_row
from tests.chaos.conftest import APP, FAST, check_history, last_heartbeat, runs, token
from tests.conftest import WorkerFactory, wait_until


def keyed_ids(db: Any, name: str, key: str) -> list[Any]:
    rows = db.execute(
        "SELECT id FROM tether_tasks WHERE name = %s AND unique_key = %s ORDER BY id", (name, key)
    ).fetchall()
    return [r["id"] for r in rows]


def test_a_unique_task_keeps_its_key_through_a_worker_kill_and_its_retry(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    key = f"unique-crash-{token()}"
    hold_retry = chaos.app.tasks["hold_retry"].with_options(unique_key=key)
    hold = chaos.app.tasks["hold"].with_options(unique_key=key + "-no-retry")
    a = workers.start(APP, "--processes", "2", env=FAST)
    tok, tok_fail = token(), token()
    first = hold_retry.send(tok, 60, 1.0)  # 60 s on its first run (killed), 1 s on the retry
    doomed = hold.send(tok_fail, 60)  # no retry policy: FAILED with WORKER_CRASHED
    wait_until(
        lambda: (
            all(
                (r := task_row(db, h.id))["status"] == "RUNNING" and r["claimed_by_worker_id"] == a.worker_id
                for h in (first, doomed)
            )
            and last_heartbeat(db, first.id, "runner") is not None
        ),
        message="A to run both unique tasks, with a runner heartbeat",
    )
    b = workers.start(APP, "--processes", "2", env=FAST)
    a.kill()  # SIGKILL to A's whole process group, by its pid

    seen: list[str] = []
    created: list[Any] = []

    def sends_meet_the_same_task_until_it_ends() -> bool:
        again = hold_retry.send(token(), 0)
        row = task_row(db, first.id)  # read after the send: it cannot have ended later than this
        seen.append(row["status"])
        if again.id == first.id:
            assert again.deduplicated is True
            assert keyed_ids(db, "hold_retry", key) == [first.id]
            return False
        # A new task: only once the first had ended.
        assert again.deduplicated is False and row["status"] == "COMPLETED", (again, row)
        created.append(again.id)
        return True

    wait_until(sends_meet_the_same_task_until_it_ends, timeout=30, interval=0.05, message="the key to free")
    # It was seen waiting for its retry and running again, holding the key all along.
    assert "PENDING" in seen and "RUNNING" in seen[seen.index("PENDING") :], seen
    row, attempts = check_history(db, first.id)
    assert [(x["outcome"], x["will_retry"], x["error_code"]) for x in attempts] == [
        ("FAILED", True, "WORKER_CRASHED"),
        ("COMPLETED", False, None),
    ]
    assert attempts[1]["worker_id"] == b.worker_id and runs(db, tok) == 2
    # Ended, the key was free: exactly one new task took it.
    assert keyed_ids(db, "hold_retry", key) == [first.id, *created]

    # The task without retries: FAILED by the reaper's crash verdict, which frees its key.
    row = wait_until(
        lambda: (r := task_row(db, doomed.id))["status"] in ("FAILED", "COMPLETED") and r,
        timeout=15,
        message="the no-retry task to be recovered",
    )
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED"
    assert runs(db, tok_fail) == 1
    replacement = hold.send(token(), 0)
    assert replacement.deduplicated is False and replacement.id != doomed.id
