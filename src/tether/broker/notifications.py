"""The NOTIFY channels tether uses, and subscribing to them.

tether_work: '<queue> <epoch of the earliest run_at>' when work becomes claimable;
tether_done: '<task id>' when a task a handle waits for reaches a terminal state;
tether_schedules: '<queue>' when a schedule of that queue is declared, changed, paused or resumed;
tether_control: an operator's request to workers: 'cancel <worker id> <task id>' (a RUNNING
task's cancel was requested), 'pause <queue>' or 'resume <queue>'.
"""

from __future__ import annotations

from typing import Final, LiteralString

from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn
from tether.db import read_only

WORK_CHANNEL: Final = "tether_work"
DONE_CHANNEL: Final = "tether_done"
SCHEDULES_CHANNEL: Final = "tether_schedules"
CONTROL_CHANNEL: Final = "tether_control"

_LISTEN: dict[str, LiteralString] = {
    WORK_CHANNEL: "LISTEN tether_work",
    DONE_CHANNEL: "LISTEN tether_done",
    SCHEDULES_CHANNEL: "LISTEN tether_schedules",
    CONTROL_CHANNEL: "LISTEN tether_control",
}


def listen(conn: Conn, channel: str) -> None:
    """LISTEN on ``channel``; on a server that is not a writable primary (a standby, or a
    primary turned read-only in a failover), close ``conn`` and raise ServerReadOnlyError:
    what is sent to the primary is not announced there."""
    conn.execute(_LISTEN[channel])
    row = conn.execute(q("session_read_only")).fetchone()
    if row is not None and row["read_only"]:
        error = read_only.refused(conn, "the listener's session is read-only")
        conn.close()
        raise error


async def listen_worker_async(conn: AsyncConn) -> float:
    """A worker's listener: new work, schedule changes and operators' requests, in one round
    trip; returns the server's wall clock (seconds since the epoch), which tether_work's
    run_at is read against. On a server that is not a writable primary it closes ``conn`` and
    raises ServerReadOnlyError."""
    cursor = await conn.execute(q("listen_worker"))
    while cursor.nextset():  # past the LISTENs' results, to the clock's
        pass
    row = await cursor.fetchone()
    if row is None:  # a SELECT without FROM always returns its one row
        raise RuntimeError("listen_worker returned no clock")
    if row["read_only"]:  # not the primary: what is sent there is not announced here
        error = read_only.refused(conn, "the listener's session is read-only")
        await conn.close()
        raise error
    return float(row["epoch"])
