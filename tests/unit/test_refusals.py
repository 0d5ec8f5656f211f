"""A refused connection (no slot left on the server) is said once per episode, with its cause
(db/refusals.py). The messages are PostgreSQL's own, as libpq hands them to psycopg;
tests/chaos/test_connections.py has a real server refuse a real worker."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

from tether.db import refusals

SOCKET = 'connection failed: connection to server on socket "/run/postgresql/.s.PGSQL.5432" failed: '
REFUSED = [
    SOCKET + "FATAL:  sorry, too many clients already",
    SOCKET + 'FATAL:  too many connections for role "app"',
    SOCKET + 'FATAL:  too many connections for database "tether"',
    SOCKET + "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
]


@pytest.fixture(autouse=True)
def no_episode() -> Iterator[None]:
    refusals.connected()  # (an episode left over by another test ends here)
    yield
    refusals.connected()


@pytest.mark.parametrize("message", REFUSED)
def test_the_server_s_refusals_for_lack_of_a_slot_are_told_apart(message: str) -> None:
    assert refusals.is_refusal(psycopg.OperationalError(message))


@pytest.mark.parametrize(
    "message",
    [
        SOCKET + "Connection refused\n\tIs the server running locally?",
        SOCKET + 'FATAL:  password authentication failed for user "app"',
        SOCKET + 'FATAL:  database "nope" does not exist',
        "terminating connection due to administrator command",
    ],
)
def test_other_connection_failures_are_not_refusals(message: str) -> None:
    assert not refusals.is_refusal(psycopg.OperationalError(message))


def test_an_episode_is_said_once_with_its_cause_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tether.db")
    refusals.connected()  # no episode: says nothing
    refusals.connect_failed(psycopg.OperationalError(SOCKET + "Connection refused"), "heartbeat")
    for role in ("heartbeat", "listener", "maintenance", "heartbeat"):
        refusals.connect_failed(psycopg.OperationalError(REFUSED[0]), role)
    refusals.connected()
    refusals.connected()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "tether.db"]
    assert len(lines) == 2, lines
    (level, said), (end_level, end) = lines
    assert level == "ERROR" and said.startswith(
        "PostgreSQL refused a new connection (tether-heartbeat): sorry, too many clients already. "
        "The server's max_connections"
    ), said
    assert end_level == "INFO" and end.startswith("PostgreSQL accepts new connections again after "), end
    assert end.endswith("(4 refused)"), end

    # A new episode is said again.
    refusals.connect_failed(psycopg.OperationalError(REFUSED[1]), "worker")
    assert (
        caplog.records[-1]
        .getMessage()
        .startswith(
            'PostgreSQL refused a new connection (tether-worker): too many connections for role "app".'
        )
    )
