"""``tether cancel ID [ID...]``: cancel tasks, running ones too (docs/tasks.md#cancelling-a-running-task)."""

from __future__ import annotations

import click

from tether.cancelling import CancelReply, cancel_task
from tether.cli import common
from tether.errors import TaskNotFoundError
from tether.ids import parse_task_id


@click.command()
@click.argument("task_ids", nargs=-1, required=True, metavar="ID...")
@click.option(
    "--by",
    default=None,
    callback=common.by_checked,
    help="Who asks: kept on the task and in its error (default: cli:<user>@<host>).",
)
@common.db_option
@common.json_option
def cancel(task_ids: tuple[str, ...], by: str | None, database_url: str | None, as_json: bool) -> None:
    """Cancel tasks: not started ones at once; running ones are told to stop (and killed after
    their cancel grace period if they go on). Exits with 1 if any task had already ended or
    does not exist, after trying every one."""
    ids = [parse_task_id(raw) for raw in task_ids]  # every id checked before anything changes
    broker = common.open_broker(database_url)
    who = by or common.who_asks()
    answers: list[dict[str, object]] = []
    for task_id in ids:
        try:
            answer = cancel_task(broker, task_id, by=who)
        except TaskNotFoundError as exc:
            answers.append({"task_id": task_id, "reply": "not_found", "status": None, "message": str(exc)})
            continue
        answers.append(
            {
                "task_id": task_id,
                "reply": answer.reply.value,
                "status": answer.status.value,
                "message": answer.message,
                "requested_at": answer.requested_at,
                "requested_by": answer.requested_by,
                "worker_id": answer.worker_id,
            }
        )
    if as_json:
        common.emit_json(answers)
    else:
        for a in answers:
            common.console.print(f"{a['reply']}: {a['message']}", highlight=False)
    done = {CancelReply.CANCELLED.value, CancelReply.REQUESTED.value}
    if any(a["reply"] not in done for a in answers):
        raise SystemExit(1)
