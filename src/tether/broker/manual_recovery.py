"""Manual recovery: the reaper's task rules, run once, on demand (docs/workers.md#manual-recovery).

One function, ``recover``, behind the three doors, as DBOS's workflow commands serve its
API, CLI and UI alike:

- the seed API on ``app.get_broker()``: ``mark_stale_tasks_as_failed`` (the RUNNING rule
  alone) and ``requeue_stale_claimed`` (the CLAIMED rule alone), with their ``_sync`` twins,
  thin delegates on PostgresBroker;
- ``tether recover`` and the dashboard's recover action (tether.recovering), with every
  rule at the configured thresholds, then the workflow reconciliation.

``stale_tasks`` is what each door lists first (``get_stale_tasks``, ``tether status``, the
dashboard's overview). The rules themselves are broker/recovery.py's, the reaper's own, so
a task recovered by hand is settled exactly as the reaper would settle it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from tether.broker.queries import q
from tether.broker.recovery import (
    Recovered,
    StaleTask,
    deactivate_stale_workers,
    expire_pending,
    recover_stale_running,
    requeue_stale_claimed,
)
from tether.broker.types import Conn
from tether.config import RecoveryConfig

#: At most this many stale tasks are listed.
STALE_SHOWN = 1_000


@dataclass(frozen=True, slots=True)
class Rules:
    """Which of the reaper's task rules a recovery applies, and their thresholds; a rule whose
    threshold is None is not applied.

    expire: PENDING tasks past their good_until become EXPIRED. claimed_threshold_ms:
    CLAIMED tasks whose claimer is silent this long go back to PENDING (their code never
    ran). running_threshold_ms: RUNNING tasks whose runner is silent this long are retried or
    fail with WORKER_CRASHED, as their retry policy says. worker_threshold_ms: active workers
    whose heartbeat is this old are marked inactive.
    """

    expire: bool = False
    claimed_threshold_ms: float | None = None
    running_threshold_ms: float | None = None
    worker_threshold_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("claimed_threshold_ms", "running_threshold_ms", "worker_threshold_ms"):
            value = getattr(self, name)
            if value is not None:
                check_positive(name, value)

    @classmethod
    def every_rule(
        cls,
        config: RecoveryConfig,
        *,
        claimed_threshold_ms: float | None = None,
        running_threshold_ms: float | None = None,
    ) -> Rules:
        """Every rule, as the reaper applies them with ``config`` (a threshold given here wins);
        a worker is inactive after three of its heartbeat intervals."""
        beat_ms = min(config.claimer_heartbeat_interval_ms, config.runner_heartbeat_interval_ms)
        return cls(
            expire=True,
            claimed_threshold_ms=claimed_threshold_ms or config.claimed_stale_threshold_ms,
            running_threshold_ms=running_threshold_ms or config.running_stale_threshold_ms,
            worker_threshold_ms=3 * beat_ms,
        )


def recover(conn: Conn, rules: Rules, *, dry_run: bool = False) -> Recovered:
    """Apply ``rules`` once, in one transaction, in the reaper's order: expire, requeue stale
    CLAIMED, retry or fail stale RUNNING, mark silent workers inactive. A dry run does it all,
    logs nothing and rolls it back: what it returns is what a real run would have done."""
    done = Recovered()
    with conn.transaction(force_rollback=dry_run):
        if rules.expire:
            done.expired = expire_pending(conn)
        if rules.claimed_threshold_ms is not None:
            done.requeued = requeue_stale_claimed(conn, rules.claimed_threshold_ms, quiet=dry_run)
        if rules.running_threshold_ms is not None:
            done.retried, done.failed = recover_stale_running(conn, rules.running_threshold_ms, quiet=dry_run)
        if rules.worker_threshold_ms is not None:
            done.deactivated = deactivate_stale_workers(conn, rules.worker_threshold_ms, quiet=dry_run)
    return done


def stale_tasks(conn: Conn, threshold_ms: float, limit: int = STALE_SHOWN) -> list[StaleTask]:
    """RUNNING tasks with no runner heartbeat (nor start, nor progress) for longer than
    ``threshold_ms``, with their worker, earliest start first. Changes nothing."""
    check_positive("threshold_ms", threshold_ms)
    rows = conn.execute(
        q("stale_tasks_report"), {"threshold": timedelta(milliseconds=threshold_ms), "limit": limit}
    )
    return [StaleTask(**row) for row in rows]


def check_positive(name: str, value: float) -> float:
    """``value`` if it is a positive number, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value
