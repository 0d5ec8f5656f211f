-- The reaper's steps. Each is bounded (LIMIT) and each action is a guarded
-- UPDATE, so two reapers racing, or a late worker, cannot act twice.

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

-- name: requeue_stale_claimed
-- CLAIMED with no claimer heartbeat (from its owner, for this claim) within the
-- threshold, or owned by a worker known to be gone: back to PENDING. Safe: the
-- code never ran. The claim index stays bumped, so a late start is fenced off.
WITH stale AS (
    SELECT t.id, t.attempt, t.claimed_by_worker_id,
           extract(epoch FROM now() - greatest(t.claimed_at, hb.last))::float8 AS silent_s
    FROM tether_tasks t
    CROSS JOIN LATERAL (
        SELECT max(h.sent_at) AS last FROM tether_heartbeats h
        WHERE h.task_id = t.id AND h.role = 'claimer' AND h.sender_id = t.claimed_by_worker_id
    ) hb
    WHERE t.status = 'CLAIMED'
      AND (%(owner)s::text IS NULL OR t.claimed_by_worker_id = %(owner)s)
      AND greatest(t.claimed_at, hb.last) < now() - %(threshold)s::interval
    ORDER BY t.claimed_at
    LIMIT %(limit)s
    FOR UPDATE OF t SKIP LOCKED
), back AS (
    UPDATE tether_tasks t
    SET status = 'PENDING', claimed_at = NULL, claimed_by_worker_id = NULL, updated_at = now()
    FROM stale
    WHERE t.id = stale.id AND t.status COLLATE "C" = 'CLAIMED' AND t.attempt = stale.attempt
    RETURNING t.id, t.name, t.queue, t.run_at, t.attempt, stale.claimed_by_worker_id, stale.silent_s,
              t.trace_context
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM back GROUP BY queue
)
SELECT id, name, queue, attempt, claimed_by_worker_id, silent_s, (SELECT count(*) FROM woken) AS queues_woken,
       trace_context
FROM back;

-- name: stale_running
-- RUNNING with no runner heartbeat (from its owner) within the threshold. Locked
-- here; the caller decides retry or failure per task and writes it fenced.
SELECT t.id, t.name, t.queue, t.attempt, t.claimed_by_worker_id, t.retry_count, t.retry_policy::text,
       extract(epoch FROM now() - greatest(t.started_at, hb.last))::float8 AS silent_s, t.trace_context
FROM tether_tasks t
CROSS JOIN LATERAL (
    SELECT max(h.sent_at) AS last FROM tether_heartbeats h
    WHERE h.task_id = t.id AND h.role = 'runner' AND h.sender_id = t.claimed_by_worker_id
) hb
WHERE t.status = 'RUNNING'
  AND (%(owner)s::text IS NULL OR t.claimed_by_worker_id = %(owner)s)
  AND greatest(t.started_at, t.progress_at, hb.last) < now() - %(threshold)s::interval
ORDER BY t.started_at
LIMIT %(limit)s
FOR UPDATE OF t SKIP LOCKED;

-- name: deactivate_stale_workers
WITH stale AS (
    SELECT id FROM tether_workers
    WHERE status = 'active' AND last_heartbeat_at < now() - %(threshold)s::interval
    ORDER BY last_heartbeat_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), no_longer_waiting AS (
    -- A dead worker waits for nothing: sends stop notifying for it.
    DELETE FROM tether_queue_waiters WHERE worker_id IN (SELECT id FROM stale)
)
UPDATE tether_workers w
SET status = 'inactive', inactive_at = now(), updated_at = now()
FROM stale
WHERE w.id = stale.id AND w.status = 'active'
RETURNING w.id, w.hostname, w.pid, extract(epoch FROM now() - w.last_heartbeat_at)::float8 AS age_s;

-- name: closed_session_workers
-- The session_closed rule: active workers that recorded their listener session (they opted
-- in) whose session is gone from this server, on the incarnation they recorded it on (a
-- restart or a failover ends every session: never read as deaths), and whose last heartbeat
-- is older than their own session_closed_after (a live worker whose listener merely
-- reconnected beats meanwhile, and records its new session). Marked inactive here, guarded
-- and locked as deactivate_stale_workers; the caller then recovers their tasks (owner=).
-- A session counts as present when a process with its pid is there and its backend_start
-- is the recorded one, or cannot be read: without pg_read_all_stats a role sees no
-- backend_start of another role's sessions, and unknown must mean alive.
-- pg_stat_get_activity(pid) reads the one process; like pg_stat_activity it is a snapshot
-- taken at its first use in the transaction.
WITH gone AS (
    SELECT w.id FROM tether_workers w
    WHERE w.status = 'active'
      AND w.listener_pid IS NOT NULL
      AND w.session_closed_after IS NOT NULL
      AND w.server_started_at = pg_postmaster_start_time()
      AND w.last_heartbeat_at < now() - w.session_closed_after
      AND NOT EXISTS (
          SELECT 1 FROM pg_stat_get_activity(w.listener_pid) a
          WHERE a.pid = w.listener_pid
            AND (a.backend_start IS NULL OR a.backend_start = w.listener_backend_start)
      )
    ORDER BY w.last_heartbeat_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), no_longer_waiting AS (
    DELETE FROM tether_queue_waiters WHERE worker_id IN (SELECT id FROM gone)
)
UPDATE tether_workers w
SET status = 'inactive', inactive_at = now(), updated_at = now()
FROM gone
WHERE w.id = gone.id AND w.status = 'active'
RETURNING w.id, w.hostname, w.pid, extract(epoch FROM now() - w.last_heartbeat_at)::float8 AS age_s;

-- name: deactivate_worker
-- A worker found gone (its process no longer exists): no waiting for staleness.
WITH no_longer_waiting AS (
    DELETE FROM tether_queue_waiters WHERE worker_id = %(id)s
)
UPDATE tether_workers SET status = 'inactive', inactive_at = now(), updated_at = now()
WHERE id = %(id)s AND status = 'active'
RETURNING id, hostname, pid, extract(epoch FROM now() - last_heartbeat_at)::float8 AS age_s;

-- name: workers_on_host
-- Active workers, and inactive ones that still own in-flight tasks (marked
-- inactive after 3 silent beats, while their tasks turn stale much later).
SELECT w.id, w.pid, w.process_started_at, w.status FROM tether_workers w
WHERE w.hostname = %(hostname)s AND w.host_key = %(host_key)s AND w.id <> %(me)s
  AND (w.status = 'active'
       OR (w.status = 'inactive' AND EXISTS (
           SELECT 1 FROM tether_tasks t
           WHERE t.claimed_by_worker_id = w.id AND t.status IN ('CLAIMED', 'RUNNING'))));

-- name: next_due_in
-- Seconds until the reaper next has something to do: a claim or a run turning
-- stale, a deadline passing. NULL when nothing is in flight or waiting.
SELECT extract(epoch FROM min(due) - now())::float8 AS seconds FROM (
    SELECT greatest(t.claimed_at, hb.last) + %(claimed_threshold)s::interval AS due
    FROM tether_tasks t
    CROSS JOIN LATERAL (
        SELECT max(h.sent_at) AS last FROM tether_heartbeats h
        WHERE h.task_id = t.id AND h.role = 'claimer' AND h.sender_id = t.claimed_by_worker_id
    ) hb
    WHERE t.status = 'CLAIMED'
    UNION ALL
    SELECT greatest(t.started_at, t.progress_at, hb.last) + %(running_threshold)s::interval
    FROM tether_tasks t
    CROSS JOIN LATERAL (
        SELECT max(h.sent_at) AS last FROM tether_heartbeats h
        WHERE h.task_id = t.id AND h.role = 'runner' AND h.sender_id = t.claimed_by_worker_id
    ) hb
    WHERE t.status = 'RUNNING'
    UNION ALL
    SELECT min(good_until) FROM tether_tasks WHERE status = 'PENDING' AND good_until IS NOT NULL
    UNION ALL
    -- A worker whose listener session is gone (closed_session_workers): the moment its last
    -- heartbeat is old enough, so that the pass comes then, not at the next check.
    SELECT min(w.last_heartbeat_at + w.session_closed_after)
    FROM tether_workers w
    WHERE w.status = 'active'
      AND w.listener_pid IS NOT NULL
      AND w.session_closed_after IS NOT NULL
      AND w.server_started_at = pg_postmaster_start_time()
      AND NOT EXISTS (
          SELECT 1 FROM pg_stat_get_activity(w.listener_pid) a
          WHERE a.pid = w.listener_pid
            AND (a.backend_start IS NULL OR a.backend_start = w.listener_backend_start)
      )
) d;

-- name: stale_tasks_report
-- For operators: RUNNING tasks silent for longer than the threshold, with where they ran.
SELECT t.id, t.name, t.queue, t.attempt, t.claimed_by_worker_id AS worker_id,
       w.hostname AS worker_hostname, w.pid AS worker_pid, w.status AS worker_status,
       t.started_at, greatest(t.started_at, t.progress_at, hb.last) AS last_heartbeat_at,
       extract(epoch FROM now() - greatest(t.started_at, t.progress_at, hb.last))::float8 AS silent_s
FROM tether_tasks t
LEFT JOIN tether_workers w ON w.id = t.claimed_by_worker_id
CROSS JOIN LATERAL (
    SELECT max(h.sent_at) AS last FROM tether_heartbeats h
    WHERE h.task_id = t.id AND h.role = 'runner' AND h.sender_id = t.claimed_by_worker_id
) hb
WHERE t.status = 'RUNNING'
  AND greatest(t.started_at, t.progress_at, hb.last) < now() - %(threshold)s::interval
ORDER BY t.started_at, t.id
LIMIT %(limit)s;
