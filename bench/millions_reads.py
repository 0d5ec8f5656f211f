"""The `millions` scenario's reads: what operators run against a large database, timed.

- commands: real ``python -m tether status`` / ``tasks`` / ... processes, wall time from
  ``Popen`` to exit; the same commands against the small reference database give what a
  process costs without the data (interpreter, imports, connection);
- server side: the broker calls behind those commands, in this process (a connection already
  open), so the figure is the queries and their round trips only;
- dashboard: a real ``tether dashboard`` process, every page's JSON fetched over HTTP.

Each figure is the median of ``repeat`` runs (the first run of each, which reads cold
pages into the cache, is run once untimed first).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import REPO

from bench.infra import connect_dict
from tether.broker import PostgresBroker, browse, tasks, workers, workflows
from tether.broker.status import status_snapshot
from tether.config import PostgresConfig
from tether.queue_control import list_queues
from tether.result import TaskStatus

STALE_MS = 300_000  # tether's default running threshold


@dataclass
class Timing:
    """One thing timed: its label, the median and every run, in ms; what it answered."""

    label: str
    runs_ms: list[float]
    note: str = ""
    reference_ms: float | None = None  # the same against the small database (commands)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.runs_ms)

    def line(self) -> str:
        if self.reference_ms is not None:  # a command: its fastest run beside the small database's
            shown = min(self.runs_ms)
            ref = (
                f" fastest (small database: {self.reference_ms:.0f} ms: +{shown - self.reference_ms:.0f} ms)"
            )
        else:
            shown, ref = self.median_ms, ""
        note = f"  [{self.note}]" if self.note else ""
        return f"{self.label:<58} {shown:8.1f} ms{ref}{note}"


@dataclass
class Samples:
    """Ids and names found in the database, for the reads that need one."""

    task_id: str  # a finished task that ran (attempts, heartbeats)
    step_task_id: str  # a workflow step's task
    workflow_id: str  # a finished workflow
    queues: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, url: str) -> Samples:
        with connect_dict(url) as conn:
            task = conn.execute(
                "SELECT id FROM tether_tasks WHERE status = 'COMPLETED' AND workflow_id IS NULL"
                " ORDER BY id DESC LIMIT 1 OFFSET 1000"
            ).fetchone()
            step = conn.execute(
                "SELECT task_id, workflow_id FROM tether_workflow_tasks WHERE status = 'COMPLETED'"
                " ORDER BY workflow_id DESC LIMIT 1"
            ).fetchone()
        assert task is not None and step is not None, "the database has no finished task or workflow"
        return cls(str(task["id"]), str(step["task_id"]), str(step["workflow_id"]))


def _time(work: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    work()  # untimed: cold pages, connection, imports
    runs, answer = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        answer = work()
        runs.append((time.perf_counter() - t0) * 1000)
    return runs, answer


# -- commands as processes ----------------------------------------------------------------------


def command_list(samples: Samples) -> list[tuple[str, ...]]:
    return [
        ("status",),
        ("tasks",),
        ("tasks", "--status", "PENDING"),
        ("tasks", "--status", "RUNNING"),
        ("tasks", "--status", "FAILED"),
        ("tasks", "--status", "EXPIRED"),
        ("tasks", "--queue", "emails"),
        ("tasks", "--queue", "maintenance"),
        ("tasks", "--name", "send_email"),
        ("tasks", "--status", "COMPLETED", "--queue", "audit"),
        ("task", samples.task_id),
        ("queues",),
        ("workers",),
        ("workflows",),
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_command(url: str, args: Sequence[str]) -> float:
    """One ``python -m tether ARGS`` process; ms from Popen to its exit. Fails if it fails."""
    cmd = [sys.executable, "-m", "tether", *args, "--database-url", url]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    ms = (time.perf_counter() - t0) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return ms


def time_commands(url: str, reference_url: str, samples: Samples, repeat: int) -> list[Timing]:
    """Each command ``repeat`` times against each database, big and small in turn (after one
    untimed run of each); the small one's figure is its fastest run, what a process costs
    here without the data (interpreter, imports, connection)."""
    found = []
    for args in command_list(samples):
        small_args = args if args[0] != "task" else ("tasks",)
        run_command(url, args)
        run_command(reference_url, small_args)
        runs, reference = [], []
        for _ in range(repeat):
            runs.append(run_command(url, args))
            reference.append(run_command(reference_url, small_args))
        found.append(Timing("tether " + " ".join(args), runs, reference_ms=min(reference)))
    return found


# -- the same, server side ------------------------------------------------------------------------


def time_server_side(url: str, samples: Samples, repeat: int) -> list[Timing]:
    broker = PostgresBroker(PostgresConfig(database_url=url, pool_max_size=2))
    found = []
    task_id = uuid.UUID(samples.task_id)

    def listing(
        status: str | None = None, queue: str | None = None, name: str | None = None
    ) -> Callable[[], Any]:
        """What `tether tasks` reads: browse_tasks since the lists' scan bound, list_tasks before."""
        if hasattr(browse, "page_params"):
            where = browse.TaskFilter(
                statuses=(TaskStatus(status),) if status else (), queue=queue, name=name
            )
            return lambda: broker.run(lambda c: browse.browse_tasks(c, where, before=None, limit=50))
        older: Any = tasks  # this bench also measures the code before it (list_tasks)
        return lambda: broker.run(
            lambda c: older.list_tasks(c, status=status, queue=queue, name=name, limit=50)
        )

    reads: list[tuple[str, Callable[[], Any]]] = [
        ("status (tether status)", lambda: status_snapshot(broker, STALE_MS)),
        (
            "status with failures and schedules (dashboard)",
            lambda: status_snapshot(broker, STALE_MS, failures=20, with_schedules=True),
        ),
        ("queues (tether queues, dashboard)", lambda: list_queues(broker)),
        ("tasks", listing()),
        ("tasks --status PENDING", listing(status="PENDING")),
        ("tasks --status FAILED", listing(status="FAILED")),
        ("tasks --status EXPIRED", listing(status="EXPIRED")),
        ("tasks --queue emails", listing(queue="emails")),
        ("tasks --queue maintenance", listing(queue="maintenance")),
        ("tasks --name send_email", listing(name="send_email")),
        ("task ID (row, attempts, heartbeats)", lambda: broker.run(lambda c: browse.task_detail(c, task_id))),
        ("workers", lambda: broker.run(lambda c: workers.list_workers(c, include_inactive=False, limit=100))),
        (
            "workflows",
            lambda: broker.run(lambda c: workflows.list_workflows(c, status=None, name=None, limit=50)),
        ),
    ]
    try:
        for label, work in reads:
            runs, _ = _time(work, repeat)
            found.append(Timing(label, runs))
    finally:
        broker.close()
    return found


# -- the dashboard over HTTP ------------------------------------------------------------------------


def dashboard_paths(samples: Samples) -> list[str]:
    return [
        "/",
        "/api/status",
        "/api/queues",
        "/api/workers",
        "/api/tasks",
        "/api/tasks?status=PENDING",
        "/api/tasks?status=CLAIMED,RUNNING",
        "/api/tasks?status=FAILED",
        "/api/tasks?status=EXPIRED",
        "/api/tasks?status=FAILED,CANCELLED,EXPIRED",
        "/api/tasks?status=FAILED&error_code=CERT_EXPIRED",
        "/api/tasks?queue=emails",
        "/api/tasks?queue=maintenance",
        "/api/tasks?name=send_email",
        "/api/tasks?name=rebuild_index",
        "/api/tasks?status=COMPLETED&queue=audit",
        "/api/tasks?status=PENDING&queue=maintenance",
        f"/api/tasks/{samples.task_id}",
        f"/api/tasks/{samples.step_task_id}",
        "/api/workflows",
        "/api/workflows?status=RUNNING",
        "/api/workflows?status=FAILED",
        f"/api/workflows/{samples.workflow_id}",
    ]


class Dashboard:
    """A real ``tether dashboard --port 0`` process on ``url``, stopped by its pid."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tether", "dashboard", "--port", "0", "--database-url", url]
        self.out = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=self.out, start_new_session=True
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().decode()
        if "tether dashboard on " not in first:
            self.stop()
            raise RuntimeError(f"the dashboard did not start: {first!r}; log {log_path}")
        self.base = first.split("tether dashboard on ", 1)[1].split()[0].rstrip("/")

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.base + path, timeout=120) as reply:
            body: bytes = reply.read()
            return body

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


STATUS_CACHE_S = 1.05  # the dashboard reads /api/status afresh when its copy is older than 1 s


def time_dashboard(url: str, samples: Samples, repeat: int, log_dir: Path) -> list[Timing]:
    board = Dashboard(url, log_dir / "dashboard.log")
    found = []
    try:
        for path in dashboard_paths(samples):

            def fetch(path: str = path) -> int:
                if path == "/api/status":
                    time.sleep(STATUS_CACHE_S)  # never its cached copy
                    t0 = time.perf_counter()
                    body = board.get(path)
                    fetch.ms = (time.perf_counter() - t0) * 1000  # type: ignore[attr-defined]
                    return len(body)
                return len(board.get(path))

            if path == "/api/status":
                fetch()
                runs = []
                for _ in range(repeat):
                    fetch()
                    runs.append(fetch.ms)  # type: ignore[attr-defined]
                size = fetch()
            else:
                runs, size = _time(fetch, repeat)
            found.append(Timing("GET " + path, runs, note=f"{size:,} bytes"))
        # A page deep in the default list: the cursor of page 1, then of page 20.
        cursor = None
        for _ in range(20):
            page = _json(board.get("/api/tasks" + (f"?before={cursor}" if cursor else "")))
            cursor = page["next"]
        runs, size = _time(lambda: len(board.get(f"/api/tasks?before={cursor}")), repeat)
        found.append(Timing("GET /api/tasks?before=<cursor of page 20>", runs, note=f"{size:,} bytes"))
    finally:
        board.stop()
    return found


def _json(body: bytes) -> Any:
    import json

    return json.loads(body)
