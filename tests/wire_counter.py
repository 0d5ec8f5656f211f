"""A loopback TCP proxy in front of PostgreSQL that counts its clients' round trips.

PostgreSQL's own counters are no exact clock for this: ``pg_stat_database`` sums a whole
database, a backend reports its transactions only when it goes idle, at most once a
second and up to 10 s late when it then stays idle, and it tells neither which connection
nor which statement. This proxy reads the protocol instead, as it passes. Clients connect
to ``127.0.0.1:<port>`` (``WireCounter.url``); every byte is forwarded unchanged to the
real server (TCP, or the Unix socket of a URL such as
``postgresql://postgres@/db?host=/path&port=N``), and the client-to-server stream is
parsed on the way: the startup packet (no type byte; its ``application_name`` names the
connection), then messages of one type byte and an int32 length. A message that makes the
server answer counts as one round trip: ``Q`` (simple query) and ``S`` (Sync, which ends
an extended-protocol exchange: Parse/Bind/Describe/Execute/Sync). Each round trip is
labelled with the statement it carried, for readable failure messages.

The server-to-client stream is parsed too, for **transactions**: each exchange ends with
a ReadyForQuery (``Z``) whose status byte says where the session is: ``I`` idle, ``T`` in a
transaction, ``E`` in a failed one. An exchange that leaves the session idle ends a
transaction: begun by this exchange (a statement in autocommit: an implicit transaction)
or by an earlier one (``BEGIN`` ... ``COMMIT``). It committed unless the server answered an
error (``E``) in it or its COMMIT came back as ``ROLLBACK``. That is what PostgreSQL counts
in ``pg_stat_database.xact_commit``, seen at once and by connection. Each transaction keeps
its statements' labels and command tags (``C``: ``UPDATE 0``, ``INSERT 0 1``, ``SELECT 1``):
an UPDATE whose tag says 0 rows wrote nothing. The start-up's own exchange (up to its first
``Z``) is not counted.

The proxied URL disables SSL and GSS encryption, so no request to negotiate them comes
before the startup packet (one that does is passed on and skipped, all the same).
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from psycopg.conninfo import conninfo_to_dict

# Startup-phase request codes that are not a startup packet (see the protocol's "Message Formats").
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
ANSWERED = {ord("Q"), ord("S")}


@dataclass(frozen=True)
class RoundTrip:
    at: float  # time.monotonic() when the proxy had the whole message
    connection: int  # the proxy's number for the client connection
    application_name: str
    label: str  # the query (Q) or the statement the Sync completes (S); "<empty>" for ""
    prepares: bool = False  # the exchange prepared a named statement (psycopg: on its 6th run)


@dataclass(frozen=True)
class Transaction:
    at: float  # time.monotonic() when the proxy saw the ReadyForQuery that ended it
    connection: int
    application_name: str
    labels: tuple[str, ...]  # the round trips in it, in order (BEGIN and COMMIT included)
    tags: tuple[str, ...]  # the command tags the server answered, in order
    committed: bool

    @property
    def label(self) -> str:
        """Its first statement other than BEGIN (what names it in a summary)."""
        for label in self.labels:
            if label.split(" ", 1)[0].upper() not in ("BEGIN", "SAVEPOINT"):
                return label
        return self.labels[0] if self.labels else "<none>"


def _label(query: str) -> str:
    text = " ".join(query.split())
    if not text:
        return "<empty>"
    return text if len(text) <= 70 else text[:67] + "..."


class _Parser:
    """The client-to-server half of one connection, fed bytes as they pass."""

    def __init__(self, counter: WireCounter, number: int) -> None:
        self.counter = counter
        self.number = number
        self.buffer = bytearray()
        self.started = False
        self.application_name = ""
        self.pending = ""  # label of the exchange the next Sync completes
        self.statements: dict[str, str] = {}  # prepared statement name -> its query's label
        self.queries: dict[str, str] = {}  # prepared statement name -> its query
        self.prepares = False  # a Parse of a named statement since the last Sync
        self.awaiting: collections.deque[str] = collections.deque()  # round trips not yet answered

    def feed(self, data: bytes) -> int | None:
        """Read what passes. None, or (when a subclass's hook asked to end the connection after
        a statement) how many bytes of ``data`` pass before the end: up to that message's end."""
        carried = len(self.buffer)  # bytes that came in earlier pieces (and passed already)
        consumed = 0
        self.buffer += data
        while True:
            if not self.started:
                if len(self.buffer) < 8:
                    return None
                (length,) = struct.unpack("!i", self.buffer[:4])
                if len(self.buffer) < length:
                    return None
                body = bytes(self.buffer[4:length])
                del self.buffer[:length]
                consumed += int(length)
                (code,) = struct.unpack("!i", body[:4])
                if code in (SSL_REQUEST, GSSENC_REQUEST, CANCEL_REQUEST):
                    continue  # the server answers one byte; the real startup packet follows
                self.started = True
                fields = body[4:].split(b"\0")
                params = dict(zip(fields[0::2], fields[1::2], strict=False))
                self.application_name = params.get(b"application_name", b"").decode(errors="replace")
                continue
            if len(self.buffer) < 5:
                return None
            kind = self.buffer[0]
            (length,) = struct.unpack("!i", self.buffer[1:5])
            if len(self.buffer) < 1 + length:
                return None
            body = bytes(self.buffer[5 : 1 + length])
            del self.buffer[: 1 + length]
            consumed += 1 + int(length)
            if self._message(kind, body):
                return max(0, consumed - carried)

    def _message(self, kind: int, body: bytes) -> bool:
        """Note one message; True if the connection must end once it has passed."""
        end = False
        if kind == ord("Q"):
            query = body.split(b"\0", 1)[0].decode(errors="replace")
            end = self.counter._query_passes(self.number, query)
            self.counter._note(self, _label(query))
        elif kind == ord("P"):  # Parse: statement name, query, ...
            name, query = (part.decode(errors="replace") for part in body.split(b"\0", 2)[:2])
            end = self.counter._query_passes(self.number, query)
            self.pending = _label(query)
            if name:
                self.statements[name] = self.pending
                self.queries[name] = query
                self.prepares = True
        elif kind == ord("B"):  # Bind: portal name, statement name, ...
            statement = body.split(b"\0", 2)[1].decode(errors="replace")
            if statement:
                self.pending = self.statements.get(statement, statement)
                end = self.counter._query_passes(self.number, self.queries.get(statement, statement))
        elif kind == ord("S"):
            self.counter._note(self, self.pending, prepares=self.prepares)
            self.prepares = False
        # Every other message (Describe, Execute, Flush, Terminate, ...) is passed on uncounted.
        return end


class _Answers:
    """The server-to-client half of one connection: where each transaction ends."""

    def __init__(self, counter: WireCounter, parser: _Parser) -> None:
        self.counter = counter
        self.parser = parser
        self.buffer = bytearray()
        self.started = False  # past the start-up's first ReadyForQuery
        self.labels: list[str] = []  # of the transaction in progress
        self.tags: list[str] = []
        self.failed = False

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 5:
            kind = self.buffer[0]
            (length,) = struct.unpack("!i", self.buffer[1:5])
            if len(self.buffer) < 1 + length:
                return
            body = bytes(self.buffer[5 : 1 + length])
            del self.buffer[: 1 + length]
            self._message(kind, body)

    def _message(self, kind: int, body: bytes) -> None:
        if kind == ord("C"):  # CommandComplete: its tag
            self.tags.append(body.split(b"\0", 1)[0].decode(errors="replace"))
        elif kind == ord("I"):  # EmptyQueryResponse (the empty statement: a transaction too)
            self.tags.append("<empty>")
        elif kind == ord("E"):
            self.failed = True
        elif kind == ord("Z"):
            status = body[:1]
            if not self.started:
                self.started = True  # the start-up's: no statement of the client's
                self.tags, self.failed = [], False
                return
            with self.counter._lock:
                label = self.parser.awaiting.popleft() if self.parser.awaiting else "?"
            self.labels.append(label)
            if status == b"I":
                committed = not self.failed and (not self.tags or self.tags[-1] != "ROLLBACK")
                self.counter._ended(self.parser, self.labels, self.tags, committed)
                self.labels, self.tags, self.failed = [], [], False


class WireCounter:
    """Proxy 127.0.0.1:<free port> -> the server of ``target_url``, counting round trips."""

    def __init__(self, target_url: str) -> None:
        params = conninfo_to_dict(target_url)
        host = str(params.get("host") or "127.0.0.1")
        port = int(params.get("port") or 5432)
        if host.startswith("/"):
            self._family, self._address = socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"
        else:
            self._family, self._address = socket.AF_INET, (host, port)
        self._user = str(params.get("user") or "postgres")
        self._password = str(params["password"]) if params.get("password") else None
        self._dbname = str(params.get("dbname") or "postgres")
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._trips: list[RoundTrip] = []
        self._transactions: list[Transaction] = []
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._connections = 0
        self._stopping = False

    @property
    def url(self) -> str:
        """A URL for the same database and user, through the proxy (no SSL or GSS negotiation)."""
        auth = quote(self._user, safe="")
        if self._password is not None:
            auth += ":" + quote(self._password, safe="")
        query = urlencode({"sslmode": "disable", "gssencmode": "disable"})
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{quote(self._dbname, safe='')}?{query}"

    def start(self) -> WireCounter:
        thread = threading.Thread(target=self._accept, name="wire-counter-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Close the listener and every proxied connection; join the threads."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> WireCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what was seen ---------------------------------------------------------------------

    def round_trips(self, since: float = 0.0, until: float = float("inf")) -> list[RoundTrip]:
        """Round trips seen with ``since <= at < until`` (time.monotonic() values)."""
        with self._lock:
            return [t for t in self._trips if since <= t.at < until]

    def transactions(self, since: float = 0.0, until: float = float("inf")) -> list[Transaction]:
        """Transactions that ended with ``since <= at < until`` (time.monotonic() values)."""
        with self._lock:
            return [t for t in self._transactions if since <= t.at < until]

    @staticmethod
    def transaction_summary(transactions: list[Transaction]) -> str:
        """Counts by connection, statement and tags, most frequent first, one per line."""
        counts = Counter(
            f"#{t.connection} {t.application_name or '-'}: {t.label} [{', '.join(t.tags)}]"
            f"{'' if t.committed else ' (rolled back)'}"
            for t in transactions
        )
        return "\n".join(f"{n:4d} x {what}" for what, n in counts.most_common())

    @staticmethod
    def summary(trips: list[RoundTrip]) -> str:
        """Counts by connection and statement, most frequent first, one per line."""
        counts = Counter(
            f"#{t.connection} {t.application_name or '-'}: {'(prepare) ' if t.prepares else ''}{t.label}"
            for t in trips
        )
        return "\n".join(f"{n:4d} x {what}" for what, n in counts.most_common())

    # -- the proxy ---------------------------------------------------------------------------

    # -- hooks for a subclass (tests/wire_cutter.py) ------------------------------------------

    def _query_passes(self, connection: int, query: str) -> bool:
        """A statement on its way to the server (a Query, a Parse, or the Bind of a prepared one);
        True ends the connection once that message has passed."""
        return False

    def _replies(self, connection: int) -> Callable[[bytes], int | None] | None:
        """What reads the server's bytes to this client before they pass (None: nothing). It
        returns None to pass them all, or how many of them pass before the connection ends."""
        return None

    def _note(self, parser: _Parser, label: str, *, prepares: bool = False) -> None:
        trip = RoundTrip(time.monotonic(), parser.number, parser.application_name, label, prepares)
        with self._lock:
            self._trips.append(trip)
            parser.awaiting.append(label)  # the server's next ReadyForQuery ends this exchange

    def _ended(self, parser: _Parser, labels: list[str], tags: list[str], committed: bool) -> None:
        tx = Transaction(
            time.monotonic(), parser.number, parser.application_name, tuple(labels), tuple(tags), committed
        )
        with self._lock:
            self._transactions.append(tx)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            try:
                server = socket.socket(self._family, socket.SOCK_STREAM)
                server.connect(self._address)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections += 1
                number = self._connections
                self._sockets += [client, server]
            parser = _Parser(self, number)
            answers = _Answers(self, parser)
            hook = self._replies(number)

            def replies(
                data: bytes, answers: _Answers = answers, hook: Callable[[bytes], int | None] | None = hook
            ) -> int | None:
                answers.feed(data)
                return None if hook is None else hook(data)

            for source, sink, seen in ((client, server, parser.feed), (server, client, replies)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, seen), name=f"wire-counter-{number}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    @staticmethod
    def _pump(
        source: socket.socket, sink: socket.socket, reader: Callable[[bytes], int | None] | None
    ) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                cut = None if reader is None else reader(data)
                if cut is not None:
                    sink.sendall(data[:cut])
                    break  # the connection ends here, both ways (below)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # The other direction learns of the end too: a closed client ends its server session.
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
