"""The worker's main process: claim tasks, hand them to children, keep the books, shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from tether import __version__, outcomes
from tether.app import Tether
from tether.broker.broker import check_if_idle_async, pooled_async
from tether.broker.queries import q
from tether.config import WorkerConfig
from tether.db.connection import worker_session_options
from tether.result import ErrorCode, TaskError
from tether.worker import protocol
from tether.worker.heartbeat import HeartbeatWriter, fence_watch, heartbeat_loop
from tether.worker.heartbeat import interval_s as heartbeat_interval_s
from tether.worker.identity import Identity, current_identity
from tether.worker.listener import listen_for_work
from tether.worker.protocol import TaskPayload
from tether.worker.reaper import Reaper, reaper_loop
from tether.worker.reconcile import reconcile_host
from tether.worker.recorder import Recorder
from tether.worker.supervisor import ChildSlot, Supervisor
from tether.worker.time_limits import TimeLimits
from tether.worker.waiting import WaitRegistration
from tether.worker.wakeups import Wakeups

log = logging.getLogger("tether.worker")

SKIP_NAME_FOR_S = 30.0
# Tasks handed to a busy child ahead of time (see _dispatch).
PUSH_AHEAD = 2


class Worker:
    def __init__(self, app: Tether, app_path: str, config: WorkerConfig | None = None) -> None:
        self.app = app
        self.app_path = app_path
        self.config = config or app.config.worker
        self.queues = list(self.config.queues or app.config.queues)
        unknown = sorted(set(self.queues) - set(app.config.queues))
        if unknown:
            from tether.errors import UnknownQueueError

            raise UnknownQueueError(
                f"--queues names undeclared queue(s) {', '.join(unknown)}; "
                f"declared queues: {', '.join(app.config.queues)}"
            )
        self.identity: Identity = current_identity()
        self.capacity = self.config.processes + self.config.effective_prefetch
        self.buffer: deque[TaskPayload] = deque()  # claimed, not yet handed to a child
        self.inflight: dict[str, TaskPayload] = {}  # claimed by us and not yet recorded
        self.stopping = False
        self.stopped = asyncio.Event()
        self.wakeups = Wakeups(self.config.poll_interval_ms / 1000)
        self._background: list[asyncio.Task[Any]] = []
        self._signals = 0
        self.supervisor: Supervisor | None = None
        self.time_limits = TimeLimits(self._time_limit_of)
        self.pool: AsyncConnectionPool[psycopg.AsyncConnection[dict[str, Any]]] | None = None
        self.recorder: Recorder | None = None
        self.reaper: Reaper | None = None
        self.heartbeat: HeartbeatWriter | None = None
        self.waiting: WaitRegistration | None = None
        self.fenced = False
        # Names this worker cannot run but another live worker can: not claimed for a while.
        self._skip_names: dict[str, float] = {}
        self.tasks_done = 0
        self._no_children = asyncio.Event()
        self._recording: set[asyncio.Task[None]] = set()

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    # -- lifecycle -----------------------------------------------------------------

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        loop = asyncio.get_running_loop()
        url = await asyncio.to_thread(lambda: self.app.broker.url)  # also migrates if behind
        bcfg = self.app.config.broker
        self.pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=3,
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                "application_name": "tether-worker",
                **worker_session_options(self.app.config.recovery),
            },
            timeout=bcfg.connect_timeout_s,
            name="tether-worker",
            open=False,
            check=check_if_idle_async,
        )
        await self.pool.open(wait=True, timeout=bcfg.connect_timeout_s)
        self.waiting = WaitRegistration(self.pool, self.worker_id, self.queues)
        session = worker_session_options(self.app.config.recovery)
        self.recorder = Recorder(
            url, self.worker_id, connect_timeout=max(1, round(bcfg.connect_timeout_s)), session=session
        )
        self.reaper = Reaper(url, self.app.config.recovery, heartbeat_interval_s(self))
        self.heartbeat = HeartbeatWriter(url, self.app.config, session)
        await self._execute(
            "register_worker",
            {
                "id": self.worker_id,
                "hostname": self.identity.hostname,
                "pid": self.identity.pid,
                "process_started_at": self.identity.process_started_at,
                "queues": self.queues,
                "processes": self.config.processes,
                "version": __version__,
                "task_names": sorted(self.app.tasks),
                "host_key": self.identity.host_key,
            },
        )
        try:
            if install_signal_handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self.request_stop)
            self.supervisor = Supervisor(
                processes=self.config.processes,
                app_path=self.app_path,
                url=url,
                worker_id=self.worker_id,
                log_level=logging.getLogger().getEffectiveLevel(),
                on_message=self._on_message,
                on_exit=self._on_child_exit,
            )
            # Children start now (they run only what they are handed), so they are ready
            # by the time the first task is claimed.
            self.supervisor.start(loop)
            # The listener listens before startup reconciliation writes anything: a crash
            # retry it schedules notifies its due time, and the timer set from that
            # notification starts the retry on time instead of at the next poll.
            listening = asyncio.Event()

            def on_listening() -> None:
                listening.set()
                self._on_listening()

            self._background = [
                asyncio.create_task(
                    listen_for_work(url, bcfg, set(self.queues), self.wakeups.on_notification, on_listening)
                ),
                asyncio.create_task(heartbeat_loop(self, self.heartbeat)),
                asyncio.create_task(fence_watch(self, self.heartbeat)),
                asyncio.create_task(reaper_loop(self.reaper)),
            ]
            try:
                await asyncio.wait_for(listening.wait(), bcfg.connect_timeout_s)
            except TimeoutError:
                log.warning(
                    "work listener not connected after %.0fs; going on (the poll finds work meanwhile)",
                    bcfg.connect_timeout_s,
                )
            # Before claiming anything: recover what dead workers on this host left behind.
            await asyncio.to_thread(reconcile_host, url, self.identity)
            log.info(
                "worker %s started: queues=%s processes=%d prefetch=%d",
                self.worker_id,
                ",".join(self.queues),
                self.config.processes,
                self.config.effective_prefetch,
            )
            await self._claim_loop()
            await self._drain()
        finally:
            await self._close()

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: stop now (running tasks are recorded as crashed)."""
        self._signals += 1
        if self._signals == 1:
            log.info(
                "worker %s stopping: no new claims; running tasks may finish within %.0fs",
                self.worker_id,
                self.config.grace_period_s,
            )
            self.stopping = True
            self.wakeups.poke()
        else:
            log.warning("worker %s: second stop request, stopping now", self.worker_id)
            self.stopped.set()
            self.wakeups.poke()

    async def _drain(self) -> None:
        """Give claimed-but-unstarted tasks back and let running ones finish within the grace period."""
        await self._release(list(self.buffer))
        self.buffer.clear()
        assert self.supervisor is not None
        for slot in self.supervisor.alive():
            if slot.idle:
                self.supervisor.send(slot, protocol.STOP)
        try:
            await asyncio.wait_for(self._all_children_gone(), self.config.grace_period_s)
        except TimeoutError:
            log.warning(
                "grace period of %.0fs over: killing %d child(ren) still running",
                self.config.grace_period_s,
                len(self.supervisor.alive()),
            )
        await self._kill_children()

    async def _all_children_gone(self) -> None:
        """Until every child has exited, or a second stop request cuts the wait short."""
        assert self.supervisor is not None
        if not self.supervisor.alive():
            return
        gone = asyncio.create_task(self._no_children.wait())
        now = asyncio.create_task(self.stopped.wait())
        try:
            await asyncio.wait({gone, now}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            now.cancel()

    async def _kill_children(self) -> None:
        assert self.supervisor is not None
        if self.supervisor.alive():
            self.supervisor.kill_all()
            await self._no_children.wait()
        # A killed child's tasks are being recorded (crashed or released): let that finish.
        if self._recording:
            await asyncio.gather(*self._recording, return_exceptions=True)

    async def _close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.supervisor is not None:
            await self._kill_children()
        self.wakeups.close()
        try:
            await self._execute("stop_worker", {"id": self.worker_id})
        except psycopg.Error as exc:
            log.error("could not mark worker %s stopped: %s", self.worker_id, exc)
        if self.pool is not None:
            await self.pool.close()
        if self.recorder is not None:
            self.recorder.close()
        if self.reaper is not None:
            self.reaper.close()
        if self.heartbeat is not None:
            await self.heartbeat.close()
        log.info("worker %s stopped after %d task(s)", self.worker_id, self.tasks_done)

    # -- claiming ----------------------------------------------------------------

    async def _claim_loop(self) -> None:
        backoff = 0.1
        while not self.stopping:
            free = self.capacity - len(self.inflight)
            # While claimed tasks still wait in the buffer, wait until half the capacity
            # is free and claim it in one statement (one commit per batch, not per task);
            # with nothing waiting, claim at once whatever fits.
            enough = 1 if not self.buffer else max(1, self.capacity // 2)
            if free >= enough and self.wakeups.maybe_more and not self.fenced:
                limit = min(free, self.config.claim_batch_size)
                told = self.wakeups.before_claim()
                try:
                    rows = await self._fetch(
                        "claim_tasks",
                        {
                            "queues": self.queues,
                            "limit": limit,
                            "worker_id": self.worker_id,
                            "skip_names": self._names_to_skip(),
                        },
                    )
                    backoff = 0.1
                except psycopg.Error as exc:
                    self.wakeups.claim_failed()
                    log.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                self.wakeups.after_claim(len(rows), limit, told)
                await self._accept([TaskPayload.from_row(r) for r in rows])
                assert self.waiting is not None
                if await self.waiting.after_claim(len(rows), limit):
                    self.wakeups.work_may_wait()  # just registered: look once more (see waiting.py)
                continue
            await self.wakeups.sleep()

    async def _accept(self, claimed: list[TaskPayload]) -> None:
        unknown = []
        for task in claimed:
            held = self.inflight.get(task.id)
            if held is not None and held.attempt == task.attempt:
                # Only after a database crash lost our claim of it (claims do not wait for
                # the flush) and this worker claimed it again: the copy held is the same
                # attempt, and a second copy would fail its start and unbalance the count.
                log.warning(
                    "task %s attempt %d claimed again while held here; keeping one", task.id, task.attempt
                )
                continue
            if task.name in self.app.tasks:
                self.inflight[task.id] = task
                self.buffer.append(task)
            else:
                unknown.append(task)
        self._dispatch()
        for task in unknown:
            await self._not_registered_here(task)

    def _names_to_skip(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, until in self._skip_names.items() if until <= now]:
            del self._skip_names[name]
        return list(self._skip_names)

    # -- fencing ------------------------------------------------------------------------

    def fence(self, silent_s: float) -> None:
        """No heartbeat reached the database for nearly the running stale threshold.

        A reaper elsewhere may soon declare this worker dead and recover its tasks,
        so their code must not go on here: the children holding tasks are frozen
        (SIGSTOP), what is claimed but not started is dropped, nothing is claimed.
        Frozen, not killed: when the database answers again, tasks still ours
        resume and only those recovered elsewhere are killed (see unfence), so a
        database restart or a network blip does not turn running tasks into crashes.
        """
        self.fenced = True
        frozen = 0
        if self.supervisor is not None:
            for slot in self.supervisor.alive():
                if (slot.current is not None or slot.queued) and slot.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(slot.pid, signal.SIGSTOP)
                        slot.frozen = True
                        frozen += 1
        log.error(
            "worker %s could not write a heartbeat for %.1fs (running stale threshold %.1fs): "
            "fencing itself off: %d child(ren) frozen, %d claimed task(s) dropped, claiming nothing",
            self.worker_id,
            silent_s,
            self.app.config.recovery.running_stale_threshold_ms / 1000,
            frozen,
            len(self.buffer),
        )
        for task in self.buffer:
            self.inflight.pop(task.id, None)
        self.buffer.clear()

    def unfence(self, lost: set[str]) -> None:
        """A heartbeat got through: resume the frozen children whose tasks are still ours."""
        self.fenced = False
        resumed = killed = 0
        if self.supervisor is not None:
            for slot in self.supervisor.alive():
                if not slot.frozen:
                    continue
                slot.frozen = False
                if any(t.id in lost for t in slot.held()):
                    slot.process.kill()  # its task was recovered elsewhere: never resume that code
                    killed += 1
                else:
                    self.supervisor.stamps[slot.index] = time.monotonic()
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(slot.process.pid or 0, signal.SIGCONT)
                    resumed += 1
        self.wakeups.work_may_wait()
        log.warning(
            "worker %s: heartbeats get through again; %d child(ren) resumed, %d killed "
            "(their tasks were recovered elsewhere); claiming resumes",
            self.worker_id,
            resumed,
            killed,
        )

    def on_lost(self, lost: set[str]) -> None:
        """Tasks this worker holds that the database says are no longer its own."""
        dropped = [t for t in self.buffer if t.id in lost]
        for task in dropped:
            self.buffer.remove(task)
            self.inflight.pop(task.id, None)
        for task_id in lost:
            if task_id in self.inflight:
                log.warning(
                    "task %s is no longer held by worker %s (recovered or cancelled elsewhere); "
                    "its outcome here will not be recorded",
                    task_id,
                    self.worker_id,
                )

    def _dispatch(self) -> None:
        if self.supervisor is None:
            return
        for slot in self.supervisor.alive():
            if not self.buffer or self.stopping:
                return
            if slot.idle:
                task = self.buffer.popleft()
                slot.current = task
                if not self.supervisor.send(slot, protocol.RUN, task=task):
                    slot.current = None
                    self.buffer.appendleft(task)
        # Every child is busy and work is waiting: hand each busy child its next tasks
        # now (PUSH_AHEAD of them, one round of children at a time), so it need not ask
        # and wait for them. With two, the next-but-one is already in the child's pipe
        # when it finishes a short task: the main process's answer is off the child's
        # path. They wait behind the child's current task: that is what prefetch means
        # (--prefetch 0 for long or uneven tasks).
        children = self.supervisor.alive()
        if len(children) < self.config.processes or any(not s.ready or s.current is None for s in children):
            return  # a child is starting, restarting or free: it will take the work itself
        for depth in range(1, PUSH_AHEAD + 1):
            for slot in children:
                if not self.buffer or self.stopping:
                    return
                if len(slot.queued) < depth:
                    task = self.buffer.popleft()
                    if self.supervisor.send(slot, protocol.RUN, task=task):
                        slot.queued.append(task)
                    else:
                        self.buffer.appendleft(task)

    def _on_listening(self) -> None:
        # Notifications sent while the listener was down are lost: look once, and
        # register as waiting again (the reaper may have removed the row meanwhile).
        if self.waiting is not None:
            self.waiting.forget()
        self.wakeups.work_may_wait()

    # -- children --------------------------------------------------------------------

    def _on_message(self, slot: ChildSlot, msg: dict[str, Any]) -> None:
        assert self.supervisor is not None
        op = msg["op"]
        if op == protocol.READY:
            slot.ready = True
            if self.stopping:
                self.supervisor.send(slot, protocol.STOP)
        elif op == protocol.STARTED:
            if msg["lost"]:
                self.inflight.pop(msg["id"], None)
                slot.current = None
            else:
                slot.running = True
                self.time_limits.started(slot)
        elif op == protocol.NEXT:
            if slot.queued:
                pass  # a RUN pushed to this child already answers its question
            elif self.stopping:
                self.supervisor.send(slot, protocol.STOP)
            elif self.buffer:
                slot.queued.append(self.buffer.popleft())
                self.supervisor.send(slot, protocol.RUN, task=slot.queued[0])
            else:
                self.supervisor.send(slot, protocol.NONE)
        elif op == protocol.DONE:
            self.inflight.pop(msg["id"], None)
            self.tasks_done += 1
            self.time_limits.finished(slot)
            slot.current = None
            slot.running = False
            if msg["next_id"] is not None:
                # The child took the oldest task handed to it, started or found lost.
                taken = slot.queued.popleft()
                if msg["next_lost"]:
                    self.inflight.pop(taken.id, None)
                else:
                    slot.current = taken
                    slot.running = True
                    self.time_limits.started(slot)
            if slot.current is None and slot.queued:
                # The child has nothing running and will read the next RUN in its pipe
                # as a fresh task, reporting STARTED for it.
                slot.current = slot.queued.popleft()
            if self.stopping and slot.current is None:
                self.supervisor.send(slot, protocol.STOP)
        self._dispatch()
        self.wakeups.poke()  # a slot may have freed up

    def _on_child_exit(self, slot: ChildSlot, code: int | None) -> None:
        self.time_limits.finished(slot)
        held = slot.held()
        if held or not self.stopping:
            log.error(
                "child %d (pid %s) exited with code %s holding %d task(s)",
                slot.index,
                slot.pid,
                code,
                len(held),
            )
        if held:
            recording = asyncio.get_running_loop().create_task(self._record_crash(held, slot.killed_for))
            self._recording.add(recording)
            recording.add_done_callback(self._recording.discard)
        if not self.stopping and self.supervisor is not None:
            self.supervisor.spawn(slot.index)
        elif self.supervisor is not None and not self.supervisor.alive():
            self._no_children.set()

    async def _record_crash(self, held: list[TaskPayload], killed_for: TaskError | None) -> None:
        """The child died: its started task failed, an unstarted one never ran and goes back.

        killed_for: the worker killed it (its time limit passed); else it crashed.
        """
        for task in held:
            try:
                verdict = await asyncio.to_thread(self._record_crash_sync, task, killed_for)
            except psycopg.Error as exc:
                # The database stayed away longer than the recorder retries: the reaper
                # (here or elsewhere) recovers the task by its heartbeats instead.
                verdict = f"could not be recorded ({exc}); the reaper will recover it when it turns stale"
            self.inflight.pop(task.id, None)
            log.warning("task %s (%s) attempt %d: %s", task.id, task.name, task.attempt, verdict)
        self.wakeups.poke()

    def _record_crash_sync(self, task: TaskPayload, killed_for: TaskError | None) -> str:
        assert self.recorder is not None
        if killed_for is not None:
            outcome = outcomes.failure(killed_for, task.retry_policy, task.retry_count)
        else:
            outcome = outcomes.crashed(
                task.retry_policy, task.retry_count, "the worker process running this task died"
            )
        code = outcome.error_code
        if self.recorder.record_for(task, outcome, expect="RUNNING"):
            return f"retry scheduled after {code}" if outcome.will_retry else f"FAILED with {code}"
        if self.recorder.release([task]):
            return "released back to PENDING (its code never started)"
        return "already settled elsewhere"

    def _time_limit_of(self, name: str) -> float | None:
        task = self.app.tasks.get(name)
        return task.time_limit if task is not None else None

    # -- database helpers ---------------------------------------------------------------

    async def _not_registered_here(self, task: TaskPayload) -> None:
        """A name this app lacks: give it back if another live worker knows it, else fail it."""
        assert self.recorder is not None
        known = await self.fetchone(
            "name_known_elsewhere", {"me": self.worker_id, "name": task.name, "queue": task.queue}
        )
        if known and known["known"]:
            # A rolling deploy: other workers run newer (or older) code. Let them have it.
            self._skip_names[task.name] = time.monotonic() + SKIP_NAME_FOR_S
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
        await asyncio.to_thread(self.recorder.record_for, task, outcome, expect="CLAIMED")

    async def _release(self, tasks: list[TaskPayload]) -> None:
        if not tasks:
            return
        assert self.recorder is not None
        n = await asyncio.to_thread(self.recorder.release, tasks)
        for task in tasks:
            self.inflight.pop(task.id, None)
        log.info("released %d claimed task(s) back to PENDING", n)

    async def fetchone(self, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
        rows = await self._fetch(name, params)
        return rows[0] if rows else None

    async def _fetch(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        assert self.pool is not None
        async with pooled_async(self.pool) as conn:
            cur = await conn.execute(q(name), params)
            return await cur.fetchall()

    async def _execute(self, name: str, params: dict[str, Any]) -> None:
        assert self.pool is not None
        async with pooled_async(self.pool) as conn:
            await conn.execute(q(name), params)


def run_worker(app: Tether, app_path: str, config: WorkerConfig | None = None) -> None:
    asyncio.run(Worker(app, app_path, config).run())


__all__ = ["Worker", "run_worker"]
