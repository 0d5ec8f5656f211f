-- Durable sleep and waits for events (tether/suspending.py, docs/durable-steps.md).
--
-- A suspension ends a RUNNING attempt without ending the task: back to PENDING, due at
-- run_at (the sleep's end, or the wait's timeout), its slot given back, with a SUSPENDED
-- attempt row. retry_count is left alone: a suspension is no retry. Every statement here
-- is fenced like an outcome (RUNNING, this attempt, this owner, row locked FOR UPDATE):
-- a zombie attempt matches nothing and suspends nothing.
--
-- A statement touching a key's events or waits runs after `lock_event_key` in the same
-- transaction: a send and a wait of the same key then go one after the other, and the
-- second one's statement (a snapshot taken after the lock) sees what the first committed.
-- Without it, a wait that found no event and a send that found no waiter could pass
-- each other and the waiter would sleep until its timeout.

-- name: lock_event_key
SELECT pg_advisory_xact_lock(hashtextextended('tether.event:' || %(key)s::text, 0));

-- name: suspend_task
-- key NULL: a sleep. Its step (tether.sleep, occurrence) is stored now, with the time it
-- ends: the attempt that resumes (only once that time has come) finds it and goes on.
-- key set: a wait. An undelivered event of the key, if any (it came while the task ran),
-- is taken at once: its step stored, the task due now. Else a wait row says what it
-- waits for, until when (delay NULL: no timeout: until NULL, run_at 9999-12-31, nothing
-- announced), and a send_event
-- delivers into it. A cancel requested while the attempt ran wins: nothing is suspended
-- (cancel_requested: the caller records the attempt CANCELLED instead).
-- The due time is announced on tether_work as a retry's is, so an idle worker wakes for it
-- on time (its due-time heap, worker/claim_triggers.py) rather than at its next poll.
WITH fence AS (
    SELECT id, attempt, queue, started_at, cancel_requested_at IS NOT NULL AS cancel_requested
    FROM tether_tasks
    WHERE id = %(id)s AND status COLLATE "C" = 'RUNNING' AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    FOR UPDATE
), go AS (
    SELECT * FROM fence WHERE NOT cancel_requested
), event AS (
    SELECT e.id, e.payload FROM tether_events e
    WHERE %(key)s::text IS NOT NULL AND EXISTS (SELECT 1 FROM go)
      AND e.key = %(key)s::text AND e.delivered_at IS NULL
    ORDER BY e.id LIMIT 1
    FOR UPDATE
), taken AS (
    UPDATE tether_events e SET delivered_at = now(), delivered_to = %(id)s
    FROM event WHERE e.id = event.id
    RETURNING e.id
), due AS (
    SELECT CASE WHEN EXISTS (SELECT 1 FROM event) THEN now()
                ELSE coalesce(now() + make_interval(secs => %(delay_s)s::float8), '9999-12-31 00:00:00+00') END AS at
), step AS (
    INSERT INTO tether_task_steps (task_id, name, occurrence, result, attempt)
    SELECT go.id, %(name)s, %(occurrence)s,
           CASE WHEN %(key)s::text IS NULL THEN jsonb_build_object('until', due.at)
                ELSE jsonb_build_object('key', %(key)s::text, 'payload', event.payload) END,
           go.attempt
    FROM go CROSS JOIN due LEFT JOIN event ON true
    WHERE %(key)s::text IS NULL OR event.id IS NOT NULL
    ON CONFLICT (task_id, name, occurrence) DO NOTHING
), wait AS (
    INSERT INTO tether_event_waits (task_id, attempt, occurrence, key, until)
    SELECT go.id, go.attempt, %(occurrence)s, %(key)s::text,
           CASE WHEN %(delay_s)s::float8 IS NOT NULL THEN due.at END
    FROM go, due
    WHERE %(key)s::text IS NOT NULL AND NOT EXISTS (SELECT 1 FROM event)
    ON CONFLICT (task_id) DO UPDATE
        SET attempt = EXCLUDED.attempt, occurrence = EXCLUDED.occurrence, key = EXCLUDED.key,
            since = now(), until = EXCLUDED.until
), done AS (
    UPDATE tether_tasks t
    SET status = 'PENDING', run_at = due.at,
        enqueued_at = CASE WHEN due.at < '9999-12-31' THEN due.at ELSE now() END,
        next_retry_at = NULL, claimed_at = NULL, started_at = NULL, claimed_by_worker_id = NULL,
        updated_at = now()
    FROM go, due WHERE t.id = go.id
    RETURNING t.id, t.queue, t.run_at
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at,
                                      outcome, will_retry, resume_at, event_key)
    SELECT go.id, go.attempt, %(worker_id)s, %(hostname)s, %(pid)s, go.started_at,
           'SUSPENDED', false, due.at, %(key)s::text
    FROM go, due
), told AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text)
    FROM done WHERE run_at < '9999-12-31'
)
SELECT EXISTS (SELECT 1 FROM fence) AS held,
       coalesce((SELECT cancel_requested FROM fence), false) AS cancel_requested,
       (SELECT at FROM due) AS resume_at,
       EXISTS (SELECT 1 FROM taken) AS delivered,
       (SELECT count(*) FROM told) AS notified;

-- name: take_event
-- A wait_for_event call with no stored step (tether.event, occurrence): the first call, or
-- the attempt that resumed after the wait's timeout. Under the key's lock: an undelivered
-- event of the key is taken and its step stored; else, if this occurrence's wait has timed
-- out, the timeout is stored as its step (so every later attempt sees the same); else
-- nothing (stored NULL): the caller suspends (suspend_task). Fenced like a step write.
-- remaining_s: an open wait not yet timed out (the attempt runs early: a retry by hand).
WITH fence AS (
    SELECT id, attempt FROM tether_tasks
    WHERE id = %(id)s AND status COLLATE "C" = 'RUNNING' AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    FOR SHARE
), wait AS (
    SELECT w.until FROM tether_event_waits w, fence
    WHERE w.task_id = fence.id AND w.occurrence = %(occurrence)s AND w.key = %(key)s::text
), event AS (
    SELECT e.id, e.payload FROM tether_events e
    WHERE EXISTS (SELECT 1 FROM fence) AND e.key = %(key)s::text AND e.delivered_at IS NULL
    ORDER BY e.id LIMIT 1
    FOR UPDATE
), taken AS (
    UPDATE tether_events e SET delivered_at = now(), delivered_to = %(id)s
    FROM event WHERE e.id = event.id
    RETURNING e.id
), found AS (
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM event)
            THEN (SELECT jsonb_build_object('key', %(key)s::text, 'payload', payload) FROM event)
        WHEN (SELECT until FROM wait) <= now()
            THEN jsonb_build_object('key', %(key)s::text, 'timed_out', true, 'until', (SELECT until FROM wait))
        END AS result
    FROM fence
), step AS (
    INSERT INTO tether_task_steps (task_id, name, occurrence, result, attempt)
    SELECT fence.id, %(name)s, %(occurrence)s, found.result, fence.attempt
    FROM fence, found WHERE found.result IS NOT NULL
    ON CONFLICT (task_id, name, occurrence) DO NOTHING
    RETURNING result::text AS result
), unwait AS (
    DELETE FROM tether_event_waits w USING fence, found
    WHERE w.task_id = fence.id AND found.result IS NOT NULL
)
SELECT EXISTS (SELECT 1 FROM fence) AS held,
       (SELECT result FROM step) AS stored,
       (SELECT extract(epoch FROM until - now())::float8 FROM wait WHERE until > now()) AS remaining_s;

-- name: send_event
-- One event (after lock_event_key, in the sender's transaction: the caller's own with
-- with_options(connection=)). The task waiting longest for the key, if any, still PENDING
-- under the attempt that suspended, gets it: its step stored, its wait row removed, the
-- task due now, and workers told (tether_work, as a send does). Else it is kept for the
-- next waiter. One row always: the event's id and the task it went to (NULL: kept).
WITH waiter AS (
    SELECT w.task_id, w.attempt, w.occurrence, t.queue FROM tether_event_waits w
    JOIN tether_tasks t ON t.id = w.task_id AND t.attempt = w.attempt AND t.status = 'PENDING'
    WHERE w.key = %(key)s::text
    ORDER BY w.since, w.task_id LIMIT 1
    FOR UPDATE OF t
), stored AS (
    INSERT INTO tether_events (key, payload, delivered_to, delivered_at)
    SELECT %(key)s::text, %(payload)s::jsonb, (SELECT task_id FROM waiter),
           CASE WHEN EXISTS (SELECT 1 FROM waiter) THEN now() END
    RETURNING id, payload
), step AS (
    INSERT INTO tether_task_steps (task_id, name, occurrence, result, attempt)
    SELECT waiter.task_id, 'tether.event', waiter.occurrence,
           jsonb_build_object('key', %(key)s::text, 'payload', stored.payload), waiter.attempt
    FROM waiter, stored
    ON CONFLICT (task_id, name, occurrence) DO NOTHING
), unwait AS (
    DELETE FROM tether_event_waits w USING waiter WHERE w.task_id = waiter.task_id
), woken AS (
    UPDATE tether_tasks t SET run_at = now(), enqueued_at = now(), updated_at = now()
    FROM waiter WHERE t.id = waiter.task_id
    RETURNING t.queue, t.run_at
), told AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text) FROM woken
)
SELECT (SELECT id FROM stored) AS event_id, (SELECT task_id::text FROM waiter) AS delivered_to,
       (SELECT count(*) FROM told) AS notified;

-- name: suspension_states
-- What each given task, if PENDING after a sleep or a wait (its current attempt SUSPENDED),
-- waits for: tether task ID and tether tasks show it. after_step: the last step of its own
-- the task completed (tether's own sleeps and waits left out).
SELECT t.id::text AS id, t.run_at, a.resume_at, a.event_key, w.key AS waiting_for, w.until,
       (SELECT s.name FROM tether_task_steps s
        WHERE s.task_id = t.id AND s.name NOT LIKE 'tether.%%'
        ORDER BY s.written_at DESC, s.name DESC, s.occurrence DESC LIMIT 1) AS after_step
FROM tether_tasks t
JOIN tether_task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt AND a.outcome = 'SUSPENDED'
LEFT JOIN tether_event_waits w ON w.task_id = t.id AND w.attempt = t.attempt
WHERE t.id = ANY(%(ids)s::uuid[]) AND t.status = 'PENDING';
