-- Worker-side transitions. Every write after the claim is fenced: it names the
-- status it expects, the attempt number the claim produced and the owner. A
-- worker that lost its claim (declared dead, task requeued, cancelled) matches
-- no row and changes nothing.

-- name: claim_tasks
-- One ordered, limited index scan per queue (LATERAL), then the best of those:
-- `queue = ANY(...)` in one scan would read and sort every ready row instead.
-- skip_names: names this worker cannot run but another live worker can.
-- A worker with both kinds of child (worker/lanes.py) has room for so many async
-- tasks (named in async_names) and so many others: the scan reads as many rows as
-- both together, in queue order, and takes from them what fits each kind. The rows
-- it read but did not take stay PENDING (locked until this statement commits). A
-- filter by name inside the scan would read past every row of the other kind.
WITH scanned AS (
    SELECT c.id, c.priority, c.run_at, c.name = ANY(%(async_names)s::text[]) AS is_async
    FROM unnest(%(queues)s::text[]) AS wanted (queue)
    CROSS JOIN LATERAL (
        SELECT t.id, t.priority, t.run_at, t.name FROM tether_tasks t
        WHERE t.status = 'PENDING' AND t.queue = wanted.queue AND t.run_at <= now()
          AND (t.good_until IS NULL OR t.good_until > now())
          AND t.name <> ALL(%(skip_names)s::text[])
        ORDER BY t.priority DESC, t.run_at, t.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) c
    -- A paused queue (a row in tether_paused_queues, docs/queues.md) is not claimed
    -- from: read here, in every claim, so a pause holds from its commit on for every
    -- worker, notified or not. The anti-join drops the queue before its scan runs.
    WHERE NOT EXISTS (SELECT 1 FROM tether_paused_queues p WHERE p.queue = wanted.queue)
      -- A flow-controlled queue (docs/limits.md) is claimed only by limited_claims.sql,
      -- which counts the slots in use under a lock: read here in every claim, as the pause.
      AND NOT EXISTS (SELECT 1 FROM tether_queue_limits l WHERE l.queue = wanted.queue)
    ORDER BY c.priority DESC, c.run_at, c.id
    LIMIT %(limit)s
), picked AS (
    SELECT id FROM (
        SELECT id, is_async,
               row_number() OVER (PARTITION BY is_async ORDER BY priority DESC, run_at, id) AS nth
        FROM scanned
    ) ranked
    WHERE nth <= CASE WHEN is_async THEN %(async_limit)s ELSE %(other_limit)s END
)
-- The claim's commit does not wait for its WAL flush (synchronous_commit off for
-- this statement's transaction only). Safe: if the server crashed before the flush,
-- the claim is lost and the task is PENDING again, and no code can have run on it:
-- the child's start is a fenced, durable commit, and its flush would have carried
-- the claim too (the claim comes earlier in the log), so a start that succeeded
-- implies a durable claim. What it saves: one fsync wait on every pickup.
UPDATE tether_tasks t
SET status = 'CLAIMED', attempt = t.attempt + 1, claimed_at = now(), updated_at = now(),
    claimed_by_worker_id = %(worker_id)s
FROM picked, (SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait
WHERE t.id = picked.id
RETURNING t.id, t.name, t.queue, t.args::text, t.kwargs::text, t.attempt, t.retry_count,
          t.max_retries, t.retry_policy::text, t.workflow_id;

-- name: start_task
UPDATE tether_tasks SET status = 'RUNNING', started_at = now(), updated_at = now()
WHERE id = %(id)s AND status = 'CLAIMED' AND attempt = %(attempt)s
  AND claimed_by_worker_id = %(worker_id)s
RETURNING id;

-- name: complete_task
-- RUNNING -> COMPLETED, with the attempt's row, in one statement: a sync child's
-- hot path. A completion wins over a cancel request that came too late: the code
-- finished its work, and the row says so. Every other outcome goes through
-- write_batch, which applies the cancel rule. A child that already holds its next
-- task starts it in the same statement (next_id NULL: nothing to start): one round
-- trip and one commit per task, without a transaction block. One row always:
-- recorded (this write matched), next_started.
WITH done AS (
    UPDATE tether_tasks
    SET status = 'COMPLETED', result = %(result)s::jsonb, error_code = NULL,
        completed_at = now(), next_retry_at = NULL, updated_at = now()
    WHERE id = %(id)s AND status = %(expect)s AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING id, attempt, started_at, notify_on_done
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at, outcome)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at, 'COMPLETED'
    FROM done
), next_start AS (
    UPDATE tether_tasks SET status = 'RUNNING', started_at = now(), updated_at = now()
    WHERE id = %(next_id)s::uuid AND status = 'CLAIMED' AND attempt = %(next_attempt)s::int
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING id
), told AS (
    SELECT pg_notify('tether_done', id::text) FROM done WHERE notify_on_done
)
SELECT EXISTS (SELECT 1 FROM done) AS recorded, EXISTS (SELECT 1 FROM next_start) AS next_started,
       (SELECT count(*) FROM told) AS notified;

-- name: release_claimed
-- Graceful shutdown or a child that died before starting: the code never ran,
-- so the claim is simply undone. Fenced like every write: only the claim this
-- worker holds with exactly that attempt number (the number stays bumped).
WITH back AS (
    UPDATE tether_tasks t
    SET status = 'PENDING', claimed_at = NULL, claimed_by_worker_id = NULL, updated_at = now()
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS mine (id, attempt)
    WHERE t.id = mine.id AND t.attempt = mine.attempt AND t.status = 'CLAIMED'
      AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id, t.queue, t.run_at
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM back GROUP BY queue
)
SELECT (SELECT count(*) FROM back) AS released, (SELECT count(*) FROM woken) AS queues,
       coalesce((SELECT array_agg(id::text) FROM back), '{}') AS released_ids;

-- name: unstart_task
-- A child started this task in the same commit as its previous outcome, then
-- found its supervisor dead before running any of its code: give it back.
WITH back AS (
    UPDATE tether_tasks
    SET status = 'PENDING', claimed_at = NULL, started_at = NULL, claimed_by_worker_id = NULL,
        updated_at = now()
    WHERE id = %(id)s AND status = 'RUNNING' AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING queue, run_at
)
SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text) FROM back;

-- name: get_fence
-- After an ambiguous write (connection lost around COMMIT): who holds the row now,
-- and which process wrote the outcome of its current attempt (NULL: a reaper).
SELECT t.status, t.attempt, t.claimed_by_worker_id, a.pid AS recorded_by_pid
FROM tether_tasks t
LEFT JOIN tether_task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt
WHERE t.id = %(id)s;

-- name: write_batch
-- Many outcomes and many starts in ONE statement and one commit: the async
-- executor writes everything that became ready during one turn of its event
-- loop this way, the worker's main process records all the tasks of a dead
-- child this way, and every outcome other than a completion goes through here.
-- Each row keeps its own fence (expected status, attempt and owner): a row that
-- lost its claim matches nothing and the others are written all the same. An
-- outcome with a delay is a retry (back to PENDING after it); one without is final.
--
-- The cancel rule (docs/tasks.md#cancelling-a-running-task): an outcome other than
-- COMPLETED settles as CANCELLED, never retried, when the outcome is a cancellation
-- or when a cancel of the task was requested (cancel_requested_at). The request is
-- read from the row being written (t.*, re-read after any concurrent update), never
-- from the statement's snapshot: a cancel committed while this write waited for the
-- row lock must still turn a retry into CANCELLED. The message says "while running"
-- and who asked; data keeps the error the attempt ended with.
WITH given AS (
    SELECT g.*, g.delay_s IS NOT NULL AS again
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(expects)s::text[], %(statuses)s::text[],
                %(results)s::text[], %(error_codes)s::text[], %(delays)s::float8[])
         AS g (id, attempt, expect, status, result, error_code, delay_s)
), done AS (
    UPDATE tether_tasks t
    SET status = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN 'CANCELLED'
            WHEN g.again THEN 'PENDING'
            ELSE g.status END,
        result = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN jsonb_build_object('err', jsonb_build_object(
                    'code', 'TASK_CANCELLED',
                    'message', CASE WHEN g.status = 'CANCELLED' THEN g.result::jsonb -> 'err' ->> 'message'
                                    ELSE 'cancelled while running' END
                               || coalesce(' (requested by ' || t.cancel_requested_by || ')', ''),
                    'data', CASE WHEN g.status = 'CANCELLED' THEN g.result::jsonb -> 'err' -> 'data'
                                 ELSE jsonb_build_object('error', g.result::jsonb -> 'err') END))
            ELSE g.result::jsonb END,
        error_code = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN 'TASK_CANCELLED'
            ELSE g.error_code END,
        completed_at = CASE WHEN g.status = 'COMPLETED' THEN now() END,
        failed_at = CASE WHEN g.status = 'FAILED' AND NOT g.again AND t.cancel_requested_at IS NULL
                         THEN now() END,
        cancelled_at = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN now() END,
        retry_count = t.retry_count + (g.again AND t.cancel_requested_at IS NULL)::int,
        next_retry_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                             THEN now() + make_interval(secs => g.delay_s) END,
        run_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                      THEN now() + make_interval(secs => g.delay_s) ELSE t.run_at END,
        enqueued_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                           THEN now() + make_interval(secs => g.delay_s) ELSE t.enqueued_at END,
        claimed_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL THEN NULL ELSE t.started_at END,
        claimed_by_worker_id = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                                    THEN NULL ELSE t.claimed_by_worker_id END,
        updated_at = now()
    FROM given g, tether_tasks before
    WHERE t.id = g.id AND before.id = t.id AND t.status = g.expect AND t.attempt = g.attempt
      AND t.claimed_by_worker_id = %(worker_id)s
    -- t.* here is the row as written; before.started_at the start this attempt had.
    RETURNING t.id, t.attempt, t.queue, t.run_at, t.notify_on_done, before.started_at,
              t.status AS settled, t.error_code, t.result -> 'err' ->> 'message' AS error_message
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at,
                                      outcome, will_retry, error_code, error_message)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at,
           CASE WHEN settled = 'PENDING' THEN 'FAILED' ELSE settled END, settled = 'PENDING',
           error_code, error_message
    FROM done
), started AS (
    UPDATE tether_tasks t SET status = 'RUNNING', started_at = now(), updated_at = now()
    FROM unnest(%(start_ids)s::uuid[], %(start_attempts)s::int[]) AS s (id, attempt)
    WHERE t.id = s.id AND t.status = 'CLAIMED' AND t.attempt = s.attempt
      AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id
), told_done AS (
    SELECT pg_notify('tether_done', id::text) FROM done WHERE notify_on_done AND settled <> 'PENDING'
), told_work AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM done WHERE settled = 'PENDING' GROUP BY queue
)
SELECT coalesce((SELECT array_agg(id::text ORDER BY id) FROM done), '{}') AS recorded,
       coalesce((SELECT array_agg(settled ORDER BY id) FROM done), '{}') AS settled,
       coalesce((SELECT array_agg(id::text) FROM started), '{}') AS started,
       (SELECT count(*) FROM told_done) + (SELECT count(*) FROM told_work) AS notified;

-- name: get_fences
-- get_fence for many tasks at once (after an ambiguous batch write).
SELECT t.id::text AS id, t.status, t.attempt, t.claimed_by_worker_id, a.pid AS recorded_by_pid
FROM tether_tasks t
LEFT JOIN tether_task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt
WHERE t.id = ANY(%(ids)s::uuid[]);
