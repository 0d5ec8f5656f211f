"""The network lets the workers down: every one of their connections is terminated, again and
again (pg_terminate_backend), while they work through 200 short tasks.

Every connection a worker has drops at once: its pool, its listener, its reaper, each
child's recorder, the tasks' own (the chaos ledger). A write cut off around its COMMIT is
ambiguous; the worker retries it and tells "already done by us" from "lost". In the end
every task is COMPLETED, its code ran exactly once, and nothing is left CLAIMED or RUNNING.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.sql
import pytest

from tests.apps.support import task_row
from tests.chaos.conftest import (
    APP,
    FAST,
    RUNNING_STALE_S,
    check_history,
    db_now,
    runs,
    token,
    wait_all,
    wait_status,
)
from tests.conftest import WorkerFactory, wait_until

TASKS = 200
# The workers' connections are named by their job (tether-worker, -heartbeat, -maintenance,
# -listener, -child, ...); the test's own connections, named 'tether', are spared.
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
    for name in (
        "tether-worker",
        "tether-maintenance",
        "tether-heartbeat",
        "tether-listener",
        "tether-child",
    ):
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


# -- refused connections: the server (or the role) has no slot left ----------------------------

LIMITED_GRANTS = """
GRANT USAGE ON SCHEMA public TO {role};
GRANT ALL ON ALL TABLES IN SCHEMA public TO {role};
GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role};
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {role}
"""
TERMINATE_ROLE = """
SELECT application_name, pg_terminate_backend(pid) AS terminated FROM pg_stat_activity
WHERE datname = current_database() AND usename = %s AND pid <> pg_backend_pid()
"""
# By the name's first word: a listener's name also carries its worker's id.
ROLE_SESSIONS = """
SELECT split_part(application_name, ' ', 1) AS application_name, count(*) AS n FROM pg_stat_activity
WHERE datname = current_database() AND usename = %s GROUP BY 1
"""


@pytest.fixture
def limited_role(db: Any, database_url: str) -> Iterator[tuple[str, str]]:
    """A login role of the test's own (not a superuser: the CONNECTION LIMIT holds for it) with
    the rights a worker needs on the test database, and a URL that logs in as it. Dropped after."""
    role = f"tether_limited_{uuid.uuid4().hex[:10]}"
    ident = psycopg.sql.Identifier(role)
    db.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        for statement in LIMITED_GRANTS.split(";"):
            db.execute(psycopg.sql.SQL(statement.strip()).format(role=ident))  # type: ignore[arg-type]
        parts = urlsplit(database_url)
        netloc = f"{role}@{parts.netloc.split('@', 1)[-1]}"
        yield role, urlunsplit(parts._replace(netloc=netloc))
    finally:
        db.execute(psycopg.sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(ident))
        wait_until(
            lambda: not db.execute(TERMINATE_ROLE, (role,)).fetchall(), timeout=30, message="its sessions"
        )
        db.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(ident))
        db.execute(psycopg.sql.SQL("DROP ROLE {}").format(ident))


def role_sessions(db: Any, role: str) -> dict[str, int]:
    return {r["application_name"]: int(r["n"]) for r in db.execute(ROLE_SESSIONS, (role,)).fetchall()}


@pytest.mark.timing
def test_a_worker_refused_connections_keeps_its_tasks_safe_says_why_once_and_recovers(
    db: Any, chaos: ModuleType, workers: WorkerFactory, limited_role: tuple[str, str]
) -> None:
    role, url = limited_role
    hold = chaos.app.tasks["hold"]
    a = workers.start(APP, "--processes", "1", "--prefetch", "1", env={**FAST, "TETHER_DATABASE_URL": url})
    t_run, t_claimed = token(), token()
    running, claimed = hold.send(t_run, 60), hold.send(t_claimed, 0)
    wait_until(
        lambda: (
            runs(db, t_run) == 1
            and task_row(db, running.id)["status"] == "RUNNING"
            and task_row(db, claimed.id)["status"] == "CLAIMED"
        ),
        message="A to run one task and hold one CLAIMED",
    )
    assert {row["claimed_by_worker_id"] for row in (task_row(db, running.id), task_row(db, claimed.id))} == {
        a.worker_id
    }

    # No slot left for the role: every new connection is refused ("too many connections for
    # role", as "sorry, too many clients already" once max_connections is reached), and
    # every connection A holds is gone.
    db.execute(psycopg.sql.SQL("ALTER ROLE {} CONNECTION LIMIT 0").format(psycopg.sql.Identifier(role)))
    refused_at = db_now(db)
    wait_until(lambda: not db.execute(TERMINATE_ROLE, (role,)).fetchall(), timeout=30, message="A's sessions")
    b = workers.start(APP, "--processes", "1", env=FAST)  # as the tests' own role: not limited

    # A's tasks, by the rules: its running task FAILED with WORKER_CRASHED once its runner
    # heartbeats went stale; its claimed one back to PENDING, then run once, by B.
    row = wait_status(db, running.id, {"FAILED", "COMPLETED"}, timeout=30)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - refused_at < timedelta(seconds=4 * RUNNING_STALE_S), (row, refused_at)
    row = wait_status(db, claimed.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED" and row["claimed_by_worker_id"] == b.worker_id, row
    assert runs(db, t_run) == 1 and runs(db, t_claimed) == 1
    for task_id in (running.id, claimed.id):
        check_history(db, task_id)
    # A stopped its own child once its heartbeats could not get through (it cannot tell a
    # refusal that lasts from a network cut): nothing of it runs on.
    wait_until(lambda: "isolating itself" in a.log(), timeout=30, message="A to isolate itself")
    assert a.proc.poll() is None, a.log()

    # Connections free up: A comes back by itself, heartbeats, and runs new work.
    db.execute(psycopg.sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(psycopg.sql.Identifier(role)))
    wait_until(lambda: "heartbeats get through again" in a.log(), timeout=30, message="A to rejoin")
    assert b.stop() == 0, b.log()
    again = token()
    assert hold.send(again, 0).get(timeout=30).is_ok
    assert runs(db, again) == 1
    assert task_row(db, running.id)["status"] == "FAILED"  # A's late writes changed nothing
    wanted = {"tether-worker", "tether-heartbeat", "tether-listener", "tether-maintenance"}
    wait_until(lambda: wanted <= set(role_sessions(db, role)), timeout=30, message="A's connections back")

    # One line names the cause, however many of A's jobs were refused, and one says it is over.
    log = a.log()
    said = [line for line in log.splitlines() if "PostgreSQL refused a new connection" in line]
    assert len(said) == 1 and f'too many connections for role "{role}"' in said[0], said
    assert "max_connections" in said[0] and "docs/workers.md#connections" in said[0], said
    assert log.count("PostgreSQL accepts new connections again") == 1, log
    assert "Traceback" not in log, log
    print("\n" + said[0])
