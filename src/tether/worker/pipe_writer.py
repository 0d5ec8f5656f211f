"""Writing messages to a child's pipe without ever blocking the worker's event loop.

A message can be bigger than the pipe's buffer (a task's arguments are not bounded: 1 MB,
20 MB), and the child reads it only when it is free: a sync child busy with a long task
reads the task pushed ahead to it when that task ends. A plain ``Connection.send_bytes``
from the event loop would block the whole main process until then: no heartbeats, no
claims, no other child served.

So each child has a ``PipeWriter``: a message is written at once as far as the pipe
takes it (``send`` with ``MSG_DONTWAIT``: the common case, a small message into an empty
pipe, costs the one system call it always did), and the rest waits in the writer's
buffer, which the event loop drains as the child reads (``loop.add_writer``). Messages
keep their order: a new one goes behind what is buffered.

Why this and not a writer thread per child: the thread would put a hand-off between
threads (and the GIL) on every message of the hot path, RUN, NONE and STOP included, for
the rare big one; and a thread cannot say at once that the child is gone, which the
dispatcher uses to keep a task it could not hand over. The buffer costs nothing until a
pipe is full, and holds at most what the worker hands a child ahead of time (two tasks
for a sync child, its share for an async child).

The pipe's descriptor itself stays blocking: the main process reads whole messages from
it with ``Connection.recv_bytes``. ``MSG_DONTWAIT`` makes only these sends non-blocking,
on a duplicate of the descriptor (multiprocessing's duplex pipes are socket pairs).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection

log = logging.getLogger("tether.worker.pipe_writer")

# MSG_NOSIGNAL: a child gone is an EPIPE error here, never a SIGPIPE (Python ignores
# SIGPIPE anyway; this keeps that true whatever an embedding program did).
_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)


class PipeWriter:
    """The main process's side of one child's pipe: messages out, in order, never blocking."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name  # for the log: which child
        self._sock: socket.socket | None = None  # made at the first write (see _socket)
        self._pending: deque[memoryview] = deque()
        self.pending_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set while the loop drains the buffer
        self.broken = False  # a write failed: the child is gone (its exit is seen and handled)
        self.closed = False

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
            self._sock.setblocking(True)  # as the pipe always is: only our sends are non-blocking
        return self._sock

    def write(self, chunks: Sequence[bytes]) -> bool:
        """Send one message (its chunks in order): at once as far as the pipe takes it, the rest
        as the child reads. False if the child is gone: nothing of it will arrive."""
        if self.broken or self.closed:
            return False
        queue = self._pending
        if not queue and len(chunks) == 1:
            # The common case, a small message into an empty pipe: one send, nothing queued.
            chunk = chunks[0]
            try:
                sent = self._socket().send(chunk, _FLAGS)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._broke(exc)
                return False
            if sent == len(chunk):
                return True
            queue.append(memoryview(chunk)[sent:])
            self.pending_bytes += len(chunk) - sent
        else:
            for chunk in chunks:
                if chunk:
                    queue.append(memoryview(chunk))
                    self.pending_bytes += len(chunk)
        if self._loop is None:  # not waiting for room already: write now
            self._flush()
        return not self.broken

    def _flush(self) -> None:
        """Write what the pipe takes now; have the loop call again when there is room."""
        sock = self._socket()
        while self._pending:
            chunk = self._pending[0]
            try:
                sent = sock.send(chunk, _FLAGS)
            except (BlockingIOError, InterruptedError):
                break  # the pipe is full: the child has not read yet
            except OSError as exc:
                self._broke(exc)
                return
            self.pending_bytes -= sent
            if sent < len(chunk):
                self._pending[0] = chunk[sent:]
            else:
                self._pending.popleft()
        if self._pending and self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_writer(sock.fileno(), self._flush)
        elif not self._pending and self._loop is not None:
            self._loop.remove_writer(sock.fileno())
            self._loop = None

    def _broke(self, exc: OSError) -> None:
        # The child is gone: its exit is seen through its process sentinel, and what it
        # held (this message's task included) is recorded or given back.
        log.warning("could not write to %s: %s", self.name, exc)
        self.broken = True
        self._drop()

    def _drop(self) -> None:
        if self._loop is not None and self._sock is not None:
            self._loop.remove_writer(self._sock.fileno())
        self._loop = None
        self._pending.clear()
        self.pending_bytes = 0

    def close(self) -> None:
        """The child is gone: forget what it will never read, and let the descriptor go."""
        self._drop()
        self.closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
