-- Workflows: starting one, advancing it when a step's task ends, pausing,
-- resuming, cancelling, reconciling, reading.
--
-- Locking rule: every write to a workflow's steps is made while holding that
-- workflow's row lock (lock_workflow), taken before any task row is touched,
-- and no one waits for a workflow lock while holding a task row lock (a task's
-- outcome commits first, the workflow advances in the next transaction). So
-- steps of one workflow advance one transaction at a time, without deadlocks.

-- name: insert_workflow
INSERT INTO tether_workflows (id, name, on_error, output_node, steps_total, trace_context)
VALUES (%(id)s, %(name)s, %(on_error)s, %(output_node)s, %(steps_total)s, %(trace_context)s);

-- name: insert_workflow_steps
-- All steps in one statement, from one JSON array of step objects.
INSERT INTO tether_workflow_tasks (workflow_id, node, node_name, task_id, task_name, queue, priority,
                                   args, kwargs, args_from, max_retries, retry_policy, depends_on,
                                   dependents, join_mode, run_anyway, unique_key, unique_for,
                                   concurrency_key, waiting_on, status)
SELECT %(workflow_id)s, s.node, s.node_name, s.task_id, s.task_name, s.queue, s.priority,
       s.args, s.kwargs, s.args_from, s.max_retries, s.retry_policy, s.depends_on, s.dependents,
       s.join_mode, s.run_anyway, s.unique_key, s.unique_for, s.concurrency_key, cardinality(s.depends_on),
       CASE WHEN cardinality(s.depends_on) = 0 THEN 'READY' ELSE 'WAITING' END
FROM jsonb_to_recordset(%(steps)s::jsonb) AS s (
    node int, node_name text, task_id uuid, task_name text, queue text, priority int, args jsonb,
    kwargs jsonb, args_from jsonb, max_retries int, retry_policy jsonb, depends_on int[],
    dependents uuid[], join_mode text, run_anyway boolean, unique_key text, unique_for interval,
    concurrency_key text);

-- name: lock_workflow
SELECT id, name, status, on_error FROM tether_workflows WHERE id = %(id)s FOR UPDATE;

-- name: plan_as_lookups
-- For the rest of an advance's transaction: joins as nested loops over
-- primary-key probes. Every statement of an advance touches a handful of rows
-- by key; a hash or merge join (which stale statistics or a generic plan can
-- pick) would read the whole workflow instead, making a step's cost grow with
-- the workflow's width.
SELECT set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true),
       set_config('enable_seqscan', 'off', true);

-- name: settle_steps
-- Steps whose task has ended take the task's outcome. A task that ended without
-- a stored result gets one synthesised from how it ended. Guarded by the step's
-- status: settling twice (a worker and the reaper racing) changes nothing.
UPDATE tether_workflow_tasks s
SET status = CASE WHEN t.status = 'COMPLETED' AND t.result ? 'ok' THEN 'COMPLETED'
                  WHEN t.status = 'CANCELLED' THEN 'CANCELLED'
                  ELSE 'FAILED' END,
    result = coalesce(t.result, jsonb_build_object('err', jsonb_build_object(
        'code', syn.code, 'message', syn.message, 'data', NULL))),
    error_code = CASE WHEN t.result IS NULL THEN syn.code ELSE t.error_code END,
    finished_at = now()
FROM tether_tasks t
CROSS JOIN LATERAL (
    SELECT CASE t.status WHEN 'CANCELLED' THEN 'TASK_CANCELLED'
                         WHEN 'EXPIRED' THEN 'TASK_EXPIRED'
                         WHEN 'COMPLETED' THEN 'RESULT_NOT_AVAILABLE'
                         ELSE 'WORKER_CRASHED' END AS code,
           'the step''s task ended ' || t.status || ' without a stored result' AS message
) syn
-- The step is found by its task id (unique). The workflow check is written with
-- IS NOT DISTINCT FROM, which no index can serve, so that the planner never reads
-- the whole workflow through the primary key to filter task ids (it did, with
-- statistics older than the workflow).
WHERE s.task_id = ANY(%(task_ids)s::uuid[])
  AND s.workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
  AND s.status = 'ENQUEUED'
  AND t.id = s.task_id AND t.status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
RETURNING s.task_id, s.node, s.status, s.dependents;

-- name: waiting_dependents
-- The counters of the finished steps' dependents that still wait, found by
-- their task ids (each step lists its dependents' task ids): one probe of the
-- single-column unique index per dependent, never a range over the workflow.
-- The workflow check is written so that no index can serve it (see settle_steps).
SELECT task_id, node, waiting_on, deps_ok, deps_failed, join_mode, run_anyway
FROM tether_workflow_tasks
WHERE task_id = ANY(%(task_ids)s::uuid[])
  AND workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
  AND status = 'WAITING';

-- name: update_dependents
-- New counters and status per dependent, given as one JSON object keyed by task
-- id ({"<task id>": {"waiting_on": n, "deps_ok": n, "deps_failed": n, "status": s}}).
-- No join (a join's plan could read the whole workflow) and no search through
-- arrays (quadratic in a step's out-degree): each row looks its values up by key.
UPDATE tether_workflow_tasks s
SET waiting_on = (%(changes)s::jsonb -> s.task_id::text ->> 'waiting_on')::int,
    deps_ok = (%(changes)s::jsonb -> s.task_id::text ->> 'deps_ok')::int,
    deps_failed = (%(changes)s::jsonb -> s.task_id::text ->> 'deps_failed')::int,
    status = %(changes)s::jsonb -> s.task_id::text ->> 'status',
    error_code = CASE WHEN %(changes)s::jsonb -> s.task_id::text ->> 'status' = 'SKIPPED'
                      THEN 'DEPENDENCY_FAILED' END,
    result = CASE WHEN %(changes)s::jsonb -> s.task_id::text ->> 'status' = 'SKIPPED'
                  THEN jsonb_build_object('err', jsonb_build_object(
                      'code', 'DEPENDENCY_FAILED',
                      'message', 'skipped: ' || CASE WHEN s.join_mode = 'any'
                                                     THEN 'no dependency completed'
                                                     ELSE 'a dependency did not complete' END,
                      'data', NULL)) END,
    finished_at = CASE WHEN %(changes)s::jsonb -> s.task_id::text ->> 'status' = 'SKIPPED'
                       THEN now() END
WHERE s.task_id = ANY(%(task_ids)s::uuid[])
  AND s.workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
  AND s.status = 'WAITING'
RETURNING s.task_id, s.node, s.status, s.dependents;

-- name: account_steps
-- Count finished steps on the workflow and move it on: PAUSED on a failure
-- under on_error='pause', COMPLETED or FAILED once every step has finished.
-- A CANCELLED workflow keeps its status while its last running steps settle.
WITH moved AS (
    UPDATE tether_workflows w
    SET steps_done = w.steps_done + %(done)s,
        steps_failed = w.steps_failed + %(failed)s,
        status = CASE
            WHEN w.status NOT IN ('RUNNING', 'PAUSED') THEN w.status
            WHEN w.steps_done + %(done)s >= w.steps_total THEN
                CASE WHEN w.steps_failed + %(failed)s > 0 THEN 'FAILED' ELSE 'COMPLETED' END
            WHEN %(failed)s > 0 AND w.on_error = 'pause' THEN 'PAUSED'
            ELSE w.status END,
        paused_at = CASE WHEN w.status = 'RUNNING' AND %(failed)s > 0 AND w.on_error = 'pause'
                         AND w.steps_done + %(done)s < w.steps_total THEN now() ELSE w.paused_at END,
        finished_at = CASE WHEN w.status IN ('RUNNING', 'PAUSED')
                           AND w.steps_done + %(done)s >= w.steps_total THEN now()
                           ELSE w.finished_at END,
        updated_at = now()
    WHERE w.id = %(workflow_id)s
    RETURNING w.id, w.status, w.finished_at, w.notify_on_done
)
SELECT status, CASE WHEN notify_on_done AND status IN ('COMPLETED', 'FAILED')
                    THEN pg_notify('tether_done', id::text) END AS notified
FROM moved;

-- name: enqueue_steps
-- READY steps, named by task id, become tasks. Parameters fed by dependencies
-- are filled in from the dependencies' stored results: the ok value ('value'),
-- or the whole result ('result', also for a dependency that failed or was
-- skipped). A parameter whose dependency has no such result is left out, so
-- its default applies. Every row is found by its task id, a single-column
-- unique key, so no plan (generic, or made from statistics older than the
-- workflow) can turn a lookup into a range over the workflow.
--
-- A step with a unique key takes it here, as a unique send does (unique.sql):
-- one INSERT ... ON CONFLICT DO UPDATE per key, deciding on the locked key row
-- alone, keys in one order. The window is the step's own, found through
-- excluded.task_id (the proposed step's task id) in `ready`, a read of the
-- workflow's steps, never of tether_tasks. A step whose key another task holds
-- is refused: its task is written FAILED with UNIQUE_KEY_HELD (no code runs)
-- and the caller settles the step in the same transaction.
WITH ready AS (
    SELECT s.workflow_id, s.task_id, s.task_name, s.queue, s.priority, s.args,
           s.kwargs || coalesce(fed.kwargs, '{}'::jsonb) AS kwargs, s.max_retries, s.retry_policy,
           s.unique_key, s.unique_for, s.concurrency_key
    FROM tether_workflow_tasks s
    CROSS JOIN LATERAL (
        SELECT jsonb_object_agg(f.key, v.value) AS kwargs
        FROM jsonb_each(s.args_from) AS f
        CROSS JOIN LATERAL (
            SELECT CASE WHEN f.value ->> 'as' = 'result' THEN d.result ELSE d.result -> 'ok' END
            FROM tether_workflow_tasks d
            WHERE d.task_id = (f.value ->> 'task')::uuid
              AND (d.status = 'COMPLETED'
                   OR (f.value ->> 'as' = 'result' AND d.status IN ('FAILED', 'SKIPPED', 'CANCELLED')))
        ) AS v (value)
    ) fed
    WHERE s.task_id = ANY(%(task_ids)s::uuid[])
      AND s.workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
      AND s.status = 'READY'
), key AS (
    INSERT INTO tether_unique_keys AS k (task_name, unique_key, task_id, sent_at, active)
    SELECT DISTINCT ON (r.task_name COLLATE "C", r.unique_key COLLATE "C")
           r.task_name, r.unique_key, r.task_id, now(), true
    FROM ready r WHERE r.unique_key IS NOT NULL
    ORDER BY r.task_name COLLATE "C", r.unique_key COLLATE "C", r.task_id
    ON CONFLICT (task_name, unique_key) DO UPDATE
    SET task_id = CASE WHEN tether_unique_key_is_free(k.active, k.sent_at, (
                           SELECT r.unique_for FROM ready r WHERE r.task_id = excluded.task_id))
                       THEN excluded.task_id ELSE k.task_id END,
        sent_at = CASE WHEN tether_unique_key_is_free(k.active, k.sent_at, (
                           SELECT r.unique_for FROM ready r WHERE r.task_id = excluded.task_id))
                       THEN excluded.sent_at ELSE k.sent_at END,
        active = k.active OR tether_unique_key_is_free(k.active, k.sent_at, (
                     SELECT r.unique_for FROM ready r WHERE r.task_id = excluded.task_id))
    RETURNING k.task_name, k.unique_key, k.task_id
), ins AS (
    INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries, retry_policy,
                              workflow_id, unique_key, status, error_code, result, failed_at,
                              trace_context, concurrency_key)
    SELECT r.task_id, r.task_name, r.queue, r.priority, r.args, r.kwargs, r.max_retries,
           r.retry_policy, r.workflow_id, r.unique_key,
           CASE WHEN h.holder IS NULL THEN 'PENDING' ELSE 'FAILED' END,
           CASE WHEN h.holder IS NOT NULL THEN 'UNIQUE_KEY_HELD' END,
           CASE WHEN h.holder IS NOT NULL THEN jsonb_build_object('err', jsonb_build_object(
               'code', 'UNIQUE_KEY_HELD',
               'message', 'unique key ' || r.unique_key || ' of task ' || r.task_name
                          || ' is held by task ' || h.holder,
               'data', jsonb_build_object('task_id', h.holder::text))) END,
           CASE WHEN h.holder IS NOT NULL THEN now() END,
           -- a step runs in its workflow's trace (docs/monitoring.md#tracing)
           (SELECT w.trace_context FROM tether_workflows w WHERE w.id = r.workflow_id),
           r.concurrency_key
    FROM ready r
    LEFT JOIN LATERAL (
        SELECT k.task_id AS holder FROM key k
        WHERE r.unique_key IS NOT NULL AND k.task_name = r.task_name AND k.unique_key = r.unique_key
          AND k.task_id <> r.task_id
    ) h ON true
    ON CONFLICT (id) DO NOTHING
    RETURNING id, status, queue, run_at
), marked AS (
    -- The same rows as `ready` (same snapshot), without a join.
    UPDATE tether_workflow_tasks SET status = 'ENQUEUED', enqueued_at = now()
    WHERE task_id = ANY(%(task_ids)s::uuid[])
      AND workflow_id IS NOT DISTINCT FROM %(workflow_id)s::uuid
      AND status = 'READY'
    RETURNING node
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM ins WHERE status = 'PENDING' GROUP BY queue
)
SELECT (SELECT count(*) FROM marked) AS enqueued, (SELECT count(*) FROM woken) AS queues,
       (SELECT array_agg(id) FROM ins WHERE status = 'FAILED') AS refused;

-- name: ready_steps
-- Every READY step of a workflow (start, resume, finalisation): reads the workflow.
SELECT task_id FROM tether_workflow_tasks
WHERE workflow_id = %(workflow_id)s AND status = 'READY'
ORDER BY node;

-- name: pause_workflow
UPDATE tether_workflows SET status = 'PAUSED', paused_at = now(), updated_at = now()
WHERE id = %(id)s AND status = 'RUNNING'
RETURNING id;

-- name: resume_workflow
UPDATE tether_workflows SET status = 'RUNNING', paused_at = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'PAUSED'
RETURNING id;

-- name: cancel_workflow
UPDATE tether_workflows SET status = 'CANCELLED', finished_at = now(), updated_at = now()
WHERE id = %(id)s AND status IN ('RUNNING', 'PAUSED')
RETURNING id, CASE WHEN notify_on_done THEN pg_notify('tether_done', id::text) END AS notified;

-- name: cancel_unstarted_steps
-- Steps that have no task yet end CANCELLED at once.
UPDATE tether_workflow_tasks
SET status = 'CANCELLED', error_code = 'TASK_CANCELLED', finished_at = now(),
    result = jsonb_build_object('err', jsonb_build_object(
        'code', 'TASK_CANCELLED', 'message', 'the workflow was cancelled before this step ran',
        'data', NULL))
WHERE workflow_id = %(id)s AND status IN ('WAITING', 'READY')
RETURNING node;

-- name: cancel_step_tasks
-- Tasks of enqueued steps that have not started: cancelled like cancel_task.
-- (Running ones finish; their steps settle as usual.)
WITH c AS (
    UPDATE tether_tasks
    SET status = 'CANCELLED', cancelled_at = now(), updated_at = now(),
        error_code = 'TASK_CANCELLED',
        result = jsonb_build_object('err', jsonb_build_object(
            'code', 'TASK_CANCELLED', 'message', 'the workflow was cancelled before this step ran',
            'data', NULL))
    WHERE id IN (SELECT task_id FROM tether_workflow_tasks
                 WHERE workflow_id = %(id)s AND status = 'ENQUEUED')
      AND status IN ('PENDING', 'CLAIMED')
    RETURNING id, notify_on_done
), told AS (
    SELECT pg_notify('tether_done', id::text) FROM c WHERE notify_on_done
)
SELECT id FROM c;

-- name: workflow_of_task
SELECT workflow_id FROM tether_tasks WHERE id = %(id)s;

-- name: stuck_steps
-- Reconciliation: steps still ENQUEUED although their task has ended (the
-- process that ended it died before advancing the workflow, or the task was
-- ended by someone who does not advance workflows).
SELECT s.workflow_id, s.task_id
FROM tether_workflow_tasks s
JOIN tether_tasks t ON t.id = s.task_id
WHERE s.status = 'ENQUEUED' AND t.status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
ORDER BY s.workflow_id
LIMIT %(limit)s;

-- name: cancelled_leftovers
-- Steps of CANCELLED workflows whose task is waiting to run again: it was
-- running at the cancel and then failed with a retry scheduled. Nothing new
-- may start in a cancelled workflow, so these are cancelled too.
SELECT DISTINCT s.workflow_id
FROM tether_workflow_tasks s
JOIN tether_workflows w ON w.id = s.workflow_id
JOIN tether_tasks t ON t.id = s.task_id
WHERE s.status = 'ENQUEUED' AND w.status = 'CANCELLED' AND t.status IN ('PENDING', 'CLAIMED')
LIMIT %(limit)s;

-- name: unfinished_workflows
-- Finalisation's safety net: open workflows whose steps have all finished.
-- (Each advance finishes its workflow in the same transaction, so this finds
-- something only if a workflow was changed by hand.)
SELECT w.id FROM tether_workflows w
WHERE w.status IN ('RUNNING', 'PAUSED') AND w.steps_done >= w.steps_total
ORDER BY w.created_at
LIMIT %(limit)s;

-- name: prune_workflows
-- Finished workflows past retention, with their steps (cascade) and the steps' tasks.
WITH old AS (
    SELECT id FROM tether_workflows
    WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED') AND finished_at < now() - %(age)s::interval
      -- a cancelled workflow waits for its last running steps to settle
      AND steps_done >= steps_total
    ORDER BY finished_at
    LIMIT %(limit)s
), step_tasks AS (
    DELETE FROM tether_tasks WHERE id IN (
        SELECT s.task_id FROM tether_workflow_tasks s WHERE s.workflow_id IN (SELECT id FROM old))
      AND status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
)
-- The status again on the row itself: a workflow reopened by a retry (docs/workflows.md)
-- after this statement's snapshot is re-checked once its lock is granted, and kept.
DELETE FROM tether_workflows WHERE id IN (SELECT id FROM old)
  AND status IN ('COMPLETED', 'FAILED', 'CANCELLED');

-- name: watch_workflow
-- A result waiter asks to be notified; the row lock orders this against the
-- finishing UPDATE, so either the finisher sees the flag or we see the status.
UPDATE tether_workflows SET notify_on_done = true WHERE id = %(id)s
RETURNING id, name, status, output_node;

-- name: get_workflow
SELECT id, name, status, on_error, output_node, steps_total, steps_done, steps_failed,
       created_at, updated_at, paused_at, finished_at
FROM tether_workflows WHERE id = %(id)s;

-- name: get_workflow_steps
SELECT s.node, s.node_name, s.task_id, s.task_name, s.queue, s.status, s.depends_on,
       s.dependents, s.join_mode, s.run_anyway, s.result, s.error_code, s.enqueued_at,
       s.finished_at, t.status AS task_status, t.attempt, t.retry_count
FROM tether_workflow_tasks s
LEFT JOIN tether_tasks t ON t.id = s.task_id
WHERE s.workflow_id = %(id)s
ORDER BY s.node;

-- name: workflow_output
-- What get() returns for a COMPLETED workflow: the output step's result, or
-- (no output step named) every sink step's result.
SELECT node_name, result FROM tether_workflow_tasks
WHERE workflow_id = %(id)s
  AND CASE WHEN %(output_node)s::int IS NULL THEN cardinality(dependents) = 0
           ELSE node = %(output_node)s::int END
ORDER BY node;

-- name: workflow_failures
SELECT node_name, error_code, result FROM tether_workflow_tasks
WHERE workflow_id = %(id)s AND status IN ('FAILED', 'CANCELLED')
ORDER BY finished_at, node
LIMIT 50;

-- name: list_workflows
-- The workflow's own columns (WorkflowSummary: get_workflow's but output_node).
SELECT id, name, status, on_error, steps_total, steps_done, steps_failed, created_at, updated_at,
       paused_at, finished_at
FROM tether_workflows
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(name)s::text IS NULL OR name = %(name)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: workflow_statuses
-- `tether recover`: the workflows it reconciles, read before and after; a handle's status().
SELECT id, name, status, output_node FROM tether_workflows
WHERE id = ANY(%(ids)s::uuid[])
ORDER BY id;
