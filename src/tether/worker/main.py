"""The worker's main process: start its services, run the claim loop, shut down cleanly.

Each job is a module of its own; this one wires them together and owns the lifecycle:

- holdings.py: where each held task sits (unhanded, a child's current task, its queue)
- claimer.py: the claim loop; claim_triggers.py: what makes it look for work again;
  notify_registration.py: asking senders to notify; work_listener.py: LISTEN
- dispatch.py: handing tasks to the children and following them; supervisor.py: the
  child processes (and killing hung ones); recorder.py: fenced writes, crashes included
- heartbeat.py: the one statement per interval; isolation.py: stopping our own work when
  heartbeats cannot get through; time_limits.py; reaper.py; reconcile.py (startup)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from tether import __version__, outcomes
from tether.app import Tether
from tether.broker import workers
from tether.broker.claims import TaskPayload
from tether.broker.heartbeats import Beat, BeatAnswer
from tether.broker.types import DatabaseError
from tether.broker.worker_pool import WorkerPool
from tether.config import WorkerConfig
from tether.errors import UnknownQueueError
from tether.result import ErrorCode, TaskError, TaskStatus
from tether.worker.cancels import Cancels
from tether.worker.claim_triggers import ClaimTriggers
from tether.worker.claimer import Claimer
from tether.worker.dispatch import Dispatcher
from tether.worker.heartbeat import HeartbeatWriter, heartbeat_loop, interval_s
from tether.worker.holdings import Holdings
from tether.worker.identity import Identity, current_identity
from tether.worker.isolation import Isolation
from tether.worker.lanes import plan_lanes
from tether.worker.notify_registration import NotifyRegistration
from tether.worker.reaper import Reaper, reaper_loop
from tether.worker.reconcile import reconcile_host
from tether.worker.recorder import Recorder
from tether.worker.scheduler import Scheduler, scheduler_loop
from tether.worker.supervisor import Supervisor
from tether.worker.task_set import TaskSet
from tether.worker.time_limits import TimeLimits
from tether.worker.work_listener import listen_for_work

log = logging.getLogger("tether.worker")

# The steps of a worker's start-up, in order ("claimed": its first claim came back). A
# test hook: TETHER_TEST_SIGTERM_AT=<step> makes the worker send itself SIGTERM as it
# reaches that step, so a test hits each window of the start-up on purpose, not by luck.
STARTUP_STEPS = ("begin", "registered", "children", "services", "reconciled", "claimed")
SIGTERM_AT_ENV = "TETHER_TEST_SIGTERM_AT"


class Worker:
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
        self.lanes = plan_lanes(self.config, app)
        self.capacity = self.lanes.capacity
        self.holdings = Holdings()
        self.triggers = ClaimTriggers(self.config.poll_interval_ms / 1000)
        self.time_limits = TimeLimits(
            self._time_limit_of, self.holdings.running_in, self.config.cancel_grace_s
        )
        self.stopping = asyncio.Event()  # a stop was requested: claim nothing more
        self.stopped = asyncio.Event()  # a second stop request: stop now
        self._signals = 0
        self._registered = False  # the registry row may exist: mark it stopped at the end
        self._claimed_any = False  # the first claim that returned tasks came back
        self._services: list[asyncio.Task[Any]] = []  # the background loops, from start to close
        # A pause's give-backs, each held until it is done (and waited for at close).
        self.give_backs = TaskSet("giving back a paused queue's tasks")
        self._closers: list[Callable[[], Awaitable[None] | None]] = []  # the services' connections
        self._sigterm_at = os.environ.get(SIGTERM_AT_ENV)
        # Set in run(), once the database is known:
        self.pool: WorkerPool | None = None
        self.recorder: Recorder | None = None
        self.claimer: Claimer | None = None
        self.dispatcher: Dispatcher | None = None
        self.isolation: Isolation | None = None
        self.supervisor: Supervisor | None = None
        self.cancels: Cancels | None = None

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    @property
    def tasks_done(self) -> int:
        return self.dispatcher.tasks_done if self.dispatcher is not None else 0

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
        try:
            await self._start(loop)
            if not self.stop_requested:
                assert self.claimer is not None
                await self.claimer.run()
            await self._drain()
        finally:
            await self._close()

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every step before the claim loop; returns early once a stop is requested."""
        await self._reached("begin")
        url = await asyncio.to_thread(lambda: self.app.broker.url)  # also migrates if behind
        config = self.app.config
        self.pool = pool = WorkerPool(url, config)
        await pool.open()
        self.recorder = Recorder(url, self.worker_id, config)
        self.dispatcher = Dispatcher(
            lanes=self.lanes,
            holdings=self.holdings,
            time_limits=self.time_limits,
            recorder=self.recorder,
            on_change=self.triggers.poke,
        )
        registration = NotifyRegistration(pool, self.worker_id, self.queues)
        self.claimer = Claimer(
            pool=pool,
            worker_id=self.worker_id,
            queues=self.queues,
            lanes=self.lanes,
            async_names=sorted(name for name, task in self.app.tasks.items() if task.is_async),
            batch_size=self.config.claim_batch_size,
            holdings=self.holdings,
            triggers=self.triggers,
            registration=registration,
            accept=self._accept,
            may_claim=lambda: self.isolation is None or not self.isolation.isolated,
        )
        if self.stop_requested:
            log.info("worker %s: stop requested before it registered; exiting", self.worker_id)
            return
        self._registered = True  # from here, _close marks the row stopped, even if this insert fails
        await pool.run("registering the worker", lambda c: workers.register_worker(c, self._registration()))
        await self._reached("registered")
        if self.stop_requested:
            return
        # Children start now (they run only what they are handed), so they are ready
        # by the time the first task is claimed.
        self.supervisor = self.dispatcher.supervisor = Supervisor(
            lanes=self.lanes,
            app_path=self.app_path,
            url=url,
            worker_id=self.worker_id,
            log_level=logging.getLogger().getEffectiveLevel(),
            on_message=self.dispatcher.on_message,
            on_exit=self.dispatcher.on_exit,
        )
        self.supervisor.start(loop)
        self.cancels = Cancels(self.holdings, self.supervisor, self._cancel_grace_of)
        await self._reached("children")
        if self.stop_requested:
            return
        await self._start_services(url, registration)
        await self._reached("services")
        if self.stop_requested:
            return
        # Before claiming anything: recover what dead workers on this host left behind.
        await asyncio.to_thread(reconcile_host, url, config, self.identity)
        await self._reached("reconciled")
        if self.stop_requested:
            return
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

    async def _start_services(self, url: str, registration: NotifyRegistration) -> None:
        """Heartbeat, isolation watch, reaper, scheduler and work listener; returns once the listener listens.

        The listener listens before startup reconciliation writes anything: a crash
        retry it schedules notifies its due time, and the timer set from that
        notification starts the retry on time instead of at the next poll.
        """
        assert self.supervisor is not None
        config = self.app.config
        every = interval_s(config.recovery)
        writer = HeartbeatWriter(url, config, self.worker_id, self.identity.hostname)
        self.isolation = Isolation(
            self.worker_id,
            self.holdings,
            self.supervisor,
            config.recovery.running_stale_threshold_ms / 1000,
            on_rejoin=self.triggers.work_may_wait,
        )
        reaper = Reaper(url, config, every)
        scheduler = Scheduler(url, config, self.queues, list(self.app.schedules.values()))
        listening = asyncio.Event()

        def on_listening() -> None:
            # Notifications sent while the listener was down are lost: look once, and
            # register as waiting again (the reaper may have removed the row meanwhile).
            listening.set()
            registration.forget()
            self.triggers.work_may_wait()
            scheduler.wake()

        self._services = [
            asyncio.create_task(
                listen_for_work(
                    url,
                    config,
                    set(self.queues),
                    self.triggers.on_notification,
                    on_listening,
                    scheduler.wake,
                    self._on_control,
                )
            ),
            asyncio.create_task(heartbeat_loop(self, writer, every)),
            asyncio.create_task(self.isolation.watch(lambda: writer.last_ok, every)),
            asyncio.create_task(reaper_loop(reaper)),
            asyncio.create_task(scheduler_loop(scheduler)),
        ]
        self._closers = [writer.close, reaper.close, scheduler.close]
        # Until the listener listens, or a stop is requested (nothing will be claimed then).
        waits = {asyncio.create_task(listening.wait()), asyncio.create_task(self.stopping.wait())}
        try:
            await asyncio.wait(
                waits, timeout=config.broker.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for wait in waits:
                wait.cancel()
        if not listening.is_set() and not self.stop_requested:
            log.warning(
                "work listener not connected after %.0fs; going on (the poll finds work meanwhile)",
                config.broker.connect_timeout_s,
            )

    def _registration(self) -> workers.Registration:
        me = self.identity
        return workers.Registration(
            worker_id=me.worker_id,
            hostname=me.hostname,
            pid=me.pid,
            process_started_at=me.process_started_at,
            host_key=me.host_key,
            queues=self.queues,
            processes=self.lanes.sync_processes,
            async_processes=self.lanes.async_processes,
            async_concurrency=self.lanes.async_concurrency if self.lanes.async_processes else None,
            version=__version__,
            task_names=sorted(self.app.tasks),
        )

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: stop now (running tasks are recorded as crashed)."""
        self._signals += 1
        if self._signals == 1:
            self.stopping.set()
            log.info(
                "worker %s stopping: no new claims; running tasks may finish within %.0fs",
                self.worker_id,
                self.config.grace_period_s,
            )
            if self.dispatcher is not None:
                self.dispatcher.stopping = True
            if self.claimer is not None:
                self.claimer.stop()
        else:
            log.warning("worker %s: second stop request, stopping now", self.worker_id)
            self.stopped.set()
            self.triggers.poke()

    async def _drain(self) -> None:
        """Give claimed-but-unstarted tasks back and let running ones finish within the grace period."""
        await self._release(self.holdings.let_go_unhanded())
        if self.dispatcher is None or self.supervisor is None:
            return  # stopped before its children were started
        self.dispatcher.stop_idle_children()
        try:
            await asyncio.wait_for(self._all_children_gone(), self.config.grace_period_s)
        except TimeoutError:
            log.warning(
                "grace period of %.0fs over: killing %d child(ren) still running",
                self.config.grace_period_s,
                len(self.supervisor.alive()),
            )
        await self.dispatcher.kill_children()

    async def _all_children_gone(self) -> None:
        """Until every child has exited, or a second stop request cuts the wait short."""
        assert self.dispatcher is not None and self.supervisor is not None
        if not self.supervisor.alive():
            return
        gone = asyncio.create_task(self.dispatcher.no_children.wait())
        now = asyncio.create_task(self.stopped.wait())
        try:
            await asyncio.wait({gone, now}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            now.cancel()

    async def _close(self) -> None:
        for task in self._services:
            task.cancel()
        await asyncio.gather(*self._services, return_exceptions=True)
        await self.give_backs.wait()  # released before the row says stopped
        if self.dispatcher is not None and self.supervisor is not None:
            self.dispatcher.stopping = True
            await self.dispatcher.kill_children()
        self.triggers.close()
        if self.pool is not None:
            if self._registered:
                try:
                    await self.pool.run(
                        "stopping the worker", lambda c: workers.stop_worker(c, self.worker_id)
                    )
                except DatabaseError as exc:
                    log.error("could not mark worker %s stopped: %s", self.worker_id, exc)
            await self.pool.close()
        if self.recorder is not None:
            self.recorder.close()
        for close in self._closers:
            result = close()
            if result is not None:
                await result
        log.info("worker %s stopped after %d task(s)", self.worker_id, self.tasks_done)

    # -- what the claim loop hands over -------------------------------------------------

    async def _accept(self, claimed: list[TaskPayload]) -> None:
        unknown = []
        for task in claimed:
            found = self.app.find_task(task.name)
            if found is None:
                unknown.append(task)
            else:
                self.holdings.take(task, self.lanes.kind_of(found.is_async))
        if self.dispatcher is not None:
            self.dispatcher.hand_out()
        if claimed and not self._claimed_any:
            self._claimed_any = True
            await self._reached("claimed")
        for task in unknown:
            await self._not_registered_here(task)

    async def _not_registered_here(self, task: TaskPayload) -> None:
        """A name this app lacks: give it back if another live worker knows it, else fail it."""
        assert self.recorder is not None and self.pool is not None and self.claimer is not None
        known = await self.pool.run(
            "looking up a task name",
            lambda c: workers.name_known_elsewhere(c, me=self.worker_id, name=task.name, queue=task.queue),
        )
        if known:
            # A rolling deploy: other workers run newer (or older) code. Let them have it.
            self.claimer.skip_name(task.name)
            log.info(
                "task %s: %r is not registered here but another worker knows it; releasing",
                task.id,
                task.name,
            )
            await self._release([task])
            return
        error = TaskError(
            ErrorCode.TASK_NOT_REGISTERED,
            f"no live worker serving queue {task.queue!r} has a task named {task.name!r} "
            f"(worker {self.worker_id} claimed it)",
        )
        outcome = outcomes.failure(error, task.retry_policy, task.retry_count)
        log.error("task %s: %s; failing it", task.id, error.message)
        await asyncio.to_thread(self.recorder.record_for, task, outcome, expect=TaskStatus.CLAIMED)

    async def _release(self, tasks: list[TaskPayload]) -> None:
        if not tasks:
            return
        assert self.recorder is not None
        released = await asyncio.to_thread(self.recorder.release, tasks)
        for task in tasks:
            self.holdings.forget(task.id)
        log.info("released %d claimed task(s) back to PENDING", len(released))

    # -- operators' requests (the tether_control channel) -------------------------------

    def _on_control(self, verb: str, arguments: list[str]) -> None:
        if verb == "pause" and len(arguments) == 1 and arguments[0] in self.queues:
            # Claimed tasks of the queue that no child has yet go back: a paused queue
            # starts nothing new here. What a child was already handed may still start.
            going = self.holdings.let_go_unhanded(arguments[0])
            if going:
                log.info("queue %s paused: giving back %d claimed task(s)", arguments[0], len(going))
                self.give_backs.start(self._release(going))
        elif verb == "resume" and len(arguments) == 1 and arguments[0] in self.queues:
            self.triggers.work_may_wait()
        elif verb == "cancel" and len(arguments) == 2 and arguments[0] == self.worker_id:
            if self.cancels is not None:
                self.cancels.request(arguments[1])
        elif verb not in ("pause", "resume", "cancel"):
            log.warning("unknown operator request %r %s on tether_control; ignored", verb, arguments)

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

    # -- what the heartbeat needs (heartbeat.BeatSource) -----------------------------------

    def collect(self) -> Beat:
        assert self.supervisor is not None
        recovery = self.app.config.recovery
        # A child whose heartbeat thread went silent past the running threshold is hung.
        self.supervisor.kill_hung(
            recovery.running_stale_threshold_ms / 1000,
            lambda slot: [] if self.holdings.frozen(slot) else self.holdings.running_in(slot),
        )
        fresh_within = 2 * recovery.runner_heartbeat_interval_ms / 1000
        supervisor, slots = self.supervisor, {slot.index: slot for slot in self.supervisor.alive()}

        def runner_pid(index: int) -> int | None:
            """The child's pid if its runner heartbeat may be relayed: stamped in time, or frozen."""
            slot = slots[index]
            fresh = self.holdings.frozen(index) or supervisor.stamp_age(slot) <= fresh_within
            return slot.pid if fresh else None

        return self.holdings.beat(os.getpid(), slots, runner_pid)

    def answered(self, answer: BeatAnswer) -> None:
        assert self.isolation is not None
        lost = set(answer.lost)
        if self.isolation.isolated:
            self.isolation.rejoin(lost)
        if self.cancels is not None:
            for task_id in answer.cancel_requested:  # a tether_control notification may have been missed
                self.cancels.request(task_id)
        if lost:
            for task_id in self.holdings.lose(lost):
                log.warning(
                    "task %s is no longer held by worker %s (recovered or cancelled elsewhere); "
                    "its outcome here will not be recorded",
                    task_id,
                    self.worker_id,
                )


def run_worker(app: Tether, app_path: str, config: WorkerConfig | None = None) -> None:
    asyncio.run(Worker(app, app_path, config).run())


__all__ = ["Worker", "run_worker"]
