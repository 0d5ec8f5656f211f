"""The main process's writes to a child's pipe (worker/pipe_writer.py), on real pipes.

What the worker relies on: a write never blocks the event loop, however big the message
and however full the pipe; messages arrive whole and in order, read by the child's plain
``Connection.recv_bytes``; a write to a child that is gone says so instead of raising.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from tether.broker.claims import TaskPayload
from tether.worker import protocol
from tether.worker.pipe_writer import PipeWriter


@pytest.fixture
def pipe() -> Iterator[tuple[Connection, Connection]]:
    parent_end, child_end = multiprocessing.get_context("spawn").Pipe(duplex=True)
    try:
        yield parent_end, child_end
    finally:
        parent_end.close()
        child_end.close()


def payload(args: str) -> TaskPayload:
    return TaskPayload("5b1e0c1e-0000-4000-8000-000000000001", "digest", "default", args, "{}", 1, 0, 0, None)


async def test_framed_messages_are_read_whole_by_recv_bytes(pipe: tuple[Connection, Connection]) -> None:
    parent_end, child_end = pipe
    writer = PipeWriter(parent_end, "child 0")
    # Below, at and above the size where header and body go as two chunks, and one of 1 MB.
    sizes = [0, 10, 16_384 - 40, 16_384, 16_385, 1_000_000]
    sent = [protocol.RUN if n else protocol.NONE for n in sizes]
    reader = asyncio.get_running_loop().run_in_executor(
        None, lambda: [protocol.recv(child_end) for _ in sizes]
    )
    for op, n in zip(sent, sizes, strict=True):
        if n:
            assert writer.write(protocol.framed(op, task=payload("x" * n)))
        else:
            assert writer.write(protocol.framed(op))
    received = await asyncio.wait_for(reader, 30)
    assert [m["op"] for m in received] == sent
    assert [len(m["task"].args) if "task" in m else 0 for m in received] == sizes
    assert all(m["task"] == payload("x" * n) for m, n in zip(received, sizes, strict=True) if n)
    assert writer.pending_bytes == 0
    writer.close()


async def test_a_write_into_a_full_pipe_returns_at_once_and_drains_as_the_child_reads(
    pipe: tuple[Connection, Connection],
) -> None:
    parent_end, child_end = pipe
    writer = PipeWriter(parent_end, "child 0")
    big = "y" * 20_000_000
    # Nobody reads yet: a blocking write would never return. This one returns with most of
    # the message still to go.
    assert writer.write(protocol.framed(protocol.RUN, task=payload(big)))
    assert writer.write(protocol.framed(protocol.STOP))  # behind the big one, in order
    assert writer.pending_bytes > 10_000_000

    first, second = await asyncio.wait_for(
        asyncio.to_thread(lambda: (protocol.recv(child_end), protocol.recv(child_end))), 30
    )
    assert first["op"] == protocol.RUN and first["task"].args == big
    assert second == {"op": protocol.STOP}
    assert writer.pending_bytes == 0
    writer.close()


async def test_a_write_to_a_child_that_is_gone_returns_false(pipe: tuple[Connection, Connection]) -> None:
    parent_end, child_end = pipe
    writer = PipeWriter(parent_end, "child 0")
    child_end.close()
    assert writer.write(protocol.framed(protocol.RUN, task=payload("z" * 1_000_000))) is False
    assert writer.broken and writer.pending_bytes == 0
    assert writer.write(protocol.framed(protocol.STOP)) is False
    writer.close()


async def test_a_child_gone_while_its_message_waits_drops_the_rest(
    pipe: tuple[Connection, Connection],
) -> None:
    parent_end, child_end = pipe
    writer = PipeWriter(parent_end, "child 0")
    assert writer.write(protocol.framed(protocol.RUN, task=payload("z" * 5_000_000)))
    assert writer.pending_bytes > 0
    child_end.close()  # the child dies without reading
    # The pipe turns writable (with an error) at once: the loop's next turns see it.
    for _ in range(10):
        await asyncio.sleep(0)
    assert writer.broken and writer.pending_bytes == 0
    writer.close()
