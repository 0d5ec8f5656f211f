"""Messages between the worker's main process and its children.

Small JSON objects over a multiprocessing pipe. Task arguments travel as the
JSON text read from the row: the main process never decodes them.
"""

from __future__ import annotations

import json
import select
import struct
from collections.abc import Callable
from dataclasses import fields
from multiprocessing.connection import Connection
from typing import Any

from tether.broker.claims import TaskPayload

# main -> child
RUN = "run"  # {"op": "run", "task": TaskPayload}: start this task (next, if asked)
NONE = "none"  # answer to NEXT: nothing buffered; wait for RUN or STOP
STOP = "stop"  # finish what you hold, record it, exit (an async child gives back what it never started)
# main -> async child
RUN_MANY = "run_many"  # {"tasks": [TaskPayload]}: start these as slots free up
CANCEL = "cancel"  # {"id"}: the task's cancel was requested: cancel its coroutine (a sync
#                    child reads its slot of the supervisor's cancel board instead)
# A sync child's slot of the cancel board (shared memory): the 16 bytes of a task id.
CANCEL_ID_BYTES = 16
# child -> main
READY = "ready"  # started, app imported, database connected
STARTED = "started"  # {"id"}: the task is RUNNING (or {"id", "lost": true}: its claim was gone)
NEXT = "next"  # {"id"}: finished running this task's code; asks for the next before recording
# {"id", "status", "next_id", "next_lost", "code": error code | None, "run_s": seconds the
#  code ran}: outcome recorded (or lost); code and run_s feed the worker's metrics
DONE = "done"
# async child -> main, after each batch write:
# {"started": [id], "lost": [id] (start found the claim gone), "done": [[id, status]]
#  (status "LOST": the outcome's fence matched nothing), "released": [id] (given back unstarted),
#  "ran": [[error code | None, seconds the code ran]], one per entry of "done"}
BATCH = "batch"


# Field names, read once: dataclasses.asdict() copies recursively, which showed in the
# main process's profile at one call per task.
_PAYLOAD_FIELDS = tuple(f.name for f in fields(TaskPayload))


def encode(op: str, **items: Any) -> bytes:
    task = items.get("task")
    if isinstance(task, TaskPayload):
        items["task"] = _plain(task)
    tasks = items.get("tasks")
    if tasks is not None:
        items["tasks"] = [_plain(t) for t in tasks]
    return json.dumps({"op": op, **items}).encode()


def send(conn: Connection, op: str, **items: Any) -> None:
    """Write a message, waiting for room in the pipe (children do; the main process uses framed())."""
    conn.send_bytes(encode(op, **items))


# Messages larger than this are sent as two chunks (header, body) instead of one joined
# copy, as Connection.send_bytes does.
_JOIN_BELOW = 16384


def framed(op: str, **items: Any) -> tuple[bytes, ...]:
    """A message as the bytes ``Connection.recv_bytes`` reads on the other end, for a writer that
    sends them itself (worker/pipe_writer.py): the length (4 bytes, big-endian; -1 then 8 bytes
    past 2 GiB) and the JSON body. This is multiprocessing's wire format, stable since 3.8 and
    checked by tests/unit/test_pipe_writer.py."""
    body = encode(op, **items)
    size = len(body)
    if size > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", size), body
    header = struct.pack("!i", size)
    return (header + body,) if size <= _JOIN_BELOW else (header, body)


def recv(conn: Connection) -> dict[str, Any]:
    msg: dict[str, Any] = json.loads(conn.recv_bytes())
    if isinstance(msg.get("task"), dict):
        msg["task"] = TaskPayload(**msg["task"])
    if isinstance(msg.get("tasks"), list):
        msg["tasks"] = [TaskPayload(**t) for t in msg["tasks"]]
    return msg


def _plain(task: TaskPayload) -> dict[str, Any]:
    return {name: getattr(task, name) for name in _PAYLOAD_FIELDS}


def message_waiting(conn: Connection) -> Callable[[], bool]:
    """A cheap "is a message (or EOF) waiting on ``conn``?" check, without blocking.

    Connection.poll() builds a new selector on every call, which showed in the profiles
    of both the main process and the children (several calls per task); one poll object
    made here serves every later check.
    """
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return lambda: bool(poller.poll(0))
