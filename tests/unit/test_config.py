"""Unit tests for tether.config: every rule, both sides of every bound, env and JSON."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from tether.config import (
    AppConfig,
    PostgresConfig,
    RecoveryConfig,
    RetryPolicy,
    WorkerConfig,
    mask_url,
)
from tether.result import ErrorCode


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's own TETHER_* settings must not leak into these tests.
    for name in list(os.environ):
        if name.upper().startswith("TETHER_"):
            monkeypatch.delenv(name)


def _fails(cls: Callable[..., Any], field: str, **kwargs: Any) -> str:
    with pytest.raises(ValidationError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert field in message
    return message


def _one(field: str, value: Any) -> dict[str, Any]:
    return {field: value}


# ---------------------------------------------------------------- RecoveryConfig


def test_recovery_defaults_match_the_seed() -> None:
    assert RecoveryConfig().model_dump() == {
        "auto_requeue_stale_claimed": True,
        "claimed_stale_threshold_ms": 120_000,
        "auto_fail_stale_running": True,
        "running_stale_threshold_ms": 300_000,
        "check_interval_ms": 30_000,
        "runner_heartbeat_interval_ms": 30_000,
        "claimer_heartbeat_interval_ms": 30_000,
        "heartbeat_retention_hours": 24,
        "worker_state_retention_hours": 168,
        "terminal_record_retention_hours": 720,
        "session_closed_threshold_ms": None,  # not the seed's: off by default
    }


# Each case moves one value to a bound; the others are chosen so only that rule can fire.
_FAST: dict[str, Any] = {"claimer_heartbeat_interval_ms": 1_000, "runner_heartbeat_interval_ms": 1_000}
_SLOW: dict[str, Any] = {"claimed_stale_threshold_ms": 3_600_000, "running_stale_threshold_ms": 7_200_000}
RECOVERY_BOUNDS = [
    ("claimed_stale_threshold_ms", 3_600_001, 3_600_000, {}),
    ("running_stale_threshold_ms", 7_200_001, 7_200_000, {}),
    ("check_interval_ms", 999, 1_000, {}),
    ("check_interval_ms", 600_001, 600_000, {}),
    ("runner_heartbeat_interval_ms", 999, 1_000, {}),
    ("runner_heartbeat_interval_ms", 120_001, 120_000, _SLOW),
    ("claimer_heartbeat_interval_ms", 999, 1_000, {}),
    ("claimer_heartbeat_interval_ms", 120_001, 120_000, _SLOW),
    ("heartbeat_retention_hours", 0, 1, {}),
    ("worker_state_retention_hours", 0, 1, {}),
    ("terminal_record_retention_hours", 0, 1, {}),
]


@pytest.mark.parametrize(("field", "bad", "good", "others"), RECOVERY_BOUNDS)
def test_recovery_bounds(field: str, bad: int, good: int, others: dict[str, Any]) -> None:
    kwargs = {k: v for k, v in others.items() if k != field}
    assert getattr(RecoveryConfig(**kwargs, **_one(field, good)), field) == good
    _fails(RecoveryConfig, field, **kwargs, **_one(field, bad))


@pytest.mark.parametrize("threshold", ["claimed_stale_threshold_ms", "running_stale_threshold_ms"])
def test_stale_threshold_lower_bound(threshold: str) -> None:
    # With the smallest interval (1000) the 2x rule needs 2000, so 1000 itself can never be
    # accepted: check that 999 fails the range and 1000 passes it, failing only the 2x rule.
    with pytest.raises(ValidationError) as low:
        RecoveryConfig(**_FAST, **_one(threshold, 999))
    assert [(e["loc"], e["type"]) for e in low.value.errors()] == [((threshold,), "greater_than_equal")]
    message = _fails(RecoveryConfig, threshold, **_FAST, **_one(threshold, 1_000))
    assert "must be at least 2 x" in message and "greater than" not in message
    assert getattr(RecoveryConfig(**_FAST, **_one(threshold, 2_000)), threshold) == 2_000


@pytest.mark.parametrize(
    ("threshold", "interval"),
    [
        ("claimed_stale_threshold_ms", "claimer_heartbeat_interval_ms"),
        ("running_stale_threshold_ms", "runner_heartbeat_interval_ms"),
    ],
)
@pytest.mark.parametrize("beat", [1_000, 30_000])
def test_stale_threshold_must_cover_two_heartbeats(threshold: str, interval: str, beat: int) -> None:
    edge: dict[str, Any] = {interval: beat, threshold: 2 * beat}
    assert getattr(RecoveryConfig(**edge), threshold) == 2 * beat
    message = _fails(RecoveryConfig, threshold, **{**edge, threshold: 2 * beat - 1})
    assert interval in message and str(2 * beat) in message


def test_session_closed_threshold_is_off_by_default_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = {"claimer_heartbeat_interval_ms": 1_000, "runner_heartbeat_interval_ms": 1_000}
    assert RecoveryConfig(**fast, session_closed_threshold_ms=1_250).session_closed_threshold_ms == 1_250
    # 1.25 x the beat interval (the smaller one): one late beat must not make a live worker dead.
    assert "greater than or equal to 1250" in _fails(
        RecoveryConfig, "session_closed_threshold_ms", **fast, session_closed_threshold_ms=1_249
    )
    slow = {"claimer_heartbeat_interval_ms": 2_000, "runner_heartbeat_interval_ms": 2_000}
    message = _fails(RecoveryConfig, "session_closed_threshold_ms", **slow, session_closed_threshold_ms=2_499)
    assert "at least 1.25 x the heartbeat interval (2000) = 2500" in message
    mixed = {"claimer_heartbeat_interval_ms": 2_000, "runner_heartbeat_interval_ms": 1_000}
    assert RecoveryConfig(**mixed, session_closed_threshold_ms=1_250).session_closed_threshold_ms == 1_250
    # Past the running threshold it would never decide first.
    message = _fails(
        RecoveryConfig,
        "session_closed_threshold_ms",
        **fast,
        running_stale_threshold_ms=2_000,
        session_closed_threshold_ms=2_001,
    )
    assert "must not exceed running_stale_threshold_ms (2000)" in message
    monkeypatch.setenv("TETHER_SESSION_CLOSED_THRESHOLD_MS", "60000")
    assert RecoveryConfig().session_closed_threshold_ms == 60_000
    monkeypatch.setenv("TETHER_SESSION_CLOSED_THRESHOLD_MS", "none")
    assert RecoveryConfig().session_closed_threshold_ms is None


def test_two_x_message_reads_well() -> None:
    message = _fails(
        RecoveryConfig,
        "running_stale_threshold_ms",
        runner_heartbeat_interval_ms=30_000,
        running_stale_threshold_ms=30_000,
    )
    assert (
        "running_stale_threshold_ms (30000) must be at least 2 x runner_heartbeat_interval_ms (30000) = 60000"
    ) in message


@pytest.mark.parametrize(
    "field", ["heartbeat_retention_hours", "worker_state_retention_hours", "terminal_record_retention_hours"]
)
def test_retention_none_disables(field: str) -> None:
    assert getattr(RecoveryConfig(**_one(field, None)), field) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("check_interval_ms", True),
        ("claimed_stale_threshold_ms", 120_000.5),
        ("heartbeat_retention_hours", False),
        ("heartbeat_retention_hours", 1.5),
        ("check_interval_ms", "thirty"),
    ],
)
def test_recovery_rejects_bools_fractions_and_junk(field: str, value: Any) -> None:
    _fails(RecoveryConfig, field, **_one(field, value))


def test_recovery_rejects_unknown_fields_and_is_frozen() -> None:
    _fails(RecoveryConfig, "check_interval", check_interval=5_000)
    config = RecoveryConfig()
    with pytest.raises(ValidationError):
        config.check_interval_ms = 5_000


def test_recovery_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_RUNNING_STALE_THRESHOLD_MS", "60000")
    monkeypatch.setenv("TETHER_AUTO_FAIL_STALE_RUNNING", "false")
    monkeypatch.setenv("TETHER_HEARTBEAT_RETENTION_HOURS", "none")
    monkeypatch.setenv("TETHER_WORKER_STATE_RETENTION_HOURS", "NULL")
    monkeypatch.setenv("TETHER_TERMINAL_RECORD_RETENTION_HOURS", "")
    config = RecoveryConfig()
    assert config.running_stale_threshold_ms == 60_000
    assert config.auto_fail_stale_running is False
    assert config.heartbeat_retention_hours is None
    assert config.worker_state_retention_hours is None
    assert config.terminal_record_retention_hours is None


def test_explicit_arguments_beat_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_CHECK_INTERVAL_MS", "5000")
    monkeypatch.setenv("TETHER_POOL_MAX_SIZE", "3")
    monkeypatch.setenv("TETHER_WORKER_PROCESSES", "3")
    assert RecoveryConfig().check_interval_ms == 5_000
    assert RecoveryConfig(check_interval_ms=7_000).check_interval_ms == 7_000
    assert PostgresConfig(pool_max_size=4).pool_max_size == 4
    assert WorkerConfig(processes=2).processes == 2


def test_invalid_env_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_CHECK_INTERVAL_MS", "10")
    _fails(RecoveryConfig, "check_interval_ms")


# ---------------------------------------------------------------- PostgresConfig


def test_postgres_defaults() -> None:
    config = PostgresConfig()
    assert (config.database_url, config.pool_min_size, config.pool_max_size) == (None, 1, 10)
    assert (config.connect_timeout_s, config.application_name) == (5.0, "tether")
    assert config.masked_url is None


@pytest.mark.parametrize(
    ("field", "bad", "good", "others"),
    [
        ("pool_min_size", -1, 0, {}),
        ("pool_min_size", 101, 100, {"pool_max_size": 200}),
        ("pool_max_size", 0, 1, {"pool_min_size": 0}),
        ("pool_max_size", 201, 200, {}),
        ("connect_timeout_s", 0.09, 0.1, {}),
        ("connect_timeout_s", 300.5, 300, {}),
    ],
)
def test_postgres_bounds(field: str, bad: float, good: float, others: dict[str, Any]) -> None:
    assert getattr(PostgresConfig(**others, **_one(field, good)), field) == good
    _fails(PostgresConfig, field, **others, **_one(field, bad))


def test_durable_sends_default_env_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PostgresConfig().durable_sends is True
    assert PostgresConfig(durable_sends=False).durable_sends is False
    monkeypatch.setenv("TETHER_DURABLE_SENDS", "false")
    assert PostgresConfig().durable_sends is False
    monkeypatch.setenv("TETHER_DURABLE_SENDS", "sometimes")
    _fails(PostgresConfig, "durable_sends")


def test_pool_max_must_cover_min() -> None:
    assert PostgresConfig(pool_min_size=5, pool_max_size=5).pool_max_size == 5
    _fails(PostgresConfig, "pool_max_size", pool_min_size=5, pool_max_size=4)


@pytest.mark.parametrize("url", ["postgresql://u:p@h:5432/db", "postgres://h/db"])
def test_postgres_url_accepted(url: str) -> None:
    assert PostgresConfig(database_url=url).database_url == url


def test_postgres_url_rejected_without_leaking_the_password() -> None:
    message = _fails(PostgresConfig, "database_url", database_url="mysql://u:hunter2@h/db")
    assert "hunter2" not in message and "mysql://u:***@h/db" in message


def test_postgres_url_from_env_and_masking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_DATABASE_URL", "postgresql://app:hunter2@db.example/prod")
    config = PostgresConfig()
    assert config.database_url == "postgresql://app:hunter2@db.example/prod"
    assert config.masked_url == "postgresql://app:***@db.example/prod"
    assert "hunter2" not in repr(config) and "hunter2" not in repr(AppConfig())
    monkeypatch.setenv("TETHER_DATABASE_URL", "")
    assert PostgresConfig().database_url is None


POOLED = "postgresql://app:hunter2@pgbouncer.internal:6432/app"
DIRECT = "postgresql://app:hunter2@db.internal:5432/app"


def test_pooler_default_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (PostgresConfig().pooler, PostgresConfig().listen_url) == ("none", None)
    assert PostgresConfig().prepares_statements is True
    monkeypatch.setenv("TETHER_DATABASE_URL", POOLED)
    monkeypatch.setenv("TETHER_POOLER", " Transaction ")
    monkeypatch.setenv("TETHER_LISTEN_URL", DIRECT)
    config = PostgresConfig()
    assert (config.pooler, config.listen_url, config.prepares_statements) == ("transaction", DIRECT, False)
    assert "hunter2" not in repr(config) and "db.internal" in repr(config)
    assert PostgresConfig(pooler="session").prepares_statements is True
    monkeypatch.setenv("TETHER_LISTEN_URL", "")
    assert PostgresConfig().listen_url is None


def test_pooler_rejects_an_unknown_mode() -> None:
    message = _fails(PostgresConfig, "pooler", database_url=POOLED, pooler="statement")
    assert "'none', 'session' or 'transaction'" in message


def test_listen_url_must_be_a_postgres_url_and_is_masked() -> None:
    message = _fails(PostgresConfig, "listen_url", database_url=POOLED, listen_url="redis://u:hunter2@h/0")
    assert "hunter2" not in message and "listen_url must start with postgresql://" in message


@pytest.mark.parametrize("field", ["pooler", "listen_url"])
def test_pooler_settings_need_a_database_url(field: str) -> None:
    value = "transaction" if field == "pooler" else DIRECT
    message = _fails(PostgresConfig, field, **_one(field, value))
    assert "database_url" in message and "hunter2" not in message


def test_listen_url_must_not_be_the_transaction_pooler() -> None:
    message = _fails(
        PostgresConfig, "listen_url", database_url=POOLED, pooler="transaction", listen_url=POOLED
    )
    assert "direct URL" in message and "hunter2" not in message
    # Through a session pooler (or none) LISTEN works on the same URL: allowed.
    assert PostgresConfig(database_url=POOLED, pooler="session", listen_url=POOLED).listen_url == POOLED


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://user:secret@host/db", "postgresql://user:***@host/db"),
        (
            "postgresql://user:secret@host:5432/db?sslmode=require",
            "postgresql://user:***@host:5432/db?sslmode=require",
        ),
        (
            "postgresql://host/db?user=u&password=secret&sslmode=require",
            "postgresql://host/db?user=u&password=***&sslmode=require",
        ),
        ("postgresql://host/db?PASSWORD=secret", "postgresql://host/db?PASSWORD=***"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("postgresql://host/db", "postgresql://host/db"),
        ("postgres://u:p%40ss@h1:5432,h2:5433/db", "postgres://u:***@h1:5432,h2:5433/db"),
        ("postgresql://u:p@ss@host/db", "postgresql://u:***@host/db"),
        ("host=h user=u password=secret dbname=d", "host=h user=u password=*** dbname=d"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


# ---------------------------------------------------------------- WorkerConfig


def test_worker_defaults() -> None:
    config = WorkerConfig()
    assert (config.processes, config.async_processes, config.async_concurrency) == (None, None, 100)
    assert (config.queues, config.prefetch, config.poll_interval_ms) == (None, None, 1_000)
    assert (config.grace_period_s, config.claim_batch_size, config.cancel_grace_s) == (30.0, 100, 5.0)


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("processes", -1, 0),
        ("processes", 257, 256),
        ("async_processes", -1, 0),
        ("async_processes", 257, 256),
        ("async_concurrency", 0, 1),
        ("async_concurrency", 10_001, 10_000),
        ("cancel_grace_s", -0.1, 0),
        ("cancel_grace_s", 3_600.5, 3_600),
        ("prefetch", -1, 0),
        ("prefetch", 100_001, 100_000),
        ("poll_interval_ms", 9, 10),
        ("poll_interval_ms", 60_001, 60_000),
        ("grace_period_s", -0.1, 0),
        ("grace_period_s", 86_400.5, 86_400),
        ("claim_batch_size", 0, 1),
        ("claim_batch_size", 10_001, 10_000),
    ],
)
def test_worker_bounds(field: str, bad: Any, good: Any) -> None:
    assert getattr(WorkerConfig(**_one(field, good)), field) == good
    _fails(WorkerConfig, field, **_one(field, bad))


def test_a_worker_needs_a_child() -> None:
    _fails(WorkerConfig, "processes and async_processes are both 0", processes=0, async_processes=0)


@pytest.mark.parametrize("queues", [[], ["ok", "bad name"], ["a", "a"], ["x" * 65]])
def test_worker_queues_rejected(queues: list[str]) -> None:
    _fails(WorkerConfig, "queues", queues=queues)


def test_worker_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_WORKER_QUEUES", "default, images")
    monkeypatch.setenv("TETHER_WORKER_PROCESSES", "3")
    monkeypatch.setenv("TETHER_WORKER_PREFETCH", "none")
    monkeypatch.setenv("TETHER_WORKER_GRACE_PERIOD_S", "2.5")
    config = WorkerConfig()
    assert config.queues == ["default", "images"]
    assert (config.processes, config.prefetch, config.grace_period_s) == (3, None, 2.5)
    monkeypatch.setenv("TETHER_WORKER_QUEUES", '["a", "b"]')
    assert WorkerConfig().queues == ["a", "b"]
    monkeypatch.setenv("TETHER_WORKER_QUEUES", "")
    assert WorkerConfig().queues is None


# ---------------------------------------------------------------- RetryPolicy


def _policy(**kwargs: Any) -> RetryPolicy:
    base: dict[str, Any] = {
        "kind": "exponential",
        "max_retries": 3,
        "base_seconds": 1,
        "auto_retry_for": ["X"],
    }
    return RetryPolicy(**{**base, **kwargs})


def test_design_example_and_code_normalisation() -> None:
    policy = RetryPolicy.exponential(
        base_seconds=5, max_retries=4, auto_retry_for=[ErrorCode.WORKER_CRASHED, "TRANSIENT"]
    )
    assert policy.auto_retry_for == frozenset({"WORKER_CRASHED", "TRANSIENT"})
    assert all(type(code) is str for code in policy.auto_retry_for)
    assert (policy.max_seconds, policy.jitter) == (3_600, 0.1)
    assert RetryPolicy.fixed(2, max_retries=1, auto_retry_for="ONE").auto_retry_for == {"ONE"}
    assert RetryPolicy.fixed(2, max_retries=1, auto_retry_for=(c for c in ["A", "B"])).auto_retry_for == {
        "A",
        "B",
    }


_WIDE: dict[str, Any] = {"max_seconds": 7 * 86_400}


@pytest.mark.parametrize(
    ("field", "bad", "good", "others"),
    [
        ("max_retries", -1, 0, {}),
        ("max_retries", 1_001, 1_000, {}),
        ("base_seconds", 0, 0.001, {}),
        ("base_seconds", 86_400.5, 86_400, _WIDE),
        ("max_seconds", 0, 1, {}),
        ("max_seconds", 7 * 86_400 + 1, 7 * 86_400, {}),
        ("jitter", -0.01, 0, {}),
        ("jitter", 1.01, 1, {}),
    ],
)
def test_retry_bounds(field: str, bad: float, good: float, others: dict[str, Any]) -> None:
    assert getattr(_policy(**others, **_one(field, good)), field) == good
    _fails(_policy, field, **others, **_one(field, bad))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_retries", True),
        ("max_retries", 2.5),
        ("base_seconds", float("nan")),
        ("base_seconds", float("inf")),
        ("jitter", True),
        ("kind", "linear"),
    ],
)
def test_retry_rejects_wrong_types(field: str, value: Any) -> None:
    _fails(_policy, field, **_one(field, value))


def test_exponential_cap_must_cover_base() -> None:
    assert _policy(base_seconds=10, max_seconds=10).max_seconds == 10
    _fails(_policy, "max_seconds", base_seconds=10, max_seconds=9.9)
    # A fixed interval is never capped, so the default cap does not get in its way.
    assert RetryPolicy.fixed(7_200, max_retries=1, auto_retry_for=["X"]).delay_seconds(1) > 3_600


@pytest.mark.parametrize("codes", [[], set(), ["bad code"], [""], ["x" * 101], [1], None, 5, ["TRANSIENT\n"]])
def test_auto_retry_for_rejected(codes: Any) -> None:
    message = _fails(_policy, "auto_retry_for", auto_retry_for=codes)
    if codes == []:
        assert "retries nothing" in message


def test_auto_retry_for_accepts_the_code_alphabet() -> None:
    assert _policy(auto_retry_for=["a.B:c-d_1", "x" * 100]).retries_on("a.B:c-d_1")


def test_fixed_delay() -> None:
    policy = RetryPolicy.fixed(7.5, max_retries=5, auto_retry_for=["X"], jitter=0)
    assert [policy.delay_seconds(n) for n in (1, 2, 10)] == [7.5, 7.5, 7.5]


def test_exponential_growth_and_cap() -> None:
    policy = RetryPolicy.exponential(2, max_retries=20, auto_retry_for=["X"], max_seconds=100, jitter=0)
    assert [policy.delay_seconds(n) for n in range(1, 9)] == [2, 4, 8, 16, 32, 64, 100, 100]
    assert policy.delay_seconds(10**6) == 100  # 2**n past float range still means the cap


@pytest.mark.parametrize("kind", ["fixed", "exponential"])
def test_jitter_bounds(kind: str) -> None:
    policy = _policy(kind=kind, base_seconds=10, max_seconds=40, jitter=0.25)
    rand = random.Random(1234)
    for n in (1, 2, 3, 5):
        raw = 10.0 if kind == "fixed" else min(10.0 * 2 ** (n - 1), 40.0)
        samples = [policy.delay_seconds(n, rand) for _ in range(2_000)]
        assert all(raw * 0.75 <= s <= raw * 1.25 for s in samples)
        assert all(0 <= s <= 40 * 1.25 for s in samples)
        # The spread is real: both halves of the range are used.
        assert min(samples) < raw * 0.8 and max(samples) > raw * 1.2


def test_full_jitter_never_negative_and_seeded_is_repeatable() -> None:
    policy = _policy(jitter=1)
    assert all(policy.delay_seconds(3, random.Random(s)) >= 0 for s in range(500))
    assert policy.delay_seconds(2, random.Random(7)) == policy.delay_seconds(2, random.Random(7))


@pytest.mark.parametrize("n", [0, -1, True])
def test_delay_rejects_bad_retry_number(n: int) -> None:
    with pytest.raises(ValueError, match="retry_number"):
        _policy().delay_seconds(n)


def test_should_retry_edges() -> None:
    policy = RetryPolicy.fixed(1, max_retries=2, auto_retry_for=[ErrorCode.WORKER_CRASHED])
    assert policy.retries_on("WORKER_CRASHED") and policy.retries_on(ErrorCode.WORKER_CRASHED)
    assert not policy.retries_on("TRANSIENT")
    assert policy.should_retry(ErrorCode.WORKER_CRASHED, 0)
    assert policy.should_retry("WORKER_CRASHED", 1)
    assert not policy.should_retry("WORKER_CRASHED", 2)  # retry_count == max_retries
    assert not policy.should_retry("TRANSIENT", 0)
    assert not RetryPolicy.fixed(1, max_retries=0, auto_retry_for=["X"]).should_retry("X", 0)
    with pytest.raises(ValueError, match="retry_count"):
        policy.should_retry("WORKER_CRASHED", -1)


def test_json_round_trip() -> None:
    import json

    policy = RetryPolicy.exponential(
        3, max_retries=4, max_seconds=60, jitter=0.2, auto_retry_for=[ErrorCode.WORKER_CRASHED, "B", "A"]
    )
    data = json.loads(json.dumps(policy.to_json()))  # what a row actually stores
    assert data == {
        "kind": "exponential",
        "max_retries": 4,
        "base_seconds": 3.0,
        "max_seconds": 60.0,
        "jitter": 0.2,
        "auto_retry_for": ["A", "B", "WORKER_CRASHED"],
    }
    assert RetryPolicy.from_json(data) == policy
    fixed = RetryPolicy.fixed(7_200, max_retries=1, auto_retry_for=["X"], jitter=0)
    assert RetryPolicy.from_json(fixed.to_json()) == fixed
    with pytest.raises(ValidationError, match="auto_retry_for"):
        RetryPolicy.from_json({**data, "auto_retry_for": []})


def test_retry_policy_is_frozen_and_hashable() -> None:
    policy = _policy()
    with pytest.raises(ValidationError):
        policy.max_retries = 9
    assert hash(policy) == hash(_policy())


# ---------------------------------------------------------------- AppConfig


def test_app_config_defaults() -> None:
    config = AppConfig()
    assert config.broker.database_url is None  # embedded server
    assert config.queues == ["default"] and config.default_queue == "default"
    assert (config.result_poll_interval_ms, config.auto_migrate) == (500, True)
    assert config.recovery == RecoveryConfig() and config.worker == WorkerConfig()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"queues": []}, "queues"),
        ({"queues": ["default", "default"]}, "queues"),
        ({"queues": ["default", "no spaces"]}, "queues"),
        ({"queues": ["default", "q" * 65]}, "queues"),
        ({"queues": ["a", "b"]}, "default_queue"),
        ({"default_queue": "other"}, "default_queue"),
        ({"result_poll_interval_ms": 9}, "result_poll_interval_ms"),
        ({"result_poll_interval_ms": 60_001}, "result_poll_interval_ms"),
    ],
)
def test_app_config_rejected(kwargs: dict[str, Any], field: str) -> None:
    _fails(AppConfig, field, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"queues": ["a", "b.c:d-e_f", "q" * 64], "default_queue": "b.c:d-e_f"},
        {"result_poll_interval_ms": 10},
        {"result_poll_interval_ms": 60_000},
    ],
)
def test_app_config_accepted(kwargs: dict[str, Any]) -> None:
    config = AppConfig(**kwargs)
    assert all(getattr(config, k) == v for k, v in kwargs.items())


def test_worker_queues_must_be_declared() -> None:
    ok = AppConfig(queues=["default", "images"], worker=WorkerConfig(queues=["images"]))
    assert ok.worker.queues == ["images"]
    message = _fails(
        AppConfig,
        "worker.queues",
        queues=["default", "images"],
        worker=WorkerConfig(queues=["images", "video", "audio"]),
    )
    assert "'video'" in message and "'audio'" in message and "'images'" in message


def test_app_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_QUEUES", "default,images")
    monkeypatch.setenv("TETHER_DEFAULT_QUEUE", "images")
    monkeypatch.setenv("TETHER_AUTO_MIGRATE", "0")
    monkeypatch.setenv("TETHER_WORKER_QUEUES", "images")
    monkeypatch.setenv("TETHER_DATABASE_URL", "postgresql://h/db")
    monkeypatch.setenv("TETHER_CHECK_INTERVAL_MS", "2000")
    config = AppConfig()
    assert (config.queues, config.default_queue) == (["default", "images"], "images")
    assert config.auto_migrate is False and config.worker.queues == ["images"]
    assert config.broker.database_url == "postgresql://h/db"
    assert config.recovery.check_interval_ms == 2_000
    assert AppConfig(queues=["x"], default_queue="x", worker=WorkerConfig(queues=None)).queues == ["x"]


def test_nested_dicts_still_read_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_RUNNER_HEARTBEAT_INTERVAL_MS", "5000")
    config = AppConfig(recovery={"running_stale_threshold_ms": 10_000})  # type: ignore[arg-type]
    assert config.recovery.runner_heartbeat_interval_ms == 5_000
    assert config.recovery.running_stale_threshold_ms == 10_000
    _fails(AppConfig, "check_interval_ms", recovery={"check_interval_ms": 5})


def test_env_names_are_read_in_any_case_and_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("tether_database_url", "postgresql://lower@h/db")
    monkeypatch.setenv("TETHER_POOL_MAX_SIZE", "3")
    assert PostgresConfig().database_url == "postgresql://lower@h/db"
    assert PostgresConfig(pool_max_size=4).pool_max_size == 4
    assert PostgresConfig(database_url=None).database_url is None  # an explicit None is an argument


def test_json_settings_from_env_name_the_field_and_lie_under_dict_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TETHER_BROKER", '{"database_url": "postgresql://h/db", "pool_max_size": 3}')
    monkeypatch.setenv("TETHER_QUEUE_LIMITS", '{"default": {"max_in_flight": 2}}')
    config = AppConfig(broker={"pool_min_size": 2})  # type: ignore[arg-type]
    assert (config.broker.database_url, config.broker.pool_min_size, config.broker.pool_max_size) == (
        "postgresql://h/db",
        2,
        3,
    )
    assert config.queue_limits["default"].max_in_flight == 2
    monkeypatch.setenv("TETHER_QUEUE_LIMITS", "default=2")
    with pytest.raises(ValueError, match="queue_limits: TETHER_QUEUE_LIMITS is not JSON"):
        AppConfig()


def test_app_config_is_frozen() -> None:
    config = AppConfig()
    with pytest.raises(ValidationError):
        config.default_queue = "x"
