"""The machine's batched claim limit, taken with pgbench in the same run as the drains.

Issue 25, item 3 holds tether's steady drain rate to "half of pgbench's batched claim limit"
(two async children to 0.7x of it), and the issue's own table takes that limit as pgbench
claiming and completing batches of 10 in two transactions. This scenario measures that
limit on the run's own server, in the same rounds as the drains, so the ratio is taken
between figures of one spell instead of against a number from another day.

The queue is a logged table of ``ROWS`` pending rows (a bigint id, a status, a small jsonb
payload: the shape of a minimal task row), with a partial index on the pending ones, made
afresh and vacuumed before each measurement. Two pgbench scripts, ``SECONDS`` each, one and
two clients, prepared statements:

- ``claim then end`` (the issue's shape, "claim + complete, 2 tx"): one statement claims up
  to 10 pending rows with ``FOR UPDATE SKIP LOCKED`` and marks them claimed, a second ends
  them; each statement is its own durable transaction, so a batch of 10 costs two commits,
  as a queue with a visible claim needs at the least;
- ``claim and end``: one statement claims and ends 10 rows (one commit a batch): no queue
  that records a claim before the work runs can do this, so it is an upper bound, shown for
  context.

Figure: rows per second, pgbench's "tps" x 10 (pgbench counts one run of a script as one
transaction, whatever the number of its statements and commits).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

BATCH = 10
ROWS = 400_000
SECONDS = 8

SETUP = (
    "DROP TABLE IF EXISTS bench_claim_limit",
    "CREATE TABLE bench_claim_limit (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " status smallint NOT NULL DEFAULT 0, args jsonb NOT NULL DEFAULT '[]')",
    f"INSERT INTO bench_claim_limit (status) SELECT 0 FROM generate_series(1, {ROWS})",
    "CREATE INDEX bench_claim_limit_pending ON bench_claim_limit (id) WHERE status = 0",
    "VACUUM ANALYZE bench_claim_limit",
)

_CLAIM = f"SELECT id FROM bench_claim_limit WHERE status = 0 ORDER BY id LIMIT {BATCH} FOR UPDATE SKIP LOCKED"
SCRIPTS: dict[str, str] = {
    "claim then end": (
        f"WITH c AS ({_CLAIM}), u AS (UPDATE bench_claim_limit t SET status = 1 FROM c WHERE t.id = c.id"
        " RETURNING t.id) SELECT coalesce(array_agg(id), '{}') AS ids FROM u\n\\gset\n"
        "UPDATE bench_claim_limit SET status = 2 WHERE id = ANY (CAST(:ids AS bigint[]));\n"
    ),
    "claim and end": (
        f"WITH c AS ({_CLAIM}) UPDATE bench_claim_limit t SET status = 2 FROM c WHERE t.id = c.id;\n"
    ),
}
CLIENTS = (1, 2)

_TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)


def pgbench() -> str:
    """The pgbench executable, or a clear error naming the package that has it."""
    found = shutil.which("pgbench")
    if found is None:
        raise RuntimeError(
            "the claim-limit scenario needs pgbench (Debian: apt-get install postgresql-client)"
        )
    return found


def claim_limit(url: str, seconds: float = SECONDS) -> dict[str, dict[str, Any]]:
    """Rows/s of each script at each client count, on database ``url``."""
    exe = pgbench()
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tether-claim-limit-") as tmp:
        for name, text in SCRIPTS.items():
            script = Path(tmp) / (name.replace(" ", "_") + ".sql")
            script.write_text(text)
            for clients in CLIENTS:
                _setup(url)
                tps = _run(exe, url, script, clients, seconds)
                out[f"pgbench {name}, {clients} client{'s' if clients > 1 else ''}"] = {
                    "limit_rows_per_s": tps * BATCH,
                    "meaning": f"batches of {BATCH}, {ROWS:,} rows, {seconds:g} s, prepared statements",
                }
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_claim_limit")
    return out


def _setup(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in SETUP:
            conn.execute(statement)


def _run(exe: str, url: str, script: Path, clients: int, seconds: float) -> float:
    done = subprocess.run(
        [
            exe,
            "-n",
            "-M",
            "prepared",
            "-c",
            str(clients),
            "-j",
            str(clients),
            "-T",
            f"{seconds:g}",
            "-f",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    found = _TPS.search(done.stdout)
    if done.returncode != 0 or found is None:
        said = done.stderr.strip() or done.stdout.strip()
        raise RuntimeError(f"pgbench failed ({done.returncode}): {said}")
    return float(found.group(1))
