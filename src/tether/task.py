"""The @app.task decorator's product: send, send_many, schedule, with_options.

Everything a caller can get wrong is checked before anything is written: here,
that arguments bind to the signature and values encode to JSON; in tether.options,
that options are in range.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from tether.broker.types import Conn
from tether.broker.unique import UniqueKey
from tether.config import RetryPolicy
from tether.errors import BadArgumentsError, InvalidOptionError, SerializationError, TaskDefinitionError
from tether.handle import TaskHandle
from tether.ids import new_task_id, new_task_ids
from tether.offload import in_thread
from tether.options import (
    SendOptions,
    check_delay,
    check_good_until,
    check_unique_for,
    check_unique_key,
)
from tether.workflow.definition import Node, NodeOptions, make_node

P = ParamSpec("P")
R = TypeVar("R")

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
    ) -> None:
        self.app = app
        self.name = name
        self.fn = fn
        self.retry_policy = retry_policy
        self.time_limit = time_limit  # seconds an attempt may run; the worker kills it after
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
    ) -> BoundTask:
        """A view of this task that sends with other options; the task itself is unchanged.

        ``unique_key``: send only if no task of this name holds the key (not terminal yet, or,
        with ``unique_for``, sent within that window); see docs/tasks.md#unique-sends.
        """
        opts = SendOptions(
            queue if queue is not None else self.options.queue,
            priority if priority is not None else self.options.priority,
            good_until if good_until is not None else self.options.good_until,
            durable if durable is not None else self.options.durable,
            unique_key,
            None if unique_for is None else check_unique_for(unique_for),
        )
        return BoundTask(self, self.app.check_options(self.name, opts))

    def send(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return BoundTask(self, self.options).send(*args, **kwargs)

    async def send_async(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return await BoundTask(self, self.options).send_async(*args, **kwargs)

    def schedule(self, delay: timedelta | float, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return BoundTask(self, self.options).schedule(delay, *args, **kwargs)

    async def schedule_async(self, delay: timedelta | float, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
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
    """A task with fixed send options (from Task.with_options)."""

    def __init__(self, task: Task[Any, Any], options: SendOptions) -> None:
        self.task = task
        self.options = options
        self._unique = (
            None if options.unique_key is None else UniqueKey(options.unique_key, options.unique_for)
        )

    def _spec(self, delay: timedelta, good_until: datetime | None) -> SendSpec:
        t, o = self.task, self.options
        return SendSpec(
            t.name,
            o.queue,
            o.priority,
            t.retry_policy.max_retries if t.retry_policy else 0,
            t._retry_json,
            good_until,
            delay,
            t.app.config.broker.durable_sends if o.durable is None else o.durable,
        )

    def _prepare(
        self, delay: timedelta | float, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[UUID, Callable[[Conn], None]]:
        """The new task's id, and its insert to run (everything checked and encoded)."""
        spec, task_id, args_json, kwargs_json = self._encode(delay, args, kwargs)
        return task_id, lambda conn: tasks.insert_task(conn, spec, task_id, args_json, kwargs_json)

    def _prepare_unique(
        self, unique: UniqueKey, delay: timedelta | float, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[UUID, Callable[[Conn], UUID]]:
        """As _prepare, for a unique send: its insert returns the id of the task holding the key."""
        spec, task_id, args_json, kwargs_json = self._encode(delay, args, kwargs)
        return task_id, lambda conn: unique_sends.insert_unique_task(
            conn, spec, unique, task_id, args_json, kwargs_json
        )

    def _encode(
        self, delay: timedelta | float, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[SendSpec, UUID, str, str]:
        good_until = kwargs.pop("good_until", None)
        good_until = check_good_until(good_until) if good_until is not None else self.options.good_until
        args_json, kwargs_json = self.task.encode_arguments(args, kwargs)
        return self._spec(check_delay(delay), good_until), new_task_id(), args_json, kwargs_json

    def send(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return self.schedule(timedelta(0), *args, **kwargs)

    def node(self, **options: Unpack[NodeOptions]) -> Node:
        """A workflow step that runs this task with these send options.

        Options: args=(...), kwargs={...}, name=, after=[...], args_from={param: node},
        join="all" | "any", run_anyway=False (see tether.workflow.definition.make_node).
        """
        return make_node(self.task, self.options, **options)

    async def send_async(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return await self.schedule_async(timedelta(0), *args, **kwargs)

    def schedule(self, delay: timedelta | float, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        if self._unique is not None:
            proposed, insert_unique = self._prepare_unique(self._unique, delay, args, kwargs)
            return self._handle(proposed, self.task.app.broker.run(insert_unique))
        task_id, insert = self._prepare(delay, args, kwargs)
        self._insert(insert)
        return TaskHandle(self.task.app, task_id, self.task.name, deduplicated=False)

    async def schedule_async(self, delay: timedelta | float, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        if self._unique is not None:
            proposed, insert_unique = self._prepare_unique(self._unique, delay, args, kwargs)
            return self._handle(proposed, await in_thread(self.task.app.broker.run, insert_unique))
        task_id, insert = self._prepare(delay, args, kwargs)
        await in_thread(self._insert, insert)
        return TaskHandle(self.task.app, task_id, self.task.name, deduplicated=False)

    def _handle(self, proposed: UUID, holder: UUID) -> TaskHandle[Any]:
        """The handle a unique send returns: the task holding the key, deduplicated unless ours."""
        return TaskHandle(self.task.app, holder, self.task.name, deduplicated=holder != proposed)

    def _prepare_many(
        self, items: Iterable[Sequence[Any] | Mapping[str, Any]], common: dict[str, Any]
    ) -> tuple[list[UUID], Callable[[Conn], None]]:
        """The new tasks' ids, and their insert to run (everything checked and encoded)."""
        spec, args_list, kwargs_list = self._encode_many(items, common)
        ids = new_task_ids(len(args_list))
        chunk = SEND_MANY_CHUNK
        return ids, lambda conn: tasks.insert_tasks(conn, spec, ids, args_list, kwargs_list, chunk=chunk)

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
        return self._spec(timedelta(0), good_until), args_list, kwargs_list

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
        ids = [proposed[k] for k in distinct]
        args_p = [args_list[first[k]] for k in distinct]
        kwargs_p = [kwargs_list[first[k]] for k in distinct]
        chunk = SEND_MANY_CHUNK

        def insert(conn: Conn) -> dict[str, UUID]:
            return unique_sends.insert_unique_tasks(
                conn, spec, window, distinct, ids, args_p, kwargs_p, chunk=chunk
            )

        return UniqueBatch(keys, proposed, first, insert)

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
            holders = self.task.app.broker.run(batch.insert) if batch.keys else {}
            return self._unique_handles(batch, holders)
        self._no_window_without_keys(unique_for)
        ids, insert = self._prepare_many(items, common)
        if ids:
            self._insert(insert)
        return [TaskHandle(self.task.app, i, self.task.name, deduplicated=False) for i in ids]

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
            holders = await in_thread(self.task.app.broker.run, batch.insert) if batch.keys else {}
            return self._unique_handles(batch, holders)
        self._no_window_without_keys(unique_for)
        ids, insert = self._prepare_many(items, common)
        if ids:
            await in_thread(self._insert, insert)
        return [TaskHandle(self.task.app, i, self.task.name, deduplicated=False) for i in ids]

    @staticmethod
    def _no_window_without_keys(unique_for: object) -> None:
        if unique_for is not None:
            raise InvalidOptionError(
                "send_many got unique_for without unique_keys: the window applies to keys; "
                "give unique_keys=[...] (one per item) or with_options(unique_key=...)"
            )

    def _insert(self, insert: Callable[[Conn], None]) -> None:
        # An insert whose commit got through just before its connection broke meets its own
        # row when run() repeats it on another: taken as done (the ids are the client's).
        self.task.app.broker.run(insert, idempotent_insert=True)


@dataclass(frozen=True, slots=True)
class UniqueBatch:
    """A unique send_many, ready to run: each item's key, and the one task proposed per key."""

    keys: list[str]  # item i's key
    proposed: dict[str, UUID]  # the id proposed for each distinct key
    first: dict[str, int]  # the first item with each key (its arguments are the ones sent)
    insert: Callable[[Conn], dict[str, UUID]]  # returns the task holding each key
