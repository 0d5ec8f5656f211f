"""Tasks that wait for the test to let them go, instead of sleeping for a guessed time.

A gate is a PostgreSQL advisory lock the test holds (``hold_gate``): a gated task takes it
shared, which waits until the test lets it go, then returns. So "a child busy with a long
task" lasts exactly as long as the test needs, and ends the moment the test says so.
Tasks that carry a token write it to the ledger first (tests/apps/basic.py), so the test
can wait for the task's code to be running.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from tests.apps.basic import ledger
from tests.apps.gate_locks import wait_for_gate
from tether import AppConfig, TaskError, TaskResult, Tether, report_progress, report_progress_async

app = Tether(AppConfig(queues=["default"]))


@app.task("gated")
def gated(key: int, token: str) -> TaskResult[str, TaskError]:
    """Runs (ledger), then holds its sync child until the test lets gate ``key`` go."""
    ledger(token)
    wait_for_gate(key)
    return TaskResult(ok=token)


@app.task("digest")
def digest(blob: str) -> TaskResult[dict[str, object], TaskError]:
    """What arrived: the length and the SHA-256 of ``blob`` (the test compares them)."""
    return TaskResult(ok={"length": len(blob), "sha256": hashlib.sha256(blob.encode()).hexdigest()})


@app.task("record")
def record(token: str) -> TaskResult[str, TaskError]:
    ledger(token)
    return TaskResult(ok=token)


@app.task("record_async")
async def record_async(token: str) -> TaskResult[str, TaskError]:
    await asyncio.to_thread(ledger, token)
    return TaskResult(ok=token)


@app.task("gated_async")
async def gated_async(key: int, token: str) -> TaskResult[str, TaskError]:
    """The async twin of ``gated``: waits for the gate in a thread, the event loop goes on."""
    await asyncio.to_thread(ledger, token)
    await asyncio.to_thread(wait_for_gate, key)
    return TaskResult(ok=token)


@app.task("reporter")
async def reporter(go: int, end: int, form: str) -> bool:
    """Once gate ``go`` opens, reports progress (``form``: "sync" for report_progress, "async" for
    report_progress_async), then waits for gate ``end``; returns what the report returned."""
    await asyncio.to_thread(wait_for_gate, go)
    if form == "async":
        stored = await report_progress_async("half", 0.5, "halfway")
    else:
        stored = report_progress("half", 0.5, "halfway")
    await asyncio.to_thread(wait_for_gate, end)
    return stored


@app.task("progress_checks")
async def progress_checks(go: int, token: str) -> None:
    """What both forms of report say to bad arguments, and, once gate ``go`` opens (the test has
    given the task to another worker meanwhile), to a task no longer this worker's. Its outcome
    cannot be recorded then: it writes its findings to the ledger, as ``<token> <json>``."""
    bad: list[tuple[Any, Any, Any]] = [("", 0.5, None), ("s", 1.5, None), ("s", True, None), ("s", None, 3)]
    errors: dict[str, list[str]] = {"sync": [], "async": []}
    for args in bad:
        try:
            report_progress(*args)
        except ValueError as exc:
            errors["sync"].append(str(exc))
        try:
            await report_progress_async(*args)
        except ValueError as exc:
            errors["async"].append(str(exc))
    await asyncio.to_thread(wait_for_gate, go)
    findings = {
        "errors": errors,
        "async": await report_progress_async("after", 1.0),
        "sync_in_a_thread": await asyncio.to_thread(report_progress, "after", 1.0),
        "sync_on_the_loop": report_progress("after", 1.0),  # what the last report written said
    }
    await asyncio.to_thread(ledger, f"{token} {json.dumps(findings)}")
