"""The `tether` command against the test database: what it prints matches the rows."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import tether.cli
import tether.cli.common
from tests.cli_support import run, run_json, tether_command
from tests.conftest import WorkerFactory
from tether.broker import PostgresBroker
from tether.db.migrate import latest_version

# Left out of the external-server run (--subset server, tests/conftest.py):
# the CLI's rendering and arguments; the SQL it runs is tested by the other modules.
pytestmark = pytest.mark.server_agnostic

APP = "tests.apps.basic:app"
WAIT = 30.0


@pytest.fixture(autouse=True)
def close_brokers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close the pool each command opens once the command is done.

    A command leaves its broker to process exit, which is fine for the `tether` process;
    run in-process here, a pool left open would be collected later, inside some other test.
    """
    opened: list[PostgresBroker] = []
    original = tether.cli.common.open_broker

    def tracking(*args: Any, **kwargs: Any) -> PostgresBroker:
        broker = original(*args, **kwargs)
        opened.append(broker)
        return broker

    monkeypatch.setattr(tether.cli.common, "open_broker", tracking)
    yield
    for broker in opened:
        broker.close()


def test_migrate_says_up_to_date(database_url: str) -> None:
    result = run(database_url, "migrate")
    assert f"schema is up to date (version {latest_version()})" in result.stdout


def test_status_json_counts_match_the_rows(
    database_url: str, basic: ModuleType, db: psycopg.Connection[Any]
) -> None:
    low = basic.add.with_options(queue="low")
    handles = [low.send(i, i) for i in range(3)]
    basic.add.with_options(queue="images").send_many([(1, 1), (2, 2)])
    assert handles[0].cancel()

    status = run_json(database_url, "status")
    printed = {(c["queue"], c["status"]): c["n"] for c in status["counts"]}
    rows = db.execute("SELECT queue, status, count(*) AS n FROM tether_tasks GROUP BY 1, 2").fetchall()
    assert printed == {(r["queue"], r["status"]): r["n"] for r in rows}
    assert printed == {("low", "PENDING"): 2, ("low", "CANCELLED"): 1, ("images", "PENDING"): 2}
    assert status["workers"] == [] and status["stale_tasks"] == []

    # The table form shows the same numbers.
    table = run(database_url, "status").stdout
    assert "images" in table and "low" in table


def test_tasks_and_task_json(
    database_url: str, basic: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--queues", "default", "--processes", "1")
    done = [basic.add.send(i, 1) for i in range(3)]
    retried = basic.flaky.send(uuid.uuid4().hex, 1)
    failed = basic.fail.send("NOPE")
    waiting = basic.add.with_options(queue="low").send(0, 0)
    for handle in [*done, retried, failed]:
        assert handle.get(timeout=WAIT).err is None or handle is failed

    completed = run_json(database_url, "tasks", "--status", "COMPLETED")
    assert {t["id"] for t in completed} == {str(h.id) for h in [*done, retried]}
    assert {t["status"] for t in completed} == {"COMPLETED"}
    assert all(t["finished_at"] and t["claimed_by_worker_id"] == worker.worker_id for t in completed)
    # Newest first, by id (time-ordered to the millisecond, docs/cli.md): two sends in one
    # millisecond may list in either order of their sent_at.
    assert [t["id"] for t in completed] == sorted((t["id"] for t in completed), key=uuid.UUID, reverse=True)

    assert [t["id"] for t in run_json(database_url, "tasks", "--status", "failed")] == [str(failed.id)]
    assert [t["id"] for t in run_json(database_url, "tasks", "--queue", "low")] == [str(waiting.id)]
    assert [t["id"] for t in run_json(database_url, "tasks", "--name", "flaky")] == [str(retried.id)]
    assert len(run_json(database_url, "tasks", "--limit", "2")) == 2
    counts = Counter(t["status"] for t in run_json(database_url, "tasks"))
    assert counts == {"COMPLETED": 4, "FAILED": 1, "PENDING": 1}

    one = run_json(database_url, "task", str(retried.id))
    assert one["id"] == str(retried.id) and one["name"] == "flaky" and one["status"] == "COMPLETED"
    assert (one["attempt"], one["retry_count"]) == (2, 1)
    assert one["result"] == {"ok": 2}
    attempts = one["attempts"]
    assert [(a["attempt"], a["outcome"], a["will_retry"]) for a in attempts] == [
        (1, "FAILED", True),
        (2, "COMPLETED", False),
    ]
    assert attempts[0]["error_code"] == "TRANSIENT"
    assert {a["worker_id"] for a in attempts} == {worker.worker_id}

    # The human form names the task and its attempts too.
    text = run(database_url, "task", str(retried.id)).stdout
    assert str(retried.id) in text and "TRANSIENT" in text and "COMPLETED" in text


def test_workers_json_lists_a_running_worker(
    database_url: str, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--queues", "default,images", "--processes", "1")
    listed = run_json(database_url, "workers")
    assert [w["id"] for w in listed] == [worker.worker_id]
    (entry,) = listed
    assert entry["status"] == "active" and entry["pid"] == worker.pid
    assert entry["queues"] == ["default", "images"] and entry["processes"] == 1
    age = entry["heartbeat_age_s"]
    assert isinstance(age, int | float), f"heartbeat_age_s should be a JSON number, got {age!r}"
    assert 0 <= age < 60
    assert [w["id"] for w in run_json(database_url, "status")["workers"]] == [worker.worker_id]

    assert worker.stop() == 0
    assert run_json(database_url, "workers") == []
    stopped = run_json(database_url, "workers", "--all")
    assert [(w["id"], w["status"]) for w in stopped] == [(worker.worker_id, "stopped")]


def test_task_with_a_bad_or_unknown_id(database_url: str, db: psycopg.Connection[Any]) -> None:
    bad = tether_command(database_url, "task", "not-a-uuid")
    assert bad.returncode != 0
    assert "'not-a-uuid' is not a UUID" in bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout

    missing_id = uuid.uuid4()
    missing = tether_command(database_url, "task", str(missing_id))
    assert missing.returncode != 0
    assert f"no task with id {missing_id}" in missing.stderr
    assert "Traceback" not in missing.stderr + missing.stdout


# -- names: --by, --queue, --name follow the API's rule (tether.names) ---------------------------


def _refused(database_url: str, *args: str) -> str:
    result = CliRunner().invoke(tether.cli.cli, [*args, "--database-url", database_url])
    assert result.exit_code == 2, (args, result.output, result.exception)
    return result.output


@pytest.mark.parametrize("by", ["", "   ", "x" * 201, "ops\nINFO forged", "a\tb", "nul\x00"], ids=repr)
def test_a_bad_by_is_a_usage_error_and_changes_nothing(
    database_url: str, basic: ModuleType, db: psycopg.Connection[Any], by: str
) -> None:
    pending = basic.add.send(1, 2)
    failed = basic.fail.send("BOOM")
    db.execute("UPDATE tether_tasks SET status = 'FAILED', failed_at = now() WHERE id = %s", (failed.id,))
    before = db.execute("SELECT * FROM tether_tasks ORDER BY id").fetchall()
    for args in (
        ("cancel", str(pending.id)),
        ("retry", str(failed.id)),
        ("retry", "--status", "FAILED", "--yes"),
        ("queue", "pause", "low"),
        ("queue", "resume", "low"),
    ):
        output = _refused(database_url, *args, "--by", by)
        assert "Invalid value for '--by': by must be who asks: 1 to 200 printable characters" in output
    assert db.execute("SELECT * FROM tether_tasks ORDER BY id").fetchall() == before
    assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}


def test_bad_queue_and_task_names_are_usage_errors(
    database_url: str, basic: ModuleType, db: psycopg.Connection[Any]
) -> None:
    failed = basic.fail.send("BOOM")
    db.execute("UPDATE tether_tasks SET status = 'FAILED', failed_at = now() WHERE id = %s", (failed.id,))
    for queue in ("", "has space", "x" * 65):
        for args in (("tasks", "--queue", queue), ("retry", "--queue", queue, "--yes")):
            output = _refused(database_url, *args)
            assert "Invalid value for '--queue': queue must be a queue name: 1 to 64 characters" in output
        for args in (("queue", "pause", queue), ("queue", "resume", queue)):
            assert "Invalid value for 'NAME': queue must be a queue name" in _refused(database_url, *args)
    for name in ("", "9lives", "has space", "x" * 201):
        for args in (("tasks", "--name", name), ("retry", "--name", name, "--yes")):
            output = _refused(database_url, *args)
            assert "Invalid value for '--name': name must be a task name: 1 to 200 characters" in output
    assert db.execute("SELECT status FROM tether_tasks").fetchall() == [{"status": "FAILED"}]
    assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}

    # As a user runs it: exit code 2, the message, no traceback.
    real = tether_command(database_url, "cancel", str(failed.id), "--by", "two\nlines")
    assert real.returncode == 2 and "Traceback" not in real.stderr
    assert "by must be who asks" in real.stderr and "got 'two\\nlines'" in real.stderr
