"""A worker host's link to the database goes dead, past the stale threshold, while it runs tasks.

Two hosts (tests/hosts.py): A runs three tasks and holds a fourth CLAIMED; B idles. A's
link is cut: its packets vanish, nothing is refused (the database end of its veth goes down).
Then, by the rules (docs/heartbeats-and-recovery.md):

- A stops its own children (SIGSTOP) before any reaper may declare it dead: a sampler
  watching A's children and the task rows sees them stopped before the first recovery;
- B's reaper recovers A's tasks once their heartbeats are older than the threshold, and
  not before: RUNNING without a crash retry -> FAILED WORKER_CRASHED; RUNNING with one ->
  retried, and run again on B; CLAIMED -> PENDING, and run on B;
- one of A's tasks finished its code just after the cut: its outcome write is in flight,
  retransmitted by A's kernel, and reaches the server when the link comes back. It lands
  nowhere (the attempt number and owner no longer match): the server's log shows it
  executed, the rows show nothing changed;
- nothing ran more often than its policy allows (the ledger counts every start of a
  task's code), nothing was lost, and A goes on working once its heartbeats get through.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from psycopg import sql

from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import (
    CHECK_S,
    FAST,
    RUNNING_STALE_S,
    check_history,
    db_now,
    run_pids,
    runs,
    token,
    wait_all,
    worker_row,
)
from tests.chaos.hosts.conftest import HostFactory, LabDatabase
from tests.conftest import wait_until

pytestmark = [pytest.mark.timing, pytest.mark.server_agnostic]

#: Recovery comes when a task's last heartbeat is RUNNING_STALE_S old, at the reaper's next
#: look (it wakes when the first task turns stale, CHECK_S at the latest): this much slack
#: on top for a loaded machine.
LATE_SLACK_S = 1.5


@dataclass
class Timeline:
    """Watches A's children and the tasks they run, every 10 ms, from its own thread; notes (in
    the database's time, read right after the observation) when it first saw every child
    stopped or gone, and when it first saw one of the tasks leave A."""

    url: str
    pids: set[int]
    task_ids: list[str]
    owner: str  # A's worker id
    stopped_seen: datetime | None = None
    left_seen: datetime | None = None
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Timeline:
        self._thread = threading.Thread(target=self._watch, name="timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(10)

    def _children_stopped(self) -> bool:
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    return False
            except psutil.NoSuchProcess:
                continue
        return True

    def _watch(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self._done.is_set() and (self.stopped_seen is None or self.left_seen is None):
                    stopped = self._children_stopped()
                    rows = conn.execute(
                        "SELECT count(*) FROM tether_tasks WHERE id = ANY(%s::uuid[])"
                        " AND (status <> 'RUNNING' OR claimed_by_worker_id IS DISTINCT FROM %s)",
                        (self.task_ids, self.owner),
                    ).fetchone()
                    left = rows is not None and rows[0] > 0
                    now = conn.execute("SELECT clock_timestamp()").fetchone()
                    assert now is not None
                    if stopped and self.stopped_seen is None:
                        self.stopped_seen = now[0]
                    if left and self.left_seen is None:
                        self.left_seen = now[0]
                    time.sleep(0.01)
        except BaseException as exc:  # the test reports it
            self.error = exc


def recovered_at(conn: Any, task_id: Any) -> datetime:
    """When the task's first attempt (A's) was settled."""
    first = attempt_rows(conn, task_id)[0]
    assert first["outcome"] == "FAILED" and first["error_code"] == "WORKER_CRASHED", first
    return first["finished_at"]


def last_beat(conn: Any, task_id: Any, sender: str) -> datetime:
    """When ``sender``'s attempt at the task was last heard of, as the recovery rule counts it
    (broker/sql/recovery.sql): its last runner heartbeat, or its start if it sent none yet (a
    cut that comes less than a heartbeat interval after the start: CI met one)."""
    row = conn.execute(
        "SELECT greatest(a.started_at, (SELECT max(h.sent_at) FROM tether_heartbeats h"
        "  WHERE h.task_id = a.task_id AND h.sender_id = a.worker_id)) AS at"
        " FROM tether_task_attempts a WHERE a.task_id = %s AND a.worker_id = %s",
        (task_id, sender),
    ).fetchone()
    return row["at"]


def test_a_host_cut_off_is_recovered_elsewhere_and_its_late_writes_land_nowhere(
    lab_db: LabDatabase, hosts: HostFactory, tmp_path: Path
) -> None:
    db, tasks = lab_db.conn, lab_db.app.tasks
    # Every statement of every session in the server's log: A's late write must show there.
    db.execute(sql.SQL("ALTER DATABASE {} SET log_statement = 'all'").format(sql.Identifier(lab_db.name)))
    host_a, host_b = hosts.add("a"), hosts.add("b")
    a = hosts.worker(host_a, "--processes", "3", "--prefetch", "1", env=FAST)

    release = tmp_path / "release"  # the late task's code returns once this file exists
    t_late, t_retry, t_fail, t_claimed = token(), token(), token(), token()
    late = tasks["hold_until_file"].send(t_late, str(release))
    retry = tasks["hold_retry"].send(t_retry, 60, 0)  # one crash retry: runs again on B
    fail = tasks["hold_then_mark"].send(t_fail, 60)  # no crash retry: FAILED, never run again
    running = [str(late.id), str(retry.id), str(fail.id)]
    wait_all(db, running, {"RUNNING"}, why="A to run three tasks")
    wait_until(lambda: all(runs(db, t) == 1 for t in (t_late, t_retry, t_fail)), message="their ledger rows")
    claimed = tasks["hold"].send(t_claimed, 0)  # A's prefetch: claimed, no child free to run it
    wait_until(
        lambda: task_row(db, claimed.id)["status"] == "CLAIMED", message="A to hold a fourth task CLAIMED"
    )
    ids = [*running, str(claimed.id)]
    assert {task_row(db, i)["claimed_by_worker_id"] for i in ids} == {a.worker_id}
    children = {pid for t in (t_late, t_retry, t_fail) for pid in run_pids(db, t)}
    assert len(children) == 3 and children <= {c.pid for c in a.task_children()}
    b = hosts.worker(host_b, "--processes", "2", env=FAST)
    assert a.worker_id is not None and b.worker_id is not None

    timeline = Timeline(lab_db.url, children, running, a.worker_id).start()
    try:
        host_a.cut()
        cut_at = db_now(db)
        release.touch()  # the late task's code returns now: its outcome write goes into the void

        wait_all(db, ids, {"COMPLETED", "FAILED"}, timeout=30, why="B to recover A's tasks by the rules")
        wait_until(
            lambda: timeline.stopped_seen is not None or timeline.error, timeout=10, message="the timeline"
        )
    finally:
        timeline.stop()
    assert timeline.error is None, timeline.error
    assert timeline.stopped_seen is not None and timeline.left_seen is not None
    log_a = a.log()
    assert "isolating itself: 3 child(ren) frozen" in log_a, log_a

    # A stopped its children before any task was taken from it.
    assert timeline.stopped_seen < timeline.left_seen, (
        f"A's children were still running at {timeline.stopped_seen}, after B took a task from A "
        f"at {timeline.left_seen} (the cut was at {cut_at})\nA's log:\n{log_a}"
    )

    # Each task by its rule, each recovered once its last heartbeat from A was RUNNING_STALE_S
    # old (by the database's clock), not sooner, and not much later.
    row, (attempt,) = check_history(db, late.id)
    assert (row["status"], row["error_code"], attempt["worker_id"]) == (
        "FAILED",
        "WORKER_CRASHED",
        a.worker_id,
    )
    row, (attempt,) = check_history(db, fail.id)
    assert (row["status"], row["error_code"], attempt["worker_id"]) == (
        "FAILED",
        "WORKER_CRASHED",
        a.worker_id,
    )
    row, attempts = check_history(db, retry.id)
    assert row["status"] == "COMPLETED" and [x["worker_id"] for x in attempts] == [a.worker_id, b.worker_id]
    assert attempts[0]["error_code"] == "WORKER_CRASHED" and attempts[0]["will_retry"]
    row, (attempt,) = check_history(db, claimed.id)
    assert row["status"] == "COMPLETED" and attempt["worker_id"] == b.worker_id
    for task_id in running:
        silent = recovered_at(db, task_id) - last_beat(db, task_id, a.worker_id)
        assert timedelta(seconds=RUNNING_STALE_S) <= silent, f"task {task_id} recovered early: {silent}"
        assert silent <= timedelta(seconds=RUNNING_STALE_S + CHECK_S + LATE_SLACK_S), (
            f"task {task_id} recovered late: {silent} after its last heartbeat"
        )
    # Nothing ran beyond its policy: the code started once per attempt, where the attempt ran.
    assert [runs(db, t) for t in (t_late, t_retry, t_fail, t_claimed)] == [1, 2, 1, 1]
    assert runs(db, t_fail + ":done") == 0  # A's copy was stopped, never finished
    before = {i: (task_row(db, i), attempt_rows(db, i)) for i in ids}

    # The link comes back. A's kernel retransmits what was in flight: the late outcome write
    # arrives and matches no row; A's heartbeats learn the tasks are gone; A goes on.
    healed_at = db_now(db)
    host_a.heal()
    wait_until(lambda: "claiming resumes" in a.log(), timeout=20, message="A's heartbeats to get through")

    def late_write() -> list[Any]:
        return [e for e in lab_db.server.log_entries(host_a.address, healed_at) if t_late in e.text]

    arrived = wait_until(late_write, timeout=30, message="A's late outcome write to reach the server")
    wait_until(
        lambda: "already settled elsewhere" in a.log(),
        timeout=20,
        message="A's crash records of its children",
    )
    assert {i: (task_row(db, i), attempt_rows(db, i)) for i in ids} == before, (
        f"a late write of A changed a row; what reached the server after the heal:\n{arrived}"
    )
    # A's heartbeats after the heal vouch for none of the tasks taken from it.
    stray = db.execute(
        "SELECT count(*) AS n FROM tether_heartbeats WHERE sender_id = %s AND sent_at >= %s"
        " AND task_id = ANY(%s::uuid[])",
        (a.worker_id, healed_at, ids),
    ).fetchone()
    assert stray["n"] == 0
    assert worker_row(db, a.worker_id)["status"] == "active"
    assert [runs(db, t) for t in (t_late, t_retry, t_fail, t_claimed)] == [1, 2, 1, 1]

    # A works again: with B gone, a new task runs on A.
    assert b.stop() == 0, b.log()
    again = tasks["work"].send(token(), 0)
    assert again.get(timeout=30).is_ok, a.log()
    assert task_row(db, again.id)["claimed_by_worker_id"] == a.worker_id
    print(
        f"\ncut at {cut_at:%T.%f}; A's children seen stopped {timeline.stopped_seen - cut_at}, first task "
        f"taken from A {timeline.left_seen - cut_at} after the cut; late write arrived "
        f"{arrived[0].at - healed_at} after the heal"
    )


#: Heartbeats every second, thresholds of 3 s: the isolation watch's margin is a quarter
#: interval (0.25 s), and room is left for psycopg's prepare round trip (see below).
SLOW_ANSWERS_ENV = {
    **FAST,
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "3000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "3000",
}
SLOW_ANSWERS_STALE_S = 3.0
BACK_MS = 400.0  # more than the margin; a beat (two round trips when psycopg prepares it) within the interval


def test_a_host_whose_answers_come_back_slowly_stops_its_children_before_any_reaper_may_act(
    lab_db: LabDatabase, hosts: HostFactory
) -> None:
    """Host A's requests reach the database at once, the answers come back BACK_MS late. Its
    beats land in time, but A learns so only BACK_MS later. When its link is cut, A must freeze
    its children a margin before the threshold counted from the *sending* of its last beat that
    got through (the database stamped it later): counted from the answer, the freeze would come
    BACK_MS less the margin after a reaper may take the tasks."""
    db, tasks = lab_db.conn, lab_db.app.tasks
    host_a, host_b = hosts.add("a"), hosts.add("b")
    host_a.slow(0, back_ms=BACK_MS)
    a = hosts.worker(host_a, "--processes", "2", env=SLOW_ANSWERS_ENV)
    t_retry, t_fail = token(), token()
    retry = tasks["hold_retry"].send(t_retry, 60, 0)
    fail = tasks["hold_then_mark"].send(t_fail, 60)
    running = [str(retry.id), str(fail.id)]
    wait_all(db, running, {"RUNNING"}, why="A to run two tasks")
    wait_until(lambda: runs(db, t_retry) == runs(db, t_fail) == 1, message="their ledger rows")
    children = {pid for t in (t_retry, t_fail) for pid in run_pids(db, t)}
    b = hosts.worker(host_b, "--processes", "2", env=SLOW_ANSWERS_ENV)
    assert a.worker_id is not None and b.worker_id is not None

    # Past psycopg's sixth run of the beat (it prepares the statement then: two round trips),
    # a beat a second from A's start, and no isolation for slow answers alone.
    started = worker_row(db, a.worker_id)["started_at"]
    wait_until(lambda: db_now(db) - started > timedelta(seconds=8), timeout=20, message="A's first beats")
    assert "isolating itself" not in a.log(), a.log()

    timeline = Timeline(lab_db.url, children, running, a.worker_id).start()
    try:
        host_a.cut()
        cut_at = db_now(db)
        wait_all(db, running, {"COMPLETED", "FAILED"}, timeout=30, why="B to recover A's tasks")
        wait_until(
            lambda: timeline.stopped_seen is not None or timeline.error, timeout=10, message="the timeline"
        )
    finally:
        timeline.stop()
    assert timeline.error is None, timeline.error
    assert timeline.stopped_seen is not None and timeline.left_seen is not None
    assert timeline.stopped_seen < timeline.left_seen, (
        f"A's children were still running at {timeline.stopped_seen}, after B took a task from A "
        f"at {timeline.left_seen} (the cut was at {cut_at})\nA's log:\n{a.log()}"
    )
    row, attempts = check_history(db, retry.id)
    assert row["status"] == "COMPLETED" and [x["worker_id"] for x in attempts] == [a.worker_id, b.worker_id]
    row, (attempt,) = check_history(db, fail.id)
    assert (row["status"], row["error_code"], attempt["worker_id"]) == (
        "FAILED",
        "WORKER_CRASHED",
        a.worker_id,
    )
    for task_id in running:
        silent = recovered_at(db, task_id) - last_beat(db, task_id, a.worker_id)
        assert timedelta(seconds=SLOW_ANSWERS_STALE_S) <= silent, f"task {task_id} recovered early: {silent}"
    assert [runs(db, t_retry), runs(db, t_fail), runs(db, t_fail + ":done")] == [2, 1, 0]
    print(
        f"\nslow answers: A's children seen stopped {timeline.stopped_seen - cut_at}, first task taken "
        f"from A {timeline.left_seen - cut_at} after the cut"
    )
