-- Retrying FAILED, CANCELLED and EXPIRED tasks by hand (docs/tasks.md#retrying-by-hand):
-- one by id, or in bulk by filter in bounded batches (keyset over id). A retried task
-- goes back to PENDING, due now, as a new attempt: the next claim bumps `attempt` (the
-- fencing token), so every earlier row of tether_task_attempts stays as it was.
-- A workflow step is retried under its workflow's row lock (workflow/reopen.py says
-- which steps can be reopened, docs/workflows.md#retrying-a-step the rules).
--
-- "When a task ended" is the time of its terminal transition: failed_at, cancelled_at
-- or expired_at (updated_at for a row edited by hand without them).

-- name: retry_task_state
-- Which path a retry by id takes: a plain task, or a workflow step (workflow first).
SELECT id, name, status, workflow_id, unique_key FROM tether_tasks WHERE id = %(id)s;

-- name: lock_task_for_retry
-- A workflow step's task, locked after its workflow (the locking rule of workflows.sql).
SELECT id, name, status, workflow_id, unique_key FROM tether_tasks WHERE id = %(id)s FOR UPDATE;

-- name: find_retry_candidates
-- One page of a bulk retry, or the sample of a dry run: tasks matching the filter with
-- an id after `after`, in id order. The keyset moves past tasks that were skipped (they
-- still match), so a bulk retry reads each row once and ends. The id bound is written
-- without OR so that a generic plan can still use it as an index bound.
SELECT t.id, t.name, t.queue, t.status, t.error_code,
       coalesce(t.failed_at, t.cancelled_at, t.expired_at, t.updated_at) AS finished_at,
       t.workflow_id, t.unique_key
FROM tether_tasks t
WHERE t.status = ANY(%(statuses)s::text[])
  AND t.id > coalesce(%(after)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
  AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
  AND (%(name)s::text IS NULL OR t.name = %(name)s)
  AND (%(error_code)s::text IS NULL OR t.error_code = %(error_code)s)
  AND (%(since)s::timestamptz IS NULL
       OR coalesce(t.failed_at, t.cancelled_at, t.expired_at, t.updated_at) >= %(since)s)
  AND (%(until)s::timestamptz IS NULL
       OR coalesce(t.failed_at, t.cancelled_at, t.expired_at, t.updated_at) < %(until)s)
ORDER BY t.id
LIMIT %(limit)s;

-- name: count_retry_candidates
-- A dry run's count: the same filter as find_retry_candidates.
SELECT count(*) AS n
FROM tether_tasks t
WHERE t.status = ANY(%(statuses)s::text[])
  AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
  AND (%(name)s::text IS NULL OR t.name = %(name)s)
  AND (%(error_code)s::text IS NULL OR t.error_code = %(error_code)s)
  AND (%(since)s::timestamptz IS NULL
       OR coalesce(t.failed_at, t.cancelled_at, t.expired_at, t.updated_at) >= %(since)s)
  AND (%(until)s::timestamptz IS NULL
       OR coalesce(t.failed_at, t.cancelled_at, t.expired_at, t.updated_at) < %(until)s);

-- name: retry_tasks
-- Tasks named by id, still in one of `statuses`, and either plain tasks (workflow_id
-- NULL) or steps of the one workflow given (whose row the caller holds locked): back to
-- PENDING, due now, with everything of the ended run cleared (result, error code, end
-- times, claim, start, progress, a cancel request) and retry_count 0 (the retry policy's
-- whole budget again). `attempt` is left alone: the next claim bumps it. A good_until
-- that has passed is cleared (an operator asked for the task to run); a later one stays.
--
-- Unique keys (migration 0006): a task that ended released its key, and a newer task may
-- have taken it since. A retried task takes its key back, as a send would (the key row
-- then names it, active, sent_at now), unless a task that is not terminal holds it: then
-- that task is not retried, and `holder` says who holds the key. Two tasks of one call
-- with the same key: the first in id order takes it, the others find it held. Keys are
-- locked in one order ("C" collation), after the task rows, as the release trigger does.
--
-- One row per task that was in one of `statuses` (others are not named: the caller
-- reads their status): retried, or the key's holder; in no particular order. NOTIFYs 'tether_work' once per
-- queue with the earliest run_at, as tasks.sql's sends do, so idle workers claim now.
--
-- Checkpointed steps (docs/durable-steps.md#retrying-from-the-last-step): a retried task
-- keeps the steps it recorded, so its next attempt resumes after the last one. With
-- `from_scratch` they are deleted here, in the statement that requeues it, so no attempt
-- can claim the task and find them (a task that is not RUNNING records no step: the step
-- writes' fence). Its row is locked first, then its steps, as a step write locks them.
WITH wanted AS (
    SELECT t.id, t.name, t.queue, t.unique_key
    FROM tether_tasks t
    WHERE t.id = ANY(%(ids)s::uuid[])
      AND t.status = ANY(%(statuses)s::text[])
      AND t.workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
    ORDER BY t.id
    FOR UPDATE
), proposed AS (
    SELECT DISTINCT ON (w.name COLLATE "C", w.unique_key COLLATE "C") w.name, w.unique_key, w.id
    FROM wanted w
    WHERE w.unique_key IS NOT NULL
    ORDER BY w.name COLLATE "C", w.unique_key COLLATE "C", w.id
), key AS (
    INSERT INTO tether_unique_keys AS k (task_name, unique_key, task_id, sent_at, active)
    SELECT p.name, p.unique_key, p.id, now(), true FROM proposed p
    ORDER BY p.name COLLATE "C", p.unique_key COLLATE "C"
    ON CONFLICT (task_name, unique_key) DO UPDATE
    SET task_id = CASE WHEN k.active AND k.task_id <> excluded.task_id THEN k.task_id
                       ELSE excluded.task_id END,
        sent_at = CASE WHEN k.active AND k.task_id <> excluded.task_id THEN k.sent_at
                       ELSE excluded.sent_at END,
        active = true
    RETURNING k.task_name, k.unique_key, k.task_id
), held AS (
    -- Every key's holder in one JSON object, looked up by key below: a join of two CTEs
    -- (which the planner sizes at one row) would be a nested loop, quadratic in the batch.
    -- Task names cannot contain a newline, so name || newline || key names one key.
    SELECT coalesce(jsonb_object_agg(k.task_name || chr(10) || k.unique_key, k.task_id), '{}'::jsonb)
           AS by_key
    FROM key k
), judged AS (
    SELECT w.id,
           nullif((SELECT by_key FROM held) ->> (w.name || chr(10) || w.unique_key), w.id::text)::uuid
           AS holder
    FROM wanted w
), retried AS (
    UPDATE tether_tasks t
    SET status = 'PENDING', result = NULL, error_code = NULL, retry_count = 0,
        run_at = now(), enqueued_at = now(), updated_at = now(),
        completed_at = NULL, failed_at = NULL, cancelled_at = NULL, expired_at = NULL,
        next_retry_at = NULL, claimed_at = NULL, started_at = NULL, claimed_by_worker_id = NULL,
        progress = NULL, progress_at = NULL,
        cancel_requested_at = NULL, cancel_requested_by = NULL,
        good_until = CASE WHEN t.good_until <= now() THEN NULL ELSE t.good_until END
    FROM judged j
    WHERE t.id = j.id AND j.holder IS NULL AND t.status = ANY(%(statuses)s::text[])
    RETURNING t.id, t.queue, t.run_at
), restarted AS (
    DELETE FROM tether_task_steps s USING retried r
    WHERE %(from_scratch)s::boolean AND s.task_id = r.id
    RETURNING s.task_id
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM retried GROUP BY queue
), unwaited AS (
    -- The open wait of a task cancelled or expired while it waited for an event
    -- (docs/durable-steps.md#events): its retry waits afresh, with its full timeout.
    DELETE FROM tether_event_waits w USING retried r WHERE w.task_id = r.id
)
-- Without a join (see held): the retried tasks, then those whose key is held. Every
-- task of `wanted` is one or the other (its row is locked, its status cannot change).
SELECT id, true AS retried, NULL::uuid AS holder, (SELECT count(*) FROM woken) AS queues_woken
FROM retried
UNION ALL
SELECT id, false, holder, 0 FROM judged WHERE holder IS NOT NULL;

-- name: step_for_retry
-- Workflow steps by task id (the step being retried, the dependents of a reopened step),
-- with what reopening needs. Found by the single-column unique key, the workflow checked
-- on the row (as workflows.sql does, so no plan reads a range of the workflow).
SELECT task_id, node, node_name, status, depends_on, dependents, join_mode, run_anyway,
       waiting_on, deps_ok, deps_failed, enqueued_at, finished_at
FROM tether_workflow_tasks
WHERE task_id = ANY(%(task_ids)s::uuid[])
  AND workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid;

-- name: step_statuses
-- The statuses of some steps of one workflow, by node (a reopened step's dependents
-- count their dependencies again from these).
SELECT node, status FROM tether_workflow_tasks
WHERE workflow_id = %(workflow_id)s AND node = ANY(%(nodes)s::int[]);

-- name: reopen_steps
-- Reopening, given as one JSON object keyed by task id ({"<task id>": {"status": s,
-- "waiting_on": n, "deps_ok": n, "deps_failed": n, "reopen": bool}}): the retried step
-- back to ENQUEUED, skipped steps back to WAITING (reopen: their result, error code and
-- end time cleared), and the counters of their dependents counted again. Each row
-- is guarded by the status it was planned from.
UPDATE tether_workflow_tasks s
SET status = %(changes)s::jsonb -> s.task_id::text ->> 'status',
    waiting_on = (%(changes)s::jsonb -> s.task_id::text ->> 'waiting_on')::int,
    deps_ok = (%(changes)s::jsonb -> s.task_id::text ->> 'deps_ok')::int,
    deps_failed = (%(changes)s::jsonb -> s.task_id::text ->> 'deps_failed')::int,
    result = CASE WHEN (%(changes)s::jsonb -> s.task_id::text ->> 'reopen')::boolean
                  THEN NULL ELSE s.result END,
    error_code = CASE WHEN (%(changes)s::jsonb -> s.task_id::text ->> 'reopen')::boolean
                      THEN NULL ELSE s.error_code END,
    finished_at = CASE WHEN (%(changes)s::jsonb -> s.task_id::text ->> 'reopen')::boolean
                       THEN NULL ELSE s.finished_at END
WHERE s.task_id = ANY(%(task_ids)s::uuid[])
  AND s.workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
  AND s.status = %(changes)s::jsonb -> s.task_id::text ->> 'was'
RETURNING s.task_id;

-- name: reopen_workflow
-- The reopened steps no longer count as finished (nor the retried one as failed); a
-- FAILED workflow is RUNNING again. A RUNNING or PAUSED one keeps its status.
UPDATE tether_workflows
SET steps_done = steps_done - %(done)s, steps_failed = steps_failed - %(failed)s,
    status = CASE WHEN status = 'FAILED' THEN 'RUNNING' ELSE status END,
    finished_at = CASE WHEN status = 'FAILED' THEN NULL ELSE finished_at END,
    updated_at = now()
WHERE id = %(workflow_id)s
RETURNING status;
