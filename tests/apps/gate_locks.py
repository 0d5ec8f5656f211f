"""Gates without an app: the advisory locks behind tests/apps/gates.py's tasks.

Apart from the gates app so that another test app (tests/apps/chaos.py) and a test module can
use a gate without importing an app, which binds to the database it finds at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from tests.apps.support import machinery_url

__all__ = ["Gate", "hold_gate", "wait_for_gate"]


def wait_for_gate(key: int) -> None:
    """Block until the test lets gate ``key`` go (its exclusive advisory lock is released)."""
    with psycopg.connect(machinery_url(), autocommit=True, application_name="tether-test-gate") as conn:
        conn.execute("SELECT pg_advisory_lock_shared(%s)", (key,))
        conn.execute("SELECT pg_advisory_unlock_shared(%s)", (key,))


class Gate:
    """The test's side of a gate: closed from creation until ``open()`` (or the end of the block)."""

    def __init__(self, conn: psycopg.Connection[tuple[object, ...]], key: int) -> None:
        self.conn = conn
        self.key = key
        self.closed = True

    def open(self) -> None:
        if self.closed:
            self.conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
            self.closed = False


@contextmanager
def hold_gate(database_url: str, key: int) -> Iterator[Gate]:
    """For the test: gate ``key`` stays closed until ``gate.open()``; opened at the end of the block
    whatever happens, so a failing test never leaves a task (and its worker) waiting."""
    with psycopg.connect(machinery_url(database_url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        gate = Gate(conn, key)
        try:
            yield gate
        finally:
            gate.open()
