"""Seed 001, "Recovery Config": its fields, defaults, ranges, examples, retention and workflow recovery.

The seed's examples are Rust struct literals; each is written here as the same
``RecoveryConfig(...)`` call in Python, field for field (``Some(x)`` is ``x``, ``None`` is
``None``, ``..Default::default()`` is the fields left out), with the Rust text above it.
Retention is run for real: a worker's reaper prunes what is past each retention and keeps
the rest, and keeps everything of a category whose retention is None.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

import tether
from tests.apps.support import ensure_ledger, load_app_module, task_row
from tests.chaos.conftest import APP, FAST
from tests.conftest import WorkerFactory, wait_until
from tether import AppConfig, PostgresConfig, RecoveryConfig

pytestmark = pytest.mark.usefixtures("db")

#: The seed's table of fields: (type, default).
FIELDS: dict[str, tuple[type, Any]] = {
    "auto_requeue_stale_claimed": (bool, True),
    "claimed_stale_threshold_ms": (int, 120_000),
    "auto_fail_stale_running": (bool, True),
    "running_stale_threshold_ms": (int, 300_000),
    "check_interval_ms": (int, 30_000),
    "runner_heartbeat_interval_ms": (int, 30_000),
    "claimer_heartbeat_interval_ms": (int, 30_000),
    "heartbeat_retention_hours": (int, 24),
    "worker_state_retention_hours": (int, 168),
    "terminal_record_retention_hours": (int, 720),
}

#: tether's own fields beyond the seed's, each off by default (so no seed behaviour changes).
BEYOND_THE_SEED: dict[str, Any] = {
    "session_closed_threshold_ms": None,  # docs/heartbeats-and-recovery.md, session_closed
}

#: The seed's "Threshold Guidelines": each field's range, in the config's units (ms).
RANGES: dict[str, tuple[int, int]] = {
    "claimed_stale_threshold_ms": (1_000, 3_600_000),  # 1 second to 1 hour
    "running_stale_threshold_ms": (1_000, 7_200_000),  # 1 second to 2 hours
    "check_interval_ms": (1_000, 600_000),  # 1 second to 10 minutes
    "runner_heartbeat_interval_ms": (1_000, 120_000),  # 1 second to 2 minutes
    "claimer_heartbeat_interval_ms": (1_000, 120_000),
}


def test_the_fields_and_their_defaults() -> None:
    config = RecoveryConfig()
    assert set(RecoveryConfig.model_fields) == set(FIELDS) | set(BEYOND_THE_SEED)
    for name, default in BEYOND_THE_SEED.items():
        assert getattr(config, name) == default, name
    for name, (kind, default) in FIELDS.items():
        value = getattr(config, name)
        assert type(value) is kind and value == default, name


def test_basic_usage() -> None:
    # let config = AppConfig { recovery: RecoveryConfig { auto_requeue_stale_claimed: true,
    #   claimed_stale_threshold_ms: 120_000, auto_fail_stale_running: true,
    #   running_stale_threshold_ms: 300_000, ..RecoveryConfig::default() },
    #   ..AppConfig::for_database_url("postgresql://...")};
    config = AppConfig(
        recovery=RecoveryConfig(
            auto_requeue_stale_claimed=True,
            claimed_stale_threshold_ms=120_000,
            auto_fail_stale_running=True,
            running_stale_threshold_ms=300_000,
        ),
        broker=PostgresConfig(database_url="postgresql://u@db.example/app"),
    )
    assert config.recovery == RecoveryConfig()
    assert config.broker.database_url == "postgresql://u@db.example/app"


@pytest.mark.parametrize("field", sorted(RANGES))
def test_the_threshold_guidelines_ranges(field: str) -> None:
    low, high = RANGES[field]
    # The heartbeat intervals at their least and the thresholds at their most, so that only
    # the field under test can break a rule; a threshold's least is then 2 x 1 s (the 2 x
    # heartbeat rule is the tighter bound).
    base = {
        "claimer_heartbeat_interval_ms": 1_000,
        "runner_heartbeat_interval_ms": 1_000,
        "claimed_stale_threshold_ms": 3_600_000,
        "running_stale_threshold_ms": 7_200_000,
    }
    least = 2 * low if field.endswith("threshold_ms") else low
    for ok in (least, high):
        assert getattr(RecoveryConfig(**{**base, field: ok}), field) == ok
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError, match=field):
            RecoveryConfig(**{**base, field: bad})


@pytest.mark.parametrize(
    ("threshold", "interval"),
    [
        ("running_stale_threshold_ms", "runner_heartbeat_interval_ms"),
        ("claimed_stale_threshold_ms", "claimer_heartbeat_interval_ms"),
    ],
)
def test_a_stale_threshold_must_be_at_least_twice_its_heartbeat_interval(
    threshold: str, interval: str
) -> None:
    # RecoveryConfig { runner_heartbeat_interval_ms: 30_000, running_stale_threshold_ms: 30_000,
    #   ..Default::default() }  // Must be >= 60_000 (2x heartbeat)
    with pytest.raises(ValueError, match=rf"{threshold} \(30000\) must be at least 2 x {interval} \(30000\)"):
        RecoveryConfig(**{interval: 30_000, threshold: 30_000})
    assert getattr(RecoveryConfig(**{interval: 30_000, threshold: 60_000}), threshold) == 60_000


def test_the_cpu_heavy_quick_and_disabled_examples() -> None:
    # RecoveryConfig { runner_heartbeat_interval_ms: 60_000, running_stale_threshold_ms: 600_000, .. }
    heavy = RecoveryConfig(runner_heartbeat_interval_ms=60_000, running_stale_threshold_ms=600_000)
    assert (heavy.runner_heartbeat_interval_ms, heavy.running_stale_threshold_ms) == (60_000, 600_000)
    # RecoveryConfig { runner_heartbeat_interval_ms: 10_000, running_stale_threshold_ms: 30_000, .. }
    quick = RecoveryConfig(runner_heartbeat_interval_ms=10_000, running_stale_threshold_ms=30_000)
    assert (quick.runner_heartbeat_interval_ms, quick.running_stale_threshold_ms) == (10_000, 30_000)
    # RecoveryConfig { auto_requeue_stale_claimed: false, auto_fail_stale_running: false, .. }
    off = RecoveryConfig(auto_requeue_stale_claimed=False, auto_fail_stale_running=False)
    assert (off.auto_requeue_stale_claimed, off.auto_fail_stale_running) == (False, False)


def test_the_retention_examples() -> None:
    # RecoveryConfig { heartbeat_retention_hours: Some(48), worker_state_retention_hours:
    #   Some(24 * 14), terminal_record_retention_hours: Some(24 * 90), .. }
    kept = RecoveryConfig(
        heartbeat_retention_hours=48,
        worker_state_retention_hours=24 * 14,
        terminal_record_retention_hours=24 * 90,
    )
    assert (
        kept.heartbeat_retention_hours,
        kept.worker_state_retention_hours,
        kept.terminal_record_retention_hours,
    ) == (48, 336, 2160)
    # RecoveryConfig { heartbeat_retention_hours: None, worker_state_retention_hours: None,
    #   terminal_record_retention_hours: None, .. }
    none = RecoveryConfig(
        heartbeat_retention_hours=None,
        worker_state_retention_hours=None,
        terminal_record_retention_hours=None,
    )
    assert (
        none.heartbeat_retention_hours,
        none.worker_state_retention_hours,
        none.terminal_record_retention_hours,
    ) == (None, None, None)


def _old_rows(db: Any, hours: int) -> dict[str, Any]:
    """One row of each pruned category, ``hours`` old: a heartbeat, a worker snapshot, a
    stopped worker, a COMPLETED task and a COMPLETED workflow. Returns their ids."""
    worker_id = f"gone-{hours}-ab"
    task = db.execute(
        "INSERT INTO tether_tasks (id, name, queue, args, kwargs, status, completed_at, updated_at)"
        " VALUES (gen_random_uuid(), 'old', 'default', '[]', '{}', 'COMPLETED',"
        " now() - make_interval(hours => %(h)s), now() - make_interval(hours => %(h)s)) RETURNING id",
        {"h": hours},
    ).fetchone()["id"]
    db.execute(
        "INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid)"
        " VALUES (%(t)s, %(w)s, 'runner', now() - make_interval(hours => %(h)s), 'gone', 1)",
        {"t": task, "w": worker_id, "h": hours},
    )
    db.execute(
        "INSERT INTO tether_workers (id, hostname, pid, queues, processes, status, updated_at)"
        " VALUES (%(w)s, 'gone', 1, '{default}', 1, 'stopped', now() - make_interval(hours => %(h)s))",
        {"w": worker_id, "h": hours},
    )
    db.execute(
        "INSERT INTO tether_worker_states (worker_id, captured_at, running, claimed, tasks_done)"
        " VALUES (%(w)s, now() - make_interval(hours => %(h)s), 0, 0, 0)",
        {"w": worker_id, "h": hours},
    )
    return {"task": task, "worker": worker_id}


def _left(db: Any, ids: dict[str, Any]) -> dict[str, int]:
    def n(statement: str, value: Any) -> int:
        return int(db.execute(statement, (value,)).fetchone()["n"])

    return {
        "heartbeats": n("SELECT count(*) AS n FROM tether_heartbeats WHERE sender_id = %s", ids["worker"]),
        "worker_states": n(
            "SELECT count(*) AS n FROM tether_worker_states WHERE worker_id = %s", ids["worker"]
        ),
        "workers": n("SELECT count(*) AS n FROM tether_workers WHERE id = %s", ids["worker"]),
        "tasks": n("SELECT count(*) AS n FROM tether_tasks WHERE id = %s", ids["task"]),
    }


@pytest.mark.parametrize("retention", ["defaults", "none"])
def test_retention_cleanup_by_the_reaper(db: Any, workers: WorkerFactory, retention: str) -> None:
    """Three categories, pruned independently: past the retention deleted, younger kept."""
    old = _old_rows(db, 24 * 31)  # older than every default (24 h, 7 days, 30 days)
    young = _old_rows(db, 23)  # younger than every default
    env = dict(FAST)
    if retention == "none":
        for name in ("HEARTBEAT", "WORKER_STATE", "TERMINAL_RECORD"):
            env[f"TETHER_{name}_RETENTION_HOURS"] = "none"
    worker = workers.start(APP, "--processes", "1", env=env)
    if retention == "defaults":
        wait_until(
            lambda: _left(db, old) == {"heartbeats": 0, "worker_states": 0, "workers": 0, "tasks": 0},
            timeout=20,
            message="the reaper to prune every category past its retention",
        )
        # Each batch commits on its own; the pass logs what it pruned once it is over.
        wait_until(lambda: "retention: pruned" in worker.log(), message="the pass to log what it pruned")
    else:
        # Nothing to wait for that would prove pruning ran: the reaper logs its start-up tick's
        # other work; give it the tick that settles a task, then check nothing was pruned.
        wait_until(lambda: "started: queues" in worker.log(), message="the worker to start")
        stale = db.execute(
            "INSERT INTO tether_tasks (id, name, queue, args, kwargs, status, good_until)"
            " VALUES (gen_random_uuid(), 'hold', 'nobody', '[]', '{}', 'PENDING', now()) RETURNING id"
        ).fetchone()["id"]
        wait_until(
            lambda: task_row(db, stale)["status"] == "EXPIRED",
            timeout=20,
            message="a reaper tick (it expires a task past good_until)",
        )
        assert "retention: pruned" not in worker.log()
        assert _left(db, old) == {"heartbeats": 1, "worker_states": 1, "workers": 1, "tasks": 1}
    assert _left(db, young) == {"heartbeats": 1, "worker_states": 1, "workers": 1, "tasks": 1}


def test_recover_stuck_workflows(database_url: str, db: Any) -> None:
    """horsies::recover_stuck_workflows(&pool, &registry) is tether.recover_stuck_workflows(app)."""
    ensure_ledger(db)
    flows: ModuleType = load_app_module("flows", database_url)
    app = flows.app
    add = flows.add.with_options(queue="other")  # a queue no worker serves here
    first = add.node(args=(1, 2), name="first")
    then = add.node(args_from={"a": first}, kwargs={"b": 10}, name="then")
    handle = app.workflow("seed-001", [first, then]).start()
    step = db.execute(
        "SELECT task_id FROM tether_workflow_tasks WHERE workflow_id = %s AND node_name = 'first'",
        (handle.id,),
    ).fetchone()
    # The worker that ran the step died between ending its task and advancing the workflow.
    db.execute(
        "UPDATE tether_tasks SET status = 'COMPLETED', result = '{\"ok\": 3}', completed_at = now()"
        " WHERE id = %s",
        (step["task_id"],),
    )
    done = tether.recover_stuck_workflows(app)
    assert done.steps == 1
    steps = {
        r["node_name"]: r
        for r in db.execute(
            "SELECT node_name, status, task_id FROM tether_workflow_tasks WHERE workflow_id = %s",
            (handle.id,),
        )
    }
    assert steps["first"]["status"] == "COMPLETED"
    assert steps["then"]["status"] == "ENQUEUED"  # its input is ready: enqueued by the same pass
    assert task_row(db, steps["then"]["task_id"])["kwargs"] == {"a": 3, "b": 10}  # fed from the result
    assert tether.recover_stuck_workflows(app).steps == 0  # nothing left to settle
