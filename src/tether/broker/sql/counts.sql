-- How many tasks each queue has in each status, for `tether status`, `tether queues`, the
-- dashboard and QueueInfo (broker/counts.py, docs/operations.md#counts-on-a-large-database).
--
-- Counted exactly: what is in flight (CLAIMED, RUNNING: as many as the workers hold), and
-- what waits (PENDING) up to a bound per queue, through the partial indexes over those rows
-- (tether_tasks_claim_idx, tether_tasks_in_flight_status_idx), so this part costs as much as
-- the live rows, never the history. The finished statuses (and a queue's PENDING beyond the
-- bound) are counted in a sample of the table's pages (TABLESAMPLE SYSTEM) and scaled up:
-- a count(*) over ten million rows reads gigabytes, a sample of 1,000 pages reads 8 MB.
-- When the sample's share is 100 % (a small table, or exact asked for) every page is read
-- and every figure is exact.

-- name: count_sample_percent
-- The share of tether_tasks' pages (in percent, up to 100) that holds about `pages` pages:
-- the table's size now, not as of its last ANALYZE. Also, for the rest of the caller's
-- transaction: no JIT compilation. queue_counts's estimated cost (it could read millions
-- of rows, but stops early) passes jit_above_cost, and compiling it took 80 ms, more than
-- the statement itself.
SELECT set_config('jit', 'off', true) AS jit,
       least(100.0, 100.0 * %(pages)s
             / greatest(1, pg_relation_size('tether_tasks') / current_setting('block_size')::int))::float8
       AS percent;

-- name: queue_counts
-- One row per queue and status present: n, and whether n is an estimate. pending_cap NULL:
-- PENDING counted without a bound. A queue's PENDING count over the bound is the sample's
-- (never below the bound); percent 100 makes the sample the whole table.
-- The queues with waiting tasks are found by a skip scan of the claim index (one probe per
-- queue, not one per row). The sample is REPEATABLE: the same pages every time, so the
-- figures of a page refreshed every few seconds stand still while nothing changes.
WITH RECURSIVE waiting_queues AS (
    (SELECT queue FROM tether_tasks WHERE status = 'PENDING' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM tether_tasks t
            WHERE t.status = 'PENDING' AND t.queue > w.queue ORDER BY t.queue LIMIT 1)
    FROM waiting_queues w WHERE w.queue IS NOT NULL
), waiting AS MATERIALIZED (  -- its n is read three times below: counted once
    SELECT w.queue,
           (SELECT count(*) FROM (SELECT 1 FROM tether_tasks t
                                  WHERE t.status = 'PENDING' AND t.queue = w.queue
                                  LIMIT %(pending_cap)s::bigint + 1) c) AS n
    FROM waiting_queues w WHERE w.queue IS NOT NULL
), in_flight AS (
    SELECT queue, status, count(*) AS n FROM tether_tasks
    WHERE status IN ('CLAIMED', 'RUNNING')
    GROUP BY queue, status
), sampled AS (
    SELECT queue, status, round(count(*) * 100.0 / %(percent)s)::bigint AS n
    FROM tether_tasks TABLESAMPLE SYSTEM (%(percent)s) REPEATABLE (22)
    WHERE status NOT IN ('CLAIMED', 'RUNNING')
    GROUP BY queue, status
)
SELECT w.queue, 'PENDING' AS status,
       CASE WHEN %(pending_cap)s::bigint IS NULL OR w.n <= %(pending_cap)s::bigint THEN w.n
            ELSE greatest(w.n, s.n) END AS n,
       %(pending_cap)s::bigint IS NOT NULL AND w.n > %(pending_cap)s::bigint AND %(percent)s < 100
           AS estimated
FROM waiting w
LEFT JOIN sampled s ON s.queue = w.queue AND s.status = 'PENDING'
UNION ALL
SELECT queue, status, n, false FROM in_flight
UNION ALL
SELECT queue, status, n, %(percent)s < 100 FROM sampled
WHERE status <> 'PENDING'
ORDER BY 1, 2;
