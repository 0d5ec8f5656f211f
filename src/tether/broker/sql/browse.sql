-- The dashboard's reads (tether dashboard): task and workflow lists one page at a time,
-- one task with everything about it, the tasks workers hold now.
--
-- Lists page by keyset, never by OFFSET: a page is "the next LIMIT rows with an id below
-- the last one shown", one backward range scan of the primary key from that id, so a
-- page deep in ten million rows costs what the first one does. Ids are UUIDv7 (time
-- ordered), so id order is the order tasks were made in, newest first. The first page
-- asks for ids below the largest UUID: the cursor is always an index condition, never
-- a filter that the plan might keep for every execution.
--
-- These statements run unprepared (browse.py passes prepare=False): each is planned
-- with its parameter values, so a filter that was not given folds away, and a status
-- filter can use the partial indexes on in-flight and terminal rows.

-- name: browse_time_limit
-- For the rest of the caller's transaction: a page that needs more than this (a filter
-- that almost no row matches, over a very large table) is stopped, not left to run.
SELECT set_config('statement_timeout', %(ms)s::text, true);

-- name: browse_tasks
-- Filters, each optional: statuses (any of), queue, name, error_code (exact), and the
-- time the task was made (its id's UUIDv7 time: when it was sent, or for a workflow
-- step when its workflow started), as an id range: [id_from, before).
--
-- A page reads at most `scan` rows below the cursor, whatever the filter: a filter that
-- few rows match (a rare queue, a name, PENDING tasks older than the newest million)
-- would otherwise read the table to its end for one page. The scan is the primary key's
-- range alone: a filter inside its LIMIT would let it read unmatched rows without
-- counting them. Each row read is then matched against every filter. Besides the
-- matches (at most `limit`), the statement returns the scan's last row (its nth = scan)
-- when it got that far: the page stopped there, and the next one goes on below it. The
-- scan is read in order and only as far as the page needs.
SELECT id, name, queue, priority, status, attempt, retry_count, max_retries, error_code,
       sent_at, started_at, finished_at, claimed_by_worker_id, workflow_id, cancel_requested_at,
       matches, nth
FROM (
    SELECT scanned.*,
           (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
           AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
           AND (%(name)s::text IS NULL OR name = %(name)s::text)
           AND (%(error_code)s::text IS NULL OR error_code = %(error_code)s::text) AS matches,
           row_number() OVER (ORDER BY id DESC) AS nth
    FROM (
        SELECT id, name, queue, priority, status, attempt, retry_count, max_retries, error_code,
               sent_at, started_at,
               coalesce(completed_at, failed_at, cancelled_at, expired_at) AS finished_at,
               claimed_by_worker_id, workflow_id, cancel_requested_at
        FROM tether_tasks
        WHERE id < %(before)s::uuid
          AND (%(id_from)s::uuid IS NULL OR id >= %(id_from)s::uuid)
        ORDER BY id DESC
        LIMIT %(scan)s::bigint
    ) scanned
) read
WHERE matches OR nth = %(scan)s::bigint
ORDER BY id DESC
LIMIT %(limit)s::bigint;

-- name: browse_tasks_indexed
-- browse_tasks for a list whose statuses all have a partial index (FAILED, CANCELLED,
-- EXPIRED: migration 10; CLAIMED, RUNNING: migrations 1-2), which browse.py passes as
-- index_statuses (and index_code for FAILED alone with an error code: the index of
-- failures by code). The scan reads that index's range, so `scan` counts only tasks of
-- those statuses. It reads ids only, in id order (the indexes of unsuccessful tasks hold
-- the id, the status and the code: no row is read for them), and a row is read from the
-- table only when the page gets to it. With the rows read in the scan itself the planner
-- sorted them, and read every one of up to `scan` rows for a page of 50 (all 1,004
-- EXPIRED rows of 11 million tasks, from disk: 149 ms). The bound is the window's run
-- condition (nth <= scan: the numbering stops there), not a LIMIT, which made the
-- planner read the ids with parallel workers.
SELECT t.id, t.name, t.queue, t.priority, t.status, t.attempt, t.retry_count, t.max_retries,
       t.error_code, t.sent_at, t.started_at,
       coalesce(t.completed_at, t.failed_at, t.cancelled_at, t.expired_at) AS finished_at,
       t.claimed_by_worker_id, t.workflow_id, t.cancel_requested_at,
       t.status = ANY(%(statuses)s::text[])
       AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
       AND (%(name)s::text IS NULL OR t.name = %(name)s::text)
       AND (%(error_code)s::text IS NULL OR t.error_code = %(error_code)s::text) AS matches,
       ids.nth
FROM (
    SELECT id, nth
    FROM (
        SELECT id, row_number() OVER (ORDER BY id DESC) AS nth FROM tether_tasks
        WHERE id < %(before)s::uuid
          AND (%(id_from)s::uuid IS NULL OR id >= %(id_from)s::uuid)
          AND status = ANY(%(index_statuses)s::text[])
          AND (%(index_code)s::text IS NULL OR error_code = %(index_code)s::text)
    ) numbered
    WHERE nth <= %(scan)s::bigint
) ids
JOIN tether_tasks t ON t.id = ids.id
WHERE (t.status = ANY(%(statuses)s::text[])
       AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
       AND (%(name)s::text IS NULL OR t.name = %(name)s::text)
       AND (%(error_code)s::text IS NULL OR t.error_code = %(error_code)s::text))
   OR ids.nth = %(scan)s::bigint
ORDER BY ids.id DESC
LIMIT %(limit)s::bigint;

-- name: count_waiting_up_to
-- How many PENDING tasks a queue has, counted in the claim index up to `bound`: few
-- enough (fewer than the bound) that browse_tasks_waiting lists them all at once.
SELECT count(*) AS n
FROM (SELECT 1 FROM tether_tasks WHERE status = 'PENDING' AND queue = %(queue)s
      LIMIT %(bound)s::bigint) counted;

-- name: browse_tasks_waiting
-- A list of one queue's PENDING tasks when it has few (count_waiting_up_to), complete,
-- without the scan's bound: their ids come from the claim index, which holds only
-- PENDING tasks and starts with the queue (and holds the id: no row is read for it), then
-- the rows of the page only. Through the primary key, the newest rows may all be other
-- queues' (a queue with 100 tasks waiting among 1,000,000 found none in 20,000 rows). The
-- ids are MATERIALIZED, gathered whole (fewer than the bound) before they are ordered:
-- never a read of the primary key backwards in the hope of meeting them.
WITH waiting AS MATERIALIZED (
    SELECT id FROM tether_tasks
    WHERE status = 'PENDING' AND queue = %(queue)s
      AND id < %(before)s::uuid
      AND (%(id_from)s::uuid IS NULL OR id >= %(id_from)s::uuid)
)
SELECT t.id, t.name, t.queue, t.priority, t.status, t.attempt, t.retry_count, t.max_retries,
       t.error_code, t.sent_at, t.started_at,
       coalesce(t.completed_at, t.failed_at, t.cancelled_at, t.expired_at) AS finished_at,
       t.claimed_by_worker_id, t.workflow_id, t.cancel_requested_at,
       true AS matches, 0::bigint AS nth
FROM (SELECT id FROM waiting ORDER BY id DESC) w
JOIN tether_tasks t ON t.id = w.id
WHERE t.status = 'PENDING'
  AND (%(name)s::text IS NULL OR t.name = %(name)s::text)
  AND (%(error_code)s::text IS NULL OR t.error_code = %(error_code)s::text)
ORDER BY w.id DESC
LIMIT %(limit)s::bigint;

-- name: task_step
-- The workflow a task is a step of, with the step's name (no row: not a step).
SELECT w.id AS workflow_id, w.name AS workflow_name, w.status AS workflow_status,
       s.node_name AS step_name
FROM tether_workflow_tasks s
JOIN tether_workflows w ON w.id = s.workflow_id
WHERE s.task_id = %(id)s;

-- name: browse_workflows
SELECT id, name, status, on_error, steps_total, steps_done, steps_failed, created_at, updated_at,
       paused_at, finished_at
FROM tether_workflows
WHERE id < %(before)s::uuid
  AND (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(name)s::text IS NULL OR name = %(name)s::text)
ORDER BY id DESC
LIMIT %(limit)s::bigint;

-- name: browse_in_flight
-- The tasks workers hold now (CLAIMED or RUNNING), through the partial index over
-- in-flight rows: the workers page lists them under their worker.
SELECT id, name, queue, status, attempt, claimed_at, started_at, claimed_by_worker_id,
       progress, cancel_requested_at
FROM tether_tasks
WHERE status IN ('CLAIMED', 'RUNNING')
ORDER BY claimed_at, id
LIMIT %(limit)s::bigint;
