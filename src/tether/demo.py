"""``tether demo``: the main job on the embedded database, end to end, as a new user sees it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from uuid import UUID

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tether import AppConfig, TaskError, TaskResult, Tether
from tether.config import mask_url
from tether.db.connection import resolve_database_url

app = Tether(AppConfig(queues=["default", "images"]))


@app.task("demo.resize", queue="images")
def resize(image_id: int, width: int) -> TaskResult[str, TaskError]:
    """Pretend to resize an image: a few milliseconds of work."""
    time.sleep(random.uniform(0.001, 0.01))
    return TaskResult(ok=f"s3://demo-bucket/{image_id}-{width}w.jpg")


def run_demo(console: Console, *, count: int, processes: int) -> int:
    console.rule("[bold]tether demo")
    console.print(
        "1. Finding the database (the embedded PostgreSQL starts on first use and is reused after)..."
    )
    url = resolve_database_url(app.config.broker)
    console.print(f"   database: {mask_url(url)}")
    app.broker.url  # noqa: B018 - resolve and migrate the schema now, not inside the progress bar

    console.print(f"2. Starting a worker with {processes} child processes...")
    env = {**os.environ, "TETHER_DATABASE_URL": url}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tether",
            "--log-level",
            "WARNING",
            "worker",
            "tether.demo:app",
            "--processes",
            str(processes),
            "--grace-period",
            "10",
        ],
        env=env,
    )
    try:
        worker_id = _wait_for_worker(worker, timeout=60)
        console.print(f"   worker {worker_id} is up (pid {worker.pid})")

        console.print(f"3. Sending {count} tasks in one round trip (send_many)...")
        started = time.monotonic()
        handles = resize.send_many([(i,) for i in range(count)], width=640)
        ids = [h.id for h in handles]
        done = _watch(console, ids, count, worker)
        elapsed = time.monotonic() - started

        counts = {r["status"]: r["n"] for r in app.broker.fetchall("count_status_of", {"ids": ids})}
        table = Table(title="Outcome", title_justify="left")
        table.add_column("status")
        table.add_column("tasks", justify="right")
        for status, n in sorted(counts.items()):
            table.add_row(status, str(n))
        console.print(table)
        sample = handles[0].get(timeout=5)
        console.print(f"   first result: {sample.ok if sample.is_ok else sample.err}")
        console.print(f"   {done} tasks completed in {elapsed:.2f}s ({done / elapsed:.0f} tasks/s)")
    finally:
        console.print("4. Stopping the worker (SIGTERM: finish running tasks, release the rest)...")
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        console.print(f"   worker exited with code {worker.returncode}")
        app.close()
    ok = counts.get("COMPLETED", 0) == count and worker.returncode == 0
    console.rule("[green]demo finished" if ok else "[red]demo failed")
    return 0 if ok else 1


def _wait_for_worker(worker: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    hostname = socket.gethostname()
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise RuntimeError(f"the demo worker exited early with code {worker.returncode}")
        row = app.broker.fetchone("find_worker_by_pid", {"pid": worker.pid, "hostname": hostname})
        if row:
            return str(row["id"])
        time.sleep(0.1)
    raise RuntimeError(f"the demo worker did not register within {timeout:.0f}s")


def _watch(console: Console, ids: list[UUID], count: int, worker: subprocess.Popen[bytes]) -> int:
    columns = (TextColumn("   running"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("tasks", total=count)
        finished = 0
        deadline = time.monotonic() + 120
        while finished < count and time.monotonic() < deadline and worker.poll() is None:
            rows = app.broker.fetchall("count_status_of", {"ids": ids})
            finished = sum(r["n"] for r in rows if r["status"] in ("COMPLETED", "FAILED"))
            progress.update(bar, completed=finished)
            time.sleep(0.1)
    return finished
