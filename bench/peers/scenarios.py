"""The side-by-side scenarios. Each runs one round for one peer and returns its figures.

Database timestamps (``now()`` of the writing transaction) are read back from each peer's
own tables; a figure that starts at the worker's process creation uses ``time.time()``
read just before ``Popen``, the same machine clock as the server's on this one host.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.infra import percentile
from bench.peers.base import Peer, Worker, WorkerSpec

# PostgreSQL 15 reports a backend's commits to pg_stat_database up to 10 s after it goes
# idle (bench/README.md "How commits_per_second counts"): wait that long before a window.
STATS_SETTLE_S = 11.0


@dataclass
class Config:
    tasks: int  # the drain's no-op tasks
    pickups: int  # sends of the pickup scenario
    sends: int  # sends per kind of the send scenario
    window: float  # seconds of each commit-counting window
    log_dir: Path
    workers: list[Worker]  # every worker ever started: stopped again at exit

    def start(self, spec: WorkerSpec) -> Worker:
        slug = "".join(c if c.isalnum() else "-" for c in spec.label)
        worker = Worker(spec, self.log_dir / f"{len(self.workers) + 1:03d}-{slug}.log")
        self.workers.append(worker)
        return worker


def wait(
    what: str, check: Callable[[], bool], timeout: float, worker: Worker | None, interval: float
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if worker is not None:
            worker.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def warm(peer: Peer, cfg: Config, worker: Worker, task: str = "noop") -> None:
    """One task run through ``worker``: it is up, listening and has claimed once."""
    peer.enqueue(task, 1)
    wait("the warm-up task", lambda: peer.left() == 0, 60, worker, 0.02)


def db_epoch(peer: Peer) -> float:
    return float(peer.query("SELECT extract(epoch FROM clock_timestamp())::float8")[0][0])


# -- a. start-up ---------------------------------------------------------------------------------


def startup(peer: Peer, cfg: Config) -> dict[str, dict[str, Any]]:
    spec = peer.startup_worker()
    peer.reset()
    peer.enqueue("noop", 1)
    t0 = time.time()
    worker = cfg.start(spec)
    try:
        wait("the first task to start", lambda: peer.first_start_epoch() is not None, 60, worker, 0.005)
        first = peer.first_start_epoch()
    finally:
        worker.stop()
    assert first is not None
    return {spec.label: {"first_task_s": first - t0}}


# -- b. async drain from cold --------------------------------------------------------------------


def drain(peer: Peer, cfg: Config) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for spec in peer.drain_workers():
        peer.reset()
        peer.enqueue("anoop", cfg.tasks)
        t0 = time.time()
        worker = cfg.start(spec)
        try:
            wait("all tasks done", lambda: peer.left() == 0, 900, worker, 0.1)
        finally:
            worker.stop()
        first, last, done = peer.span()
        if done != cfg.tasks:
            raise RuntimeError(f"{spec.label}: {done} of {cfg.tasks} tasks done")
        out[spec.label] = {
            "tasks": cfg.tasks,
            "cold_rate": cfg.tasks / (last - t0),
            "wall_s": last - t0,
            "steady_rate": cfg.tasks / (last - first),
            "steady_s": last - first,
        }
    return out


# -- c. pickup latency of an idle worker ---------------------------------------------------------


def pickup(peer: Peer, cfg: Config) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for spec, task in peer.pickup_workers():
        peer.reset()
        worker = cfg.start(spec)
        open_, send, close = peer.producer(task)
        open_()
        try:
            warm(peer, cfg, worker, task)
            for _ in range(20):  # untimed warm-up, as bench/scenarios.py's paced_sends
                send()
                time.sleep(0.015)
            wait("the warm-up tasks", lambda: peer.left() == 0, 60, worker, 0.02)
            since = db_epoch(peer)  # only the timed sends are read back
            rng = random.Random(7)
            for _ in range(cfg.pickups):
                send()
                time.sleep(rng.uniform(0.010, 0.020))
            wait("all pickups done", lambda: peer.left() == 0, 120, worker, 0.02)
        finally:
            close()
            worker.stop()
        values, meaning = peer.pickup_ms(since)
        if len(values) != cfg.pickups:
            raise RuntimeError(f"{spec.label}: {len(values)} of {cfg.pickups} pickups read back")
        values.sort()
        out[spec.label] = {
            "p50_ms": percentile(values, 50),
            "p95_ms": percentile(values, 95),
            "p99_ms": percentile(values, 99),
            "max_ms": values[-1],
            "measured": meaning,
        }
        claims = peer.claim_ms(since)
        if claims:  # tether: the claim alone, the moment the peers' figures stop at
            claims.sort()
            out[spec.label] |= {
                "claim_p50_ms": percentile(claims, 50),
                "claim_p99_ms": percentile(claims, 99),
            }
    return out


# -- d. single durable sends, beside the commit rate of a one-row INSERT -------------------------


def sends(peers: list[Peer], cfg: Config) -> dict[str, dict[str, Any]]:
    """All peers' senders and the plain INSERT in interleaved blocks: they share the drift."""
    kinds: dict[str, tuple[Callable[[], None], Callable[[int], None], Callable[[], None]]] = {}
    for peer in peers:
        peer.reset()
        kinds.update(peer.senders())
    kinds["INSERT one row, ordinary table"] = _insert_sender(peers[0].url)
    blocks, warmup = 4, 100
    seconds = dict.fromkeys(kinds, 0.0)
    for open_, send, _ in kinds.values():
        open_()
        send(warmup)
    try:
        for _ in range(blocks):
            for label, (_, send, _) in kinds.items():
                t0 = time.perf_counter()
                send(cfg.sends // blocks)
                seconds[label] += time.perf_counter() - t0
    finally:
        for _, _, close in kinds.values():
            close()
    n = blocks * (cfg.sends // blocks)
    return {label: {"sends": n, "rate": n / s} for label, s in seconds.items()}


def _insert_sender(url: str) -> tuple[Callable[[], None], Callable[[int], None], Callable[[], None]]:
    state: dict[str, Any] = {}

    def open_() -> None:
        conn = psycopg.connect(url, autocommit=True)
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_commit_logged (id bigint, at timestamptz DEFAULT now())"
        )
        state["conn"] = conn

    def send(n: int) -> None:
        conn = state["conn"]
        for i in range(n):
            conn.execute("INSERT INTO bench_commit_logged (id) VALUES (%s)", (i,))

    def close() -> None:
        conn = state.pop("conn")
        conn.execute("DROP TABLE bench_commit_logged")
        conn.close()

    return open_, send, close


# -- e. commits/s of an idle worker, and with 50 tasks running -----------------------------------


def commits(peer: Peer, cfg: Config, server_url: str, dbname: str) -> dict[str, dict[str, Any]]:
    spec = peer.hold_worker()
    peer.reset()
    worker = cfg.start(spec)
    try:
        warm(peer, cfg, worker)
        idle = _window(server_url, dbname, cfg.window, worker)
        peer.enqueue("hold", 50, (3600.0,))
        wait("50 tasks running", lambda: peer.running() == 50, 300, worker, 0.2)
        busy = _window(server_url, dbname, cfg.window, worker)
        if peer.running() != 50:
            raise RuntimeError(f"{spec.label}: only {peer.running()} of 50 still running after the window")
    finally:
        worker.kill()  # 50 tasks sleeping for an hour: a graceful stop would wait for them
    return {spec.label: {"idle_commits_per_s": idle, "busy_commits_per_s": busy}}


def _window(server_url: str, dbname: str, seconds: float, worker: Worker) -> float:
    """Commits/s of database ``dbname`` over ``seconds``, read from the server's own database
    (so that none of these reads is a commit of ``dbname``)."""
    time.sleep(STATS_SETTLE_S)
    with psycopg.connect(server_url, autocommit=True) as conn:

        def read() -> tuple[int, float]:
            row = conn.execute(
                "SELECT xact_commit, extract(epoch FROM clock_timestamp())::float8"
                " FROM pg_stat_database WHERE datname = %s",
                (dbname,),
            ).fetchone()
            assert row is not None
            return int(row[0]), float(row[1])

        before, t0 = read()
        time.sleep(seconds)
        worker.check_alive()
        after, t1 = read()
    return (after - before) / (t1 - t0)


# -- f. whole-worker SIGKILL to the recovery decision ---------------------------------------------


def recovery(peer: Peer, cfg: Config, rnd: int) -> dict[str, dict[str, Any]]:
    """A holds a task; B runs beside it; A's whole session is SIGKILLed at a random point of
    its heartbeat cycle; the figure is the decision's database time minus a ``now()`` read
    just before the kill."""
    specs = peer.recovery_workers()
    if specs is None:
        return {}
    spec_a, spec_b = specs
    peer.reset()
    a = cfg.start(spec_a)
    b: Worker | None = None
    try:
        warm(peer, cfg, a)
        peer.enqueue("hold", 1, (3600.0,))
        wait("the held task to run on A", lambda: peer.running() == 1, 60, a, 0.02)
        since = db_epoch(peer)
        b = cfg.start(spec_b)
        wait("B to be up", lambda: peer.ready_since(since), 60, b, 0.02)
        time.sleep(random.Random(rnd).uniform(1.0, 2.0))  # B's start-up done; a random point of A's beat
        kill_at = db_epoch(peer)
        a.kill()  # SIGKILL to A's session; returns once A's main process is reaped
        wait("the recovery decision", lambda: peer.decision_epoch() is not None, 90, b, 0.01)
        decided = peer.decision_epoch()
    finally:
        a.kill()
        if b is not None:
            b.kill()
    assert decided is not None
    return {spec_a.label.replace("A, ", "", 1): {"kill_to_decision_s": decided - kill_at}}
