-- The worker's heartbeat: ONE statement per interval for the whole worker,
-- however many tasks it holds: its registry row, a 'claimer' row per CLAIMED
-- task, a 'runner' row per RUNNING task whose child stamped its slot in time,
-- and (every few beats) a snapshot. Rows are only written for tasks this
-- worker still owns in the expected state; the others come back as 'lost'. The
-- RUNNING ones whose cancel was requested come back too: the fallback for a
-- tether_control notification the worker's listener missed (while reconnecting).
-- The beat also reads when the next slot of the worker's queues' live schedules comes
-- (as schedules.sql next_slot_in): the scheduler's look at least every check interval
-- rides on it instead of a transaction of its own (worker/scheduler.py).

-- name: write_heartbeats
WITH me AS (
    UPDATE tether_workers
    SET last_heartbeat_at = now(), updated_at = now(), status = 'active', inactive_at = NULL
    WHERE id = %(worker_id)s AND status <> 'stopped'
    RETURNING id
), sent AS (
    SELECT u.task_id, u.role, u.pid
    FROM unnest(%(task_ids)s::uuid[], %(roles)s::text[], %(pids)s::int[]) AS u (task_id, role, pid)
), owned AS (
    SELECT sent.*, t.status, t.cancel_requested_at IS NOT NULL AS cancel_requested FROM sent
    -- COLLATE "C": each task by its primary key, never the in-flight index's dead
    -- entries (claims.sql says why)
    LEFT JOIN tether_tasks t ON t.id = sent.task_id AND t.claimed_by_worker_id = %(worker_id)s
        AND t.status COLLATE "C" IN ('CLAIMED', 'RUNNING')
), beats AS (
    INSERT INTO tether_heartbeats (task_id, sender_id, role, hostname, pid)
    SELECT task_id, %(worker_id)s, role, %(hostname)s, pid FROM owned
    WHERE status = CASE role WHEN 'claimer' THEN 'CLAIMED' ELSE 'RUNNING' END
    RETURNING 1
), snapshot AS (
    INSERT INTO tether_worker_states (worker_id, running, claimed, tasks_done, rss_bytes, cpu_percent)
    SELECT %(worker_id)s, %(running)s, %(claimed)s, %(tasks_done)s, %(rss_bytes)s, %(cpu_percent)s
    WHERE %(snapshot)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM me) AS registered,
       (SELECT count(*) FROM beats) AS beats,
       (SELECT count(*) FROM snapshot) AS snapshots,
       coalesce((SELECT array_agg(task_id::text) FROM owned WHERE status IS NULL), '{}') AS lost,
       coalesce((SELECT array_agg(task_id::text) FROM owned WHERE status = 'RUNNING' AND cancel_requested),
                '{}') AS cancel_requested,
       (SELECT extract(epoch FROM min(s.next_slot) - now())::float8 FROM tether_schedules s
        WHERE s.queue = ANY(%(queues)s::text[]) AND NOT s.paused AND s.removed_at IS NULL) AS next_slot_in_s;

-- name: report_progress
-- From inside a task: stored on the row, and it counts as a runner heartbeat.
UPDATE tether_tasks
SET progress = %(progress)s::jsonb, progress_at = now(), updated_at = now()
WHERE id = %(id)s AND status COLLATE "C" = 'RUNNING' AND attempt = %(attempt)s
  AND claimed_by_worker_id = %(worker_id)s
RETURNING id;
