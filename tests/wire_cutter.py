"""A loopback proxy in front of PostgreSQL that loses one answer: the connection ends just
after the server finished a chosen statement's transaction, before the client reads so.

What it stands for: a connection that dies (a server restart, a failover, a network cut,
pg_terminate_backend) after the server committed but before its answer reached the
client. Exactly then, and every time: the proxy (tests/wire_counter.py, which forwards
every byte) reads the client's statements, and once one containing the chosen text passes
(a Query, a Parse, or the Bind of a prepared one), it reads that connection's replies too.
The first ReadyForQuery that says the session is idle (``Z`` with status ``I``: no
transaction open, so the statement's transaction, or the one it was part of, has ended)
and everything after it are not passed on; both sockets are shut. The server has
finished the transaction by then; the client is left waiting for a ReadyForQuery and
gets the end of the connection instead.

``cut_at_commit`` ends the connection earlier: right after the client's COMMIT of the
chosen statement's transaction has passed to the server, before the server answers. The
server still runs that COMMIT (a backend reads its client only between statements), so
the transaction commits after the client gave it up: a first attempt "still in flight".
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from tests.wire_counter import WireCounter


class WireCutter(WireCounter):
    def __init__(self, target_url: str) -> None:
        super().__init__(target_url)
        self._wanted: str | None = None
        self._at_commit = False  # the armed connection ends when its COMMIT passes
        self._armed: set[int] = set()
        self.cut: list[str] = []  # the statements whose transaction's end was cut, in order

    def cut_after(self, text: str) -> None:
        """Cut the connection of the next statement that contains ``text``, once the server
        has ended its transaction."""
        with self._lock:
            self._wanted, self._at_commit = text, False

    def cut_at_commit(self, text: str) -> None:
        """Cut the connection of the next statement that contains ``text`` as soon as the
        client's COMMIT of its transaction has passed to the server."""
        with self._lock:
            self._wanted, self._at_commit = text, True

    def _query_passes(self, connection: int, query: str) -> bool:
        with self._lock:
            if self._wanted is not None and self._wanted in query:
                self._wanted = None
                self._armed.add(connection)
                self.cut.append(query)
                return False
            if self._at_commit and connection in self._armed and query.strip().upper() == "COMMIT":
                self._armed.discard(connection)
                return True
            return False

    def _replies(self, connection: int) -> Callable[[bytes], int | None]:
        return _Replies(self, connection).feed

    def _ends_here(self, connection: int) -> bool:
        with self._lock:
            if connection in self._armed and not self._at_commit:
                self._armed.discard(connection)
                return True
            return False


class _Replies:
    """The server-to-client half of one connection: finds where to cut it."""

    def __init__(self, cutter: WireCutter, connection: int) -> None:
        self.cutter = cutter
        self.connection = connection
        self.buffer = bytearray()  # bytes of messages not yet whole (already passed on)

    def feed(self, data: bytes) -> int | None:
        """None: pass ``data`` on; else pass on only its first so many bytes, then end."""
        carried = len(self.buffer)  # bytes of the buffer that came in earlier pieces
        self.buffer += data
        at = 0
        # After the startup exchange every server message is a type byte and an int32
        # length (the proxied URL asks for no SSL or GSS, whose one-byte answers come first).
        while len(self.buffer) - at >= 5:
            kind = self.buffer[at]
            (length,) = struct.unpack("!i", self.buffer[at + 1 : at + 5])
            if len(self.buffer) - at < 1 + length:
                break
            body = bytes(self.buffer[at + 5 : at + 1 + length])
            if kind == ord("Z") and body == b"I" and self.cutter._ends_here(self.connection):
                return max(0, at - carried)
            at += 1 + length
        del self.buffer[:at]
        return None
