-- Retention: rows past their retention deleted in small batches, one statement and one
-- commit each, so no batch holds its row locks for long (docs/schema.md#retention).
--
-- Each batch reads its table's rows oldest first from `after` (the newest time the
-- previous batch read; '-infinity' for a pass from the start) and says how far it read
-- (`reached`). Rows a batch deleted keep their index entries until a vacuum removes them;
-- while a transaction holds the vacuum back, a batch that read from the oldest again
-- would read every row deleted since, and each batch would cost more than the last.
-- FOR UPDATE SKIP LOCKED: two pruners (two workers' reapers, one after the other) never
-- wait for each other's batch, and never delete the same row twice.

-- name: prune_heartbeats
WITH doomed AS (
    SELECT id, sent_at FROM tether_heartbeats
    WHERE sent_at >= %(after)s AND sent_at < now() - %(age)s::interval
    ORDER BY sent_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM tether_heartbeats h USING doomed WHERE h.id = doomed.id RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM doomed) AS read,
       (SELECT max(sent_at) FROM doomed) AS reached;

-- name: prune_worker_states
WITH doomed AS (
    SELECT id, captured_at FROM tether_worker_states
    WHERE captured_at >= %(after)s AND captured_at < now() - %(age)s::interval
    ORDER BY captured_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM tether_worker_states s USING doomed WHERE s.id = doomed.id RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM doomed) AS read,
       (SELECT max(captured_at) FROM doomed) AS reached;

-- name: prune_workers
-- Registry rows of workers stopped or inactive for longer than the snapshot retention.
-- Few rows (one per worker process started): read from the start every time.
WITH doomed AS (
    SELECT id FROM tether_workers
    WHERE status <> 'active' AND updated_at < now() - %(age)s::interval
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM tether_workers w USING doomed WHERE w.id = doomed.id AND w.status <> 'active' RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM doomed) AS read,
       NULL::timestamptz AS reached;

-- name: prune_terminal_tasks
-- Attempts and checkpointed steps go with their task (ON DELETE CASCADE), and so do unique keys. Workflow steps'
-- tasks go with their workflow (prune_workflows), never while it may still need them.
-- The status again on the row itself: a task retried by hand after this statement's
-- snapshot is re-checked once its lock is granted, and kept.
WITH doomed AS (
    SELECT id, updated_at FROM tether_tasks
    WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
      AND updated_at >= %(after)s AND updated_at < now() - %(age)s::interval AND workflow_id IS NULL
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM tether_tasks t USING doomed
    WHERE t.id = doomed.id AND t.status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM doomed) AS read,
       (SELECT max(updated_at) FROM doomed) AS reached;

-- name: prune_recovery_minutes
-- The dashboard's recoveries per minute and rule (migration 15): a few rows an hour, along
-- the primary key (minute, rule).
WITH doomed AS (
    SELECT minute, rule FROM tether_recovery_minutes
    WHERE minute >= %(after)s AND minute < now() - %(age)s::interval
    ORDER BY minute
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM tether_recovery_minutes r USING doomed
    WHERE r.minute = doomed.minute AND r.rule = doomed.rule
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM doomed) AS read,
       (SELECT max(minute) FROM doomed) AS reached;

-- name: prune_events
-- Events no task took (docs/durable-steps.md#events), older than the terminal record
-- retention. A delivered event goes with the task it was delivered to (ON DELETE CASCADE).
WITH doomed AS (
    SELECT id, sent_at FROM tether_events
    WHERE delivered_at IS NULL AND sent_at >= %(after)s AND sent_at < now() - %(age)s::interval
    ORDER BY sent_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM tether_events e USING doomed WHERE e.id = doomed.id AND e.delivered_at IS NULL RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM doomed) AS read,
       (SELECT max(sent_at) FROM doomed) AS reached;
