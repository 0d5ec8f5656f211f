"""Worker hosts whose wall clocks are wrong by hours: the database's clock decides everything.

Host A's clock runs two hours ahead, host B's two hours behind (libfaketime, tests/hosts.py);
the database's is right. Only these two run workers, so every reaper is on a wrong clock.
The test first shows the skew is real where it matters: a task's code reads time.time()
two hours off. Then every decision that involves time must follow the server's now():

- staleness: live tasks three thresholds long are not recovered (A would see B's heartbeats
  as two hours old, B would never see anything stale, if either judged by its own clock);
  a host that dies has its RUNNING task recovered once its last heartbeat is the threshold
  old, neither sooner nor later, by a reaper two hours ahead and by one two hours behind;
- retries: run_at is the failure's time plus the policy's delay, and the retry starts then,
  not a poll interval later (the workers poll only every 30 s here: a wake-up timer set by
  the host's clock would show as seconds of delay);
- a delayed send from a producer on host A runs at the database's now() plus the delay;
- expiry: a task past its good_until is EXPIRED when the database's clock passes it.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest

from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import CHECK_S, FAST, RUNNING_STALE_S, check_history, db_now, runs, token, wait_all
from tests.chaos.hosts.conftest import HostFactory, LabDatabase
from tests.conftest import wait_until
from tests.hosts import Host, HostWorker

pytestmark = [pytest.mark.timing, pytest.mark.server_agnostic]

SKEW_S = 7200.0
POLL = ("--poll-interval-ms", "30000")  # a missed wake-up costs up to 30 s, not 1 s
#: How late a due task may start: a wake-up timer and a claim on a loaded machine.
START_SLACK = timedelta(seconds=1.0)
#: Recovery comes at the threshold, at the reaper's next look (CHECK_S at the latest).
RECOVERY_SLACK = timedelta(seconds=CHECK_S + 1.5)
LONG_S = 3 * RUNNING_STALE_S
DELAY_S = 3.0


def epoch(at: datetime) -> float:
    return at.timestamp()


def send_from(host: Host, db: LabDatabase, code: str) -> str:
    """Run ``code`` on ``host`` with ``app`` (tests/apps/hosts.py, bound to the lab database); its output."""
    setup = (
        "from tether import AppConfig, PostgresConfig\n"
        "from tests.apps.hosts import QUEUES, build\n"
        f"app = build(AppConfig(queues=QUEUES, broker=PostgresConfig(database_url={db.host_url!r})))\n"
    )
    return host.python(setup + code + "\napp.close()\n").strip()


def recovery_delay(conn: Any, task_id: Any, owner: str) -> timedelta:
    """From the owner's last runner heartbeat (or the task's start) to the recovery of its attempt."""
    row = task_row(conn, task_id)
    beat = conn.execute(
        "SELECT max(sent_at) AS at FROM tether_heartbeats"
        " WHERE task_id = %s AND sender_id = %s AND role = 'runner'",
        (task_id, owner),
    ).fetchone()["at"]
    last = max(t for t in (beat, row["started_at"]) if t is not None)
    (attempt,) = attempt_rows(conn, task_id)
    return attempt["finished_at"] - last


def hold_and_die(conn: Any, victim: HostWorker, queue: str, app: Any) -> tuple[str, str]:
    """A long task on ``victim``'s queue, RUNNING; then the victim's whole process group is
    SIGKILLed (the host dies). Returns (task id, victim's worker id)."""
    handle = app.tasks["hold"].with_options(queue=queue).send(token(), 60)
    wait_until(
        lambda: task_row(conn, handle.id)["status"] == "RUNNING", message=f"the task to run on {queue}"
    )
    owner = task_row(conn, handle.id)["claimed_by_worker_id"]
    assert owner == victim.worker_id
    victim.kill()
    return str(handle.id), owner


def test_the_databases_clock_decides_whatever_the_hosts_clocks_say(
    lab_db: LabDatabase, hosts: HostFactory
) -> None:
    db, tasks = lab_db.conn, lab_db.app.tasks
    host_a, host_b = hosts.add("a", clock=f"+{SKEW_S:.0f}"), hosts.add("b", clock=f"-{SKEW_S:.0f}")
    a, b = (hosts.worker(h, "--processes", "2", *POLL, env=FAST, wait=False) for h in (host_a, host_b))
    for worker in (a, b):
        worker.wait_registered()

    clocks = {q: tasks["wall_clock"].with_options(queue=q).send(token()) for q in ("a", "b")}
    longs = {q: tasks["hold"].with_options(queue=q).send(token(), LONG_S) for q in ("a", "b")}
    retried = {q: tasks["fail_once"].with_options(queue=q).send(token()) for q in ("a", "b")}
    good_until = db_now(db) + timedelta(seconds=DELAY_S)
    no_one_serves_c = tasks["work"].with_options(queue="c", good_until=good_until)
    expiring = no_one_serves_c.send(token())
    firsts = [str(h.id) for h in [*clocks.values(), *retried.values()]]
    wait_all(db, firsts, {"COMPLETED", "FAILED"}, timeout=60, why="the clocks and the retries")
    # Sent once B has no other wake-up pending: a worker keeps one timer, for the earliest
    # task due later that it heard of (claim_triggers.py); a later one waits for the poll.
    delayed_id = send_from(
        host_a, lab_db, f"print(app.tasks['work'].with_options(queue='b').schedule({DELAY_S}, 'delayed').id)"
    )
    ids = [*firsts, *(str(h.id) for h in longs.values()), delayed_id]
    wait_all(db, ids, {"COMPLETED", "FAILED"}, timeout=60, why="every task to end")
    wait_until(lambda: task_row(db, expiring.id)["status"] == "EXPIRED", timeout=20, message="the expiry")

    # The skew is real: each host's task code reads its own wrong clock.
    for queue, skew, worker in (("a", SKEW_S, a), ("b", -SKEW_S, b)):
        row = task_row(db, clocks[queue].id)
        said = row["result"]["ok"] if isinstance(row["result"], dict) else json.loads(row["result"])["ok"]
        off = said["time"] - epoch(row["completed_at"])
        assert abs(off - skew) < 60, f"host {queue}'s clock is off by {off:.0f}s, not {skew:.0f}s"
        assert said["hostname"] == worker.hostname and row["claimed_by_worker_id"] == worker.worker_id

    # Live tasks three thresholds long: never taken for dead.
    for queue, worker in (("a", a), ("b", b)):
        row, attempts = check_history(db, longs[queue].id)
        outcome = (row["status"], len(attempts), row["claimed_by_worker_id"])
        assert outcome == ("COMPLETED", 1, worker.worker_id), f"{row}\n{attempts}\n{worker.log()}"
    assert not db.execute("SELECT 1 FROM tether_task_attempts WHERE error_code = 'WORKER_CRASHED'").fetchall()

    # Retries: due at the failure's time plus the delay (the database's), started then.
    for queue in ("a", "b"):
        row, attempts = check_history(db, retried[queue].id)
        first, second = attempts
        assert (first["error_code"], first["will_retry"], row["status"]) == ("FIRST_RUN", True, "COMPLETED")
        # Imported here, not at the top: tests.apps.hosts imports the chaos app, which binds its
        # database at import, and collection (in every process of a run) would bind it to none.
        from tests.apps.hosts import RETRY_DELAY_S

        assert row["run_at"] - first["finished_at"] == timedelta(seconds=RETRY_DELAY_S), (row, first)
        late = second["started_at"] - row["run_at"]
        assert timedelta(0) <= late <= START_SLACK, (
            f"the retry on host {queue} started {late} after its run_at"
        )

    # A delayed send from host A: due at the database's now() plus the delay, run then (on B).
    row = task_row(db, delayed_id)
    assert row["run_at"] - row["sent_at"] == timedelta(seconds=DELAY_S), row
    late = row["started_at"] - row["run_at"]
    assert timedelta(0) <= late <= START_SLACK, f"the delayed task started {late} after its run_at"
    assert row["claimed_by_worker_id"] == b.worker_id

    # Expiry: when the database's clock passed good_until.
    expired = task_row(db, expiring.id)["expired_at"] - good_until
    assert timedelta(0) <= expired <= RECOVERY_SLACK, f"expired {expired} after good_until"

    # A host dies: B's task is recovered by A's reaper (two hours ahead), then A's by B's
    # (two hours behind, a new worker on host B): each at the threshold, by the database's clock.
    task_b, owner_b = hold_and_die(db, b, "b", lab_db.app)
    wait_until(
        lambda: task_row(db, task_b)["status"] == "FAILED", timeout=20, message="A to recover B's task"
    )
    b2 = hosts.worker(host_b, "--processes", "2", *POLL, env=FAST)
    task_a, owner_a = hold_and_die(db, a, "a", lab_db.app)
    wait_until(
        lambda: task_row(db, task_a)["status"] == "FAILED", timeout=20, message="B to recover A's task"
    )
    delays = {}
    for task_id, owner in ((task_b, owner_b), (task_a, owner_a)):
        row = task_row(db, task_id)
        assert row["error_code"] == "WORKER_CRASHED"
        delays[owner] = delay = recovery_delay(db, task_id, owner)
        assert (
            timedelta(seconds=RUNNING_STALE_S) <= delay <= timedelta(seconds=RUNNING_STALE_S) + RECOVERY_SLACK
        ), f"the task of {owner} was recovered {delay} after its last heartbeat"
    ran = {i: runs(db, task_row(db, i)["args"][0]) for i in (task_b, task_a)}
    assert set(ran.values()) == {1}, (ran, [attempt_rows(db, i) for i in ran], b2.log(), a.log())
    assert b2.alive()
    print(f"\nrecovered after: {', '.join(f'{o}: {d.total_seconds():.2f}s' for o, d in delays.items())}")
