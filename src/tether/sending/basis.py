"""What every kind of send shares: the task, its send options and where it sends; a call's
own options; its arguments encoded; the columns of its rows.

A send option reaches the database here and only here: ``row_spec`` turns the options
(``SendOptions``, checked in tether.options) and the call's own (``good_until=``, the
delay) into the ``SendSpec`` every insert statement takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol
from uuid import UUID

from tether.app_view import AppView
from tether.broker.tasks import SendSpec
from tether.broker.types import AsyncCallerConn, CallerConn
from tether.broker.unique import UniqueKey
from tether.errors import BadArgumentsError, InvalidOptionError, SerializationError
from tether.handle import TaskHandle
from tether.limits import check_concurrency_key
from tether.options import SendOptions, check_good_until
from tether.sending.route import Route
from tether.workflow.definition import StepTask

#: Keyword names a send takes for itself (send, schedule, send_many); a task may not use
#: them as parameters. Each is read by ``SendBasis.call_good_until`` or ``SendBasis.call_key``.
CALL_OPTIONS = frozenset({"good_until", "concurrency_key"})

#: The items of a send_many: each a tuple/list of positional arguments or a dict of keyword ones.
Items = Iterable[Sequence[Any] | Mapping[str, Any]]


class SendingTask(StepTask, Protocol):
    """What a send uses of its task (a ``tether.task.Task``; a Protocol, as task.py imports
    this package): what a workflow step uses (node() builds one), and what a send adds."""

    @property
    def app(self) -> AppView: ...

    @property
    def retry_policy_json(self) -> str | None: ...

    @property
    def concurrency_key_arg(self) -> str | None: ...

    def bound_argument(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any: ...

    def encode_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]: ...


class SendBasis:
    """A task's sends with one set of options, to one place (the pool or the caller's connection)."""

    __slots__ = ("options", "route", "task", "unique")

    def __init__(
        self,
        task: SendingTask,
        options: SendOptions,
        connection: CallerConn | AsyncCallerConn | None = None,
    ) -> None:
        self.task = task
        self.options = options
        self.route = Route(task.app, connection)
        self.unique = (
            None if options.unique_key is None else UniqueKey(options.unique_key, options.unique_for)
        )

    def call_good_until(self, kwargs: dict[str, Any]) -> datetime | None:
        """The call's ``good_until=`` (taken out of its keyword arguments), else the options'."""
        given = kwargs.pop("good_until", None)
        return self.options.good_until if given is None else check_good_until(given)

    def call_key(self, kwargs: dict[str, Any]) -> str | None:
        """The call's ``concurrency_key=`` (taken out of its keyword arguments), else the options'."""
        given = kwargs.pop("concurrency_key", None)
        return self.options.concurrency_key if given is None else check_concurrency_key(given)

    def derived_key(self, given: str | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """A task's concurrency key: ``given`` (the call's or the options'), else the value of the
        argument its task declares (``@app.task(concurrency_key="customer_id")``; None: no key)."""
        if given is not None:
            return given
        arg = self.task.concurrency_key_arg
        if arg is None:
            return None
        value = self.task.bound_argument(arg, args, kwargs)
        if value is None:
            return None
        return check_concurrency_key(
            value, f"argument {arg!r} of task {self.task.name!r} (its concurrency key)"
        )

    def row_spec(
        self,
        delay: timedelta,
        run_at: datetime | None,
        good_until: datetime | None,
        key: str | None = None,
        keys: tuple[str | None, ...] | None = None,
    ) -> SendSpec:
        """The columns every task of this send shares (``keys``: one per task instead)."""
        task, options = self.task, self.options
        in_callers = self.route.connection is not None
        return SendSpec(
            task.name,
            options.queue,
            options.priority,
            task.retry_policy.max_retries if task.retry_policy else 0,
            task.retry_policy_json,
            good_until,
            delay,
            # Inside the caller's transaction its commit decides durability: tether leaves
            # synchronous_commit alone (with_options refuses durable=False there).
            True
            if in_callers
            else task.app.config.broker.durable_sends
            if options.durable is None
            else options.durable,
            run_at,
            notify_always=in_callers,
            concurrency_key=key,
            concurrency_keys=keys,
        )

    def encode_items(self, items: Items, common: dict[str, Any]) -> tuple[SendSpec, list[str], list[str]]:
        """A send_many's columns, and the arguments of each item as JSON; ``common``: the keyword
        arguments every item shares (an item's dict wins over them), ``good_until=`` among
        them. Errors name the item."""
        good_until = self.call_good_until(common)
        given_key = self.call_key(common)
        keys: list[str | None] | None = (
            None if given_key is not None or self.task.concurrency_key_arg is None else []
        )
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
                if keys is not None:
                    keys.append(self.derived_key(None, args, kwargs))
            except (BadArgumentsError, SerializationError, InvalidOptionError) as exc:
                raise type(exc)(f"send_many item {index}: {exc}") from None
            args_list.append(a)
            kwargs_list.append(k)
        spec = self.row_spec(timedelta(0), None, good_until, given_key, None if keys is None else tuple(keys))
        return spec, args_list, kwargs_list

    def handle(self, task_id: UUID, *, deduplicated: bool = False) -> TaskHandle[Any]:
        return TaskHandle(self.task.app, task_id, self.task.name, deduplicated=deduplicated)
