"""Cron expressions in a named time zone: which instants (slots) an expression names.

Parsing and matching are cronsim's (five fields, or six with seconds first); this module
adds the aliases (@hourly, ...) and the time zone. cronsim walks naive wall-clock times;
each wall-clock time is turned into real instants here, by these rules (docs/periodic.md):

- a wall-clock time that does not exist (the hour skipped when clocks go forward) names
  no slot: it is skipped;
- a wall-clock time that happens twice (the hour repeated when clocks go back) names one
  slot, the first, unless the expression's hour field is ``*``: such a schedule runs at
  least hourly, follows elapsed time, and so fires in both passes of the repeated hour.

Slots are returned as UTC datetimes: the schedule's slot key in the database.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

# Clock changes are at most this large (the largest in the tz database is 2 h), and a
# wall-clock time's instants lie within this of it: the window searched near a change.
_SHIFT = timedelta(hours=3)


class CronError(ValueError):
    """A cron expression or time zone that cannot be used; the message says which and why."""


class Cron:
    """A cron expression (five fields, six with seconds first, or an alias) in a time zone."""

    def __init__(self, expression: str, timezone: str = "UTC") -> None:
        if not isinstance(expression, str):
            raise CronError(f"cron expression must be a string, got {type(expression).__name__}")
        if not isinstance(timezone, str):
            raise CronError(
                f"timezone must be a string such as 'Europe/Berlin', got {type(timezone).__name__}"
            )
        text = " ".join(expression.split())
        fields = ALIASES.get(text.lower(), text)
        parts = fields.split()
        if len(parts) not in (5, 6):
            raise CronError(
                f"cron expression {expression!r} has {len(parts)} field(s): use five "
                "(minute hour day-of-month month day-of-week), six with seconds first, "
                f"or one of {', '.join(ALIASES)}"
            )
        try:
            self.tz = ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise CronError(
                f"timezone {timezone!r} is not a known IANA time zone (e.g. 'Europe/Berlin')"
            ) from exc
        try:
            CronSim(fields, datetime(2000, 1, 1))
        except CronSimError as exc:
            raise CronError(f"cron expression {expression!r} is invalid: {exc}") from exc
        self.expression = text
        self.timezone = timezone
        self._fields = fields
        self.has_seconds = len(parts) == 6
        # Hour field "*": runs at least hourly, so it follows elapsed time through a repeated hour.
        self.follows_elapsed_time = parts[2 if self.has_seconds else 1] == "*"
        if self.next_after(datetime(2000, 1, 1, tzinfo=UTC)) is None:
            raise CronError(f"cron expression {expression!r} names no time at all (for example 30 February)")

    def __repr__(self) -> str:
        return f"Cron({self.expression!r}, {self.timezone!r})"

    def next_after(self, instant: datetime) -> datetime | None:
        """The first slot strictly after ``instant`` (an aware datetime), in UTC; None if none."""
        after = instant.astimezone(UTC)
        wall = after.astimezone(self.tz).replace(tzinfo=None, fold=0)
        if self._offset(after - _SHIFT) == self._offset(after + _SHIFT):
            # No clock change near ``after``: the first later wall-clock time that names
            # an instant gives the slot (its first instant is the earliest of all later ones).
            for candidate in self._walk(wall):
                slots = [slot for slot in self._instants(candidate) if slot > after]
                if slots:
                    return slots[0]
            return None
        # Near a change: instants of wall-clock times a little before ``wall`` may still
        # lie after ``after`` (the second pass of a repeated hour), so look from before it.
        best: datetime | None = None
        for candidate in self._walk(wall - _SHIFT):
            if best is not None and candidate > wall + _SHIFT:
                break
            for slot in self._instants(candidate):
                if slot > after and (best is None or slot < best):
                    best = slot
        return best

    def slots(self, after: datetime, until: datetime) -> Iterator[datetime]:
        """The slots in (after, until], in order, as UTC datetimes."""
        slot = self.next_after(after)
        while slot is not None and slot <= until:
            yield slot
            slot = self.next_after(slot)

    def explain(self) -> str:
        """The expression in words (cronsim's explanation), for listings."""
        return CronSim(self._fields, datetime(2000, 1, 1)).explain()

    def _walk(self, start: datetime) -> Iterator[datetime]:
        """Naive wall-clock matches strictly after ``start``; ends where cronsim gives up (50 years)."""
        return CronSim(self._fields, start)

    def _instants(self, wall: datetime) -> list[datetime]:
        """The UTC instants one naive wall-clock time names in this zone, by the rules above."""
        first = wall.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=self.tz, fold=1).astimezone(UTC)
        if first == second:
            return [first]
        if first.astimezone(self.tz).replace(tzinfo=None) != wall:
            return []  # in the gap when clocks go forward: this wall-clock time never happens
        return [first, second] if self.follows_elapsed_time else [first]

    def _offset(self, instant: datetime) -> timedelta | None:
        return instant.astimezone(self.tz).utcoffset()
