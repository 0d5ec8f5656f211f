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
-- would otherwise read the table to its end for one page. The inner scan is the index
-- range alone: the primary key, or, when browse.py passes them (index_statuses,
-- index_code), the partial index over unsuccessful or in-flight rows that the status (and
-- a FAILED task's error code) select. Only those conditions go inside the LIMIT: a filter
-- there would let the scan read unmatched rows without counting them. Each row read is
-- then matched against every filter. Besides the matches (at most `limit`), the
-- statement returns the scan's last row (its nth = scan) when it got that far: the page
-- stopped there, and the next one goes on below it.
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
          AND (%(index_statuses)s::text[] IS NULL OR status = ANY(%(index_statuses)s::text[]))
          AND (%(index_code)s::text IS NULL OR error_code = %(index_code)s::text)
        ORDER BY id DESC
        LIMIT %(scan)s::bigint
    ) scanned
) read
WHERE matches OR nth = %(scan)s::bigint
ORDER BY id DESC
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
