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

-- name: queue_states
-- For each queue in names and every paused queue, by name: how long its oldest due
-- PENDING task (run_at <= now()) has been due, in database time (NULL: none is due), and
-- its pause. The counts come from counts.sql. The oldest due task is found in the claim
-- index (queue, priority DESC, run_at, id) without reading the queue's backlog: a skip
-- scan finds each priority the queue's PENDING tasks have (one probe each), and the first
-- entry of each priority is its earliest run_at.
SELECT n.queue, extract(epoch FROM now() - due.first_run_at)::float8 AS oldest_pending_age_s,
       p.queue IS NOT NULL AS paused, p.paused_at, p.paused_by
FROM (SELECT unnest(%(names)s::text[]) UNION SELECT queue FROM tether_paused_queues) AS n (queue)
LEFT JOIN tether_paused_queues p ON p.queue = n.queue
CROSS JOIN LATERAL (
    WITH RECURSIVE priorities AS (
        (SELECT t.priority FROM tether_tasks t
         WHERE t.status = 'PENDING' AND t.queue = n.queue ORDER BY t.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT t.priority FROM tether_tasks t
                WHERE t.status = 'PENDING' AND t.queue = n.queue AND t.priority < seen.priority
                ORDER BY t.priority DESC LIMIT 1)
        FROM priorities seen WHERE seen.priority IS NOT NULL
    )
    SELECT min(first.run_at) FILTER (WHERE first.run_at <= now()) AS first_run_at
    FROM priorities pr
    CROSS JOIN LATERAL (
        SELECT t.run_at FROM tether_tasks t
        WHERE t.status = 'PENDING' AND t.queue = n.queue AND t.priority = pr.priority
        ORDER BY t.run_at LIMIT 1
    ) first
    WHERE pr.priority IS NOT NULL
) due
ORDER BY n.queue;
