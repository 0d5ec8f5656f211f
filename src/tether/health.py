"""Is tether healthy? The database's facts (broker/health.py) judged against documented
thresholds (docs/health.md), as ``ok``, ``warning`` or ``critical`` per check.

One function, ``check_health``, behind every door, as tether.recovering serves ``tether
recover`` and the dashboard alike: ``tether health`` (its exit code is the report's:
0 ok, 1 warning, 2 critical), the dashboard, and a metrics collector read the same
``HealthReport``, whose ``checks`` are typed rows (check, subject, status, value, unit,
thresholds, detail) and whose ``as_json()`` is the document of ``tether health --json``.

The checks, each a row per subject:

- ``oldest_transaction``: the longest-open transaction in this database (seconds);
- ``mvcc_horizon``: the age, in transactions, of the horizon held furthest back (a session,
  a prepared transaction or a replication slot): the dead rows of every queue table wait
  for it, and a queue that must skip them slows to a crawl;
- ``dead_tuples`` and ``table_size``: each tether table's dead rows (the statistics'
  estimate, with its last vacuum) and its size with its indexes;
- ``worker_heartbeat`` and ``worker_listener``: each active worker's heartbeat age, and
  whether its work listener's connection is in the server;
- ``queue_lag``: how long each queue's oldest due PENDING task has been due.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from tether.broker import PostgresBroker, tasks
from tether.broker import health as facts
from tether.broker.health import HorizonHolder, QueueLag, TableStats, WorkerLiveness
from tether.broker.types import Conn
from tether.config import RecoveryConfig


class HealthStatus(StrEnum):
    OK = "ok"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def exit_code(self) -> int:
        """The exit code of ``tether health``: 0 ok, 1 warning, 2 critical."""
        return _ORDER.index(self)


_ORDER = [HealthStatus.OK, HealthStatus.WARNING, HealthStatus.CRITICAL]


def worst(statuses: list[HealthStatus]) -> HealthStatus:
    return max(statuses, key=_ORDER.index, default=HealthStatus.OK)


class ThresholdError(ValueError):
    """A threshold out of range, naming its field (``tether health`` names the option)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.reason = message


@dataclass(frozen=True, slots=True)
class HealthThresholds:
    """Where each check turns ``warning`` and ``critical`` (docs/health.md says why these).

    Each field is the option of ``tether health`` with the same name (``lag_warning_s`` is
    ``--lag-warning-s``). A table size threshold of None checks nothing; every other one
    is a positive number, a warning below its critical.
    """

    transaction_warning_s: float = 300.0
    transaction_critical_s: float = 1_800.0
    horizon_warning_xids: int = 1_000_000
    horizon_critical_xids: int = 10_000_000
    dead_tuples_warning: int = 100_000
    dead_tuples_critical: int = 1_000_000
    table_size_warning_mb: float | None = None
    table_size_critical_mb: float | None = None
    heartbeat_warning_s: float = 60.0
    heartbeat_critical_s: float = 300.0
    lag_warning_s: float = 60.0
    lag_critical_s: float = 600.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name.startswith("table_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ThresholdError(f.name, f"must be a positive number, got {value!r}")
        for warning, critical in self.pairs():
            low, high = getattr(self, warning), getattr(self, critical)
            if low is not None and high is not None and low > high:
                raise ThresholdError(
                    warning,
                    f"{low:g} is above {critical} ({high:g}): a warning must come before its critical",
                )

    @classmethod
    def pairs(cls) -> list[tuple[str, str]]:
        """(warning field, critical field) of each measure."""
        names = [f.name for f in dataclasses.fields(cls)]
        return [(w, w.replace("_warning", "_critical")) for w in names if "_warning" in w]

    @classmethod
    def for_recovery(cls, recovery: RecoveryConfig, **given: Any) -> HealthThresholds:
        """The defaults, with the heartbeat's from ``recovery`` (warning: two heartbeat intervals
        missed; critical: the running stale threshold, past which its tasks count as crashed),
        and ``given`` (fields whose value is None are left at their default)."""
        beat_s = min(recovery.claimer_heartbeat_interval_ms, recovery.runner_heartbeat_interval_ms) / 1000
        values: dict[str, Any] = {
            "heartbeat_warning_s": 2 * beat_s,
            "heartbeat_critical_s": max(2 * beat_s, recovery.running_stale_threshold_ms / 1000),
        }
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """One check of one subject: a row of ``tether health``.

    check: what was checked (``queue_lag``, ...); subject: of what (a queue, a table, a
    worker id, a transaction's holder); value: the measure, in ``unit``, None when there is
    nothing to measure; warning and critical: the thresholds it was judged by (None: none).
    """

    check: str
    subject: str
    status: HealthStatus
    value: float | None
    unit: str
    warning: float | None
    critical: float | None
    detail: str


@dataclass(frozen=True, slots=True)
class HealthReport:
    """Every check, and the facts they were made from."""

    checked_at: datetime  # the database's clock
    thresholds: HealthThresholds
    checks: list[HealthCheck]
    horizon_holders: list[HorizonHolder] = field(default_factory=list)
    tables: list[TableStats] = field(default_factory=list)
    workers: list[WorkerLiveness] = field(default_factory=list)
    queues: list[QueueLag] = field(default_factory=list)

    @property
    def status(self) -> HealthStatus:
        """The worst status of any check."""
        return worst([c.status for c in self.checks])

    @property
    def exit_code(self) -> int:
        return self.status.exit_code

    def problems(self) -> list[HealthCheck]:
        """The checks that are not ok, the critical ones first."""
        bad = [c for c in self.checks if c.status is not HealthStatus.OK]
        return sorted(bad, key=lambda c: -_ORDER.index(c.status))

    def as_json(self) -> dict[str, Any]:
        """The report as ``tether health --json`` prints it (datetimes and UUIDs as text)."""
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "checked_at": self.checked_at,
            "thresholds": dataclasses.asdict(self.thresholds),
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "horizon_holders": [dataclasses.asdict(h) for h in self.horizon_holders],
            "tables": [dataclasses.asdict(t) for t in self.tables],
            "workers": [dataclasses.asdict(w) for w in self.workers],
            "queues": [dataclasses.asdict(q) for q in self.queues],
        }


def check_health(broker: PostgresBroker, thresholds: HealthThresholds) -> HealthReport:
    """Read the facts on one pooled connection and judge them.

    Behind a transaction pooler with no listen_url (docs/pgbouncer.md) workers poll by design:
    a worker with no listener is then no warning.
    """
    polls = broker.listen_url is None
    return broker.run(lambda conn: gather(conn, thresholds, polls=polls))


def gather(conn: Conn, thresholds: HealthThresholds, *, polls: bool = False) -> HealthReport:
    """``check_health`` on a connection the caller holds."""
    now = tasks.database_now(conn)
    holders = facts.horizon_holders(conn)
    tables = facts.tether_tables(conn)
    alive = facts.worker_liveness(conn)
    lags = facts.queue_lag(conn)
    checks = [
        *transaction_checks(holders, thresholds),
        *table_checks(tables, thresholds),
        *worker_checks(alive, thresholds, polls=polls),
        *queue_checks(lags, thresholds),
    ]
    return HealthReport(now, thresholds, checks, holders, tables, alive, lags)


# -- judging -------------------------------------------------------------------------------


def judge(value: float | None, warning: float | None, critical: float | None) -> HealthStatus:
    """critical at or past ``critical``, else warning at or past ``warning``, else ok."""
    if value is None:
        return HealthStatus.OK
    if critical is not None and value >= critical:
        return HealthStatus.CRITICAL
    if warning is not None and value >= warning:
        return HealthStatus.WARNING
    return HealthStatus.OK


def _measured(
    check: str,
    subject: str,
    value: float | None,
    unit: str,
    limits: tuple[float | None, float | None],
    detail: str,
) -> HealthCheck:
    warning, critical = limits
    return HealthCheck(
        check, subject, judge(value, warning, critical), value, unit, warning, critical, detail
    )


def transaction_checks(holders: list[HorizonHolder], t: HealthThresholds) -> list[HealthCheck]:
    """The longest-open transaction and the horizon held furthest back (each may be the other's)."""
    timed = [h for h in holders if h.transaction_age_s is not None]
    oldest = max(timed, key=lambda h: h.transaction_age_s or 0.0, default=None)
    if oldest is None:
        txn = _measured(
            "oldest_transaction",
            "-",
            None,
            "s",
            (t.transaction_warning_s, t.transaction_critical_s),
            "no open transaction",
        )
    else:
        txn = _measured(
            "oldest_transaction",
            oldest.describe(),
            oldest.transaction_age_s,
            "s",
            (t.transaction_warning_s, t.transaction_critical_s),
            f"open for {_duration(oldest.transaction_age_s)}"
            + (f", holding the horizon {oldest.xmin_age} transactions back" if oldest.xmin_age else ""),
        )
    aged = [h for h in holders if h.xmin_age is not None]
    held = max(aged, key=lambda h: h.xmin_age or 0, default=None)
    if held is None:
        horizon = _measured(
            "mvcc_horizon",
            "-",
            None,
            "transactions",
            (t.horizon_warning_xids, t.horizon_critical_xids),
            "nothing holds the horizon back",
        )
    else:
        since = (
            f" (its transaction open for {_duration(held.transaction_age_s)})"
            if held.transaction_age_s
            else ""
        )
        horizon = _measured(
            "mvcc_horizon",
            held.describe(),
            held.xmin_age,
            "transactions",
            (t.horizon_warning_xids, t.horizon_critical_xids),
            f"{held.xmin_age} transactions since the horizon it holds{since}; dead rows younger than it "
            "cannot be removed by any vacuum until it ends",
        )
    return [txn, horizon]


def table_checks(tables: list[TableStats], t: HealthThresholds) -> list[HealthCheck]:
    """Per tether table: its dead rows, and its size with its indexes."""
    checks = []
    mb = 1024 * 1024
    for table in tables:
        vacuumed = (
            f"last vacuum {table.last_vacuum_at:%Y-%m-%d %H:%M:%S %Z}"
            if table.last_vacuum_at
            else "never vacuumed"
        )
        checks.append(
            _measured(
                "dead_tuples",
                table.table_name,
                table.dead_rows,
                "rows",
                (t.dead_tuples_warning, t.dead_tuples_critical),
                f"{table.dead_rows} dead of {table.live_rows + table.dead_rows} rows "
                f"({table.dead_fraction:.0%}, estimated); {vacuumed}",
            )
        )
        total = table.table_bytes + table.index_bytes
        checks.append(
            _measured(
                "table_size",
                table.table_name,
                round(total / mb, 3),
                "MB",
                (t.table_size_warning_mb, t.table_size_critical_mb),
                f"table {human_size(table.table_bytes)}, indexes {human_size(table.index_bytes)}",
            )
        )
    return checks


def worker_checks(
    alive: list[WorkerLiveness], t: HealthThresholds, *, polls: bool = False
) -> list[HealthCheck]:
    """Per active worker: its heartbeat's age, and its work listener (``polls``: none is expected)."""
    checks = []
    for w in alive:
        checks.append(
            _measured(
                "worker_heartbeat",
                w.id,
                round(w.heartbeat_age_s, 3),
                "s",
                (t.heartbeat_warning_s, t.heartbeat_critical_s),
                f"last heartbeat {_duration(w.heartbeat_age_s)} ago (host {w.hostname}, pid {w.pid})",
            )
        )
        checks.append(
            HealthCheck(
                "worker_listener",
                w.id,
                HealthStatus.OK if w.listening or polls else HealthStatus.WARNING,
                None,
                "",
                None,
                None,
                _listener_detail(w.listening, polls),
            )
        )
    return checks


def _listener_detail(listening: bool, polls: bool) -> str:
    if listening:
        return "its work listener is connected"
    if polls:
        return (
            "no work listener, as configured: behind a transaction pooler with no listen_url, "
            "workers find work by polling (docs/pgbouncer.md)"
        )
    return (
        "no work listener connection in the server: it wakes up only by polling "
        "(a lost connection it is reconnecting, a worker older than this check, or a hung worker)"
    )


def queue_checks(lags: list[QueueLag], t: HealthThresholds) -> list[HealthCheck]:
    """Per queue with PENDING tasks: how long its oldest due task has waited since it became due."""
    checks = []
    for lag in lags:
        if lag.oldest_due_age_s is None:
            detail = "nothing due yet"
        else:
            detail = f"task {lag.oldest_due_task_id} due {_duration(lag.oldest_due_age_s)} ago"
            if lag.paused:
                detail += "; the queue is paused"
            elif not lag.served:
                detail += "; no active worker serves this queue"
            elif lag.limited_in_flight:
                detail += f"; waiting for its limits ({lag.limited_in_flight} in flight, docs/limits.md)"
        check = _measured(
            "queue_lag",
            lag.queue,
            None if lag.oldest_due_age_s is None else round(lag.oldest_due_age_s, 3),
            "s",
            (t.lag_warning_s, t.lag_critical_s),
            detail,
        )
        # A pause is an operator's decision, and a wait for a slot of a flow-controlled queue
        # whose tasks are moving is what its limits ask for: neither is lateness.
        if lag.paused or (lag.served and lag.limited_in_flight):
            check = dataclasses.replace(check, status=HealthStatus.OK)
        checks.append(check)
    return checks


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7_200:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3_600:.1f}h"


def human_size(n: int) -> str:
    """Bytes in kB, MB, GB or TB (1024 each)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"
