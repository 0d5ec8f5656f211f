"""TASKS settings of a TetherBackend: what OPTIONS give, and clear errors naming the key at fault."""

from __future__ import annotations

from typing import Any

import pytest

from tether import ErrorCode, RetryPolicy

BACKEND = "tether.contrib.django.TetherBackend"


def backend(options: dict[str, Any] | None = None, **params: Any) -> Any:
    from tether.contrib.django import TetherBackend

    return TetherBackend("extra", {"BACKEND": BACKEND, "OPTIONS": options or {}, **params})


@pytest.mark.parametrize(
    ("options", "params", "expected"),
    [
        (
            {"RETRIES": 3},
            {},
            r"TASKS\['extra'\]\['OPTIONS'\]: unknown key\(s\) 'RETRIES'; known keys: AUTO_MIGRATE",
        ),
        (
            {"DATABASE": "legacy"},
            {},
            r"\['DATABASE'\]: DATABASES\['legacy'\] uses ENGINE 'django.db.backends.sqlite3'",
        ),
        (
            {"DATABASE": "nope"},
            {},
            r"\['DATABASE'\]: 'nope' is not a database alias .*aliases: 'default', 'legacy'",
        ),
        ({"DATABASE": 3}, {}, r"\['DATABASE'\] must be a DATABASES alias"),
        (
            {"RETRY_POLICY": {"kind": "fixed", "base_seconds": 1, "max_retries": 2}},
            {},
            r"\['RETRY_POLICY'\]: auto_retry_for: Field required",
        ),
        ({"RETRY_POLICY": "always"}, {}, r"\['RETRY_POLICY'\] must be a RetryPolicy or a dict"),
        ({"TIME_LIMIT": -1}, {}, r"\['TIME_LIMIT'\] must be a number of seconds .*got -1"),
        (
            {"RECOVERY": {"running_stale_threshold_ms": 10}},
            {},
            r"\['RECOVERY'\]: running_stale_threshold_ms: Input should be greater than or equal to 1000",
        ),
        (
            {"WORKER": {"processes": -1}},
            {},
            r"\['WORKER'\]: processes: Input should be greater than or equal to 0",
        ),
        ({"WORKER": {"queues": ["elsewhere"]}}, {}, r"worker.queues names queue\(s\) \['elsewhere'\]"),
        ({"BROKER": {"database_url": "postgresql://x/y"}}, {}, r"\['BROKER'\]: give no database_url"),
        ({"BROKER": {"pool_max_size": 0}}, {}, r"\['BROKER'\]: pool_max_size: Input should be greater"),
        ({"AUTO_MIGRATE": "yes"}, {}, r"\['AUTO_MIGRATE'\] must be True or False"),
        (
            {"TASK_OPTIONS": {"shop.tasks.charge": {"RETRIES": 1}}},
            {},
            r"\['TASK_OPTIONS'\]\['shop.tasks.charge'\]: unknown key\(s\) 'RETRIES'",
        ),
        ({"TASK_OPTIONS": {"charge": {}}}, {}, r"\['TASK_OPTIONS'\]\['charge'\]: keys are task paths"),
        (
            {},
            {"QUEUES": ["bad queue!"]},
            r"TASKS\['extra'\]\['QUEUES'\]: queues: Value error, queues: invalid",
        ),
        ({}, {"QUEUES": "default"}, r"TASKS\['extra'\]\['QUEUES'\] must be a list of queue names"),
        ([("DATABASE", "default")], {}, r"TASKS\['extra'\]\['OPTIONS'\] must be a dict"),
    ],
)
def test_bad_settings_name_the_key(
    django_project: None, options: Any, params: dict[str, Any], expected: str
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match=expected):
        backend(options, **params)


def test_options_reach_tether(django_project: None, database_url: str) -> None:
    from tests.django_project.shop import tasks

    crash_retry = RetryPolicy.fixed(5, max_retries=2, auto_retry_for=[ErrorCode.WORKER_CRASHED])
    made = backend(
        {
            "RETRY_POLICY": {
                "KIND": "exponential",
                "BASE_SECONDS": 1,
                "MAX_RETRIES": 3,
                "AUTO_RETRY_FOR": ["UNHANDLED_EXCEPTION"],
            },
            "TIME_LIMIT": 60,
            "TASK_OPTIONS": {"tests.django_project.shop.tasks.add": {"RETRY_POLICY": crash_retry}},
            "RECOVERY": {"running_stale_threshold_ms": 60_000},
            "WORKER": {"processes": 3},
            "BROKER": {"pool_min_size": 0},
        },
        QUEUES=["emails", "default"],
    )
    config = made.app.config
    assert config.queues == ["emails", "default"] and config.default_queue == "default"
    assert config.recovery.running_stale_threshold_ms == 60_000 and config.worker.processes == 3
    assert config.broker.pool_min_size == 0
    from tests.django_project.settings import DATABASES

    assert (
        config.broker.database_url is not None and DATABASES["default"]["NAME"] in config.broker.database_url
    )
    record = made.tether_task(tasks.record)
    assert record.retry_policy is not None and record.retry_policy.kind == "exponential"
    assert (
        record.retry_policy.auto_retry_for == frozenset({"UNHANDLED_EXCEPTION"}) and record.time_limit == 60
    )
    add = made.tether_task(tasks.add)
    assert add.retry_policy == crash_retry and add.time_limit is None  # TASK_OPTIONS replace the defaults


def test_queues_default_to_django_s_default_queue(django_project: None) -> None:
    from django.tasks.exceptions import InvalidTask

    from tests.django_project.shop import tasks

    for params in ({}, {"QUEUES": []}):
        made = backend(None, **params)
        assert made.queues == {"default"} and made.app.config.queues == ["default"]
        with pytest.raises(InvalidTask, match=r"tether serves the queues in TASKS\['extra'\]\['QUEUES'\]"):
            made.validate_task(tasks.send_email)  # queue "emails"


def test_system_check_warns_about_task_options_for_unknown_tasks(django_project: None) -> None:
    made = backend(
        {
            "TASK_OPTIONS": {
                "tests.django_project.shop.tasks.record": {"TIME_LIMIT": 5},
                "tests.django_project.shop.tasks.gone": {"TIME_LIMIT": 5},
            }
        }
    )
    [warning] = made.check()
    assert warning.id == "tether.W001" and "'tests.django_project.shop.tasks.gone'" in warning.msg
