"""``tether workflows`` (recent workflows, filtered) and ``tether workflow ID`` (one workflow,
its steps as a tree; --cancel, --resume), with how a workflow is shown as a tree and as JSON."""

from __future__ import annotations

import base64
import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import click
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from tether.app import Tether
from tether.broker.workflows import list_workflows
from tether.cli import common
from tether.errors import WorkflowNotFoundError
from tether.ids import parse_task_id
from tether.result import StepStatus, TaskError, TaskResult, WorkflowStatus
from tether.workflow.handle import StepInfo, WorkflowHandle, WorkflowInfo


def _app(database_url: str | None) -> Tether:
    """A bare app (no tasks) on the command's database: enough for a WorkflowHandle."""
    app = Tether(common.load_config(database_url))
    click.get_current_context().call_on_close(app.close)
    return app


# -- tether workflows -----------------------------------------------------------------------


@click.command()
@common.db_option
@common.json_option
@click.option(
    "--status", "status_", type=click.Choice([s.value for s in WorkflowStatus], case_sensitive=False)
)
@click.option("--name", default=None, help="Exact workflow name.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
def workflows(
    database_url: str | None, as_json: bool, status_: str | None, name: str | None, limit: int
) -> None:
    """Recent workflows, newest first, filtered by status or name."""
    status = WorkflowStatus(status_.upper()) if status_ else None
    rows = common.open_broker(database_url).run(
        lambda c: list_workflows(c, status=status, name=name, limit=limit)
    )
    if as_json:
        common.emit_json([dataclasses.asdict(r) for r in rows])
        return
    table = common.table(
        "Workflows",
        ["id", "name", "status", "steps", "failed", "created", "finished"],
        [
            [
                r.id,
                r.name,
                common.status_text(r.status),
                f"{r.steps_done}/{r.steps_total}",
                r.steps_failed,
                common.ts(r.created_at),
                common.ts(r.finished_at),
            ]
            for r in rows
        ],
    )
    common.console.print(table)


# -- tether workflow ID ---------------------------------------------------------------------


@click.command()
@click.argument("workflow_id")
@common.db_option
@common.json_option
@click.option(
    "--cancel", is_flag=True, help="Cancel it: steps not started are cancelled, running ones finish."
)
@click.option("--resume", is_flag=True, help="Resume it if it is PAUSED: steps that became ready start.")
def workflow(workflow_id: str, database_url: str | None, as_json: bool, cancel: bool, resume: bool) -> None:
    """One workflow with its steps as a tree (each step under the steps it waits for)."""
    if cancel and resume:
        raise click.UsageError("--cancel and --resume cannot be used together")
    wid = parse_task_id(workflow_id, what="workflow id")
    handle = WorkflowHandle(_app(database_url), wid)
    info = _read(handle)
    acted: bool | None = None
    message: Text | None = None
    if cancel:
        acted = handle.cancel()
        before, info = info, _read(handle)
        message = _cancelled(before, info) if acted else _not_acted(info, "cancel", "it has already ended")
    elif resume:
        acted = handle.resume()
        before, info = info, _read(handle)
        message = _resumed(before, info) if acted else _not_acted(info, "resume", "it is not PAUSED")
    if as_json:
        action = {"cancelled": acted} if cancel else {"resumed": acted} if resume else {}
        common.emit_json({**action, **info_json(info)})
        return
    if message is not None:
        common.console.print(message)
    common.console.print(_fields(info))
    common.console.print(steps_tree(info.steps, max_depth=max(4, (common.console.width - 40) // 4)))


def _read(handle: WorkflowHandle) -> WorkflowInfo:
    try:
        return handle.info()
    except WorkflowNotFoundError:
        raise click.ClickException(
            f"no workflow with id {handle.id} (never started, or pruned by retention)"
        ) from None


def _cancelled(before: WorkflowInfo, after: WorkflowInfo) -> Text:
    was = {s.name: s.status for s in before.steps}
    stopped = sum(1 for s in after.steps if s.status is StepStatus.CANCELLED and was[s.name] != s.status)
    running = sum(1 for s in after.steps if s.status is StepStatus.ENQUEUED)
    return Text(
        f"workflow {after.id} cancelled: {stopped} step(s) that had not started were cancelled, "
        f"{running} step(s) already running will finish"
    )


def _resumed(before: WorkflowInfo, after: WorkflowInfo) -> Text:
    was = {s.name: s.status for s in before.steps}
    started = sum(
        1 for s in after.steps if was[s.name] is StepStatus.READY and s.status is not StepStatus.READY
    )
    return Text.assemble(
        f"workflow {after.id} resumed: {started} step(s) that became ready while it was paused "
        "were enqueued; it is now ",
        common.status_text(after.status),
    )


def _not_acted(info: WorkflowInfo, verb: str, why: str) -> Text:
    return Text.assemble(
        f"workflow {info.id} is ", common.status_text(info.status), f": nothing to {verb} ({why})"
    )


def _fields(info: WorkflowInfo) -> Table:
    title = f"Workflow {info.id}"
    fields = Table(title=title, title_justify="left", show_header=False, min_width=len(title))
    rows: list[tuple[str, str | Text]] = [
        ("name", info.name),
        ("status", common.status_text(info.status)),
        ("on_error", info.on_error),
        ("steps", f"{info.steps_done} of {info.steps_total} done, {info.steps_failed} failed"),
        ("created_at", common.ts(info.created_at)),
        ("updated_at", common.ts(info.updated_at)),
        ("paused_at", common.ts(info.paused_at)),
        ("finished_at", common.ts(info.finished_at)),
    ]
    for key, value in rows:
        fields.add_row(key, Text(value) if isinstance(value, str) else value)
    return fields


def steps_tree(steps: Sequence[StepInfo], *, max_depth: int = 10) -> Tree:
    """The steps as a tree: roots at the top, each step's dependents under it.

    A step appears in full once, under its first dependency (the first of ``after``,
    then of ``args_from``), and as a one-line reference under each of the others, so
    the tree has one line per root plus one per dependency edge. A step that would sit
    deeper than ``max_depth`` with dependents of its own continues as a top-level entry
    right after the current one, so long chains do not run off the screen.
    """
    dependents: dict[str, list[StepInfo]] = {s.name: [] for s in steps}
    for s in steps:
        for d in s.depends_on:
            if d in dependents:
                dependents[d].append(s)
    tree = Tree(Text(f"steps ({len(steps)})", style="bold"), guide_style="dim")
    printed: set[str] = set()
    tops: deque[tuple[StepInfo, str | None]] = deque((s, None) for s in steps if not s.depends_on)
    rest = iter(steps)  # steps no root leads to (only in rows changed by hand) are listed last
    while True:
        if tops:
            top, came_from = tops.popleft()
        else:
            unplaced = next((s for s in rest if s.name not in printed), None)
            if unplaced is None:
                return tree
            top, came_from = unplaced, None
        if top.name in printed:
            continue
        continued: list[tuple[StepInfo, str | None]] = []
        stack: list[tuple[Tree, StepInfo, int, str | None]] = [(tree, top, 1, None)]
        while stack:
            parent, step, depth, via = stack.pop()
            if step.name in printed or (via is not None and step.depends_on[0] != via):
                where = "see above" if step.name in printed else "see below"
                parent.add(Text.assemble(("↳ ", "dim"), step.name, (f" ({where})", "dim")))
                continue
            children = dependents[step.name]
            if via is not None and depth > max_depth and children:
                continued.append((step, via))
                parent.add(Text.assemble(("↳ ", "dim"), step.name, (" (continued below)", "dim")))
                continue
            printed.add(step.name)
            label = _step_line(step)
            if via is None and came_from is not None:
                label.append(f"  (continued from {came_from})", style="dim")
            branch = parent.add(label)
            stack.extend((branch, child, depth + 1, step.name) for child in reversed(children))
        tops.extendleft(reversed(continued))


def _step_line(step: StepInfo) -> Text:
    line = Text(step.name, style="bold")
    if step.task_name != step.name:
        line.append(f"  {step.task_name}", style="dim")
    line.append("  ")
    line.append_text(common.status_text(step.status))
    if step.task_status is not None:
        line.append("  task ", style="dim")
        line.append_text(common.status_text(step.task_status))
        if step.attempt:
            line.append(f", attempt {step.attempt}", style="dim")
    if step.error_code and step.status in (StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.CANCELLED):
        line.append(f"  {step.error_code}", style="red")
    if step.join == "any":
        line.append("  join=any", style="cyan")
    if step.run_anyway:
        line.append("  run_anyway", style="cyan")
    return line


def info_json(info: WorkflowInfo) -> dict[str, Any]:
    """The WorkflowInfo as JSON-able data: statuses as strings, results as {"ok"} or {"err"}."""
    data = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "steps"}
    data["steps"] = [
        {
            **{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
            "depends_on": list(s.depends_on),
            "result": _result_json(s.result),
        }
        for s in info.steps
    ]
    return data


def _result_json(result: TaskResult[Any, TaskError] | None) -> Any:
    if result is None:
        return None
    err = result.err
    if err is None:
        return {"ok": _plain(result.ok)}
    return {"err": {"code": str(err.code), "message": err.message, "data": _plain(err.data)}}


def _plain(value: Any) -> Any:
    """A decoded value in JSON's types; bytes as base64, and other values the codec
    restores (datetime, UUID, Decimal, ...) as strings by common.emit_json."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    return value


__all__ = ["info_json", "steps_tree", "workflow", "workflows"]
