"""Fill a tether database with a large, realistic history fast, in SQL: the `millions` scenario's data.

Everything is made by ``INSERT ... SELECT generate_series`` in batches of BATCH rows, one
transaction each, in id order (UUIDv7 made from each row's time, so the primary key grows
at its right edge, as sends make it grow). Choices (queue, name, status, error code,
durations) come from ``hashint8`` of the row's number: the same parameters give the same
mix every time, without a random source.

What it makes, for ``pending`` P and ``terminal`` T:

- T terminal tasks sent over the last 20 hours (until half an hour ago: about 140 a
  second): 97.49 % COMPLETED, 2 % FAILED (six error codes, one of them rare), 0.5 %
  CANCELLED, 0.01 % EXPIRED; queues with unequal shares (``default`` 30 %, down to
  ``audit`` 0.5 % and ``maintenance`` 0.01 %), two task names per queue (``noop`` in
  ``default``: the bench app's); JSON arguments, keyword arguments and results of a few
  hundred bytes; 5 % of those that ran were retried once. Each task that ran has its
  attempt rows and one runner heartbeat.
- P PENDING tasks sent over the last 6 hours: 10 % delayed (``run_at`` up to a day ahead),
  5 % with a ``good_until`` deadline 1-48 hours ahead, 10 % at priority 10; ``default``'s
  are ``noop`` tasks a bench worker can run.
- T/1000 finished workflows of 5 steps (their step tasks count in T) and P/1000 running
  ones (2 steps done, the third's task PENDING in ``reports``, two waiting).
- IN_FLIGHT tasks held by one fake active worker ``bench-fleet`` (2/3 RUNNING, 1/3
  CLAIMED), with fresh heartbeats: refresh_in_flight() makes them fresh again before a
  measurement, so no reaper finds them stale.
- 48 stopped workers of the past.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

BATCH = 250_000
# The history's span: within the default heartbeat retention (24 h), so the fill's
# heartbeats are rows a real deployment keeps, and no reaper prunes them for a few hours.
HISTORY_HOURS = 20
IN_FLIGHT = 300
FLEET_WORKER = "bench-fleet"
STEPS = 5
FAILURE = '{"err": {"code": "HTTP_500", "message": "upstream answered HTTP_500", "data": null}}'

# (queue, share in 200ths, its two task names)
QUEUES: list[tuple[str, int, tuple[str, str]]] = [
    ("default", 60, ("noop", "noop")),
    ("emails", 50, ("send_email", "send_digest")),
    ("webhooks", 30, ("deliver_webhook", "retry_webhook")),
    ("reports", 20, ("render_report", "export_csv")),
    ("images", 20, ("resize_image", "make_thumbnail")),
    ("billing", 10, ("charge_card", "refund")),
    ("exports", 9, ("export_account", "export_archive")),
    ("audit", 1, ("audit_log", "audit_scan")),
]
ERROR_CODES = ["HTTP_500", "HTTP_500", "TIMEOUT", "TIMEOUT", "HTTP_429", "VALIDATION", "WORKER_CRASHED"]
RARE_QUEUE = "maintenance"  # every 10,000th task
RARE_NAME = "rebuild_index"
RARE_ERROR = "CERT_EXPIRED"  # 1 failure in 5,000


def _slots() -> tuple[list[str], list[str]]:
    queues, names = [], []
    for queue, share, (a, b) in QUEUES:
        for k in range(share):
            queues.append(queue)
            names.append(a if k % 2 == 0 else b)
    assert len(queues) == 200
    return queues, names


UUID7 = """
CREATE OR REPLACE FUNCTION pg_temp.uuid7(at timestamptz) RETURNS uuid LANGUAGE sql VOLATILE AS $$
SELECT encode(set_byte(overlay(uuid_send(gen_random_uuid())
                               PLACING substring(int8send(floor(extract(epoch FROM at) * 1000)::bigint)
                                                 FROM 3)
                               FROM 1 FOR 6),
                       6, 112 | (random() * 15)::int), 'hex')::uuid
$$;
"""

# Row i of n (global numbering), spread evenly over [start, stop).
TERMINAL = """
INSERT INTO tether_tasks (id, name, queue, priority, status, args, kwargs, result, error_code,
                          attempt, retry_count, max_retries, good_until, run_at, sent_at, enqueued_at,
                          claimed_at, started_at, completed_at, failed_at, cancelled_at, expired_at,
                          updated_at, claimed_by_worker_id)
SELECT pg_temp.uuid7(sent_at), name, queue, priority, status, args, kwargs,
       CASE status
           WHEN 'COMPLETED' THEN jsonb_build_object('ok', jsonb_build_object(
               'id', i, 'bytes', r2 %% 1000000, 'path', 's3://tether-bench/out/' || i || '.json'))
           ELSE jsonb_build_object('err', jsonb_build_object(
               'code', code, 'message', CASE status
                   WHEN 'FAILED' THEN 'upstream answered ' || code || ' for request ' || md5(i::text)
                   WHEN 'CANCELLED' THEN 'cancelled before it ran (by dashboard:10.0.0.7)'
                   ELSE 'good_until passed before a worker claimed it' END,
               'data', NULL))
       END,
       code, CASE WHEN ran THEN 1 + retried ELSE 0 END, retried, CASE WHEN retried = 1 THEN 3 ELSE 0 END,
       CASE WHEN status = 'EXPIRED' THEN sent_at + interval '10 minutes' END,
       sent_at, sent_at, sent_at,
       CASE WHEN ran THEN sent_at + interval '40 ms' END,
       CASE WHEN ran THEN sent_at + interval '50 ms' END,
       CASE WHEN status = 'COMPLETED' THEN finished END,
       CASE WHEN status = 'FAILED' THEN finished END,
       CASE WHEN status = 'CANCELLED' THEN finished END,
       CASE WHEN status = 'EXPIRED' THEN sent_at + interval '10 minutes' END,
       CASE WHEN status = 'EXPIRED' THEN sent_at + interval '10 minutes' ELSE finished END,
       CASE WHEN ran THEN 'host-' || (r2 %% 20) || '-' || (1000 + r2 %% 20) || '-a1b2c3' END
FROM (
    SELECT i, r2, sent_at, queue, name, priority, args, kwargs, status,
           status IN ('COMPLETED', 'FAILED') AS ran,
           CASE WHEN status IN ('COMPLETED', 'FAILED') AND r3 %% 20 = 0 THEN 1 ELSE 0 END AS retried,
           CASE status
               WHEN 'FAILED' THEN CASE WHEN r2 %% 5000 = 7 THEN %(rare_error)s
                                       ELSE (%(codes)s::text[])[1 + r3 %% cardinality(%(codes)s::text[])] END
               WHEN 'CANCELLED' THEN 'TASK_CANCELLED'
               WHEN 'EXPIRED' THEN 'TASK_EXPIRED'
           END AS code,
           sent_at + interval '50 ms' + (r2 %% 3000) * interval '1 ms' AS finished
    FROM (
        SELECT i, r2, r3,
               %(start)s::timestamptz + (%(stop)s::timestamptz - %(start)s::timestamptz) * (i::float8 / %(n)s)
                   AS sent_at,
               CASE WHEN i %% 10000 = 17 THEN %(rare_queue)s
                    ELSE (%(queues)s::text[])[1 + r1 %% 200] END AS queue,
               CASE WHEN i %% 10000 = 17 THEN %(rare_name)s
                    ELSE (%(names)s::text[])[1 + r1 %% 200] END AS name,
               CASE WHEN r2 %% 10 = 0 THEN 10 ELSE 0 END AS priority,
               jsonb_build_array(i, 'user-' || (r2 %% 100000),
                                 jsonb_build_object('tenant', 't' || (r3 %% 50))) AS args,
               jsonb_build_object('trace_id', md5(i::text), 'locale', 'en_GB') AS kwargs,
               CASE WHEN r3 %% 10000 < 9749 THEN 'COMPLETED' WHEN r3 %% 10000 < 9949 THEN 'FAILED'
                    WHEN r3 %% 10000 < 9999 THEN 'CANCELLED' ELSE 'EXPIRED' END AS status
        FROM (SELECT i, abs(hashint8(i)) AS r1, abs(hashint8(i + 7919)) AS r2, abs(hashint8(i + 104729)) AS r3
              FROM generate_series(%(lo)s::bigint, %(hi)s::bigint - 1) AS i) h
    ) a
) b
ORDER BY b.sent_at;
"""

PENDING = """
INSERT INTO tether_tasks (id, name, queue, priority, status, args, kwargs, good_until, run_at,
                          sent_at, enqueued_at, updated_at)
SELECT pg_temp.uuid7(sent_at), name, queue, priority, 'PENDING',
       -- noop takes no argument: a bench worker runs these
       CASE WHEN name = 'noop' THEN '[]' ELSE args END, CASE WHEN name = 'noop' THEN '{}' ELSE kwargs END,
       CASE WHEN r3 %% 20 = 0 THEN now() + interval '1 hour' + (r3 %% 47) * interval '1 hour' END,
       CASE WHEN r2 %% 10 = 0 THEN sent_at + (1 + r3 %% 86400) * interval '1 second' ELSE sent_at END,
       sent_at, sent_at, sent_at
FROM (
    SELECT i, r2, r3,
           %(start)s::timestamptz + (%(stop)s::timestamptz - %(start)s::timestamptz) * (i::float8 / %(n)s)
               AS sent_at,
           CASE WHEN i %% 10000 = 17 THEN %(rare_queue)s
                ELSE (%(queues)s::text[])[1 + r1 %% 200] END AS queue,
           CASE WHEN i %% 10000 = 17 THEN %(rare_name)s
                ELSE (%(names)s::text[])[1 + r1 %% 200] END AS name,
           CASE WHEN r2 %% 10 = 0 THEN 10 ELSE 0 END AS priority,
           jsonb_build_array(i, 'user-' || (r2 %% 100000),
                             jsonb_build_object('tenant', 't' || (r3 %% 50))) AS args,
           jsonb_build_object('trace_id', md5(i::text), 'locale', 'en_GB') AS kwargs
    FROM (SELECT i, abs(hashint8(i + 31)) AS r1, abs(hashint8(i + 7937)) AS r2,
                 abs(hashint8(i + 104743)) AS r3
          FROM generate_series(%(lo)s::bigint, %(hi)s::bigint - 1) AS i) h
) a
ORDER BY a.sent_at;
"""

# Attempts of the tasks that ran, sent in [lo, hi): the retried ones' first attempt too.
ATTEMPTS = """
INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at, finished_at,
                                  outcome, will_retry, error_code, error_message)
SELECT t.id, a.n, t.claimed_by_worker_id, split_part(t.claimed_by_worker_id, '-', 1) || '-'
           || split_part(t.claimed_by_worker_id, '-', 2),
       1000 + abs(hashtext(t.claimed_by_worker_id)) %% 20,
       t.started_at - (t.attempt - a.n) * interval '30 seconds',
       coalesce(t.completed_at, t.failed_at) - (t.attempt - a.n) * interval '30 seconds',
       CASE WHEN a.n < t.attempt THEN 'FAILED' ELSE t.status END,
       a.n < t.attempt,
       CASE WHEN a.n < t.attempt THEN 'TIMEOUT' ELSE t.error_code END,
       CASE WHEN a.n < t.attempt THEN 'timed out after 30 s'
            WHEN t.status = 'FAILED' THEN t.result -> 'err' ->> 'message' END
FROM tether_tasks t
CROSS JOIN LATERAL generate_series(1, t.attempt) AS a (n)
WHERE t.id >= %(lo)s AND t.id < %(hi)s AND t.status IN ('COMPLETED', 'FAILED')
ORDER BY t.id, a.n;
"""

HEARTBEATS = """
INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid)
SELECT id, claimed_by_worker_id, 'runner', started_at + (coalesce(completed_at, failed_at) - started_at) / 2,
       split_part(claimed_by_worker_id, '-', 1) || '-' || split_part(claimed_by_worker_id, '-', 2),
       1000 + abs(hashtext(claimed_by_worker_id)) %% 20
FROM tether_tasks
WHERE id >= %(lo)s AND id < %(hi)s AND status IN ('COMPLETED', 'FAILED')
ORDER BY id;
"""

# Finished workflows: WF of them, made over [start, stop); their 5 steps' tasks COMPLETED
# (every 10th workflow: its last step FAILED, the workflow FAILED).
FINISHED_WORKFLOWS = """
WITH w AS (
    SELECT k, pg_temp.uuid7(at) AS id, at, (k %% 10 = 0) AS failed
    FROM (SELECT k, %(start)s::timestamptz + (%(stop)s::timestamptz - %(start)s::timestamptz)
                 * (k::float8 / %(n)s) AS at
          FROM generate_series(%(lo)s::bigint, %(hi)s::bigint - 1) AS k) g
), flows AS (
    INSERT INTO tether_workflows (id, name, status, on_error, output_node, steps_total, steps_done,
                                  steps_failed, created_at, updated_at, finished_at)
    SELECT id, CASE WHEN k %% 3 = 0 THEN 'nightly_export' ELSE 'onboard_user' END,
           CASE WHEN failed THEN 'FAILED' ELSE 'COMPLETED' END, 'fail', NULL, %(steps)s, %(steps)s,
           CASE WHEN failed THEN 1 ELSE 0 END, at, at + interval '2 seconds', at + interval '2 seconds'
    FROM w
), steps AS (
    SELECT w.id AS workflow_id, w.at, w.failed, w.k, s.node,
           pg_temp.uuid7(w.at + s.node * interval '1 ms') AS task_id
    FROM w CROSS JOIN generate_series(0, %(steps)s - 1) AS s (node)
), step_rows AS (
    INSERT INTO tether_workflow_tasks (workflow_id, node, node_name, task_id, task_name, queue, priority,
                                       args, kwargs, depends_on, dependents, waiting_on, status, result,
                                       error_code, enqueued_at, finished_at)
    SELECT workflow_id, node, 'step_' || node, task_id, 'render_report', 'reports', 0, '[]', '{}',
           CASE WHEN node = 0 THEN '{}'::int[] ELSE ARRAY[node - 1] END,
           '{}'::uuid[], 0,
           CASE WHEN failed AND node = %(steps)s - 1 THEN 'FAILED' ELSE 'COMPLETED' END,
           CASE WHEN failed AND node = %(steps)s - 1
                THEN %(failure)s::jsonb
                ELSE jsonb_build_object('ok', node) END,
           CASE WHEN failed AND node = %(steps)s - 1 THEN 'HTTP_500' END,
           at + node * interval '300 ms', at + node * interval '300 ms' + interval '200 ms'
    FROM steps
)
INSERT INTO tether_tasks (id, name, queue, priority, status, args, kwargs, result, error_code, attempt,
                          run_at, sent_at, enqueued_at, claimed_at, started_at, completed_at, failed_at,
                          updated_at, claimed_by_worker_id, workflow_id)
SELECT task_id, 'render_report', 'reports', 0,
       CASE WHEN failed AND node = %(steps)s - 1 THEN 'FAILED' ELSE 'COMPLETED' END,
       '[]', '{}',
       CASE WHEN failed AND node = %(steps)s - 1
            THEN %(failure)s::jsonb
            ELSE jsonb_build_object('ok', node) END,
       CASE WHEN failed AND node = %(steps)s - 1 THEN 'HTTP_500' END, 1,
       at + node * interval '300 ms', at + node * interval '300 ms', at + node * interval '300 ms',
       at + node * interval '300 ms' + interval '20 ms', at + node * interval '300 ms' + interval '30 ms',
       CASE WHEN NOT (failed AND node = %(steps)s - 1)
            THEN at + node * interval '300 ms' + interval '200 ms' END,
       CASE WHEN failed AND node = %(steps)s - 1 THEN at + node * interval '300 ms' + interval '200 ms' END,
       at + node * interval '300 ms' + interval '200 ms', 'host-3-1003-a1b2c3', workflow_id
FROM steps
ORDER BY task_id;
"""

# Running workflows: steps 0-1 COMPLETED, step 2 ENQUEUED (its task PENDING), 3-4 WAITING.
RUNNING_WORKFLOWS = """
WITH w AS (
    SELECT k, pg_temp.uuid7(at) AS id, at
    FROM (SELECT k, %(start)s::timestamptz + (%(stop)s::timestamptz - %(start)s::timestamptz)
                 * (k::float8 / %(n)s) AS at
          FROM generate_series(0, %(n)s - 1) AS k) g
), flows AS (
    INSERT INTO tether_workflows (id, name, status, on_error, output_node, steps_total, steps_done,
                                  steps_failed, created_at, updated_at)
    SELECT id, 'onboard_user', 'RUNNING', 'fail', NULL, %(steps)s, 2, 0, at, at + interval '1 second' FROM w
), steps AS (
    SELECT w.id AS workflow_id, w.at, s.node, pg_temp.uuid7(w.at + s.node * interval '1 ms') AS task_id
    FROM w CROSS JOIN generate_series(0, %(steps)s - 1) AS s (node)
), step_rows AS (
    INSERT INTO tether_workflow_tasks (workflow_id, node, node_name, task_id, task_name, queue, priority,
                                       args, kwargs, depends_on, dependents, waiting_on, status, result,
                                       enqueued_at, finished_at)
    SELECT workflow_id, node, 'step_' || node, task_id, 'render_report', 'reports', 0, '[]', '{}',
           CASE WHEN node = 0 THEN '{}'::int[] ELSE ARRAY[node - 1] END, '{}'::uuid[],
           CASE WHEN node > 2 THEN 1 ELSE 0 END,
           CASE WHEN node < 2 THEN 'COMPLETED' WHEN node = 2 THEN 'ENQUEUED' ELSE 'WAITING' END,
           CASE WHEN node < 2 THEN jsonb_build_object('ok', node) END,
           CASE WHEN node <= 2 THEN at + node * interval '300 ms' END,
           CASE WHEN node < 2 THEN at + node * interval '300 ms' + interval '200 ms' END
    FROM steps
)
INSERT INTO tether_tasks (id, name, queue, priority, status, args, kwargs, result, attempt, run_at, sent_at,
                          enqueued_at, claimed_at, started_at, completed_at, updated_at,
                          claimed_by_worker_id, workflow_id)
SELECT task_id, 'render_report', 'reports', 0, CASE WHEN node < 2 THEN 'COMPLETED' ELSE 'PENDING' END,
       '[]', '{}', CASE WHEN node < 2 THEN jsonb_build_object('ok', node) END,
       CASE WHEN node < 2 THEN 1 ELSE 0 END,
       at + node * interval '300 ms', at + node * interval '300 ms', at + node * interval '300 ms',
       CASE WHEN node < 2 THEN at + node * interval '300 ms' + interval '20 ms' END,
       CASE WHEN node < 2 THEN at + node * interval '300 ms' + interval '30 ms' END,
       CASE WHEN node < 2 THEN at + node * interval '300 ms' + interval '200 ms' END,
       at + node * interval '300 ms' + interval '200 ms',
       CASE WHEN node < 2 THEN 'host-3-1003-a1b2c3' END, workflow_id
FROM steps WHERE node <= 2
ORDER BY task_id;
"""

PAST_WORKERS = """
INSERT INTO tether_workers (id, hostname, pid, queues, processes, status, started_at, last_heartbeat_at,
                            stopped_at, updated_at, tether_version, host_key)
SELECT 'host-' || k || '-' || (1000 + k) || '-a1b2c3', 'host-' || k, 1000 + k,
       ARRAY['default', 'emails', 'webhooks', 'reports', 'images', 'billing', 'exports', 'audit'],
       8, 'stopped', now() - interval '7 days', now() - interval '2 hours', now() - interval '2 hours',
       now() - interval '2 hours', '0.1.0', 'bench'
FROM generate_series(0, 47) AS k
ON CONFLICT (id) DO NOTHING;
"""

# The fake fleet's in-flight tasks, made afresh: the old ones (and their rows) go first.
IN_FLIGHT_SQL = [
    """
    INSERT INTO tether_workers (id, hostname, pid, queues, processes, status, host_key, tether_version)
    VALUES (%(worker)s, 'fleet-host', 999999, ARRAY['emails', 'webhooks'], %(n)s, 'active', 'bench', '0.1.0')
    ON CONFLICT (id) DO UPDATE SET status = 'active', last_heartbeat_at = now(), updated_at = now(),
                                   inactive_at = NULL, stopped_at = NULL
    """,
    "DELETE FROM tether_heartbeats WHERE sender_id = %(worker)s",
    "DELETE FROM tether_tasks WHERE claimed_by_worker_id = %(worker)s",
    """
    WITH made AS (
        INSERT INTO tether_tasks (id, name, queue, status, args, kwargs, attempt, run_at, sent_at,
                                  enqueued_at, claimed_at, started_at, updated_at, claimed_by_worker_id)
        SELECT pg_temp.uuid7(now() - interval '1 second' + k * interval '1 ms'),
               CASE WHEN k %% 2 = 0 THEN 'send_email' ELSE 'deliver_webhook' END,
               CASE WHEN k %% 2 = 0 THEN 'emails' ELSE 'webhooks' END,
               CASE WHEN k %% 3 = 0 THEN 'CLAIMED' ELSE 'RUNNING' END,
               jsonb_build_array(k), '{}', 1, now() - interval '1 second', now() - interval '1 second',
               now() - interval '1 second', now(), CASE WHEN k %% 3 = 0 THEN NULL ELSE now() END, now(),
               %(worker)s
        FROM generate_series(1, %(n)s) AS k
        RETURNING id, status
    )
    INSERT INTO tether_heartbeats (task_id, sender_id, role, hostname, pid)
    SELECT id, %(worker)s, CASE WHEN status = 'RUNNING' THEN 'runner' ELSE 'claimer' END, 'fleet-host', 999999
    FROM made
    """,
]

TABLES = (
    "tether_tasks",
    "tether_task_attempts",
    "tether_heartbeats",
    "tether_workflows",
    "tether_workflow_tasks",
    "tether_workers",
)

Say = Callable[[str], None]


def _batches(total: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + BATCH, total)) for lo in range(0, total, BATCH)]


def fill(conn: psycopg.Connection[Any], *, pending: int, terminal: int, say: Say) -> dict[str, float]:
    """Fill an empty, migrated tether database (autocommit ``conn``); seconds per part."""
    conn.execute(UUID7)
    conn.execute("SET maintenance_work_mem = '512MB'")
    conn.execute("SET synchronous_commit = off")  # a bulk load: nothing waits on each batch's flush
    queues, names = _slots()
    (now,) = conn.execute("SELECT now()").fetchone() or (None,)
    seconds: dict[str, float] = {}
    finished_flows = max(1, terminal // 1000)
    running_flows = max(1, pending // 1000)
    plain_terminal = terminal - finished_flows * STEPS
    plain_pending = pending - running_flows
    common = {
        "queues": queues,
        "names": names,
        "codes": ERROR_CODES,
        "rare_queue": RARE_QUEUE,
        "rare_name": RARE_NAME,
        "rare_error": RARE_ERROR,
    }

    t0 = time.perf_counter()
    for lo, hi in _batches(plain_terminal):
        conn.execute(
            TERMINAL,
            {
                **common,
                "start": _ago(now, hours=HISTORY_HOURS),
                "stop": _ago(now, minutes=30),
                "n": plain_terminal,
                "lo": lo,
                "hi": hi,
            },
        )
        say(f"  terminal tasks {hi:,}/{plain_terminal:,} ({time.perf_counter() - t0:.0f}s)")
    seconds["terminal_tasks"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    for lo, hi in _batches(finished_flows * STEPS):
        flo, fhi = lo // STEPS, hi // STEPS
        conn.execute(
            FINISHED_WORKFLOWS,
            {
                "start": _ago(now, hours=HISTORY_HOURS),
                "stop": _ago(now, minutes=30),
                "n": finished_flows,
                "lo": flo,
                "hi": fhi,
                "steps": STEPS,
                "failure": FAILURE,
            },
        )
    conn.execute(
        RUNNING_WORKFLOWS,
        {"start": _ago(now, hours=6), "stop": now, "n": running_flows, "steps": STEPS},
    )
    took = time.perf_counter() - t0
    say(f"  workflows: {finished_flows:,} finished, {running_flows:,} running ({took:.0f}s)")
    seconds["workflows"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    for lo, hi in _batches(plain_pending):
        conn.execute(
            PENDING,
            {**common, "start": _ago(now, hours=6), "stop": now, "n": plain_pending, "lo": lo, "hi": hi},
        )
        say(f"  pending tasks {hi:,}/{plain_pending:,} ({time.perf_counter() - t0:.0f}s)")
    seconds["pending_tasks"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    bounds = [
        row[0]
        for row in conn.execute(
            "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM tether_tasks) n"
            " WHERE k %% %s = 1 ORDER BY id",
            (BATCH,),
        ).fetchall()
    ]
    edges = [*bounds, "ffffffff-ffff-ffff-ffff-ffffffffffff"]
    for k in range(len(bounds)):
        conn.execute(ATTEMPTS, {"lo": edges[k], "hi": edges[k + 1]})
        conn.execute(HEARTBEATS, {"lo": edges[k], "hi": edges[k + 1]})
        say(f"  attempts and heartbeats: {k + 1}/{len(bounds)} id ranges ({time.perf_counter() - t0:.0f}s)")
    seconds["attempts_heartbeats"] = time.perf_counter() - t0

    conn.execute(PAST_WORKERS)
    refresh_in_flight(conn)
    return seconds


def refresh_in_flight(conn: psycopg.Connection[Any]) -> None:
    """The fake fleet's in-flight tasks made afresh (claimed and started just now, fresh heartbeats)."""
    conn.execute(UUID7)
    with conn.transaction():
        for statement in IN_FLIGHT_SQL:
            conn.execute(statement, {"worker": FLEET_WORKER, "n": IN_FLIGHT})


def vacuum_analyze(conn: psycopg.Connection[Any], say: Say) -> float:
    """VACUUM (ANALYZE) the filled tables: hint bits and the visibility map set, statistics
    taken, as autovacuum leaves a table that has settled."""
    t0 = time.perf_counter()
    for table in TABLES:
        conn.execute(f"VACUUM (ANALYZE) {table}")
        say(f"  vacuum analyze {table} ({time.perf_counter() - t0:.0f}s)")
    return time.perf_counter() - t0


def _ago(now: Any, **delta: float) -> Any:
    from datetime import timedelta

    return now - timedelta(**delta)
