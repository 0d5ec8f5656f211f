"""Periodic tasks with real worker processes: exactly one task per slot, whoever sends it.

Seconds schedules (six fields) keep these tests short. Each worker gets its schedules from
TETHER_TEST_SCHEDULES (tests/apps/periodic.py), so a test can start workers running
other code: a deploy that changes or removes a schedule.
"""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import load_app_module
from tests.cli_support import run, run_json
from tests.conftest import WorkerFactory, wait_until
from tether.errors import ScheduleDefinitionError, ScheduleNotFoundError

APP = "tests.apps.periodic:app"
Conn = psycopg.Connection[Any]


@pytest.fixture
def periodic(database_url: str, db: Conn) -> ModuleType:
    return load_app_module("periodic", database_url)


def schedules_env(*specs: dict[str, Any]) -> dict[str, str]:
    return {"TETHER_TEST_SCHEDULES": json.dumps(list(specs))}


def slot_tasks(db: Conn, schedule: str) -> list[dict[str, Any]]:
    return db.execute(
        "SELECT id, schedule_slot AS slot, sent_at, status, args FROM tether_tasks"
        " WHERE schedule_name = %s ORDER BY schedule_slot",
        (schedule,),
    ).fetchall()


def db_now(db: Conn) -> datetime:
    now: datetime = db.execute("SELECT now() AS now").fetchone()["now"]
    return now


def wait_db_time(db: Conn, moment: datetime, message: str) -> None:
    """Until the database's clock passes ``moment`` (slots are database time)."""
    wait_until(lambda: db_now(db) > moment, timeout=60, interval=0.05, message=message)


def assert_one_task_per_slot(tasks: list[dict[str, Any]], step_s: int) -> None:
    slots = [t["slot"] for t in tasks]
    assert len(slots) == len(set(slots)), "a slot has two tasks"
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(slots)]
    assert all(g == step_s for g in gaps), f"slots missing or doubled: {slots}"


@pytest.mark.timing
def test_three_workers_send_exactly_one_task_per_slot(db: Conn, workers: WorkerFactory) -> None:
    env = schedules_env({"cron": "* * * * * *", "task": "beat", "name": "every-second", "args": ["s"]})
    for _ in range(3):
        workers.start(APP, "--processes", "1", env=env)
    tasks = wait_until(
        lambda: (t := slot_tasks(db, "every-second")) and len(t) >= 21 and t,
        timeout=60,
        message="21 slots",
    )
    assert_one_task_per_slot(tasks, 1)
    late = sorted((t["sent_at"] - t["slot"]).total_seconds() for t in tasks)
    assert late[0] >= 0 and late[-1] < 1.0, late  # sent at or after its slot, within a second
    assert tasks[0]["args"] == ["s"]
    wait_until(
        lambda: all(t["status"] == "COMPLETED" for t in slot_tasks(db, "every-second")[:20]),
        message="the slots' tasks to run",
    )
    row = db.execute(
        "SELECT slots_sent, slots_skipped FROM tether_schedules WHERE name = 'every-second'"
    ).fetchone()
    assert row["slots_skipped"] == 0 and row["slots_sent"] >= 21


def test_killing_the_workers_that_send_slots_loses_none_and_doubles_none(
    db: Conn, workers: WorkerFactory
) -> None:
    env = schedules_env({"cron": "* * * * * *", "task": "beat", "name": "kill-me", "args": ["k"]})
    alive = [workers.start(APP, "--processes", "1", env=env) for _ in range(2)]
    wait_until(lambda: len(slot_tasks(db, "kill-me")) >= 2, message="the first slots")
    for round_ in range(4):
        # Kill -9 one worker just after a slot comes, while the workers are sending it.
        last = slot_tasks(db, "kill-me")[-1]["slot"]
        wait_db_time(db, last + timedelta(seconds=1), "the next slot")
        victim = alive.pop(round_ % len(alive))
        victim.kill()
        alive.append(workers.start(APP, "--processes", "1", env=env))
    end = db_now(db)
    wait_until(
        lambda: slot_tasks(db, "kill-me")[-1]["slot"] >= end + timedelta(seconds=1),
        message="slots after the last kill",
    )
    tasks = slot_tasks(db, "kill-me")
    assert_one_task_per_slot(tasks, 1)
    assert len(tasks) >= 8


@pytest.mark.parametrize("catch_up", ["latest", "all", "none"])
def test_missed_slots_after_all_workers_were_down(db: Conn, workers: WorkerFactory, catch_up: str) -> None:
    name = f"down-{catch_up}"
    env = schedules_env(
        {"cron": "*/2 * * * * *", "task": "beat", "name": name, "args": [catch_up], "catch_up": catch_up}
    )
    first = workers.start(APP, "--processes", "1", env=env)
    before = wait_until(lambda: slot_tasks(db, name), message="a first slot")[-1]["slot"]
    first.stop()
    stopped_at = db_now(db)
    wait_db_time(db, stopped_at + timedelta(seconds=11), "five slots without a worker")
    workers.start(APP, "--processes", "1", env=env)
    restarted_at = db_now(db)
    # The catch-up happens on the restarted worker's first tick; then one more regular slot.
    wait_until(
        lambda: slot_tasks(db, name)[-1]["slot"] > restarted_at + timedelta(seconds=2),
        message="a regular slot after the restart",
    )
    missed = [
        before + timedelta(seconds=2 * i)
        for i in range(1, 30)
        if stopped_at < before + timedelta(seconds=2 * i) <= restarted_at - timedelta(seconds=2)
    ]
    assert len(missed) >= 4
    sent = {t["slot"]: t for t in slot_tasks(db, name)}
    sent_missed = [s for s in missed if s in sent]
    if catch_up == "all":
        assert sent_missed == missed
    elif catch_up == "latest":
        assert sent_missed == [] or sent_missed == [missed[-1]]
        # The most recent missed slot (the last before the restart) was sent, late.
        latest = max(s for s in sent if s <= restarted_at)
        assert latest > missed[-1] - timedelta(seconds=1) and latest >= missed[-1]
    else:
        assert sent_missed == []
        for slot in [s for s in sent if stopped_at < s <= restarted_at]:
            assert (sent[slot]["sent_at"] - slot).total_seconds() <= 1.0  # only if still on time
    row = db.execute("SELECT slots_skipped FROM tether_schedules WHERE name = %s", (name,)).fetchone()
    assert (row["slots_skipped"] == 0) == (catch_up == "all")


@pytest.mark.smoke
def test_a_deploy_changes_one_schedule_and_removes_another(
    db: Conn, workers: WorkerFactory, periodic: ModuleType
) -> None:
    old_code = schedules_env(
        {"cron": "*/2 * * * * *", "task": "beat", "name": "kept", "args": ["old"]},
        {"cron": "* * * * * *", "task": "beat", "name": "dropped", "args": ["d"]},
    )
    new_code = schedules_env({"cron": "*/3 * * * * *", "task": "beat", "name": "kept", "args": ["new"]})
    old = workers.start(APP, "--processes", "1", env=old_code)
    wait_until(lambda: slot_tasks(db, "kept") and slot_tasks(db, "dropped"), message="both schedules to fire")
    # A rolling deploy: the new code starts while the old still runs.
    new = workers.start(APP, "--processes", "1", env=new_code)
    # The new worker syncs its declarations in its scheduler's first tick, which may come
    # after its startup is logged: read changed_at once the new definition is stored.
    stored = "SELECT cron, changed_at FROM tether_schedules WHERE name = 'kept'"
    deployed_at = wait_until(
        lambda: (row := db.execute(stored).fetchone())["cron"] == "*/3 * * * * *" and row["changed_at"],
        message="the new worker to store the new definition",
    )
    wait_until(
        lambda: len([t for t in slot_tasks(db, "kept") if t["slot"] > deployed_at]) >= 3,
        message="three slots by the new expression",
    )
    after = [t for t in slot_tasks(db, "kept") if t["slot"] > deployed_at]
    assert all(t["slot"].second % 3 == 0 and t["args"] == ["new"] for t in after), after
    removed_at = db.execute("SELECT removed_at FROM tether_schedules WHERE name = 'dropped'").fetchone()[
        "removed_at"
    ]
    assert removed_at is not None
    assert all(t["slot"] <= removed_at for t in slot_tasks(db, "dropped"))
    assert "schedule kept changed: cron: */2 * * * * * -> */3 * * * * *" in new.log()
    assert "schedule dropped (task beat, * * * * * *) is no longer declared in the code" in new.log()
    listed = {s.name: s for s in periodic.app.list_schedules()}
    assert listed["dropped"].removed_at == removed_at and listed["kept"].cron == "*/3 * * * * *"
    assert old.alive()


@pytest.mark.timing
def test_pause_and_resume_without_a_deploy(
    db: Conn, workers: WorkerFactory, periodic: ModuleType, database_url: str
) -> None:
    env = schedules_env({"cron": "* * * * * *", "task": "beat", "name": "pausable", "args": ["p"]})
    workers.start(APP, "--processes", "1", env=env)
    wait_until(lambda: slot_tasks(db, "pausable"), message="a first slot")
    assert periodic.app.pause_schedule("pausable") is True
    assert periodic.app.pause_schedule("pausable") is False  # already paused
    paused_at = db_now(db)
    wait_db_time(db, paused_at + timedelta(seconds=3), "three slots while paused")
    assert all(t["slot"] <= paused_at for t in slot_tasks(db, "pausable"))
    assert run_json(database_url, "schedules")[0]["paused"] is True
    run(database_url, "schedules", "resume", "pausable")
    resumed_at = db_now(db)
    first = wait_until(
        lambda: [t for t in slot_tasks(db, "pausable") if t["slot"] > paused_at],
        message="a slot after the resume",
    )[0]
    # No catch-up of the paused slots: the first slot after the resume, on time.
    assert resumed_at < first["slot"] <= resumed_at + timedelta(seconds=1)
    assert (first["sent_at"] - first["slot"]).total_seconds() < 1.0
    with pytest.raises(ScheduleNotFoundError, match="no schedule named 'nope'"):
        periodic.app.pause_schedule("nope")


def test_overlap_skip_waits_for_the_previous_run(db: Conn, workers: WorkerFactory) -> None:
    env = schedules_env(
        {"cron": "* * * * * *", "task": "slow_beat", "name": "slow", "args": ["s", 2.5], "overlap": "skip"}
    )
    workers.start(APP, "--processes", "2", env=env)
    tasks = wait_until(
        lambda: (t := slot_tasks(db, "slow")) and len(t) >= 3 and t, timeout=30, message="three runs"
    )
    gaps = [(b["slot"] - a["slot"]).total_seconds() for a, b in itertools.pairwise(tasks)]
    assert all(g >= 3 for g in gaps), gaps  # never two at once: slots were skipped meanwhile
    row = db.execute("SELECT slots_skipped FROM tether_schedules WHERE name = 'slow'").fetchone()
    assert row["slots_skipped"] >= 2


def test_the_task_row_info_and_cli_say_which_slot(
    db: Conn, workers: WorkerFactory, periodic: ModuleType, database_url: str
) -> None:
    env = schedules_env(
        {"cron": "*/2 * * * * *", "task": "beat", "name": "shown", "args": ["i"], "timezone": "Europe/Berlin"}
    )
    workers.start(APP, "--processes", "1", env=env)
    task = wait_until(lambda: slot_tasks(db, "shown"), message="a slot")[0]
    info = periodic.app.handle(task["id"]).info()
    assert (info.schedule_name, info.schedule_slot) == ("shown", task["slot"])
    shown = run_json(database_url, "task", str(task["id"]))
    assert shown["schedule_name"] == "shown"
    listed = run_json(database_url, "schedules")
    assert [(s["name"], s["task_name"], s["cron"], s["timezone"]) for s in listed] == [
        ("shown", "beat", "*/2 * * * * *", "Europe/Berlin")
    ]
    assert listed[0]["next_slot"] is not None and listed[0]["last_task_id"] is not None
    assert "shown" in run(database_url, "schedules").stdout


@pytest.mark.smoke
def test_declaration_errors_name_the_problem(periodic: ModuleType) -> None:
    app, beat = periodic.app, periodic.beat
    cases = [
        (
            lambda: app.periodic("61 * * * *", beat, name="a", args=["x"]),
            "schedule 'a': cron expression '61 * * * *' is invalid",
        ),
        (
            lambda: app.periodic("* * * * *", beat, name="b", args=["x"], timezone="Nowhere/City"),
            "timezone 'Nowhere/City'",
        ),
        (
            lambda: app.periodic("* * * * *", beat, name="c"),
            "schedule 'c': task 'beat': missing a required argument",
        ),
        (
            lambda: app.periodic("* * * * *", beat, name="d", args=["x"], catch_up="some"),
            "catch_up must be one of",
        ),
        (
            lambda: app.periodic("* * * * *", beat, name="e", args=["x"], overlap="maybe"),
            "overlap must be one of",
        ),
        (lambda: app.periodic("* * * * *", print, name="f"), "must be a task registered in this app"),
        (lambda: app.periodic("* * * * *", beat, name="9bad", args=["x"]), "schedule name '9bad' is invalid"),
    ]
    for declare, message in cases:
        with pytest.raises(ScheduleDefinitionError, match=message.replace("*", r"\*")):
            declare()
    assert app.schedules == {}
    app.periodic("@hourly", beat, name="once", args=["x"])
    with pytest.raises(ScheduleDefinitionError, match="'once' is already declared"):
        app.periodic("@daily", beat, name="once", args=["y"])
    decorated = app.periodic("@daily", name="decorated", kwargs={"label": "z"})(beat)
    assert decorated is beat and set(app.schedules) == {"once", "decorated"}
    app.schedules.clear()


def test_periodic_tasks_carry_their_concurrency_key(
    db: Conn, workers: WorkerFactory, periodic: ModuleType
) -> None:
    """From the argument the task declares (fixed with the schedule's args), or given by hand
    (docs/limits.md): every slot's task is sent with it."""
    env = schedules_env(
        {"cron": "* * * * * *", "task": "keyed_beat", "name": "keyed-by-arg", "args": ["tenant-1"]},
        {
            "cron": "* * * * * *",
            "task": "beat",
            "name": "keyed-by-hand",
            "args": ["x"],
            "concurrency_key": "given",
        },
        {"cron": "* * * * * *", "task": "beat", "name": "no-key", "args": ["y"]},
    )
    workers.start(APP, "--processes", "1", env=env)
    sent = "SELECT DISTINCT schedule_name, concurrency_key FROM tether_tasks WHERE schedule_name IS NOT NULL"
    rows = wait_until(
        lambda: (r := db.execute(sent).fetchall()) and len({x["schedule_name"] for x in r}) == 3 and r,
        timeout=60,
        message="a slot of each schedule",
    )
    assert {(r["schedule_name"], r["concurrency_key"]) for r in rows} == {
        ("keyed-by-arg", "tenant-1"),
        ("keyed-by-hand", "given"),
        ("no-key", None),
    }
    stored = db.execute("SELECT name, concurrency_key FROM tether_schedules ORDER BY name").fetchall()
    assert [(r["name"], r["concurrency_key"]) for r in stored] == [
        ("keyed-by-arg", "tenant-1"),
        ("keyed-by-hand", "given"),
        ("no-key", None),
    ]
    # A bad key is refused when the schedule is declared, naming where it came from.
    with pytest.raises(
        ScheduleDefinitionError, match=r"argument 'label' of task 'keyed_beat'.*must not be empty"
    ):
        periodic.app.periodic("* * * * *", periodic.keyed_beat, name="bad-key", args=[""])
