"""What every connection tether opens is given, directly and behind a pooler (docs/pgbouncer.md)."""

from __future__ import annotations

import os

import pytest

from tether.config import AppConfig, PostgresConfig
from tether.db.connection import connect_kwargs, listen_url, worker_connection_options

POOLED = "postgresql://app@pgbouncer.internal:6432/app"
DIRECT = "postgresql://app@db.internal:5432/app"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("TETHER_"):
            monkeypatch.delenv(name)


def app(**broker: str) -> AppConfig:
    return AppConfig(broker=PostgresConfig(database_url=POOLED, **broker))  # type: ignore[arg-type]


def test_direct_connections_prepare_and_workers_ask_for_the_idle_transaction_limit() -> None:
    config = app()
    assert "prepare_threshold" not in connect_kwargs(config.broker)
    worker = worker_connection_options(config, "worker")
    assert "prepare_threshold" not in worker
    # Half the smaller stale threshold (120 s claimed, 300 s running by default).
    assert worker["options"] == "-c idle_in_transaction_session_timeout=60000"


def test_behind_a_transaction_pooler_nothing_is_prepared_and_no_startup_option_is_sent() -> None:
    config = app(pooler="transaction")
    assert connect_kwargs(config.broker)["prepare_threshold"] is None
    worker = worker_connection_options(config, "heartbeat")
    assert worker["prepare_threshold"] is None and "options" not in worker
    assert worker["application_name"] == "tether-heartbeat" and worker["keepalives"] == 1


def test_behind_a_session_pooler_statements_are_prepared_but_no_startup_option_is_sent() -> None:
    config = app(pooler="session")
    assert "prepare_threshold" not in connect_kwargs(config.broker)
    assert "options" not in worker_connection_options(config, "worker")


@pytest.mark.parametrize(
    ("pooler", "given", "listens_on"),
    [
        ("none", None, POOLED),
        ("none", DIRECT, DIRECT),
        ("session", None, POOLED),
        ("transaction", DIRECT, DIRECT),
        ("transaction", None, None),  # nothing listens: workers and handles poll
    ],
)
def test_where_listen_connections_go(pooler: str, given: str | None, listens_on: str | None) -> None:
    broker = app(pooler=pooler, **({"listen_url": given} if given else {})).broker
    assert listen_url(broker, POOLED) == listens_on
