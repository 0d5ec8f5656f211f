"""The worker's main process: start its services, run the claim loop, shut down cleanly.

Each job is a module of its own; this one wires them together and owns the lifecycle.
``Worker`` is made with what needs no database; ``Worker.run`` makes a ``StartedWorker``,
which holds everything that does (pool, recorder, children, claim loop, services), step
by step, and takes it down in reverse: nothing here is ``None`` until a step has run.

- holdings.py: where each held task sits (unhanded, a child's current task, its queue)
- claimer.py: the claim loop; claim_triggers.py: what makes it look for work again;
  claim_marks.py: where its claims start reading; notify_registration.py: asking
  senders to notify
- dispatch.py: handing tasks to the children and following them; supervisor.py: the
  child processes (and killing hung ones); recorder.py: fenced writes, crashes included
- services.py: the background services, each a module with its tick: work_listener.py
  (LISTEN), heartbeat.py (the one statement per interval), isolation.py (stopping our
  own work when heartbeats cannot get through), reaper.py (with retention.py), scheduler.py
- time_limits.py, cancels.py; reconcile.py (start-up)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from tether import __version__, outcomes
from tether.app import Tether
from tether.broker import workers
from tether.broker.claims import TaskPayload
from tether.broker.heartbeats import Beat, BeatAnswer
from tether.broker.types import DatabaseError
from tether.broker.worker_pool import WorkerPool
from tether.config import RecoveryConfig, WorkerConfig
from tether.db.connection import listen_url
from tether.errors import UnknownQueueError
from tether.log_fields import about_task, set_worker
from tether.log_setup import LogSetup
from tether.metrics import hooks as metric_hooks
from tether.metrics import rules
from tether.result import ErrorCode, TaskError, TaskStatus
from tether.worker.cancels import Cancels
from tether.worker.claim_triggers import ClaimTriggers
from tether.worker.claimer import Claimer
from tether.worker.dispatch import Dispatcher
from tether.worker.heap import freeze_start_up
from tether.worker.heartbeat import Heartbeat, interval_s
from tether.worker.holdings import Holdings
from tether.worker.identity import Identity, current_identity
from tether.worker.isolation import Isolation, IsolationWatch
from tether.worker.lanes import plan_lanes
from tether.worker.limited_claimer import LimitedClaimer
from tether.worker.notify_registration import NotifyRegistration
from tether.worker.reaper import Reaper
from tether.worker.reconcile import reconcile_host
from tether.worker.recorder import Recorder
from tether.worker.scheduler import Scheduler
from tether.worker.services import Service, Services
from tether.worker.shared_connection import SharedConnection
from tether.worker.start_method import ChildContext, child_context
from tether.worker.supervisor import Supervisor
from tether.worker.task_set import TaskSet
from tether.worker.time_limits import TimeLimits
from tether.worker.work_listener import WorkListener

if TYPE_CHECKING:
    from tether.metrics.serve import WorkerEndpoint

log = logging.getLogger("tether.worker")

# The steps of a worker's start-up, in order ("claimed": its first claim came back). A
# test hook: TETHER_TEST_SIGTERM_AT=<step> makes the worker send itself SIGTERM as it
# reaches that step, so a test hits each window of the start-up on purpose, not by luck.
STARTUP_STEPS = ("begin", "registered", "children", "services", "reconciled", "claimed")
SIGTERM_AT_ENV = "TETHER_TEST_SIGTERM_AT"


class Worker:
    """One `tether worker` main process. What needs no database is made here; ``run()`` does the rest."""

    def __init__(self, app: Tether, app_path: str, config: WorkerConfig | None = None) -> None:
        self.app = app
        self.app_path = app_path
        self.config = config or app.config.worker
        self.queues = list(self.config.queues or app.config.queues)
        unknown = sorted(set(self.queues) - set(app.config.queues))
        if unknown:
            raise UnknownQueueError(
                f"--queues names undeclared queue(s) {', '.join(unknown)}; "
                f"declared queues: {', '.join(app.config.queues)}"
            )
        self.identity: Identity = current_identity()
        set_worker(self.identity.worker_id)  # every line of this process names its worker
        self.lanes = plan_lanes(self.config, app)
        self.capacity = self.lanes.capacity
        self.holdings = Holdings()
        self.triggers = ClaimTriggers(self.config.poll_interval_ms / 1000)
        self.time_limits = TimeLimits(
            self._time_limit_of, self.holdings.running_in, self.config.cancel_grace_s
        )
        # A stop was requested (or the worker is closing): claim and hand out nothing more.
        # The claim loop and the dispatcher read it, so a stop needs nothing that run() makes.
        self.stopping = asyncio.Event()
        self.stopped = asyncio.Event()  # a second stop request: stop now
        self._signals = 0
        # A pause's give-backs, each held until it is done (and waited for at close).
        self.give_backs = TaskSet("giving back a paused queue's tasks")
        self._sigterm_at = os.environ.get(SIGTERM_AT_ENV)
        self.child_context: ChildContext | None = None  # made as run() begins

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    # -- lifecycle -----------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        return self.stopping.is_set()

    async def _reached(self, step: str) -> None:
        """A step of the start-up is done (see STARTUP_STEPS and its test hook)."""
        log.debug("worker %s start-up: %s", self.worker_id, step)
        if self._sigterm_at == step:
            self._sigterm_at = None
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs from the event loop: let it, so the stop lands at this step.
            await self.stopping.wait()

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        """Start, claim and run tasks until asked to stop, then stop cleanly.

        A stop asked at any moment, the start-up included, takes the same clean path: the
        registry row ends ``stopped``, the children are gone, claimed tasks are given back.
        """
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            # First of all: SIGTERM's default action would end the process on the spot,
            # leaving its registry row active and its children to die unrecorded.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        started: StartedWorker | None = None
        try:
            if self.child_context is None:  # not made before the loop by run_worker
                self.child_context = child_context(self.config.start_method, self.app_path)
            await self._reached("begin")
            url = await asyncio.to_thread(lambda: self.app.broker.url)  # also migrates if behind
            started = StartedWorker(self, url)
            await self._start(started, loop)
            if not self.stop_requested:
                await started.claimer.run()
            await started.drain()
        finally:
            if started is not None:
                await started.close()
            self.triggers.close()
            done = started.tasks_done if started is not None else 0
            log.info("worker %s stopped after %d task(s)", self.worker_id, done)

    async def _start(self, started: StartedWorker, loop: asyncio.AbstractEventLoop) -> None:
        """Every step before the claim loop; returns early once a stop is requested."""
        if self.stop_requested:
            log.info("worker %s: stop requested before it registered; exiting", self.worker_id)
            return
        # Children start first (they run only what they are handed): the fork server makes
        # them while this process connects, registers, listens and reconciles, so they are
        # ready by the time the first task is claimed.
        children = asyncio.create_task(started.supervisor.start_async())
        try:
            await self._connect_and_register(started)
            if self.stop_requested:
                return
            await self._reached("children")
            if self.stop_requested:
                return
            # Reconciliation reads beside the listener's connect (its own connection, the
            # maintenance one); it writes only once the listener listens (or will not).
            listened = threading.Event()
            reconciling = asyncio.ensure_future(
                asyncio.to_thread(
                    reconcile_host,
                    started.url,
                    self.app.config,
                    self.identity,
                    started.maintenance,
                    lambda: listened.wait() and not self.stop_requested,
                )
            )
            try:
                try:
                    await started.start_services()
                finally:
                    listened.set()
                await self._reached("services")
                if self.stop_requested:
                    return
            finally:
                # Before claiming anything: what dead workers on this host left is recovered.
                # (After a stop, a gone worker's tasks are left to the next start or the reaper.)
                reconciled = await reconciling
                started.reconciled.set()  # the reaper's and the scheduler's first rounds may run
        finally:
            await children  # a stop cut short or not: the children exist before anything else
        metric_hooks.recovered(
            rules.STARTUP_RECONCILIATION,
            len(reconciled.requeued) + len(reconciled.retried) + len(reconciled.failed),
        )
        await self._reached("reconciled")
        if self.stop_requested:
            return
        # The start-up's objects live as long as the process: out of every garbage collection
        # pass from here (heap.py: a full pass over them stalled pickups for 60 ms).
        freeze_start_up()
        lanes = self.lanes
        log.info(
            "worker %s started: queues=%s processes=%d (prefetch %d) async_processes=%d "
            "(concurrency %d, prefetch %d)",
            self.worker_id,
            ",".join(self.queues),
            lanes.sync_processes,
            lanes.sync_prefetch,
            lanes.async_processes,
            lanes.async_concurrency,
            lanes.async_prefetch,
        )

    async def _connect_and_register(self, started: StartedWorker) -> None:
        await started.pool.open()
        started.serve_metrics()
        if self.stop_requested:
            log.info("worker %s: stop requested before it registered; exiting", self.worker_id)
            return
        await started.register()
        await self._reached("registered")

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: stop now (running tasks are recorded as crashed).

        Safe at any moment, before run() and during its start-up included: it only sets
        events that the claim loop and the dispatcher read, and wakes the claim loop.
        """
        self._signals += 1
        if self._signals == 1:
            self.stopping.set()
            log.info(
                "worker %s stopping: no new claims; running tasks may finish within %.0fs",
                self.worker_id,
                self.config.grace_period_s,
            )
            self.triggers.poke()
        else:
            log.warning("worker %s: second stop request, stopping now", self.worker_id)
            self.stopped.set()
            self.triggers.poke()

    # -- what needs no database -----------------------------------------------------------

    def hold(self, claimed: list[TaskPayload]) -> list[TaskPayload]:
        """Hold what a claim returned; returns the tasks whose name this app does not register."""
        unknown = []
        for task in claimed:
            found = self.app.find_task(task.name)
            if found is None:
                unknown.append(task)
            else:
                self.holdings.take(task, self.lanes.kind_of(found.is_async))
        return unknown

    def _cancel_grace_of(self, name: str) -> float:
        """How long a task of that name may go on after its cancel was requested, in seconds."""
        task = self.app.find_task(name)
        if task is not None and task.cancel_grace is not None:
            return task.cancel_grace
        return self.config.cancel_grace_s

    def _time_limit_of(self, name: str) -> tuple[float, bool] | None:
        """A task name's time limit and whether the task is async; None: no limit."""
        task = self.app.find_task(name)
        if task is None or task.time_limit is None:
            return None
        return task.time_limit, task.is_async


class StartedWorker:
    """What a worker holds once its database is known: made by ``Worker.run``, never ``None``.

    Made whole at once (opening nothing: the pool opens, the row is written, the children
    and services start in ``Worker._start``'s steps), so that ``close()`` can take down
    whatever a start-up cut short by a stop got to: each part knows whether it started.
    """

    def __init__(self, worker: Worker, url: str) -> None:
        self.worker = worker
        self.url = url
        config = worker.app.config
        me, holdings, triggers = worker.worker_id, worker.holdings, worker.triggers
        self.registered = False  # the registry row may exist: close() marks it stopped
        self.metrics: WorkerEndpoint | None = None  # the /metrics endpoint, once serve_metrics() ran
        self._claimed_any = False  # the first claim that returned tasks came back
        self.pool = WorkerPool(url, config)
        self.recorder = Recorder(url, me, config, role="recorder")
        # The supervisor calls the dispatcher back only once its children run (start()).
        self.supervisor = Supervisor(
            lanes=worker.lanes,
            app_path=worker.app_path,
            url=url,
            worker_id=me,
            log_level=logging.getLogger().getEffectiveLevel(),
            on_message=lambda slot, msg: self.dispatcher.on_message(slot, msg),
            on_exit=lambda slot, code: self.dispatcher.on_exit(slot, code),
            log_format=LogSetup.current().format,
            context=worker.child_context,
        )
        self.dispatcher = Dispatcher(
            lanes=worker.lanes,
            holdings=holdings,
            time_limits=worker.time_limits,
            recorder=self.recorder,
            supervisor=self.supervisor,
            on_change=triggers.poke,
            stopping=worker.stopping,
            traced=config.tracing,
        )
        self.cancels = Cancels(holdings, self.supervisor, worker._cancel_grace_of)
        self.isolation = Isolation(
            me,
            holdings,
            self.supervisor,
            _isolate_within_s(config.recovery),
            on_rejoin=triggers.work_may_wait,
        )
        # None: behind a transaction pooler with no listen_url, nothing listens (docs/pgbouncer.md).
        self.listen_url = listen_url(config.broker, url)
        self.registration = NotifyRegistration(
            self.pool, me, worker.queues, notified=self.listen_url is not None
        )
        self.claimer = Claimer(
            pool=self.pool,
            worker_id=me,
            queues=worker.queues,
            lanes=worker.lanes,
            async_names=sorted(name for name, task in worker.app.tasks.items() if task.is_async),
            batch_size=worker.config.claim_batch_size,
            holdings=holdings,
            triggers=triggers,
            registration=self.registration,
            accept=self._accept,
            may_claim=lambda: not self.isolation.isolated,
            stopping=worker.stopping,
            limited=LimitedClaimer(
                pool=self.pool,
                worker_id=me,
                queues=worker.queues,
                declared=config.queue_limits,
                async_names=sorted(name for name, task in worker.app.tasks.items() if task.is_async)
                if worker.lanes.both
                else [],
            ),
        )
        every = interval_s(config.recovery)
        # The beat also reads when the next slot of these queues' schedules comes: the
        # scheduler's periodic look rides on it (answered() hands it over).
        heartbeat = Heartbeat(url, config, me, worker.identity.hostname, self, every, list(worker.queues))
        # The reaper, the scheduler and startup reconciliation take turns on one connection.
        self.maintenance = SharedConnection(url, config, "maintenance")
        self.scheduler = Scheduler(
            url, config, worker.queues, list(worker.app.schedules.values()), self.maintenance
        )
        self.listening = asyncio.Event()
        listeners: list[Service] = []
        self.listener: WorkListener | None = None
        if self.listen_url is not None:
            self.listener = WorkListener(
                self.listen_url,
                config,
                set(worker.queues),
                on_work=self._on_work,
                on_listening=self._on_listening,
                on_schedules=self.scheduler.wake,
                on_control=self._on_control,
                worker_id=me,  # its connection's name says whose it is (`tether health` looks)
            )
            listeners.append(self.listener)
        # An idle pass rides on this worker's beats, in the beat's transaction (beat_rides.py).
        reaper = Reaper(url, config, every, me, self.maintenance, beats=heartbeat)
        heartbeat.rider = reaper
        # Startup reconciliation has the maintenance connection first: the claim loop waits
        # for it, and neither a reaper pass nor the scheduler's first round goes before it.
        self.reconciled = asyncio.Event()
        reaper.first_round_after = self.scheduler.first_round_after = self.reconciled
        # Started in this order, closed in reverse (docs/internals.md lists them).
        self.services = Services(
            [
                *listeners,
                heartbeat,
                IsolationWatch(self.isolation, lambda: heartbeat.last_ok, every),
                reaper,
                self.scheduler,
            ]
        )

    @property
    def tasks_done(self) -> int:
        return self.dispatcher.tasks_done

    def serve_metrics(self) -> None:
        """Start the metrics endpoint if --metrics-port asks for one (prometheus_client is
        imported only then)."""
        if self.worker.config.metrics_port is None:
            return
        from tether.metrics.serve import WorkerEndpoint

        self.metrics = WorkerEndpoint(
            self.worker.app,
            self.url,
            self.worker.config,
            in_flight=lambda: len(self.worker.holdings),
            children=lambda: len(self.supervisor.alive()),
        )

    async def register(self) -> None:
        self.registered = True  # from here, close() marks the row stopped, even if this insert fails
        await self.pool.run(
            "registering the worker", lambda c: workers.register_worker(c, self._registration())
        )

    def _registration(self) -> workers.Registration:
        w = self.worker
        me, lanes = w.identity, w.lanes
        return workers.Registration(
            worker_id=me.worker_id,
            hostname=me.hostname,
            pid=me.pid,
            process_started_at=me.process_started_at,
            host_key=me.host_key,
            queues=w.queues,
            processes=lanes.sync_processes,
            async_processes=lanes.async_processes,
            async_concurrency=lanes.async_concurrency if lanes.async_processes else None,
            version=__version__,
            task_names=sorted(w.app.tasks),
        )

    async def start_services(self) -> None:
        """Start the background services; returns once the listener listens (or a stop is requested).

        The listener listens before startup reconciliation writes anything: a crash
        retry it schedules notifies its due time, and the timer set from that
        notification starts the retry on time instead of at the next poll.
        """
        self.services.start()
        if self.listen_url is None:
            self._say_polling()
            return
        timeout = self.worker.app.config.broker.connect_timeout_s
        waits = {asyncio.create_task(self.listening.wait()), asyncio.create_task(self.worker.stopping.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if not self.listening.is_set() and not self.worker.stop_requested:
            log.warning(
                "work listener not connected after %.0fs; going on (the poll finds work meanwhile)", timeout
            )

    def _say_polling(self) -> None:
        config = self.worker.app.config
        log.warning(
            "worker %s: no LISTEN connection (pooler=transaction and no listen_url): new work is "
            "found by polling every %d ms (poll_interval_ms), and cancels reach running tasks "
            "within a heartbeat (%.0f s). Set TETHER_LISTEN_URL (PostgresConfig.listen_url) to a "
            "direct URL to PostgreSQL to be woken at once (docs/pgbouncer.md)",
            self.worker.worker_id,
            self.worker.config.poll_interval_ms,
            interval_s(config.recovery),
        )

    def _on_work(self, queue: str, run_at: float | None, due_in: float | None) -> None:
        """New work on ``queue`` from ``run_at`` (Unix seconds, database time), due in
        ``due_in`` seconds by the server's clock (both None: unknown)."""
        when = None if run_at is None else datetime.fromtimestamp(run_at, UTC)
        self.claimer.marks.rewind(queue, when)  # the claim must read back to it
        behind = self.listener.clock.behind_by_at_most() if self.listener is not None else 0.0
        self.worker.triggers.on_notification(due_in, behind)

    def _on_listening(self) -> None:
        # Notifications sent while the listener was down are lost: look once (without
        # marks: what they announced may sit behind one), and register as waiting again
        # (the reaper may have removed the row meanwhile).
        self.listening.set()
        self.claimer.marks.forget()
        self.registration.forget()
        self.worker.triggers.work_may_wait()
        self.scheduler.wake()

    async def drain(self) -> None:
        """Give claimed-but-unstarted tasks back and let running ones finish within the grace period.

        With no child started (a stop during the start-up), there is nothing to wait for.
        """
        await self._release(self.worker.holdings.let_go_unhanded())
        self.dispatcher.stop_idle_children()
        grace = self.worker.config.grace_period_s
        try:
            await asyncio.wait_for(self._all_children_gone(), grace)
        except TimeoutError:
            log.warning(
                "grace period of %.0fs over: killing %d child(ren) still running",
                grace,
                len(self.supervisor.alive()),
            )
        await self.dispatcher.kill_children()

    async def _all_children_gone(self) -> None:
        """Until every child has exited, or a second stop request cuts the wait short."""
        if not self.supervisor.alive():
            return
        gone = asyncio.create_task(self.dispatcher.no_children.wait())
        now = asyncio.create_task(self.worker.stopped.wait())
        try:
            await asyncio.wait({gone, now}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            now.cancel()

    async def close(self) -> None:
        """Take down what started, in reverse: services, give-backs, children, the row, connections."""
        w = self.worker
        await self.services.close()  # the heartbeat goes on until here: through the grace period
        await w.give_backs.wait()  # released before the row says stopped
        w.stopping.set()  # (if the run ended by an error) the dispatcher restarts no child
        await self.dispatcher.kill_children()
        if self.registered:
            try:
                await self.pool.run("stopping the worker", lambda c: workers.stop_worker(c, w.worker_id))
            except DatabaseError as exc:
                log.error("could not mark worker %s stopped: %s", w.worker_id, exc)
        await self.pool.close()
        await asyncio.to_thread(self.recorder.close)
        await asyncio.to_thread(self.maintenance.close)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)

    # -- what the claim loop hands over -------------------------------------------------

    async def _accept(self, claimed: list[TaskPayload]) -> None:
        unknown = self.worker.hold(claimed)
        self.dispatcher.hand_out()
        if claimed and not self._claimed_any:
            self._claimed_any = True
            await self.worker._reached("claimed")
        for task in unknown:
            await self._not_registered_here(task)

    async def _not_registered_here(self, task: TaskPayload) -> None:
        """A name this app lacks: give it back if another live worker knows it, else fail it."""
        me = self.worker.worker_id
        known = await self.pool.run(
            "looking up a task name",
            lambda c: workers.name_known_elsewhere(c, me=me, name=task.name, queue=task.queue),
        )
        if known:
            # A rolling deploy: other workers run newer (or older) code. Let them have it.
            self.claimer.skip_name(task.name)
            log.info(
                "task %s: %r is not registered here but another worker knows it; releasing",
                task.id,
                task.name,
                extra=about_task(task),
            )
            await self._release([task])
            return
        error = TaskError(
            ErrorCode.TASK_NOT_REGISTERED,
            f"no live worker serving queue {task.queue!r} has a task named {task.name!r} "
            f"(worker {me} claimed it)",
        )
        outcome = outcomes.failure(error, task.retry_policy, task.retry_count)
        log.error("task %s: %s; failing it", task.id, error.message, extra=about_task(task))
        await asyncio.to_thread(self.recorder.record_for, task, outcome, expect=TaskStatus.CLAIMED)

    async def _release(self, tasks: list[TaskPayload]) -> None:
        if not tasks:
            return
        released = await asyncio.to_thread(self.recorder.release, tasks)
        for task in tasks:
            self.worker.holdings.forget(task.id, task.attempt)
        log.info("released %d claimed task(s) back to PENDING", len(released))

    # -- operators' requests (the tether_control channel) -------------------------------

    def _on_control(self, verb: str, arguments: list[str]) -> None:
        w = self.worker
        if verb == "pause" and len(arguments) == 1 and arguments[0] in w.queues:
            # Claimed tasks of the queue that no child has yet go back: a paused queue
            # starts nothing new here. What a child was already handed may still start.
            going = w.holdings.let_go_unhanded(arguments[0])
            if going:
                log.info("queue %s paused: giving back %d claimed task(s)", arguments[0], len(going))
                w.give_backs.start(self._release(going))
        elif verb == "resume" and len(arguments) == 1 and arguments[0] in w.queues:
            w.triggers.work_may_wait()
        elif verb == "cancel" and len(arguments) == 2 and arguments[0] == w.worker_id:
            self.cancels.request(arguments[1])
        elif verb == "limits" and len(arguments) == 1 and arguments[0] in w.queues:
            self.claimer.limits_changed()  # docs/limits.md: which claim takes the queue
        elif verb not in ("pause", "resume", "cancel", "limits"):
            log.warning("unknown operator request %r %s on tether_control; ignored", verb, arguments)

    # -- what the heartbeat needs (heartbeat.BeatSource) -----------------------------------

    def collect(self) -> Beat:
        recovery = self.worker.app.config.recovery
        holdings, supervisor = self.worker.holdings, self.supervisor
        # A child whose heartbeat thread went silent past the running threshold is hung.
        supervisor.kill_hung(
            recovery.running_stale_threshold_ms / 1000,
            lambda slot: [] if holdings.frozen(slot) else holdings.running_in(slot),
        )
        fresh_within = 2 * recovery.runner_heartbeat_interval_ms / 1000
        slots = {slot.index: slot for slot in supervisor.alive()}

        def runner_pid(index: int) -> int | None:
            """The child's pid if its runner heartbeat may be relayed: stamped in time, or frozen."""
            slot = slots[index]
            fresh = holdings.frozen(index) or supervisor.stamp_age(slot) <= fresh_within
            return slot.pid if fresh else None

        return holdings.beat(os.getpid(), slots, runner_pid)

    def answered(self, answer: BeatAnswer) -> None:
        lost = set(answer.lost)
        if self.isolation.isolated:
            self.isolation.rejoin(lost)
        if answer.slots_read:
            self.scheduler.heard(answer.next_slot_in, answer.sent_at)
        for task_id in answer.cancel_requested:  # a tether_control notification may have been missed
            self.cancels.request(task_id)
        if lost:
            holdings = self.worker.holdings
            for task_id in holdings.lose(lost):
                held = holdings.get(task_id)
                log.warning(
                    "task %s is no longer held by worker %s (recovered or cancelled elsewhere); "
                    "its outcome here will not be recorded",
                    task_id,
                    self.worker.worker_id,
                    extra={"task_id": task_id} if held is None else about_task(held),
                )


def run_worker(app: Tether, app_path: str, config: WorkerConfig | None = None) -> None:
    worker = Worker(app, app_path, config)
    # Before the event loop and any thread or connection exist: the fork server can then be
    # forked from this process, with tether and the app imported (tether.worker.start_method).
    worker.child_context = child_context(worker.config.start_method, app_path)
    asyncio.run(worker.run())


def _isolate_within_s(recovery: RecoveryConfig) -> float:
    """How soon after its last heartbeat a reaper may judge this worker dead: the running stale
    threshold, or sooner with the session_closed rule (a middlebox may close its session while
    it still runs its tasks, cut off: it isolates itself before that rule could act)."""
    closed = recovery.session_closed_threshold_ms  # validated: at most the running threshold
    return (recovery.running_stale_threshold_ms if closed is None else closed) / 1000


__all__ = ["Worker", "run_worker"]
