"""The @app.task decorator's product: send, send_many, schedule, with_options.

Everything a caller can get wrong is checked before anything is written: here,
that arguments bind to the signature and values encode to JSON; in tether.options,
that options are in range.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar
from uuid import UUID

from typing_extensions import Unpack

from tether import codec
from tether.app_view import AppView
from tether.broker import tasks
from tether.broker import unique as unique_sends
from tether.broker.tasks import SendSpec
from tether.broker.types import AsyncCallerConn, AsyncConn, CallerConn, Conn
from tether.broker.unique import UniqueKey
from tether.caller_transaction import check_connection, run_in, run_in_async
from tether.config import RetryPolicy
from tether.errors import BadArgumentsError, InvalidOptionError, SerializationError, TaskDefinitionError
from tether.handle import TaskHandle
from tether.ids import new_task_id, new_task_ids
from tether.offload import in_thread
from tether.options import (
    SendOptions,
    check_good_until,
    check_unique_for,
    check_unique_key,
    check_when,
)
from tether.workflow.definition import Node, NodeOptions, make_node

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: Keyword names that send() takes for itself; a task may not use them as parameters.
RESERVED_OPTION_NAMES = frozenset({"good_until"})
# Rows per INSERT in send_many; bigger batches run several statements in one transaction.
SEND_MANY_CHUNK = 20_000


class Task(Generic[P, R]):
    """A registered task. Call it to run the function here; send() to run it on a worker."""

    def __init__(
        self,
        app: AppView,
        name: str,
        fn: Callable[P, R],
        *,
        queue: str,
        priority: int,
        retry_policy: RetryPolicy | None,
        time_limit: float | None = None,
        cancel_grace: float | None = None,
    ) -> None:
        self.app = app
        self.name = name
        self.fn = fn
        self.retry_policy = retry_policy
        self.time_limit = time_limit  # seconds an attempt may run; the worker kills it after
        # seconds its code may go on after a cancel request; None: the worker's cancel_grace_s
        self.cancel_grace = cancel_grace
        self.signature = inspect.signature(fn)
        for reserved in RESERVED_OPTION_NAMES & set(self.signature.parameters):
            raise TaskDefinitionError(
                f"task {name!r}: parameter {reserved!r} is reserved for send() options; rename it"
            )
        self.is_async = inspect.iscoroutinefunction(fn)
        self._shapes: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {}
        self._what_args = f"arguments of task {name!r}"
        self._what_kwargs = f"keyword arguments of task {name!r}"
        self._retry_json = json.dumps(retry_policy.to_json()) if retry_policy else None
        self.options = app.check_options(name, SendOptions(queue, priority, None))

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, queue={self.options.queue!r})"

    # -- sending --------------------------------------------------------------

    def with_options(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        good_until: datetime | None = None,
        durable: bool | None = None,
        unique_key: str | None = None,
        unique_for: timedelta | float | None = None,
        connection: CallerConn | AsyncCallerConn | None = None,
    ) -> BoundTask:
        """A view of this task that sends with other options; the task itself is unchanged.

        ``unique_key``: send only if no task of this name holds the key (not terminal yet, or,
        with ``unique_for``, sent within that window); see docs/tasks.md#unique-sends.
        ``connection``: your psycopg 3 connection (AsyncConnection for the async forms) with a
        transaction open; the task is written in that transaction and commits or rolls back
        with it (docs/transactions.md).
        """
        if connection is not None:
            connection = check_connection(connection)
            if durable is False:
                raise InvalidOptionError(
                    "durable=False cannot apply to a send inside your transaction (connection=...): "
                    "its durability is your commit's. Set synchronous_commit on your own transaction "
                    "if you want that"
                )
        opts = SendOptions(
            queue if queue is not None else self.options.queue,
            priority if priority is not None else self.options.priority,
            good_until if good_until is not None else self.options.good_until,
            durable if durable is not None else self.options.durable,
            unique_key,
            None if unique_for is None else check_unique_for(unique_for),
        )
        return BoundTask(self, self.app.check_options(self.name, opts), connection)

    def send(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return BoundTask(self, self.options).send(*args, **kwargs)

    async def send_async(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return await BoundTask(self, self.options).send_async(*args, **kwargs)

    def schedule(self, delay: timedelta | float | datetime, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        """Send to run after ``delay`` (a timedelta or seconds), or at ``delay`` if it is an aware
        datetime (at once if that time has passed)."""
        return BoundTask(self, self.options).schedule(delay, *args, **kwargs)

    async def schedule_async(
        self, delay: timedelta | float | datetime, *args: Any, **kwargs: Any
    ) -> TaskHandle[Any]:
        return await BoundTask(self, self.options).schedule_async(delay, *args, **kwargs)

    def send_many(
        self,
        items: Iterable[Sequence[Any] | Mapping[str, Any]],
        *,
        unique_keys: Sequence[str] | None = None,
        unique_for: timedelta | float | None = None,
        **common: Any,
    ) -> list[TaskHandle[Any]]:
        return BoundTask(self, self.options).send_many(
            items, unique_keys=unique_keys, unique_for=unique_for, **common
        )

    async def send_many_async(
        self,
        items: Iterable[Sequence[Any] | Mapping[str, Any]],
        *,
        unique_keys: Sequence[str] | None = None,
        unique_for: timedelta | float | None = None,
        **common: Any,
    ) -> list[TaskHandle[Any]]:
        return await BoundTask(self, self.options).send_many_async(
            items, unique_keys=unique_keys, unique_for=unique_for, **common
        )

    def node(self, **options: Unpack[NodeOptions]) -> Node:
        """A workflow step that runs this task (see app.workflow and docs/workflows.md)."""
        return BoundTask(self, self.options).node(**options)

    # -- encoding -------------------------------------------------------------

    def encode_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]:
        """Check the call fits the signature, then encode; errors name the task and the argument.

        Whether a call binds, and how bind() splits it into positional and keyword
        arguments, depends only on its shape (how many positional arguments, which
        keyword names), never on the values: each shape goes through
        Signature.bind once. The worker binds again before calling.
        """
        shape = (len(args), tuple(kwargs))
        moved = self._shapes.get(shape)
        if moved is None:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise BadArgumentsError(
                    f"task {self.name!r}: {exc} (signature: {self.name}{self.signature})"
                ) from None
            # Keyword arguments that binding turns into positional ones (same for every
            # call of this shape), so rows store calls exactly as bind() would.
            moved = tuple(name for name in list(bound.arguments)[len(args) : len(bound.args)])
            self._shapes[shape] = moved
        if moved:
            args = [*args, *(kwargs[name] for name in moved)]
            kwargs = {k: v for k, v in kwargs.items() if k not in moved}
        try:
            return (
                codec.dumps(list(args), what=self._what_args) if args else "[]",
                codec.dumps(dict(kwargs), what=self._what_kwargs) if kwargs else "{}",
            )
        except SerializationError:
            # Re-encode one argument at a time so the message names the parameter.
            for pname, value in self.signature.bind(*args, **kwargs).arguments.items():
                codec.dumps(value, what=f"argument {pname!r} of task {self.name!r}")
            raise


class BoundTask:
    """A task with fixed send options (from Task.with_options).

    With a ``connection`` (the caller's psycopg connection, docs/transactions.md) every send
    runs inside the caller's transaction instead of on the app's pool.
    """

    def __init__(
        self,
        task: Task[Any, Any],
        options: SendOptions,
        connection: CallerConn | AsyncCallerConn | None = None,
    ) -> None:
        self.task = task
        self.options = options
        self.connection = connection
        self._unique = (
            None if options.unique_key is None else UniqueKey(options.unique_key, options.unique_for)
        )

    def _spec(self, delay: timedelta, run_at: datetime | None, good_until: datetime | None) -> SendSpec:
        t, o = self.task, self.options
        in_callers = self.connection is not None
        return SendSpec(
            t.name,
            o.queue,
            o.priority,
            t.retry_policy.max_retries if t.retry_policy else 0,
            t._retry_json,
            good_until,
            delay,
            # Inside the caller's transaction its commit decides durability: tether leaves
            # synchronous_commit alone (with_options refuses durable=False there).
            True if in_callers else t.app.config.broker.durable_sends if o.durable is None else o.durable,
            run_at,
            notify_always=in_callers,
        )

    def _encode(
        self, when: timedelta | float | datetime, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[SendSpec, UUID, str, str]:
        good_until = kwargs.pop("good_until", None)
        good_until = check_good_until(good_until) if good_until is not None else self.options.good_until
        args_json, kwargs_json = self.task.encode_arguments(args, kwargs)
        delay, run_at = check_when(when)
        return self._spec(delay, run_at, good_until), new_task_id(), args_json, kwargs_json

    # -- where the statements run ----------------------------------------------------

    def _run(self, work: Callable[[Conn], T], call: str, *, idempotent_insert: bool = False) -> T:
        """``work`` on the caller's connection if one was lent, else on the app's pool."""
        if self.connection is None:
            return self.task.app.broker.run(work, idempotent_insert=idempotent_insert)
        return run_in(self.task.app.broker, self.connection, call, work)

    def _run_all_or_none(self, work: Callable[[Conn], T], call: str, *, idempotent_insert: bool = False) -> T:
        """As _run, for several statements: in a transaction of their own on the pool; in the
        caller's transaction (which makes them all or none) on a lent connection."""
        if self.connection is None:

            def whole(conn: Conn) -> T:
                with conn.transaction():
                    return work(conn)

            return self.task.app.broker.run(whole, idempotent_insert=idempotent_insert)
        return run_in(self.task.app.broker, self.connection, call, work)

    async def _run_async(
        self,
        work: Callable[[Conn], T],
        work_async: Callable[[AsyncConn], Awaitable[T]],
        call: str,
        *,
        all_or_none: bool = False,
        idempotent_insert: bool = False,
    ) -> T:
        """The async API: ``work_async`` on the caller's async connection if one was lent, else
        ``work`` on the app's pool in a thread (offload.py says why not an async pool)."""
        if self.connection is not None:
            return await run_in_async(self.task.app.broker, self.connection, call, work_async)
        if all_or_none:
            return await in_thread(
                lambda: self._run_all_or_none(work, call, idempotent_insert=idempotent_insert)
            )
        return await in_thread(lambda: self._run(work, call, idempotent_insert=idempotent_insert))

    # -- one task ---------------------------------------------------------------------

    def send(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return self._schedule(timedelta(0), args, kwargs, "send()")

    def schedule(self, delay: timedelta | float | datetime, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        """Send to run after ``delay`` (a timedelta or seconds), or at ``delay`` if it is an aware
        datetime (at once if that time has passed)."""
        return self._schedule(delay, args, kwargs, "schedule()")

    async def send_async(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return await self._schedule_async(timedelta(0), args, kwargs, "send_async()")

    async def schedule_async(
        self, delay: timedelta | float | datetime, *args: Any, **kwargs: Any
    ) -> TaskHandle[Any]:
        return await self._schedule_async(delay, args, kwargs, "schedule_async()")

    def _schedule(
        self, when: timedelta | float | datetime, args: tuple[Any, ...], kwargs: dict[str, Any], call: str
    ) -> TaskHandle[Any]:
        spec, task_id, args_json, kwargs_json = self._encode(when, args, kwargs)
        unique = self._unique
        if unique is not None:

            def insert_unique(conn: Conn) -> UUID:
                return unique_sends.insert_unique_task(conn, spec, unique, task_id, args_json, kwargs_json)

            return self._handle(task_id, self._run(insert_unique, call))

        def insert(conn: Conn) -> None:
            tasks.insert_task(conn, spec, task_id, args_json, kwargs_json)

        # An insert whose commit got through just before its connection broke meets its own
        # row when run() repeats it on another: taken as done (the ids are the client's).
        self._run(insert, call, idempotent_insert=True)
        return TaskHandle(self.task.app, task_id, self.task.name, deduplicated=False)

    async def _schedule_async(
        self, when: timedelta | float | datetime, args: tuple[Any, ...], kwargs: dict[str, Any], call: str
    ) -> TaskHandle[Any]:
        spec, task_id, args_json, kwargs_json = self._encode(when, args, kwargs)
        unique = self._unique
        if unique is not None:
            holder = await self._run_async(
                lambda c: unique_sends.insert_unique_task(c, spec, unique, task_id, args_json, kwargs_json),
                lambda c: unique_sends.insert_unique_task_async(
                    c, spec, unique, task_id, args_json, kwargs_json
                ),
                call,
            )
            return self._handle(task_id, holder)
        await self._run_async(
            lambda c: tasks.insert_task(c, spec, task_id, args_json, kwargs_json),
            lambda c: tasks.insert_task_async(c, spec, task_id, args_json, kwargs_json),
            call,
            idempotent_insert=True,
        )
        return TaskHandle(self.task.app, task_id, self.task.name, deduplicated=False)

    def _handle(self, proposed: UUID, holder: UUID) -> TaskHandle[Any]:
        """The handle a unique send returns: the task holding the key, deduplicated unless ours."""
        return TaskHandle(self.task.app, holder, self.task.name, deduplicated=holder != proposed)

    def node(self, **options: Unpack[NodeOptions]) -> Node:
        """A workflow step that runs this task with these send options.

        Options: args=(...), kwargs={...}, name=, after=[...], args_from={param: node},
        join="all" | "any", run_anyway=False (see tether.workflow.definition.make_node).
        """
        if self.connection is not None:
            raise InvalidOptionError(
                f"task {self.task.name!r}: a workflow node takes no connection=; give it to the "
                "workflow's start(connection=...) instead"
            )
        return make_node(self.task, self.options, **options)

    # -- many tasks -------------------------------------------------------------------

    def _encode_many(
        self, items: Iterable[Sequence[Any] | Mapping[str, Any]], common: dict[str, Any]
    ) -> tuple[SendSpec, list[str], list[str]]:
        good_until = common.pop("good_until", None)
        good_until = check_good_until(good_until) if good_until is not None else self.options.good_until
        args_list: list[str] = []
        kwargs_list: list[str] = []
        for index, item in enumerate(items):
            if isinstance(item, Mapping):
                args, kwargs = (), {**common, **item}
            elif isinstance(item, Sequence) and not isinstance(item, str | bytes):
                args, kwargs = tuple(item), common
            else:
                raise BadArgumentsError(
                    f"send_many of task {self.task.name!r}: item {index} must be a tuple/list of "
                    f"positional arguments or a dict of keyword arguments, got {type(item).__name__}"
                )
            try:
                a, k = self.task.encode_arguments(args, kwargs)
            except (BadArgumentsError, SerializationError) as exc:
                raise type(exc)(f"send_many item {index}: {exc}") from None
            args_list.append(a)
            kwargs_list.append(k)
        return self._spec(timedelta(0), None, good_until), args_list, kwargs_list

    def _prepare_many(
        self, items: Iterable[Sequence[Any] | Mapping[str, Any]], common: dict[str, Any]
    ) -> PlainBatch:
        spec, args_list, kwargs_list = self._encode_many(items, common)
        return PlainBatch(spec, new_task_ids(len(args_list)), args_list, kwargs_list)

    def _prepare_many_unique(
        self,
        items: Iterable[Sequence[Any] | Mapping[str, Any]],
        common: dict[str, Any],
        unique_keys: Sequence[str] | None,
        unique_for: timedelta | float | None,
    ) -> UniqueBatch:
        """A unique send_many, checked and encoded: one proposed task per distinct key.

        Items that repeat a key are folded into the first item with that key (its arguments
        are the ones sent), since one statement cannot take one key twice.
        """
        window = self._unique.window if self._unique is not None else None
        if unique_for is not None:
            window = check_unique_for(unique_for)
        spec, args_list, kwargs_list = self._encode_many(items, common)
        if unique_keys is None:
            assert self._unique is not None  # the caller comes here only with some key
            keys = [self._unique.key] * len(args_list)
        else:
            if self._unique is not None:
                raise InvalidOptionError(
                    "send_many got unique_keys, and this task view already has a "
                    f"unique_key ({self._unique.key!r}) from with_options; give one or the other"
                )
            if isinstance(unique_keys, str | bytes) or not isinstance(unique_keys, Sequence):
                raise InvalidOptionError(
                    f"unique_keys must be a list of str, one per item, got {type(unique_keys).__name__}"
                )
            if len(unique_keys) != len(args_list):
                raise InvalidOptionError(
                    f"unique_keys must have one key per item: {len(args_list)} item(s), "
                    f"{len(unique_keys)} key(s)"
                )
            keys = [check_unique_key(k, f"unique_keys[{i}]") for i, k in enumerate(unique_keys)]
        first: dict[str, int] = {}
        for index, key in enumerate(keys):
            first.setdefault(key, index)
        # Code-point order, the order the statement locks keys in ("C" collation), so the
        # chunks of two batches sharing keys lock them in one order too.
        distinct = sorted(first)
        proposed = dict(zip(distinct, new_task_ids(len(distinct)), strict=True))
        return UniqueBatch(
            keys,
            proposed,
            first,
            spec,
            window,
            distinct,
            [proposed[k] for k in distinct],
            [args_list[first[k]] for k in distinct],
            [kwargs_list[first[k]] for k in distinct],
        )

    def _unique_handles(self, batch: UniqueBatch, holders: Mapping[str, UUID]) -> list[TaskHandle[Any]]:
        """One handle per item: the task holding its key; deduplicated unless this item created it."""
        app, name = self.task.app, self.task.name
        return [
            TaskHandle(
                app,
                holders[key],
                name,
                deduplicated=not (batch.first[key] == index and holders[key] == batch.proposed[key]),
            )
            for index, key in enumerate(batch.keys)
        ]

    def _plain_handles(self, batch: PlainBatch) -> list[TaskHandle[Any]]:
        return [TaskHandle(self.task.app, i, self.task.name, deduplicated=False) for i in batch.ids]

    def send_many(
        self,
        items: Iterable[Sequence[Any] | Mapping[str, Any]],
        *,
        unique_keys: Sequence[str] | None = None,
        unique_for: timedelta | float | None = None,
        **common: Any,
    ) -> list[TaskHandle[Any]]:
        """Enqueue many in one transaction (one statement per 20,000): all or none.

        ``unique_keys``: one key per item (a unique send each, see docs/tasks.md#unique-sends);
        ``unique_for``: their window. Every item gets a handle, deduplicated or not.
        """
        if unique_keys is not None or self._unique is not None:
            batch = self._prepare_many_unique(items, common, unique_keys, unique_for)
            holders = self._run_all_or_none(batch.insert, "send_many()") if batch.keys else {}
            return self._unique_handles(batch, holders)
        self._no_window_without_keys(unique_for)
        plain = self._prepare_many(items, common)
        if plain.ids:
            self._run_all_or_none(plain.insert, "send_many()", idempotent_insert=True)
        return self._plain_handles(plain)

    async def send_many_async(
        self,
        items: Iterable[Sequence[Any] | Mapping[str, Any]],
        *,
        unique_keys: Sequence[str] | None = None,
        unique_for: timedelta | float | None = None,
        **common: Any,
    ) -> list[TaskHandle[Any]]:
        if unique_keys is not None or self._unique is not None:
            batch = self._prepare_many_unique(items, common, unique_keys, unique_for)
            holders: dict[str, UUID] = {}
            if batch.keys:
                holders = await self._run_async(
                    batch.insert, batch.insert_async, "send_many_async()", all_or_none=True
                )
            return self._unique_handles(batch, holders)
        self._no_window_without_keys(unique_for)
        plain = self._prepare_many(items, common)
        if plain.ids:
            await self._run_async(
                plain.insert,
                plain.insert_async,
                "send_many_async()",
                all_or_none=True,
                idempotent_insert=True,
            )
        return self._plain_handles(plain)

    @staticmethod
    def _no_window_without_keys(unique_for: object) -> None:
        if unique_for is not None:
            raise InvalidOptionError(
                "send_many got unique_for without unique_keys: the window applies to keys; "
                "give unique_keys=[...] (one per item) or with_options(unique_key=...)"
            )


@dataclass(frozen=True, slots=True)
class PlainBatch:
    """A send_many without keys, checked and encoded: task ``ids[i]`` gets ``args[i]``, ``kwargs[i]``."""

    spec: SendSpec
    ids: list[UUID]
    args: list[str]
    kwargs: list[str]

    def insert(self, conn: Conn) -> None:
        tasks.insert_tasks(conn, self.spec, self.ids, self.args, self.kwargs, chunk=SEND_MANY_CHUNK)

    async def insert_async(self, conn: AsyncConn) -> None:
        await tasks.insert_tasks_async(
            conn, self.spec, self.ids, self.args, self.kwargs, chunk=SEND_MANY_CHUNK
        )


@dataclass(frozen=True, slots=True)
class UniqueBatch:
    """A unique send_many, ready to run: each item's key, and the one task proposed per key."""

    keys: list[str]  # item i's key
    proposed: dict[str, UUID]  # the id proposed for each distinct key
    first: dict[str, int]  # the first item with each key (its arguments are the ones sent)
    spec: SendSpec
    window: timedelta | None
    distinct: list[str]  # the distinct keys, sorted; the rest are in the same order
    ids: list[UUID]
    args: list[str]
    kwargs: list[str]

    def insert(self, conn: Conn) -> dict[str, UUID]:
        """Returns the task holding each key."""
        return unique_sends.insert_unique_tasks(
            conn,
            self.spec,
            self.window,
            self.distinct,
            self.ids,
            self.args,
            self.kwargs,
            chunk=SEND_MANY_CHUNK,
        )

    async def insert_async(self, conn: AsyncConn) -> dict[str, UUID]:
        return await unique_sends.insert_unique_tasks_async(
            conn,
            self.spec,
            self.window,
            self.distinct,
            self.ids,
            self.args,
            self.kwargs,
            chunk=SEND_MANY_CHUNK,
        )
