-- Operator control of whole queues (docs/queues.md): pause, resume, the overview.
-- A paused queue has a row in tether_paused_queues (migration 0009). Workers read
-- that table in every claim (claims.sql claim_tasks skips a paused queue), so the
-- row is the truth; the NOTIFYs here only make workers act at once rather than at
-- their next claim: on 'pause <queue>' a worker gives back the claimed tasks of the
-- queue that no child has yet, on 'resume <queue>' it claims at once.

-- name: pause_queue
-- One row if this call paused the queue; none if it was paused already (the row
-- and its paused_at / paused_by stay as they were). The NOTIFY is delivered at
-- commit, when every later claim already sees the row.
WITH paused AS (
    INSERT INTO tether_paused_queues (queue, paused_by) VALUES (%(queue)s, %(by)s)
    ON CONFLICT (queue) DO NOTHING
    RETURNING queue, paused_at, paused_by
)
SELECT queue, paused_at, paused_by, pg_notify('tether_control', 'pause ' || queue) AS notified
FROM paused;

-- name: resume_queue
-- The pause this call ended (one row), or none if the queue was not paused. Besides
-- the workers' control channel, 'tether_work' is told that the queue's work is due
-- now: whatever waits for work on that queue looks at once.
WITH resumed AS (
    DELETE FROM tether_paused_queues WHERE queue = %(queue)s
    RETURNING queue, paused_at, paused_by
)
SELECT queue, paused_at, paused_by,
       pg_notify('tether_control', 'resume ' || queue) AS told_workers,
       pg_notify('tether_work', queue || ' ' || extract(epoch FROM now())::text) AS told_work
FROM resumed;

-- name: get_pause
SELECT queue, paused_at, paused_by FROM tether_paused_queues WHERE queue = %(queue)s;

-- name: queue_known
-- Whether anything but a pause names the queue: a task waiting or in flight (through
-- the claim and in-flight partial indexes), a worker registration or a schedule, and
-- only when none of those does, any task in the history (a scan of tether_tasks,
-- paid only for a name nothing else knows: a typo, usually). The EXISTS subplans
-- are evaluated left to right and only as far as needed.
SELECT EXISTS (SELECT 1 FROM tether_tasks WHERE status = 'PENDING' AND queue = %(queue)s)
    OR EXISTS (SELECT 1 FROM tether_tasks
               WHERE status IN ('CLAIMED', 'RUNNING') AND queue = %(queue)s)
    OR EXISTS (SELECT 1 FROM tether_workers WHERE %(queue)s = ANY(queues))
    OR EXISTS (SELECT 1 FROM tether_schedules WHERE queue = %(queue)s)
    OR EXISTS (SELECT 1 FROM tether_tasks WHERE queue = %(queue)s) AS known;

-- name: queue_overview
-- One row per queue: every queue with tasks, every paused queue and every name in
-- also (an app's declared queues), ordered by name. counts: {status: n}, statuses
-- with no task left out. The waiting and in-flight rows are read through their
-- partial indexes (tether_tasks_claim_idx for PENDING, which holds queue and run_at;
-- tether_tasks_in_flight_status_idx for CLAIMED and RUNNING), so that part costs as
-- much as the backlog, not the history. The terminal counts have no index holding
-- the queue (migration 0003 dropped it: every send paid for it): they are one pass
-- over the table, the same pass `tether status` makes. oldest_pending_age_s: how long
-- the oldest PENDING task that is due (run_at <= now()) has been due, in database
-- time; NULL when none is due.
WITH pending AS (
    SELECT queue, count(*) AS n,
           extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))::float8
               AS oldest_pending_age_s
    FROM tether_tasks
    WHERE status = 'PENDING'
    GROUP BY queue
), counted AS (
    SELECT queue, 'PENDING' AS status, n FROM pending
    UNION ALL
    SELECT queue, status, count(*) FROM tether_tasks
    WHERE status IN ('CLAIMED', 'RUNNING')
    GROUP BY queue, status
    UNION ALL
    SELECT queue, status, count(*) FROM tether_tasks
    WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
    GROUP BY queue, status
), per_queue AS (
    SELECT queue, jsonb_object_agg(status, n) AS counts FROM counted GROUP BY queue
), names AS (
    SELECT queue FROM per_queue
    UNION
    SELECT queue FROM tether_paused_queues
    UNION
    SELECT unnest(%(also)s::text[])
)
SELECT names.queue, coalesce(per_queue.counts, '{}'::jsonb) AS counts,
       pending.oldest_pending_age_s,
       p.queue IS NOT NULL AS paused, p.paused_at, p.paused_by
FROM names
LEFT JOIN per_queue ON per_queue.queue = names.queue
LEFT JOIN pending ON pending.queue = names.queue
LEFT JOIN tether_paused_queues p ON p.queue = names.queue
ORDER BY names.queue;
