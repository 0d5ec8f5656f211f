"""``GET /api/charts?range=1h|24h``: what the overview's charts draw (docs/dashboard.md#charts).

Three sources, none on the path that ends a task:

- **Tasks ended per minute and status** are read back from the terminal rows through their
  partial index on updated_at (broker/charts.py): a range scan of the minutes asked for.
  A minute that ended more than SETTLE_S ago is read once and kept here (a day of them);
  each answer reads the last minutes live, and the kept ones it lacks newest first, a run
  of minutes per statement, for at most ANSWER_BUDGET_S (the sampler's thread goes on
  reading them back, BACKGROUND_BUDGET_S per sample). So an answer costs a bounded read however
  many tasks ended in the range: on a busy database just started, the charts fill in from
  now backwards over a few refreshes (``complete_from`` says how far back they are read).
- **Recoveries per bucket and rule** come from tether_recovery_minutes (migration 15), a
  few rows per minute at most, written by the workers with their heartbeats.
- **Depth and lag per queue** have no history in the database: this dashboard samples them
  every SAMPLE_S (the read of a Prometheus scrape: a count of what waits and runs through
  the claim and in-flight indexes, and one probe of the claim index per queue and
  priority) and keeps a day of samples in memory. They start when the dashboard starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tether.broker import PostgresBroker, browse, charts
from tether.broker.charts import Finished, QueueSample
from tether.metrics import rules
from tether.web.jsonout import ApiError

log = logging.getLogger("tether.web")

FINISHED_STATUSES = ("COMPLETED", "FAILED", "CANCELLED", "EXPIRED")


@dataclass(frozen=True, slots=True)
class Range:
    span_s: int  # how far back the chart goes
    bucket_s: int  # one point per bucket
    queue_bucket_s: int  # the queue samples, folded into buckets this long (0: every sample)


RANGES: Mapping[str, Range] = {
    "1h": Range(3600, 60, 0),
    "24h": Range(86_400, 900, 300),
}
#: A minute that ended this long ago is taken as final: a task's end is stamped by the
#: statement that ends it, so only a transaction open longer than this could still add one.
SETTLE_S = 120
MINUTE = timedelta(minutes=1)
#: How long one answer may spend reading kept minutes back (each is one statement, so one
#: minute's read can go over); what is left is read by later answers and the sampler.
ANSWER_BUDGET_S = 0.5
BACKGROUND_BUDGET_S = 1.0
#: A read-back statement reads about this many ended tasks (its minutes adapt to the rate).
READ_BACK_ROWS = 20_000
MAX_READ_BACK_MINUTES = 120
#: No statement of the charts runs longer (tether.web.api's limit for every read).
READ_TIME_LIMIT_MS = 10_000
#: How often the queues are sampled (and how long an answer is served again).
SAMPLE_S = 10.0
ANSWER_MAX_AGE_S = 5.0


class Charts:
    """The chart data of one dashboard: the minutes it has read, and its queue samples."""

    def __init__(self, broker: PostgresBroker, *, sample_s: float = SAMPLE_S) -> None:
        self.broker = broker
        self.sample_s = sample_s
        self.samples: deque[tuple[datetime, list[QueueSample]]] = deque(
            maxlen=int(max(RANGES.values(), key=lambda r: r.span_s).span_s / sample_s) + 1
        )
        # Settled minutes of the last day: {minute: what ended in it}. The lock: the answers
        # and the sampler's thread read them back in turns.
        self._minutes: dict[datetime, list[Finished]] = {}
        self._reading = threading.Lock()
        self._answers: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the sampler ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._sample_forever, name="tether-dashboard-charts", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _sample_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
                self.read_back(BACKGROUND_BUDGET_S)
            except Exception as exc:  # the database is away: the next sample tries again
                log.warning("dashboard could not sample the queues for the charts: %s", exc)
            self._stop.wait(self.sample_s)

    def read_back(self, budget_s: float, span_s: int | None = None) -> None:
        """Read the settled minutes of the last ``span_s`` (a day) not kept yet, newest first,
        until ``budget_s`` is spent: a statement per run of minutes, as many minutes as about
        READ_BACK_ROWS ended in (one at first; more while they are few, fewer when many)."""
        span = timedelta(seconds=span_s or max(r.span_s for r in RANGES.values()))
        with self._reading:

            def work(conn: Any) -> None:
                with conn.transaction():
                    browse.limit_time(conn, READ_TIME_LIMIT_MS)
                    now = charts.database_now(conn)
                    live_from = _floor(now - timedelta(seconds=SETTLE_S), 60)
                    oldest = _floor(now - span, 60)
                    for old in [m for m in self._minutes if m < oldest - MINUTE]:
                        del self._minutes[old]
                    deadline = time.monotonic() + budget_s
                    end, width = live_from, 1  # read [end - width minutes, end) next
                    while end > oldest and time.monotonic() < deadline:
                        if end - MINUTE in self._minutes:
                            end -= MINUTE
                            continue
                        start = max(oldest, end - width * MINUTE)
                        while any(m in self._minutes for m in _minutes(start, end)):
                            start += MINUTE  # stop at a minute kept already
                        found = charts.finished_per_bucket(conn, start, end, 60)
                        for m in _minutes(start, end):
                            self._minutes[m] = []
                        for row in found:
                            self._minutes[_floor(row.at, 60)].append(row)
                        width = _next_width(width, sum(r.n for r in found))
                        end = start

            self.broker.run(work)

    def sample(self) -> None:
        """Read every queue's depth and lag now, and keep them."""
        found = self.broker.run(charts.queue_samples)
        with self._lock:
            self.samples.append((datetime.now(UTC), found))

    # -- the answer ----------------------------------------------------------------------------

    def answer(self, name: str) -> dict[str, Any]:
        """The charts of range ``name`` (RANGES), read afresh unless one is younger than
        ANSWER_MAX_AGE_S."""
        spec = RANGES.get(name)
        if spec is None:
            raise ApiError(400, f"range {name!r} is not one of {', '.join(RANGES)}")
        with self._lock:
            cached = self._answers.get(name)
            if cached is not None and time.monotonic() - cached[0] < ANSWER_MAX_AGE_S:
                return cached[1]
            fresh = (
                not self.samples or (datetime.now(UTC) - self.samples[-1][0]).total_seconds() >= self.sample_s
            )
        if fresh:  # none yet (the dashboard just started), or the sampler is behind
            self.sample()
        with self._lock:
            shown = self._read(name, spec)
            self._answers[name] = (time.monotonic(), shown)
            return shown

    def _read(self, name: str, spec: Range) -> dict[str, Any]:
        self.read_back(ANSWER_BUDGET_S, spec.span_s)
        with self._reading:
            kept = dict(self._minutes)
        bucket = timedelta(seconds=spec.bucket_s)

        def work(conn: Any) -> tuple[datetime, datetime, list[Finished], list[charts.Recoveries]]:
            with conn.transaction():
                browse.limit_time(conn, READ_TIME_LIMIT_MS)
                # The database's clock: it stamped the ends, so it says which minutes are over.
                now = charts.database_now(conn)
                first = _floor(now - timedelta(seconds=spec.span_s), spec.bucket_s) + bucket
                # Live from the first minute not over, or earlier if the minute before it is not
                # kept yet (a minute may have ended since the read-back; at most two).
                live_from = _floor(now - timedelta(seconds=SETTLE_S), 60)
                for _ in range(2):
                    if live_from - MINUTE in kept:
                        break
                    live_from -= MINUTE
                return (
                    now,
                    live_from,
                    charts.finished_per_bucket(conn, live_from, datetime.max.replace(tzinfo=UTC), 60),
                    charts.recoveries_per_bucket(conn, first, spec.bucket_s),
                )

        now, live_from, live, recoveries = self.broker.run(work)
        first = _floor(now - timedelta(seconds=spec.span_s), spec.bucket_s) + bucket
        points = [first + i * bucket for i in range(spec.span_s // spec.bucket_s)]
        # Back from the live minutes, every minute known until the first one not read yet.
        complete_from = live_from
        while complete_from - MINUTE >= first and complete_from - MINUTE in kept:
            complete_from -= MINUTE
        minutes = [(m, found) for m, found in kept.items() if complete_from <= m < live_from]
        minutes += [(_floor(r.at, 60), [r]) for r in live]
        return {
            "range": name,
            "bucket_s": spec.bucket_s,
            "from": first,
            "to": now,
            "complete_from": max(complete_from, first),
            # A bucket with a minute not read yet is left out (null), not drawn short.
            "finished": _finished(points, _in_buckets(minutes, spec.bucket_s), complete_from),
            "recoveries": _recoveries(points, recoveries),
            "queues": self._queues(now - timedelta(seconds=spec.span_s), spec.queue_bucket_s),
            "sample_s": self.sample_s,
        }

    def _queues(self, since: datetime, fold_s: int) -> dict[str, Any]:
        """The samples since ``since``: each queue's depth (PENDING) and lag in seconds per
        point, folded to the highest in each ``fold_s`` bucket (0: every sample)."""
        kept = [(at, found) for at, found in self.samples if at >= since]
        names = sorted({s.queue for _, found in kept for s in found})
        points: dict[datetime, dict[str, QueueSample]] = {}
        for sampled, found in kept:
            key = _floor(sampled, fold_s) if fold_s else sampled
            shown = points.setdefault(key, {})
            for s in found:
                was = shown.get(s.queue)
                shown[s.queue] = s if was is None else _higher(was, s)
        times = sorted(points)
        return {
            "at": [_epoch(t) for t in times],
            "depth": {q: [points[t][q].pending if q in points[t] else 0 for t in times] for q in names},
            "lag_s": {q: [_lag(points[t].get(q)) for t in times] for q in names},
        }


def _finished(points: Sequence[datetime], rows: list[Finished], known_from: datetime) -> dict[str, Any]:
    """Tasks ended per bucket, one series per status and one per queue (every status); null
    for the buckets before ``known_from`` (not read back yet)."""
    index = {at: i for i, at in enumerate(points)}
    start: list[int | None] = [None if at < known_from else 0 for at in points]
    by_status = {s: list(start) for s in FINISHED_STATUSES}
    by_queue: dict[str, list[int | None]] = {}
    for r in rows:
        i = index.get(r.at)
        if i is None or points[i] < known_from:
            continue
        by_status[r.status][i] = (by_status[r.status][i] or 0) + r.n
        series = by_queue.setdefault(r.queue, list(start))
        series[i] = (series[i] or 0) + r.n
    return {
        "at": [_epoch(t) for t in points],
        "by_status": by_status,
        "by_queue": dict(sorted(by_queue.items())),
        "total": {s: sum(n or 0 for n in v) for s, v in by_status.items()},
    }


def _in_buckets(minutes: list[tuple[datetime, list[Finished]]], bucket_s: int) -> list[Finished]:
    """Minutes' rows summed in buckets of ``bucket_s`` (a multiple of 60): a day is 1,440
    minutes of a row per queue and status each, so each minute is floored once."""
    summed: dict[tuple[datetime, str, str], int] = {}
    for minute, found in minutes:
        at = _floor(minute, bucket_s) if bucket_s != 60 else minute
        for r in found:
            key = (at, r.queue, r.status)
            summed[key] = summed.get(key, 0) + r.n
    return [Finished(at, queue, status, n) for (at, queue, status), n in summed.items()]


def _recoveries(points: Sequence[datetime], rows: list[charts.Recoveries]) -> dict[str, Any]:
    """Recoveries per bucket, one series per rule that recovered any (in RULES' order)."""
    index = {at: i for i, at in enumerate(points)}
    series: dict[str, list[int]] = {}
    for r in rows:
        i = index.get(r.at)
        if i is not None:
            series.setdefault(r.rule, [0] * len(points))[i] += r.n
    order = {rule: i for i, rule in enumerate(rules.RULES)}
    ranked = sorted(series.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))
    return {
        "at": [_epoch(t) for t in points],
        "by_rule": dict(ranked),
        "total": {rule: sum(v) for rule, v in ranked},
        "rules": list(rules.RULES),
    }


def _next_width(width: int, rows: int) -> int:
    """The minutes of the next read-back statement, after one of ``width`` read ``rows``."""
    if rows < READ_BACK_ROWS // 2:
        return min(MAX_READ_BACK_MINUTES, width * 2)
    if rows > READ_BACK_ROWS * 2:
        return max(1, width // 2)
    return width


def _minutes(start: datetime, end: datetime) -> list[datetime]:
    return [start + i * MINUTE for i in range(int((end - start) / MINUTE))]


def _higher(a: QueueSample, b: QueueSample) -> QueueSample:
    lags = [x for x in (a.lag_s, b.lag_s) if x is not None]
    return QueueSample(
        a.queue, max(a.pending, b.pending), max(a.in_flight, b.in_flight), max(lags, default=None)
    )


def _lag(sample: QueueSample | None) -> float | None:
    return None if sample is None or sample.lag_s is None else round(sample.lag_s, 3)


def _floor(at: datetime, step_s: int) -> datetime:
    epoch = int(at.timestamp())
    return datetime.fromtimestamp(epoch - epoch % step_s, UTC)


def _epoch(at: datetime) -> int:
    return int(at.timestamp())
