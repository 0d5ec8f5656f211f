"""Tether: the registry of tasks, the configuration and the door to the broker."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from tether.broker import PostgresBroker, schedules
from tether.broker.answers import CHANGED
from tether.broker.schedules import ScheduleInfo
from tether.config import AppConfig, RetryPolicy
from tether.errors import ScheduleDefinitionError, TaskDefinitionError
from tether.events import AppWithOptions, EventSent, send_event
from tether.handle import TaskHandle
from tether.ids import parse_task_id
from tether.names import check_task_name
from tether.options import (
    SendOptions,
    check_cancel_grace,
    check_queue,
    check_send_options,
    check_time_limit,
)
from tether.periodic import CatchUp, Overlap, Schedule, declare, set_paused
from tether.queue_control import list_queues, pause_queue, resume_queue
from tether.result_listener import ResultListener
from tether.task import Task
from tether.workflow.definition import Node, OnError, Workflow
from tether.workflow.handle import WorkflowHandle

if TYPE_CHECKING:
    # Imported by retry_tasks() on first use (tether.handle says why).
    from tether.queue_control import QueueInfo  # imported by it on first use
    from tether.retrying import BulkRetry, RetryFilter

P = ParamSpec("P")
R = TypeVar("R")


class Tether:
    """One application: its tasks and where they are queued.

    ``Tether()`` alone uses the embedded PostgreSQL; give ``AppConfig(broker=
    PostgresConfig(database_url=...))`` or set TETHER_DATABASE_URL for a server.
    """

    def __init__(self, config: AppConfig | None = None) -> None:
        self.config = config if config is not None else AppConfig()
        self.tasks: dict[str, Task[Any, Any]] = {}
        self.schedules: dict[str, Schedule] = {}  # periodic tasks, by schedule name
        # Asked by find_task for a name no task is registered under (see find_task).
        self.task_resolver: Callable[[str], Task[Any, Any] | None] | None = None
        self.broker = PostgresBroker(self.config.broker, auto_migrate=self.config.auto_migrate)
        self._listener: ResultListener | None = None
        self._listener_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Tether(tasks={sorted(self.tasks)}, queues={self.config.queues})"

    def task(
        self,
        name: str,
        *,
        queue: str | None = None,
        priority: int = 0,
        retry_policy: RetryPolicy | None = None,
        time_limit: float | timedelta | None = None,
        cancel_grace: float | timedelta | None = None,
        concurrency_key: str | None = None,
    ) -> Callable[[Callable[P, R]], Task[P, R]]:
        """Register a function as the task ``name`` (unique in the app, stable across deploys).

        time_limit: how long an attempt may run before its process is killed. cancel_grace:
        how long its code may go on after a cancel was requested before its process is
        killed (None: the worker's ``cancel_grace_s``, 5 s by default). concurrency_key: the
        name of the argument whose value is each send's concurrency key (docs/limits.md).
        """
        check_task_name(name, "task name", TaskDefinitionError)
        if name in self.tasks:
            raise TaskDefinitionError(f"task name {name!r} is already registered ({self.tasks[name].fn!r})")
        if retry_policy is not None and not isinstance(retry_policy, RetryPolicy):
            raise TaskDefinitionError(
                f"task {name!r}: retry_policy must be a RetryPolicy, got {type(retry_policy).__name__}"
            )

        def register(fn: Callable[P, R]) -> Task[P, R]:
            if not callable(fn):
                raise TaskDefinitionError(f"task {name!r}: @app.task must decorate a function")
            task: Task[P, R] = Task(
                self,
                name,
                fn,
                queue=queue if queue is not None else self.config.default_queue,
                priority=priority,
                retry_policy=retry_policy,
                time_limit=check_time_limit(name, time_limit),
                cancel_grace=check_cancel_grace(name, cancel_grace),
                concurrency_key_arg=concurrency_key,
            )
            self.tasks[name] = task
            return task

        return register

    def find_task(self, name: str) -> Task[Any, Any] | None:
        """The task registered as ``name``; else what ``task_resolver`` finds, or None.

        A worker looks up every task it claims here. A resolver lets an integration
        register tasks on demand (the Django backend imports a task's module when a
        row names it, under its own rules); it registers what it finds, so it is
        asked once per name.
        """
        task = self.tasks.get(name)
        if task is None and self.task_resolver is not None:
            task = self.task_resolver(name)
        return task

    @overload
    def periodic(
        self,
        cron: str,
        task: None = None,
        *,
        name: str | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timezone: str = "UTC",
        catch_up: CatchUp = "latest",
        overlap: Overlap = "allow",
        queue: str | None = None,
        priority: int | None = None,
        concurrency_key: str | None = None,
    ) -> Callable[[Task[P, R]], Task[P, R]]: ...

    @overload
    def periodic(
        self,
        cron: str,
        task: Task[Any, Any],
        *,
        name: str | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timezone: str = "UTC",
        catch_up: CatchUp = "latest",
        overlap: Overlap = "allow",
        queue: str | None = None,
        priority: int | None = None,
        concurrency_key: str | None = None,
    ) -> Schedule: ...

    def periodic(
        self,
        cron: str,
        task: Task[Any, Any] | None = None,
        *,
        name: str | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timezone: str = "UTC",
        catch_up: CatchUp = "latest",
        overlap: Overlap = "allow",
        queue: str | None = None,
        priority: int | None = None,
        concurrency_key: str | None = None,
    ) -> Schedule | Callable[[Task[P, R]], Task[P, R]]:
        """Send ``task`` at every time ``cron`` names (a slot), exactly once per slot.

        ``cron``: five fields, six with seconds first (``*/2 * * * * *``), or @hourly,
        @daily, ...; read in ``timezone`` (an IANA name). ``name`` (default: the task's
        name) identifies the schedule across deploys. ``catch_up`` decides what happens
        to slots missed while no worker ran: "latest" (one task, for the most recent),
        "all" (every one, up to 100) or "none". ``overlap="skip"`` skips a slot while the
        previous slot's task has not ended. ``concurrency_key``: the key its tasks are sent
        with (default: the argument the task declares, from ``args``/``kwargs``; see
        docs/limits.md). Without ``task``, a decorator for one.
        See docs/periodic.md.
        """
        if task is None:

            def register(fn: Task[P, R]) -> Task[P, R]:
                self.periodic(
                    cron,
                    fn,
                    name=name,
                    args=args,
                    kwargs=kwargs,
                    timezone=timezone,
                    catch_up=catch_up,
                    overlap=overlap,
                    queue=queue,
                    priority=priority,
                    concurrency_key=concurrency_key,
                )
                return fn

            return register
        if not isinstance(task, Task) or self.tasks.get(task.name) is not task:
            raise ScheduleDefinitionError(
                f"schedule {name or getattr(task, 'name', task)!r}: the task must be a task registered "
                f"in this app with @app.task (got {task!r}); put @app.periodic above @app.task"
            )
        options = self.check_options(
            task.name,
            SendOptions(
                queue if queue is not None else task.options.queue,
                priority if priority is not None else task.options.priority,
                None,
                concurrency_key=concurrency_key,
            ),
        )
        schedule = declare(
            cron,
            task,
            name=name,
            args=args,
            kwargs=kwargs,
            timezone=timezone,
            catch_up=catch_up,
            overlap=overlap,
            options=options,
        )
        if schedule.name in self.schedules:
            raise ScheduleDefinitionError(
                f"schedule name {schedule.name!r} is already declared ({self.schedules[schedule.name]!r}); "
                "give each schedule of a task its own name="
            )
        self.schedules[schedule.name] = schedule
        return schedule

    def pause_schedule(self, name: str) -> bool:
        """Stop sending the schedule's slots until resumed (no deploy needed); False if already paused."""
        return self.broker.run_request(lambda conn: set_paused(conn, name, paused=True), CHANGED)

    def resume_schedule(self, name: str) -> bool:
        """Send its slots again, from the first slot after now; False if it was not paused."""
        return self.broker.run_request(lambda conn: set_paused(conn, name, paused=False), CHANGED)

    def list_schedules(self) -> list[ScheduleInfo]:
        """Every schedule stored in the database (all apps), as ``tether schedules`` lists them."""
        return self.broker.run(schedules.list_schedules)

    def pause_queue(self, name: str, *, by: str | None = None) -> bool:
        """Stop workers claiming from the declared queue ``name`` until resumed (docs/queues.md).

        Running tasks go on; claimed tasks no child has yet are given back; sends are still
        accepted. True if this call paused it, False if it was paused already. ``by``: who
        asks (stored with the pause and logged).
        """
        return pause_queue(self.broker, check_queue(name, self.config.queues), by=by)

    def resume_queue(self, name: str, *, by: str | None = None) -> bool:
        """Let workers claim from the declared queue ``name`` again (at once); True if this call
        resumed it, False if it was not paused."""
        return resume_queue(self.broker, check_queue(name, self.config.queues), by=by)

    def queues(self, *, exact: bool = False) -> list[QueueInfo]:
        """Every declared queue, every queue with tasks and every paused queue (all apps), as
        ``tether queues`` shows them: counts per status, oldest due task's age, pause. On a
        large task table the finished counts are estimates (each QueueInfo's ``estimated``
        names them); ``exact=True`` counts every row instead (seconds at millions of rows)."""
        return list_queues(self.broker, also=self.config.queues, exact=exact)

    def retry_tasks(
        self,
        filter: RetryFilter,
        *,
        by: str | None = None,
        dry_run: bool = False,
        sample_size: int = 10,
        from_scratch: bool = False,
    ) -> BulkRetry:
        """Retry every FAILED, CANCELLED or EXPIRED task (all apps) ``filter`` matches, in
        batches (docs/tasks.md#retrying-by-hand); ``dry_run``: count and sample, change nothing.
        Each keeps its recorded steps (it resumes after them) unless ``from_scratch``.
        ``by``: who asks (logged). One task: ``app.handle(id).retry()``."""
        from tether.retrying import retry_tasks

        return retry_tasks(
            self.broker, filter, by=by, dry_run=dry_run, sample_size=sample_size, from_scratch=from_scratch
        )

    def check_options(self, task_name: str, options: SendOptions) -> SendOptions:
        """Validate send options; the error says which option and why."""
        return check_send_options(options, self.config.queues)

    def workflow(
        self,
        name: str,
        nodes: Sequence[Node],
        *,
        on_error: OnError = "fail",
        output: Node | str | None = None,
    ) -> Workflow:
        """A workflow of ``nodes`` (built with ``task.node(...)``), checked now; ``.start()`` runs it.

        on_error="fail": a failed step skips its dependents, independent branches
        finish, and the workflow ends FAILED. on_error="pause": the first failure
        pauses the workflow (no new steps) until ``resume()`` or ``cancel()``.
        ``output``: the node whose result ``get()`` returns (default: the only
        final node; with several, a dict of their values by node name).
        """
        return Workflow(self, name, nodes, on_error=on_error, output=output)

    def workflow_handle(self, workflow_id: str | uuid.UUID) -> WorkflowHandle:
        """A handle for a workflow started earlier (by id)."""
        return WorkflowHandle(self, parse_task_id(workflow_id, what="workflow id"))

    def send_event(self, key: str, payload: Any = None) -> EventSent:
        """Send the event ``key`` with a JSON ``payload`` to the task waiting for it
        (``current_task().wait_for_event(key)``; docs/durable-steps.md#events): the task waiting
        longest gets it and becomes due at once. With no task waiting, the event is kept and
        delivered to the first that waits for the key. Each send is one event: a second send of
        a key goes to the next waiter. EventError for a bad key or a payload that is not JSON
        (nothing sent). In your transaction: ``app.with_options(connection=conn).send_event(...)``.
        """
        return send_event(self.broker, key, payload)

    def with_options(self, *, connection: Any) -> AppWithOptions:
        """The app's calls that can run in your transaction (``send_event``): ``connection`` is a
        psycopg 3 Connection with a transaction open, as for ``task.with_options(connection=)``."""
        return AppWithOptions(self, connection)

    def handle(self, task_id: str | uuid.UUID) -> TaskHandle[Any]:
        """A handle for a task sent earlier (by id)."""
        return TaskHandle(self, parse_task_id(task_id))

    def get_broker(self) -> PostgresBroker:
        """The app's broker: manual recovery as the seed documents show it (docs/heartbeats-and-recovery.md).

        ``await app.get_broker().get_stale_tasks(stale_threshold_minutes=5)``,
        ``mark_stale_tasks_as_failed(stale_threshold_ms=...)`` and
        ``requeue_stale_claimed(stale_threshold_ms=...)``. The same object as ``app.broker``;
        a supported API, part of the seed contract (tests/seeds).
        """
        return self.broker

    @property
    def result_listener(self) -> ResultListener:
        with self._listener_lock:
            if self._listener is None:
                self._listener = ResultListener(self.broker)
            return self._listener

    def close(self) -> None:
        """Close the connection pool and stop the result listener; safe to call twice.

        A process that ends without calling it still exits at once: open pools are
        closed at interpreter exit. Call it (or use ``with Tether(...) as app:``) to
        release the connections earlier, for example at the end of a request-less job.
        """
        if self._listener is not None:
            self._listener.stop()
        self.broker.close()

    def __enter__(self) -> Tether:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
