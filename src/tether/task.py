"""The @app.task decorator's product: send, send_many, schedule, with_options.

Everything a caller can get wrong is checked before anything is written: here and in
tether.sending, that arguments bind to the signature and values encode to JSON; in
tether.options, that options are in range. What a send writes, and where, is the plan of
its kind in tether.sending; this module picks the plan.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar

from typing_extensions import Unpack

from tether import codec
from tether.app_view import AppView
from tether.broker.types import AsyncCallerConn, CallerConn
from tether.caller_transaction import check_connection
from tether.config import RetryPolicy
from tether.errors import BadArgumentsError, InvalidOptionError, SerializationError, TaskDefinitionError
from tether.handle import TaskHandle
from tether.options import SendOptions, check_unique_for
from tether.sending.basis import CALL_OPTIONS, SendBasis
from tether.sending.many import ManySend
from tether.sending.many_unique import ManyUniqueSend
from tether.sending.one import OneSend
from tether.sending.one_unique import OneUniqueSend
from tether.workflow.definition import Node, NodeOptions, make_node

P = ParamSpec("P")
R = TypeVar("R")

#: Keyword names that send() takes for itself; a task may not use them as parameters.
RESERVED_OPTION_NAMES = CALL_OPTIONS
_NOW = timedelta(0)


class Sends:
    """send, schedule, send_many (and their async forms) and node(), defined once for a task
    (with its own options) and for a with_options view (``_basis``: options and route)."""

    _basis: SendBasis

    # -- one task ---------------------------------------------------------------------

    def send(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return self._one(_NOW, args, kwargs, "send()")

    async def send_async(self, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        return await self._one_async(_NOW, args, kwargs, "send_async()")

    def schedule(self, delay: timedelta | float | datetime, *args: Any, **kwargs: Any) -> TaskHandle[Any]:
        """Send to run after ``delay`` (a timedelta or seconds), or at ``delay`` if it is an aware
        datetime (at once if that time has passed)."""
        return self._one(delay, args, kwargs, "schedule()")

    async def schedule_async(
        self, delay: timedelta | float | datetime, *args: Any, **kwargs: Any
    ) -> TaskHandle[Any]:
        return await self._one_async(delay, args, kwargs, "schedule_async()")

    def _one(
        self, when: timedelta | float | datetime, args: tuple[Any, ...], kwargs: dict[str, Any], call: str
    ) -> TaskHandle[Any]:
        basis = self._basis
        plain = OneSend.prepare(basis, when, args, kwargs)
        if basis.unique is None:
            basis.route.run(plain, call)
            return plain.handle()
        keyed = OneUniqueSend(plain, basis.unique)
        return keyed.handle(basis.route.run(keyed, call))

    async def _one_async(
        self, when: timedelta | float | datetime, args: tuple[Any, ...], kwargs: dict[str, Any], call: str
    ) -> TaskHandle[Any]:
        basis = self._basis
        plain = OneSend.prepare(basis, when, args, kwargs)
        if basis.unique is None:
            await basis.route.run_async(plain, call)
            return plain.handle()
        keyed = OneUniqueSend(plain, basis.unique)
        return keyed.handle(await basis.route.run_async(keyed, call))

    # -- many tasks -------------------------------------------------------------------

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
        basis = self._basis
        if unique_keys is None and basis.unique is None:
            plain = ManySend.prepare(basis, items, common, unique_for)
            if not plain.empty:
                basis.route.run(plain, "send_many()")
            return plain.handles()
        keyed = ManyUniqueSend.prepare(basis, items, common, unique_keys, unique_for)
        return [] if keyed.empty else keyed.handles(basis.route.run(keyed, "send_many()"))

    async def send_many_async(
        self,
        items: Iterable[Sequence[Any] | Mapping[str, Any]],
        *,
        unique_keys: Sequence[str] | None = None,
        unique_for: timedelta | float | None = None,
        **common: Any,
    ) -> list[TaskHandle[Any]]:
        basis, call = self._basis, "send_many_async()"
        if unique_keys is None and basis.unique is None:
            plain = ManySend.prepare(basis, items, common, unique_for)
            if not plain.empty:
                await basis.route.run_async(plain, call)
            return plain.handles()
        keyed = ManyUniqueSend.prepare(basis, items, common, unique_keys, unique_for)
        return [] if keyed.empty else keyed.handles(await basis.route.run_async(keyed, call))

    # -- workflows --------------------------------------------------------------------

    def node(self, **options: Unpack[NodeOptions]) -> Node:
        """A workflow step that runs this task with these send options (see app.workflow and
        docs/workflows.md).

        Options: args=(...), kwargs={...}, name=, after=[...], args_from={param: node},
        join="all" | "any", run_anyway=False (see tether.workflow.definition.make_node).
        """
        basis = self._basis
        if basis.route.connection is not None:
            raise InvalidOptionError(
                f"task {basis.task.name!r}: a workflow node takes no connection=; give it to the "
                "workflow's start(connection=...) instead"
            )
        return make_node(basis.task, basis.options, **options)


class Task(Sends, Generic[P, R]):
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
        concurrency_key_arg: str | None = None,
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
        if concurrency_key_arg is not None and concurrency_key_arg not in self.signature.parameters:
            raise TaskDefinitionError(
                f"task {name!r}: concurrency_key names argument {concurrency_key_arg!r}, which the "
                f"function does not take (signature: {name}{self.signature})"
            )
        # The argument whose value is a send's concurrency key (docs/limits.md); None: none.
        self.concurrency_key_arg = concurrency_key_arg
        self.is_async = inspect.iscoroutinefunction(fn)
        self._shapes: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {}
        self._what_args = f"arguments of task {name!r}"
        self._what_kwargs = f"keyword arguments of task {name!r}"
        self.retry_policy_json = json.dumps(retry_policy.to_json()) if retry_policy else None
        self.options = app.check_options(name, SendOptions(queue, priority, None))
        self._basis = SendBasis(self, self.options)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, queue={self.options.queue!r})"

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
        concurrency_key: str | None = None,
    ) -> BoundTask:
        """A view of this task that sends with other options; the task itself is unchanged.

        ``unique_key``: send only if no task of this name holds the key (not terminal yet, or,
        with ``unique_for``, sent within that window); see docs/tasks.md#unique-sends.
        ``connection``: your psycopg 3 connection (AsyncConnection for the async forms) with a
        transaction open; the task is written in that transaction and commits or rolls back
        with it (docs/transactions.md). ``concurrency_key``: the key the task's slot is counted
        under in a flow-controlled queue (docs/limits.md).
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
            concurrency_key if concurrency_key is not None else self.options.concurrency_key,
        )
        return BoundTask(self, self.app.check_options(self.name, opts), connection)

    # -- encoding -------------------------------------------------------------

    def bound_argument(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The value argument ``name`` takes in this call (its default if not given)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments.get(name)

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


class BoundTask(Sends):
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
        self._basis = SendBasis(task, options, connection)
