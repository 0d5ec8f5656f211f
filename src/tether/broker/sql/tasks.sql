-- Producer-side statements: enqueue, read, cancel, wait.
-- An enqueue NOTIFYs 'tether_work' (once per queue per statement, with the
-- earliest run_at, so a worker wakes now or sets a timer) when its tasks are
-- due later, or when a worker waits for that queue (tether_work_is_awaited,
-- migration 0005). Otherwise nobody needs telling: every worker of the queue
-- is busy and claims again when a slot frees. Skipping the NOTIFY lets
-- concurrent sends share WAL flushes (NOTIFY serialises commits).
--
-- notify_always: a send inside the caller's own transaction (docs/transactions.md)
-- NOTIFYs whenever its task is due, without asking tether_work_is_awaited: that
-- check holds the queue's waiter lock (shared) until commit, and a transaction the
-- application keeps open for seconds would hold back every worker registering to
-- wait on that queue, and every send queued behind that worker. The NOTIFY itself
-- is delivered at commit, and never after a rollback.
-- run_at: the time a send asked for (schedule(when=datetime)); NULL means now()
-- plus delay. now() is the transaction's start, in the caller's transaction too.

-- name: insert_task
-- One INSERT, no CTE and no rows back (psycopg has no result to describe): the statement's
-- side effects are computed once, before the row is written, in a one-row subquery the
-- planner keeps for its volatile functions (EXPLAIN VERBOSE shows it as a Subquery Scan):
-- durable false (PostgresConfig.durable_sends / with_options(durable=False)): this
-- transaction's commit does not wait for its WAL flush. The setting is made whether or not
-- anyone is notified; a durable send leaves the session's synchronous_commit (the server's
-- or the user's) untouched. No code can run on a task whose insert is later lost in a
-- server crash: a child's start is a durable commit, and its flush carries the earlier insert.
-- The NOTIFY, as the header says. Asking tether_work_is_awaited before the row is written
-- rather than after keeps the lost-wakeup race closed (migration 0005): its lock is held
-- shared from the check to the commit either way, and a registering worker's exclusive
-- lock waits for that commit, then claims and sees the row. An INSERT that then fails
-- aborts the transaction, and its NOTIFY with it.
INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries,
                          retry_policy, good_until, run_at, enqueued_at, trace_context, concurrency_key)
SELECT %(id)s, %(name)s, %(queue)s, %(priority)s, %(args)s::jsonb, %(kwargs)s::jsonb,
       %(max_retries)s, %(retry_policy)s::jsonb, %(good_until)s, due.run_at, due.run_at,
       %(trace_context)s, %(concurrency_key)s::text
FROM (SELECT coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval) AS run_at) AS due,
     LATERAL (
         SELECT CASE WHEN NOT %(durable)s THEN set_config('synchronous_commit', 'off', true) END,
                CASE WHEN due.run_at > now()
                          OR CASE WHEN %(notify_always)s THEN true ELSE tether_work_is_awaited(%(queue)s) END
                     THEN pg_notify('tether_work', %(queue)s || ' ' || extract(epoch FROM due.run_at)::text)
                END
     ) AS side_effects;

-- name: insert_tasks
-- send_many: one statement for the whole batch. The per-task columns arrive as
-- one JSON array each (joined from already-encoded texts) and one id string,
-- zipped back into rows here: far cheaper to ship than 10,000-element arrays.
WITH ins AS (
    INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries,
                              retry_policy, good_until, run_at, enqueued_at, trace_context, concurrency_key)
    SELECT u.id::uuid, %(name)s, %(queue)s, %(priority)s, u.args, u.kwargs,
           %(max_retries)s, %(retry_policy)s::jsonb, %(good_until)s,
           coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval),
           coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval), %(trace_context)s,
           coalesce(u.key, %(concurrency_key)s::text)
    FROM ROWS FROM (
        unnest(string_to_array(%(ids)s, ',')),
        jsonb_array_elements(%(args)s::jsonb),
        jsonb_array_elements(%(kwargs)s::jsonb),
        -- one key per task (NULL: none, or every task takes concurrency_key); no array: none
        jsonb_array_elements_text(%(keys)s::jsonb)
    ) AS u (id, args, kwargs, key),
    -- durable false: as insert_task
    (SELECT CASE WHEN NOT %(durable)s THEN set_config('synchronous_commit', 'off', true) END)
        AS commit_mode
    RETURNING queue, run_at
)
SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
FROM ins GROUP BY queue
HAVING min(run_at) > now() OR CASE WHEN %(notify_always)s THEN true ELSE tether_work_is_awaited(queue) END;

-- name: get_task
SELECT id, name, queue, priority, status, args, kwargs, result AS stored_result, error_code, attempt,
       retry_count, max_retries, retry_policy, good_until, unique_key, run_at, sent_at, enqueued_at,
       claimed_at, started_at, completed_at, failed_at, cancelled_at, expired_at,
       next_retry_at, updated_at, claimed_by_worker_id, progress, progress_at,
       schedule_name, schedule_slot, cancel_requested_at, cancel_requested_by
FROM tether_tasks WHERE id = %(id)s;

-- name: get_status
SELECT status, result FROM tether_tasks WHERE id = %(id)s;

-- name: watch_task
-- A result waiter asks to be notified (handle.get()): the flag tells the finishing
-- statement to NOTIFY tether_done. Setting it takes the row lock, which orders this
-- against the finishing UPDATE: either the finisher sees the flag or we see the result.
--
-- That lock must never delay a claim. A claim skips locked rows (FOR UPDATE SKIP LOCKED),
-- so one that runs while this UPDATE holds the row (until its commit, a WAL flush) passes
-- the task over, and if it took fewer tasks than it had room for nothing makes its worker
-- look again before the next poll (seconds). Two rules close that:
-- - A row already flagged is only read, never locked: whoever flagged it (committed, as
--   every snapshot here sees) already made the finisher notify. So only a task's first
--   get() writes, and later ones, polls and repeated waits cost a claim nothing.
-- - A PENDING row flagged here is announced on tether_work exactly as a send announces
--   it (tasks.sql insert_task): due later, always (a worker sets a timer; one delivered
--   after run_at counts as due now); due now, when a worker waits for its queue
--   (tether_work_is_awaited, migration 0005). The NOTIFY is delivered at commit, the
--   moment the row lock goes, so a claim that skipped the row is followed by one that
--   finds it free. A busy worker that is not registered needs no telling: it registers
--   when a claim comes back short, which waits for this statement's shared advisory lock
--   (taken by tether_work_is_awaited) and then claims again, as for a send.
-- Why not drop the lock (a separate table of waiters, read by the finisher): without the
-- row lock, a finisher's snapshot may miss a waiter that registered just before it
-- committed while the waiter's read misses the result, and the waiter would sleep until
-- its poll. One NOTIFY per task that a get() meets PENDING (while a worker waits) is the
-- price, and the notification is what the send would have sent had it come a moment later.
WITH seen AS (
    SELECT id, status, result, notify_on_done FROM tether_tasks WHERE id = %(id)s
), flagged AS (
    UPDATE tether_tasks t SET notify_on_done = true
    FROM seen
    WHERE t.id = seen.id AND NOT seen.notify_on_done
    RETURNING t.status, t.result, t.queue, t.run_at
), announced AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text)
    FROM flagged
    WHERE status = 'PENDING' AND (run_at > now() OR tether_work_is_awaited(queue))
)
SELECT status, result, (SELECT count(*) FROM announced) AS announced FROM flagged
UNION ALL
SELECT status, result, 0 FROM seen WHERE notify_on_done;

-- name: get_attempts
-- An attempt that slept or waited (SUSPENDED, docs/durable-steps.md) left its task PENDING:
-- its outcome reads PENDING (no new task status), `suspended` says why, resume_at until when.
SELECT attempt, worker_id, hostname, pid, started_at, finished_at,
       CASE WHEN outcome = 'SUSPENDED' THEN 'PENDING' ELSE outcome END AS outcome, will_retry,
       error_code, error_message, outcome = 'SUSPENDED' AS suspended, resume_at, event_key
FROM tether_task_attempts WHERE task_id = %(id)s ORDER BY attempt;

-- name: cancel_task
-- PENDING or CLAIMED: CANCELLED at once, no code ran (a worker's start then matches
-- nothing). RUNNING: the request is recorded on the row (the first request's time and
-- asker are kept) and the worker holding the task is told on tether_control; the row
-- settles when the code stops (claims.sql write_batch, docs/tasks.md#cancelling-a-
-- running-task). One UPDATE whose CASEs read the row as it is when its lock is
-- granted: a task that started or ended meanwhile is judged by its new status.
WITH c AS (
    UPDATE tether_tasks t
    SET status = CASE WHEN t.status = 'RUNNING' THEN t.status ELSE 'CANCELLED' END,
        cancelled_at = CASE WHEN t.status = 'RUNNING' THEN t.cancelled_at ELSE now() END,
        error_code = CASE WHEN t.status = 'RUNNING' THEN t.error_code ELSE 'TASK_CANCELLED' END,
        result = CASE WHEN t.status = 'RUNNING' THEN t.result
                      ELSE jsonb_build_object('err', jsonb_build_object(
                          'code', 'TASK_CANCELLED',
                          'message', 'cancelled before it ran' || coalesce(' (by ' || %(by)s || ')', ''),
                          'data', NULL)) END,
        cancel_requested_at = coalesce(t.cancel_requested_at, now()),
        cancel_requested_by = CASE WHEN t.cancel_requested_at IS NULL THEN %(by)s
                                   ELSE t.cancel_requested_by END,
        updated_at = now()
    WHERE t.id = %(id)s AND t.status IN ('PENDING', 'CLAIMED', 'RUNNING')
    RETURNING t.id, t.status, t.workflow_id, t.notify_on_done, t.claimed_by_worker_id,
              t.cancel_requested_at, t.cancel_requested_by
)
SELECT id, status, workflow_id, claimed_by_worker_id, cancel_requested_at, cancel_requested_by,
       CASE WHEN status = 'CANCELLED' AND notify_on_done THEN pg_notify('tether_done', id::text)
            WHEN status = 'RUNNING'
                THEN pg_notify('tether_control', 'cancel ' || claimed_by_worker_id || ' ' || id::text)
       END AS told
FROM c;

-- name: recent_failures
-- The dashboard's "recently failed": the latest failures first, among the 200 newest
-- FAILED tasks (by id: when they were sent), read through the partial index over
-- unsuccessful tasks, which holds only them (migration 10). Reading the terminal rows by
-- updated_at until enough FAILED ones turn up reads every task that ended since: in a
-- healthy system, hours of successes (30,000 rows after a burst of them: 52 ms). A task
-- sent long before it failed (retries over hours) shows here only while it is among the
-- 200 newest failed ones.
SELECT id, name, queue, attempt, retry_count, error_code, error_message, failed_at,
       claimed_by_worker_id
FROM (
    SELECT id, name, queue, attempt, retry_count, error_code,
           left(result -> 'err' ->> 'message', 300) AS error_message, failed_at, claimed_by_worker_id
    FROM tether_tasks
    WHERE status = 'FAILED'
    ORDER BY id DESC
    LIMIT 200
) newest
ORDER BY failed_at DESC NULLS LAST, id DESC
LIMIT %(limit)s;

-- name: count_status_of
SELECT status, count(*) AS n FROM tether_tasks WHERE id = ANY(%(ids)s::uuid[]) GROUP BY status;

-- name: find_worker_by_pid
SELECT id, status FROM tether_workers
WHERE pid = %(pid)s AND hostname = %(hostname)s AND status = 'active'
ORDER BY started_at DESC LIMIT 1;

-- name: database_now
SELECT now() AS now;

-- name: get_heartbeats
SELECT role, sender_id, hostname, pid, sent_at FROM tether_heartbeats
WHERE task_id = %(id)s ORDER BY sent_at DESC LIMIT %(limit)s;
