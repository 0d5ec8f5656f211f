"""Soak: three workers of two processes each work through a stream of short tasks while, every
few seconds, a random worker's whole process group is SIGKILLed (or one of its children is)
and a replacement is started, at once or a little later.

At the end (no more kills, no more sends) every task must reach a terminal state within a
bounded wait, and the books must balance: no task without a crash policy ran more than once,
none with one ran more than 1 + max_retries times, every COMPLETED task ran, every FAILED
task failed by a crash the rules allow, and the attempt rows agree with their task.

Short by default (about a minute, ~1,500 tasks); TETHER_SOAK=long runs ten minutes.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter, defaultdict
from types import ModuleType
from typing import Any

import pytest

from tests.chaos.conftest import APP, FAST, token
from tests.conftest import WorkerFactory, WorkerProcess, wait_until

LONG = os.environ.get("TETHER_SOAK", "").lower() == "long"
DURATION_S = 600.0 if LONG else 50.0
TASKS = 20_000 if LONG else 1_500
WORKERS = 3
PROCESSES = 2
BLOW_EVERY_S = (1.5, 4.0)
DRAIN_TIMEOUT_S = 120.0 if LONG else 45.0


def _in_flight(db: Any) -> int:
    row = db.execute(
        "SELECT count(*) AS n FROM tether_tasks"
        " WHERE status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')"
    ).fetchone()
    return int(row["n"])


def _seen_by(message: str) -> str:
    if "no runner heartbeat" in message:
        return "a reaper (stale heartbeat)"
    if "on this host is gone" in message:
        return "startup reconciliation"
    if "process running this task died" in message:
        return "its supervisor (dead child)"
    return f"? ({message})"


@pytest.mark.soak
@pytest.mark.timeout(DURATION_S + DRAIN_TIMEOUT_S + 120)
def test_soak_random_kills_lose_nothing_and_run_nothing_too_often(
    db: Any, chaos: ModuleType, workers: WorkerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    max_retries = chaos.CRASH_RETRY.max_retries
    seed = int(os.environ.get("TETHER_SOAK_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    with capsys.disabled():
        print(f"\nsoak: seed {seed}, {DURATION_S:.0f}s, {TASKS} tasks, {WORKERS} workers x {PROCESSES}")
    start = lambda: workers.start(APP, "--processes", str(PROCESSES), env=FAST)  # noqa: E731
    live: list[WorkerProcess] = [start() for _ in range(WORKERS)]
    work, work_retry = chaos.app.tasks["work"], chaos.app.tasks["work_retry"]
    kinds: dict[str, str] = {}  # token -> task name

    sent = 0
    kills: Counter[str] = Counter()
    owed = 0  # replacements to start at the next blow
    t0 = time.monotonic()
    next_blow = t0 + rng.uniform(*BLOW_EVERY_S)
    while (elapsed := time.monotonic() - t0) < DURATION_S:
        # Send at a steady pace so that tasks are in every state when the blows land.
        due = min(TASKS, int(TASKS * elapsed / (DURATION_S * 0.9)) + 1)
        if due > sent:
            batch = [(token(), rng.randint(0, 200)) for _ in range(due - sent)]
            plain = [b for b in batch if rng.random() < 0.5]
            retried = [b for b in batch if b not in plain]
            if plain:
                work.send_many(plain)
            if retried:
                work_retry.send_many(retried)
            kinds.update({t: "work" for t, _ in plain})
            kinds.update({t: "work_retry" for t, _ in retried})
            sent = due
        now = time.monotonic()
        if now >= next_blow:
            for _ in range(owed):
                live.append(start())
            owed = 0
            victim = rng.choice(live)
            children = sorted(c.pid for c in victim.task_children())
            if children and rng.random() < 0.3:
                # One child, from outside: the worker records the crash and replaces the child.
                try:
                    os.kill(rng.choice(children), signal.SIGKILL)
                    kills["child"] += 1
                except ProcessLookupError:
                    pass
            else:
                victim.kill()  # SIGKILL to the whole process group, by pid
                live.remove(victim)
                kills["worker"] += 1
                if rng.random() < 0.5:
                    live.append(start())  # at once: its startup reconciliation recovers the dead one
                    kills["replaced_at_once"] += 1
                else:
                    owed += 1  # later: the survivors' reapers recover it by staleness first
            next_blow = time.monotonic() + rng.uniform(*BLOW_EVERY_S)
        time.sleep(0.05)  # pacing of the producer and the killer, not a wait for a state

    for _ in range(owed):
        live.append(start())
    assert sent == TASKS
    try:
        wait_until(
            lambda: _in_flight(db) == 0,
            timeout=DRAIN_TIMEOUT_S,
            interval=0.5,
            message="every task to reach a terminal state",
        )
    except AssertionError:
        stuck = db.execute(
            "SELECT id, name, status, attempt, retry_count, claimed_by_worker_id, run_at, updated_at"
            " FROM tether_tasks WHERE status NOT IN ('COMPLETED', 'FAILED') ORDER BY updated_at LIMIT 20"
        ).fetchall()
        raise AssertionError(f"tasks left in flight (seed {seed}): {stuck}") from None
    for w in live:
        assert w.proc.poll() is None, w.log()

    # -- the books ------------------------------------------------------------------------
    tasks = db.execute(
        "SELECT id, name, status, error_code, attempt, retry_count, max_retries, args->>0 AS token"
        " FROM tether_tasks"
    ).fetchall()
    runs = {
        r["token"]: r["n"]
        for r in db.execute("SELECT token, count(*) AS n FROM tether_chaos_ledger GROUP BY token").fetchall()
    }
    history: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for a in db.execute(
        "SELECT task_id, attempt, outcome, will_retry, error_code, error_message FROM tether_task_attempts"
        " ORDER BY task_id, attempt"
    ).fetchall():
        history[a["task_id"]].append(a)

    assert len(tasks) == TASKS and {t["token"] for t in tasks} == set(kinds)
    problems: list[str] = []
    summary: Counter[str] = Counter()
    for t in tasks:
        n = runs.get(t["token"], 0)
        rows = history.get(t["id"], [])
        crash_policy = t["name"] == "work_retry"
        where = f"task {t['id']} ({t['name']}, {t['status']}, attempt {t['attempt']}, ran {n}x): "
        summary[f"{t['name']} {t['status']}"] += 1
        summary["retried"] += t["retry_count"] > 0
        if t["status"] not in ("COMPLETED", "FAILED"):
            problems.append(where + "not terminal")
            continue
        if t["status"] == "FAILED" and t["error_code"] != "WORKER_CRASHED":
            problems.append(where + f"failed with {t['error_code']}")
        if t["status"] == "FAILED" and crash_policy and t["retry_count"] != max_retries:
            problems.append(where + f"crash-failed with retries left ({t['retry_count']}/{max_retries})")
        if t["status"] == "COMPLETED" and n < 1:
            problems.append(where + "COMPLETED without its code running")
        if n > (1 + max_retries if crash_policy else 1):
            problems.append(where + "ran more often than its policy allows")
        if n > len(rows):
            problems.append(where + f"ran more often than it has attempt rows ({len(rows)})")
        numbers = [a["attempt"] for a in rows]
        if not rows or len(set(numbers)) != len(numbers) or max(numbers) != t["attempt"]:
            problems.append(where + f"attempt numbers {numbers}")
            continue
        last = rows[-1]
        if last["outcome"] != t["status"] or last["will_retry"]:
            problems.append(where + f"last attempt says {last['outcome']} will_retry={last['will_retry']}")
        if any(not a["will_retry"] or a["outcome"] != "FAILED" for a in rows[:-1]):
            problems.append(where + f"an earlier attempt was not a retried failure: {rows}")
        if len(rows) != t["retry_count"] + 1:
            problems.append(where + f"{len(rows)} attempt rows for {t['retry_count']} retries")
        if not crash_policy and t["retry_count"]:
            problems.append(where + "retried without a retry policy")
        summary["claims requeued"] += t["attempt"] - len(rows)
        for a in rows:
            if a["error_code"] == "WORKER_CRASHED":
                summary["crashes seen by " + _seen_by(a["error_message"])] += 1

    with capsys.disabled():
        print(
            f"soak summary (seed {seed}): {len(tasks)} tasks, {kills['worker']} worker kills "
            f"({kills['replaced_at_once']} replaced at once), {kills['child']} child kills, "
            f"{len(workers.started)} workers started; "
            + ", ".join(f"{k}: {v}" for k, v in sorted(summary.items()))
        )
    assert kills["worker"] >= 5, kills
    assert not problems, f"{len(problems)} problem(s) (seed {seed}):\n" + "\n".join(problems[:30])
