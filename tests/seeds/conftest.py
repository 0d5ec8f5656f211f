"""The seed documents' code examples, run as written against a real database and real workers.

The seed documents (the pages tether was created from; DESIGN.md section 1) are a contract:
every API and rule they show must keep working under the seed's names. Each test here
holds an example's text as the seed prints it and runs it, with only these changes:

- the seed's library's names become tether's (``SEED_NAMES``): its package and its
  ``horsies_`` tables;
- ``PostgresConfig(...)``, the seed's placeholder, gets this run's database URL;
- indentation lost by the page's scrape is restored (Python needs it);
- seed 001's examples are Rust: they are written as the same call in Python, field for
  field, the Rust text kept beside them; seeds 002 and 003 show another system's code (a
  Node.js job queue, a Rust executor): what runs here is the behaviour each example shows,
  and their SQL against tether's tables.

When a seed example stops working, a test here fails: such a change needs an issue, not a
quiet edit (docs/internals.md#the-seed-contract).
"""

from __future__ import annotations

import ast
import contextlib
import io
from datetime import timedelta
from typing import Any

import psycopg

from tests.chaos.conftest import chaos as chaos  # the chaos app fixture, for the seed tests too
from tests.chaos.conftest import stopped_groups as stopped_groups

#: The seed's library's names and what they are in tether, applied in this order.
SEED_NAMES: tuple[tuple[str, str], ...] = (
    ("horsies.core.models.recovery", "tether"),
    ("horsies_", "tether_"),
    ("horsies", "tether"),
)

Conn = psycopg.Connection[Any]


def as_tether(seed_text: str, database_url: str | None = None) -> str:
    """The example with the seed's names mapped to tether's, and nothing else changed."""
    text = seed_text
    for seed_name, tether_name in SEED_NAMES:
        text = text.replace(seed_name, tether_name)
    if database_url is not None:
        text = text.replace("PostgresConfig(...)", f"PostgresConfig(database_url={database_url!r})")
    return text


async def run_example(seed_text: str, namespace: dict[str, Any], database_url: str | None = None) -> str:
    """Run a Python example (top-level ``await`` allowed, as the seed writes it); what it printed.

    As in the interactive interpreter, the value of a last bare expression (an example that
    is just ``RecoveryConfig(...)``) is left in ``namespace["_"]``.
    """
    tree = ast.parse(as_tether(seed_text, database_url))
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        tree.body[-1] = ast.copy_location(
            ast.Assign(targets=[ast.Name("_", ast.Store())], value=last.value), last
        )
        ast.fix_missing_locations(tree)
    code = compile(tree, "<seed example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pending = eval(code, namespace)  # a coroutine when the example awaits
        if pending is not None:
            await pending
    return printed.getvalue()


def age_rows(conn: Conn, task_ids: list[Any], by: timedelta) -> None:
    """Move a dead worker's task and heartbeat times ``by`` into the past.

    The seed's manual recovery examples use thresholds of minutes (5 min, 2 min). Rather than
    wait that long after a real kill, the test moves the times the rules read (claim, start,
    progress, heartbeats) back by the same amount, which is what waiting would have done.
    """
    conn.execute(
        "UPDATE tether_tasks SET claimed_at = claimed_at - %(by)s, started_at = started_at - %(by)s,"
        " progress_at = progress_at - %(by)s WHERE id = ANY(%(ids)s::uuid[])",
        {"by": by, "ids": [str(i) for i in task_ids]},
    )
    conn.execute(
        "UPDATE tether_heartbeats SET sent_at = sent_at - %(by)s WHERE task_id = ANY(%(ids)s::uuid[])",
        {"by": by, "ids": [str(i) for i in task_ids]},
    )
