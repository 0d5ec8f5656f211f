-- The worker registry.

-- name: register_worker
-- The id is new to this process (hostname-pid-random): a row that exists already is this
-- very registration, committed before a lost connection made the worker run it again.
INSERT INTO tether_workers (id, hostname, pid, process_started_at, queues, processes,
                            async_processes, async_concurrency, tether_version, task_names, host_key)
VALUES (%(id)s, %(hostname)s, %(pid)s, %(process_started_at)s, %(queues)s, %(processes)s,
        %(async_processes)s, %(async_concurrency)s, %(version)s, %(task_names)s, %(host_key)s)
ON CONFLICT (id) DO NOTHING;

-- name: name_known_elsewhere
-- Does another live worker serving this queue know this task name? (rolling deploys)
SELECT EXISTS (
    SELECT 1 FROM tether_workers
    WHERE status = 'active' AND id <> %(me)s AND %(name)s = ANY(task_names) AND %(queue)s = ANY(queues)
) AS known;

-- name: touch_worker
UPDATE tether_workers SET last_heartbeat_at = now(), updated_at = now(),
       status = CASE WHEN status = 'inactive' THEN 'active' ELSE status END
WHERE id = %(id)s AND status <> 'stopped'
RETURNING id;

-- name: stop_worker
WITH no_longer_waiting AS (
    DELETE FROM tether_queue_waiters WHERE worker_id = %(id)s
)
UPDATE tether_workers SET status = 'stopped', stopped_at = now(), updated_at = now()
WHERE id = %(id)s;

-- name: list_workers
SELECT w.id, w.hostname, w.pid, w.queues, w.processes, w.async_processes, w.async_concurrency,
       w.status, w.started_at,
       w.last_heartbeat_at,
       -- clock_timestamp(), not now(): a heartbeat committed after this statement's transaction
       -- began carries a later now() than ours, and its age would come out negative.
       greatest(0, extract(epoch FROM clock_timestamp() - w.last_heartbeat_at))::float8 AS heartbeat_age_s,
       (SELECT count(*) FROM tether_tasks t
         WHERE t.claimed_by_worker_id = w.id AND t.status = 'CLAIMED') AS claimed,
       (SELECT count(*) FROM tether_tasks t
         WHERE t.claimed_by_worker_id = w.id AND t.status = 'RUNNING') AS running
FROM tether_workers w
WHERE %(all)s OR w.status = 'active'
ORDER BY w.status, w.started_at DESC
LIMIT %(limit)s;

-- name: record_listener_session
-- On the listener's own connection, each time it (re)connects, for a worker that opted in
-- to the session_closed rule (broker/sql/recovery.sql, closed_session_workers): this
-- session's server process and its start (a pid alone may be reused), the server's
-- incarnation, and how long after its last heartbeat the worker may be judged once the
-- session is gone. A session may always read its own backend_start.
UPDATE tether_workers
SET listener_pid = pg_backend_pid(),
    listener_backend_start = (SELECT a.backend_start FROM pg_stat_get_activity(pg_backend_pid()) a),
    server_started_at = pg_postmaster_start_time(),
    session_closed_after = %(after)s::interval
WHERE id = %(id)s;
