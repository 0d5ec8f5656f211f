-- Worker-side transitions. Every write after the claim is fenced: it names the
-- status it expects, the attempt number the claim produced and the owner. A
-- worker that lost its claim (declared dead, task requeued, cancelled) matches
-- no row and changes nothing.

-- name: claim_tasks
-- One ordered, limited index scan per queue (LATERAL), then the best of those:
-- `queue = ANY(...)` in one scan would read and sort every ready row instead.
-- skip_names: names this worker cannot run but another live worker can.
WITH picked AS (
    SELECT c.id
    FROM unnest(%(queues)s::text[]) AS wanted (queue)
    CROSS JOIN LATERAL (
        SELECT t.id, t.priority, t.run_at FROM tether_tasks t
        WHERE t.status = 'PENDING' AND t.queue = wanted.queue AND t.run_at <= now()
          AND (t.good_until IS NULL OR t.good_until > now())
          AND t.name <> ALL(%(skip_names)s::text[])
        ORDER BY t.priority DESC, t.run_at, t.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) c
    ORDER BY c.priority DESC, c.run_at, c.id
    LIMIT %(limit)s
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
SELECT (SELECT count(*) FROM back) AS released, (SELECT count(*) FROM woken) AS queues;

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
