"""``tether demo``: the main job on the embedded database, end to end, as a new user sees it.

It starts a worker, sends a batch with a progress bar, then shows why tether
exists: it starts a second worker, kills the first one (SIGKILL to its whole
process group) while it runs two tasks, and prints their recovery as it
happens: one task retried on the survivor (its policy allows crash retries),
one FAILED with WORKER_CRASHED (its policy does not). The retried task is the
middle step of a workflow, which then carries on to its last step.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from uuid import UUID

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tether import (
    AppConfig,
    ErrorCode,
    RetryPolicy,
    TaskError,
    TaskInfo,
    TaskResult,
    TaskStatus,
    Tether,
    WorkflowHandle,
)
from tether.broker.tasks import count_status_of, database_now, find_worker_by_pid
from tether.broker.workers import list_workers
from tether.config import mask_url
from tether.db.connection import resolve_database_url
from tether.errors import TaskNotFoundError

app = Tether(AppConfig(queues=["default", "images"]))

# Short heartbeats so the demo's recovery takes seconds, not the production default of minutes.
RECOVERY_ENV = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
    "TETHER_CHECK_INTERVAL_MS": "1000",
}


@app.task("demo.resize", queue="images")
def resize(image_id: int, width: int) -> TaskResult[str, TaskError]:
    """Pretend to resize an image: a few milliseconds of work."""
    time.sleep(random.uniform(0.001, 0.01))
    return TaskResult(ok=f"s3://demo-bucket/{image_id}-{width}w.jpg")


@app.task(
    "demo.render",
    retry_policy=RetryPolicy.fixed(0.5, max_retries=2, auto_retry_for=[ErrorCode.WORKER_CRASHED]),
)
def render(frames: int) -> TaskResult[str, TaskError]:
    """Slow, and safe to run again: crash retries allowed."""
    time.sleep(frames * 0.1)
    return TaskResult(ok=f"rendered {frames} frames")


@app.task("demo.plan")
def plan(scenes: int) -> TaskResult[int, TaskError]:
    """First step of the demo workflow: decide how many frames to render."""
    return TaskResult(ok=scenes * 10)


@app.task("demo.publish")
def publish(video: str) -> TaskResult[str, TaskError]:
    """Last step of the demo workflow: runs once the render step has succeeded."""
    return TaskResult(ok=f"published ({video})")


@app.task("demo.charge")
def charge(amount_cents: int) -> TaskResult[str, TaskError]:
    """Slow, and NOT safe to run twice (no crash retries): a crash must surface, not repeat."""
    time.sleep(30)
    return TaskResult(ok=f"charged {amount_cents}")


class DemoFailed(Exception):
    pass


def run_demo(console: Console, *, count: int, processes: int) -> int:
    console.rule("[bold]tether demo")
    console.print(
        "1. Finding the database (the embedded PostgreSQL starts on first use and is reused after)..."
    )
    url = resolve_database_url(app.config.broker)
    console.print(f"   database: {mask_url(url)}")
    app.broker.url  # noqa: B018 - resolve and migrate the schema now, not inside the progress bar
    workers: list[subprocess.Popen[bytes]] = []
    ok = False
    try:
        console.print(f"2. Starting worker A with {processes} child processes...")
        a = _start_worker(url, processes, workers)
        a_id = _wait_for_worker(a, timeout=60)
        console.print(f"   worker A = {a_id} (pid {a.pid})")
        ok = _batch(console, count, a) and _crash(console, url, processes, workers, a, a_id)
    except DemoFailed as exc:
        console.print(f"[red]   {exc}[/red]")
    finally:
        console.print("6. Stopping the workers (SIGTERM: finish running tasks, release the rest)...")
        for proc in workers:
            _stop(proc)
        app.close()
    console.rule("[green]demo finished" if ok else "[red]demo failed")
    return 0 if ok else 1


def _batch(console: Console, count: int, worker: subprocess.Popen[bytes]) -> bool:
    console.print(f"3. Sending {count} tasks in one round trip (send_many)...")
    started = time.monotonic()
    handles = resize.send_many([(i,) for i in range(count)], width=640)
    ids = [h.id for h in handles]
    done = _watch(console, ids, count, worker)
    elapsed = time.monotonic() - started
    counts = app.broker.run(lambda conn: count_status_of(conn, ids))
    sample = handles[0].get(timeout=5)
    console.print(f"   first result: {sample.ok if sample.is_ok else sample.err}")
    shown = {status.value: n for status, n in counts.items()}
    console.print(f"   {done} of {count} finished in {elapsed:.2f}s (workers still warming up): {shown}")
    return counts.get(TaskStatus.COMPLETED, 0) == count


def _crash(
    console: Console,
    url: str,
    processes: int,
    workers: list[subprocess.Popen[bytes]],
    a: subprocess.Popen[bytes],
    a_id: str,
) -> bool:
    console.print(
        "4. Worker A takes two slow tasks: demo.render, the middle step of the workflow\n"
        "   plan -> render -> publish (crash retries allowed), and demo.charge (not)..."
    )
    planned = plan.node(args=(4,), name="plan")
    rendered = render.node(args_from={"frames": planned}, name="render")
    published = publish.node(args_from={"video": rendered}, name="publish")
    flow = app.workflow("demo.video", [planned, rendered, published]).start()
    tasks = {"demo.render": flow.task("render"), "demo.charge": charge.send(1999)}
    _until(lambda: all(_running_on(h.info, a_id) for h in tasks.values()), 20, "both tasks RUNNING on A")
    console.print("   starting worker B, then killing worker A (SIGKILL to its process group) mid-task...")
    b = _start_worker(url, processes, workers)
    b_id = _wait_for_worker(b, timeout=60)
    console.print(f"   worker B = {b_id} (pid {b.pid})")
    seen: dict[str, str] = {}
    for name, handle in tasks.items():
        info = handle.info()
        seen[name] = _state(info)
        console.print(f"   before the kill: {name:12s} {seen[name]}")
    killed_at = app.broker.run(database_now)
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    console.print("5. Recovery, as the database sees it (times from the kill):")
    deadline = time.monotonic() + 30
    finished = False
    while not finished and time.monotonic() < deadline:
        finished = True
        for name, handle in tasks.items():
            info = handle.info()
            finished = finished and info.status.is_terminal
            state = _state(info)
            if seen.get(name) != state:
                seen[name] = state
                after = (info.updated_at - killed_at).total_seconds()
                console.print(f"   +{after:5.2f}s  {name:12s} {state}{_why(info)}")
        time.sleep(0.05)
    render_result = tasks["demo.render"].get(timeout=1)
    charge_result = tasks["demo.charge"].get(timeout=1)
    console.print(f"   demo.render: {render_result.ok if render_result.is_ok else render_result.err}")
    console.print(f"   demo.charge: {charge_result.err if charge_result.is_err else charge_result.ok}")
    flow_ok = _workflow_outcome(console, flow)
    # The reaper marks a silent worker inactive after three missed heartbeats: usually before
    # the workflow ends, but not always on a busy machine, and the demo ends with no worker
    # left active.
    _until(lambda: _status_of(a_id) == "inactive", 20, "worker A to be marked inactive")
    console.print("   worker A: inactive (the reaper saw three heartbeats missed)")
    charge_err = charge_result.err
    return (
        render_result.is_ok
        and flow_ok
        and charge_err is not None
        and charge_err.code == ErrorCode.WORKER_CRASHED
    )


def _status_of(worker_id: str) -> str | None:
    rows = app.broker.run(lambda conn: list_workers(conn, include_inactive=True, limit=100))
    return next((w.status for w in rows if w.id == worker_id), None)


def _running_on(info: Callable[[], TaskInfo], worker_id: str) -> bool:
    try:
        now = info()
    except TaskNotFoundError:  # a workflow step's task exists once its dependencies are done
        return False
    return now.status is TaskStatus.RUNNING and now.claimed_by_worker_id == worker_id


def _workflow_outcome(console: Console, flow: WorkflowHandle) -> bool:
    result = flow.get(timeout=20)
    steps = ", ".join(f"{s.name} {s.status.value}" for s in flow.info().steps)
    console.print(f"   workflow demo.video: {flow.status().value} ({steps})")
    console.print(f"   its result: {result.ok if result.is_ok else result.err}")
    return result.is_ok


def _state(info: TaskInfo) -> str:
    return f"{info.status.value} (attempt {info.attempt}, worker {info.claimed_by_worker_id or '-'})"


def _why(info: TaskInfo) -> str:
    attempts = info.attempts
    if info.status not in (TaskStatus.PENDING, TaskStatus.FAILED) or not attempts:
        return ""
    if attempts[-1].error_code != ErrorCode.WORKER_CRASHED:
        return ""
    last = attempts[-1]
    rule = "retry scheduled" if last.will_retry else TaskStatus.FAILED.value
    return f"  <- {rule}: {last.error_message}"


def _start_worker(
    url: str, processes: int, workers: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TETHER_DATABASE_URL": url, **RECOVERY_ENV}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tether",
            "--log-level",
            "ERROR",
            "worker",
            "tether.demo:app",
            "--processes",
            str(processes),
            "--grace-period",
            "10",
        ],
        env=env,
        start_new_session=True,  # its own process group: the demo kills it whole
    )
    workers.append(proc)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise DemoFailed(f"timed out waiting for {what}")


def _wait_for_worker(worker: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    hostname = socket.gethostname()
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise DemoFailed(f"a demo worker exited early with code {worker.returncode}")
        worker_id = app.broker.run(lambda conn: find_worker_by_pid(conn, pid=worker.pid, hostname=hostname))
        if worker_id is not None:
            return worker_id
        time.sleep(0.1)
    raise DemoFailed(f"a demo worker did not register within {timeout:.0f}s")


def _watch(console: Console, ids: list[UUID], count: int, worker: subprocess.Popen[bytes]) -> int:
    columns = (TextColumn("   running"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("tasks", total=count)
        finished = 0
        deadline = time.monotonic() + 120
        while finished < count and time.monotonic() < deadline and worker.poll() is None:
            counts = app.broker.run(lambda conn: count_status_of(conn, ids))
            finished = counts.get(TaskStatus.COMPLETED, 0) + counts.get(TaskStatus.FAILED, 0)
            progress.update(bar, completed=finished)
            time.sleep(0.1)
    return finished
