-- The reaper's steps. Each is bounded (LIMIT) and each action is a guarded
-- UPDATE, so two reapers racing, or a late worker, cannot act twice.

-- name: reaper_lock
-- One reaper acts per tick across all workers; the others skip (lock held to COMMIT).
SELECT pg_try_advisory_xact_lock(2122188290) AS acquired;

-- name: expire_pending
-- PENDING past good_until -> EXPIRED with TASK_EXPIRED. No attempt row: nothing ran.
WITH gone AS (
    UPDATE tether_tasks
    SET status = 'EXPIRED', expired_at = now(), updated_at = now(), error_code = 'TASK_EXPIRED',
        result = jsonb_build_object('err', jsonb_build_object(
            'code', 'TASK_EXPIRED', 'message', 'good_until passed before a worker claimed it',
            'data', NULL))
    WHERE id IN (
        SELECT id FROM tether_tasks
        WHERE status = 'PENDING' AND good_until IS NOT NULL AND good_until <= now()
        ORDER BY good_until
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AND status = 'PENDING'
    RETURNING id, notify_on_done
), told AS (
    SELECT pg_notify('tether_done', id::text) FROM gone WHERE notify_on_done
)
SELECT (SELECT count(*) FROM gone) AS expired, (SELECT count(*) FROM told) AS notified;
