"""``tether queues``: every queue with its counts, pause and limits; ``tether queue pause|resume
NAME``; ``tether queue limit|unlimit NAME`` (docs/limits.md)."""

from __future__ import annotations

import click
from rich.table import Table
from rich.text import Text

from tether.broker import PostgresBroker, limited_claims
from tether.broker import queues as queue_rows
from tether.broker.limited_claims import LimitUse
from tether.cli import common
from tether.limits import QueueLimits
from tether.names import check_queue_name
from tether.queue_control import QueueInfo, list_queues, pause_queue, resume_queue
from tether.result import TaskStatus


@click.command()
@common.db_option
@common.json_option
@click.option(
    "--app",
    "app_path",
    default=None,
    help="module:app whose declared queues are listed too, even those with no task yet.",
)
@common.exact_option
def queues(database_url: str | None, as_json: bool, app_path: str | None, exact: bool) -> None:
    """Every queue: tasks per status, how long the oldest due task has waited, and its pause."""
    also = common.load_config(database_url, app_path).queues if app_path else []
    rows = list_queues(common.open_broker(database_url, app_path), also=also, exact=exact)
    if as_json:
        common.emit_json(rows)
        return
    statuses = [s.value for s in TaskStatus]
    common.console.print(
        common.table(
            "Queues",
            ["queue", "state", *statuses, "oldest due"],
            [
                [
                    r.queue,
                    _state(r),
                    *(common.count_text(r.counts[s], s in r.estimated) for s in statuses),
                    _age(r.oldest_pending_age_s),
                ]
                for r in rows
            ],
        )
    )
    if any(r.estimated for r in rows):
        common.console.print(common.ESTIMATE_NOTE, markup=False, highlight=False)
    uses = common.open_broker(database_url, app_path).run(limited_claims.limit_uses)
    if uses:
        common.console.print(limits_table(uses))
        key_rates = key_rates_table(uses)
        if key_rates is not None:
            common.console.print(key_rates)
    # Since when and by whom under the table, one line each: the table stays narrow.
    for r in rows:
        if r.paused:
            common.console.print(
                f"queue {r.queue} paused since {common.ts(r.paused_at)} by {r.paused_by or '(not given)'}",
                markup=False,
                highlight=False,
            )


def limits_table(uses: list[LimitUse]) -> Table:
    """The flow-controlled queues: each limit with its use now ("in use / limit")."""
    return common.table(
        "Limits (docs/limits.md)",
        ["queue", "in flight", "per key", "busiest key", "keys at limit", "rate", "tokens", "weights"],
        [
            [
                u.queue,
                f"{u.in_flight} / {u.limits.max_in_flight}" if u.limits.max_in_flight else str(u.in_flight),
                str(u.limits.per_key or ""),
                str(u.busiest_key_in_flight) if u.keys_in_flight else "",
                str(u.keys_at_limit) if u.limits.per_key else "",
                _rate(u.limits),
                "" if u.tokens is None else f"{u.tokens:.1f}",
                ", ".join(f"{k}={w:g}" for k, w in sorted(u.limits.key_weights.items())),
            ]
            for u in uses
        ],
    )


def _rate(limits: QueueLimits) -> str:
    if limits.rate_limit is None:
        return ""
    burst = f", burst {limits.burst}" if limits.burst else ""
    return f"{limits.rate_limit} per {limits.rate_period_s:g}s{burst}"


def key_rates_table(uses: list[LimitUse]) -> Table | None:
    """The queues with a rate per key (a table of its own: the limits table is full): each
    rate, and how many keys have spent their tokens now. None: no such queue."""
    rated = [u for u in uses if u.limits.key_rate_limit is not None]
    if not rated:
        return None
    return common.table(
        "Rates per key (docs/limits.md)",
        ["queue", "rate per key", "keys out of tokens"],
        [[u.queue, _key_rate(u.limits), str(u.keys_out_of_tokens or 0)] for u in rated],
    )


def _key_rate(limits: QueueLimits) -> str:
    if limits.key_rate_limit is None:
        return ""
    burst = f", burst {limits.key_burst}" if limits.key_burst else ""
    return f"{limits.key_rate_limit} per {limits.key_rate_period_s:g}s{burst}"


def _state(row: QueueInfo) -> Text:
    return Text("paused", style="yellow") if row.paused else Text("active", style="green")


def _age(seconds: float | None) -> str:
    """A waiting time as people read it: 4.2s, 3m 07s, 2h 05m, 3d 04h."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86_400}d {whole % 86_400 // 3600:02d}h"


@click.group()
def queue() -> None:
    """Pause or resume one queue (docs/queues.md)."""


by_option = click.option(
    "--by",
    default=None,
    callback=common.by_checked,
    help="Who asks: stored with the pause and logged (default: cli:<user>@<host>).",
)
name_argument = click.argument("name", callback=common.checked(check_queue_name, "queue"))


def _warn_if_unknown(broker: PostgresBroker, name: str) -> None:
    if not broker.run(lambda conn: queue_rows.queue_known(conn, name)):
        click.echo(
            f"warning: no task of queue {name} is known (none in the database, no worker serves "
            "it and no schedule sends to it): is the name right?",
            err=True,
        )


def _since(held: queue_rows.Pause | None, lead: str = "") -> str:
    if held is None:
        return ""
    return f" ({lead}since {common.ts(held.paused_at)}, by {held.paused_by or '(not given)'})"


@queue.command()
@name_argument
@by_option
@common.db_option
def pause(name: str, by: str | None, database_url: str | None) -> None:
    """Stop workers claiming from queue NAME until it is resumed.

    Running tasks go on; claimed tasks that no child has been handed yet go back to
    PENDING; sends to NAME are still accepted and wait.
    """
    broker = common.open_broker(database_url)
    if pause_queue(broker, name, by=by or common.who_asks()):
        click.echo(
            f"queue {name} paused; workers stop claiming from it within 1 s; running tasks go on; "
            "sends are still accepted"
        )
    else:
        held = broker.run(lambda conn: queue_rows.get_pause(conn, name))
        click.echo(f"queue {name} was already paused{_since(held)}; nothing changed")
    _warn_if_unknown(broker, name)


@queue.command()
@name_argument
@by_option
@common.db_option
def resume(name: str, by: str | None, database_url: str | None) -> None:
    """Let workers claim from queue NAME again; they do at once."""
    broker = common.open_broker(database_url)
    held = broker.run(lambda conn: queue_rows.get_pause(conn, name))
    if resume_queue(broker, name, by=by or common.who_asks()):
        click.echo(f"queue {name} resumed{_since(held, 'it was paused ')}; workers claim from it at once")
    else:
        click.echo(f"queue {name} was not paused; nothing changed")
        _warn_if_unknown(broker, name)


def _weights(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in value:
        key, sep, weight = item.rpartition("=")
        try:
            weights[key] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: give KEY=WEIGHT, e.g. tenant-7=2", param=param)
    return weights


@queue.command()
@name_argument
@click.option(
    "--max-in-flight", type=int, default=None, help="At most N tasks of the queue CLAIMED or RUNNING."
)
@click.option("--per-key", type=int, default=None, help="At most N in flight per concurrency key.")
@click.option("--rate", "rate_limit", type=int, default=None, help="At most N claims per --per seconds.")
@click.option("--per", "rate_period_s", type=float, default=1.0, show_default=True, help="The rate's period.")
@click.option("--burst", type=int, default=None, help="The rate's bucket (default: --rate).")
@click.option(
    "--key-rate",
    "key_rate_limit",
    type=int,
    default=None,
    help="At most N claims per --key-per seconds, per key.",
)
@click.option(
    "--key-per",
    "key_rate_period_s",
    type=float,
    default=1.0,
    show_default=True,
    help="The per-key rate's period.",
)
@click.option("--key-burst", type=int, default=None, help="Each key's bucket (default: --key-rate).")
@click.option("--weight", "weights", multiple=True, callback=_weights, help="KEY=WEIGHT in the round-robin.")
@by_option
@common.db_option
def limit(
    name: str,
    max_in_flight: int | None,
    per_key: int | None,
    rate_limit: int | None,
    rate_period_s: float,
    burst: int | None,
    key_rate_limit: int | None,
    key_rate_period_s: float,
    key_burst: int | None,
    weights: dict[str, float],
    by: str | None,
    database_url: str | None,
) -> None:
    """Set queue NAME's limits (replacing any), for every worker at once.

    With no option the queue is still flow-controlled: its keys are served round-robin.
    A worker whose app declares limits for NAME writes its own when it starts.
    """
    try:
        limits = QueueLimits(
            max_in_flight=max_in_flight,
            per_key=per_key,
            rate_limit=rate_limit,
            rate_period_s=rate_period_s,
            burst=burst,
            key_weights=weights,
            key_rate_limit=key_rate_limit,
            key_rate_period_s=key_rate_period_s,
            key_burst=key_burst,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    broker = common.open_broker(database_url)
    changed = broker.run(lambda conn: limited_claims.set_limits(conn, name, limits, by or common.who_asks()))
    click.echo(
        f"queue {name}: limits set; claims apply them from now on"
        if changed
        else f"queue {name}: limits unchanged"
    )
    _warn_if_unknown(broker, name)


@queue.command()
@name_argument
@common.db_option
def unlimit(name: str, database_url: str | None) -> None:
    """Remove queue NAME's limits: the plain claim takes it again (workers are told at once)."""
    broker = common.open_broker(database_url)
    if broker.run(lambda conn: limited_claims.drop_limits(conn, name)):
        click.echo(f"queue {name}: limits removed")
    else:
        click.echo(f"queue {name} had no limits; nothing changed")
