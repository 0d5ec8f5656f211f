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

-- name: finish_task
-- RUNNING -> COMPLETED or FAILED, with the attempt's row, in one statement.
-- A child that already holds its next task starts it in the same statement
-- (next_id NULL: nothing to start): one round trip and one commit per task,
-- without a transaction block. One row always: recorded (this write matched),
-- next_started.
WITH done AS (
    UPDATE tether_tasks
    SET status = %(status)s, result = %(result)s::jsonb, error_code = %(error_code)s,
        completed_at = CASE WHEN %(status)s = 'COMPLETED' THEN now() END,
        failed_at = CASE WHEN %(status)s = 'FAILED' THEN now() END,
        next_retry_at = NULL, updated_at = now()
    WHERE id = %(id)s AND status = %(expect)s AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING id, attempt, started_at, notify_on_done
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at,
                                      outcome, error_code, error_message)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at, %(status)s,
           %(error_code)s, %(error_message)s
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

-- name: retry_task
-- A retryable failure with retries left: back to PENDING after the delay (and
-- the next task started, as in finish_task). The self-join reads started_at as
-- it was before this UPDATE clears it.
WITH again AS (
    UPDATE tether_tasks t
    SET status = 'PENDING', retry_count = t.retry_count + 1, result = %(result)s::jsonb,
        error_code = %(error_code)s, next_retry_at = now() + %(delay)s::interval,
        run_at = now() + %(delay)s::interval, enqueued_at = now() + %(delay)s::interval,
        claimed_at = NULL, started_at = NULL, claimed_by_worker_id = NULL, updated_at = now()
    FROM tether_tasks before
    WHERE t.id = %(id)s AND before.id = t.id AND t.status = %(expect)s
      AND t.attempt = %(attempt)s AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id, t.attempt, t.queue, t.run_at, before.started_at
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at,
                                      outcome, will_retry, error_code, error_message)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at, 'FAILED', true,
           %(error_code)s, %(error_message)s
    FROM again
), next_start AS (
    UPDATE tether_tasks SET status = 'RUNNING', started_at = now(), updated_at = now()
    WHERE id = %(next_id)s::uuid AND status = 'CLAIMED' AND attempt = %(next_attempt)s::int
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING id
), told AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text) FROM again
)
SELECT EXISTS (SELECT 1 FROM again) AS recorded, EXISTS (SELECT 1 FROM next_start) AS next_started,
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
-- loop this way, and the worker's main process records all the tasks of a dead
-- child this way. Each row keeps its own fence (expected status, attempt and
-- owner): a row that lost its claim matches nothing and the others are written
-- all the same. An outcome with a delay is a retry (back to PENDING after it),
-- as in retry_task; one without is final, as in finish_task. Returns the ids
-- that matched: recorded outcomes and started tasks.
WITH given AS (
    SELECT g.*, g.delay_s IS NOT NULL AS again
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(expects)s::text[], %(statuses)s::text[],
                %(results)s::text[], %(error_codes)s::text[], %(error_messages)s::text[],
                %(delays)s::float8[])
         AS g (id, attempt, expect, status, result, error_code, error_message, delay_s)
), done AS (
    UPDATE tether_tasks t
    SET status = CASE WHEN g.again THEN 'PENDING' ELSE g.status END,
        result = g.result::jsonb, error_code = g.error_code,
        completed_at = CASE WHEN NOT g.again AND g.status = 'COMPLETED' THEN now() END,
        failed_at = CASE WHEN NOT g.again AND g.status = 'FAILED' THEN now() END,
        retry_count = t.retry_count + g.again::int,
        next_retry_at = CASE WHEN g.again THEN now() + make_interval(secs => g.delay_s) END,
        run_at = CASE WHEN g.again THEN now() + make_interval(secs => g.delay_s) ELSE t.run_at END,
        enqueued_at = CASE WHEN g.again THEN now() + make_interval(secs => g.delay_s)
                           ELSE t.enqueued_at END,
        claimed_at = CASE WHEN g.again THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN g.again THEN NULL ELSE t.started_at END,
        claimed_by_worker_id = CASE WHEN g.again THEN NULL ELSE t.claimed_by_worker_id END,
        updated_at = now()
    FROM given g, tether_tasks before
    WHERE t.id = g.id AND before.id = t.id AND t.status = g.expect AND t.attempt = g.attempt
      AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id, t.attempt, t.queue, t.run_at, t.notify_on_done, before.started_at,
              g.status, g.again, g.error_code, g.error_message
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at,
                                      outcome, will_retry, error_code, error_message)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at, status, again,
           error_code, error_message
    FROM done
), started AS (
    UPDATE tether_tasks t SET status = 'RUNNING', started_at = now(), updated_at = now()
    FROM unnest(%(start_ids)s::uuid[], %(start_attempts)s::int[]) AS s (id, attempt)
    WHERE t.id = s.id AND t.status = 'CLAIMED' AND t.attempt = s.attempt
      AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id
), told_done AS (
    SELECT pg_notify('tether_done', id::text) FROM done WHERE notify_on_done AND NOT again
), told_work AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM done WHERE again GROUP BY queue
)
SELECT coalesce((SELECT array_agg(id::text) FROM done), '{}') AS recorded,
       coalesce((SELECT array_agg(id::text) FROM started), '{}') AS started,
       (SELECT count(*) FROM told_done) + (SELECT count(*) FROM told_work) AS notified;

-- name: get_fences
-- get_fence for many tasks at once (after an ambiguous batch write).
SELECT t.id::text AS id, t.status, t.attempt, t.claimed_by_worker_id, a.pid AS recorded_by_pid
FROM tether_tasks t
LEFT JOIN tether_task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt
WHERE t.id = ANY(%(ids)s::uuid[]);
