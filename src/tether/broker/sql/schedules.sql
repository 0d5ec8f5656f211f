-- Periodic tasks (docs/periodic.md): the schedules workers declare at start, and
-- the scheduler's tick. Whoever sends a slot, the unique index on
-- tether_tasks (schedule_name, schedule_slot) lets its task in once.
-- Changes (declared, paused, resumed) NOTIFY 'tether_schedules' with the queue, so
-- sleeping schedulers look again at once instead of at their next timeout.

-- name: lock_declared_schedules
-- A starting worker's view of the schedules of its queues, locked until it has
-- written its own declarations (workers starting together take turns).
SELECT name, task_name, cron, timezone, args::text, kwargs::text, queue, priority,
       max_retries, retry_policy::text, catch_up, overlap, concurrency_key,
       removed_at IS NOT NULL AS removed,
       now() AS now
FROM tether_schedules
WHERE queue = ANY(%(queues)s)
ORDER BY name
FOR UPDATE;

-- name: upsert_schedule
-- A new schedule, or a changed or re-declared one: its slots start after now (no
-- backfill of the time it did not exist or had another definition).
INSERT INTO tether_schedules (name, task_name, cron, timezone, args, kwargs, queue, priority,
                              max_retries, retry_policy, catch_up, overlap, concurrency_key, next_slot)
VALUES (%(name)s, %(task_name)s, %(cron)s, %(timezone)s, %(args)s::jsonb, %(kwargs)s::jsonb,
        %(queue)s, %(priority)s, %(max_retries)s, %(retry_policy)s::jsonb, %(catch_up)s,
        %(overlap)s, %(concurrency_key)s, %(next_slot)s)
ON CONFLICT (name) DO UPDATE SET
    task_name = excluded.task_name, cron = excluded.cron, timezone = excluded.timezone,
    args = excluded.args, kwargs = excluded.kwargs, queue = excluded.queue,
    priority = excluded.priority, max_retries = excluded.max_retries,
    retry_policy = excluded.retry_policy, catch_up = excluded.catch_up, overlap = excluded.overlap,
    concurrency_key = excluded.concurrency_key,
    next_slot = excluded.next_slot, removed_at = NULL, changed_at = now(), slots_after = now(),
    updated_at = now();

-- name: remove_schedule
UPDATE tether_schedules SET removed_at = now(), updated_at = now()
WHERE name = %(name)s AND removed_at IS NULL;

-- name: schedules_changed
SELECT pg_notify('tether_schedules', q) FROM unnest(%(queues)s::text[]) AS q;

-- name: lock_due_schedules
-- The scheduler's tick: live schedules of these queues whose next slot has come,
-- locked to the end of the tick. A worker that finds one locked waits for the
-- other's commit, then reads the row again: its next_slot has moved on, so it is
-- no longer due (READ COMMITTED re-checks the WHERE on the newer row). If the other
-- worker died instead, its lock went with its connection and this one sends.
SELECT s.name, s.task_name, s.cron, s.timezone, s.args::text, s.kwargs::text, s.queue,
       s.priority, s.max_retries, s.retry_policy::text, s.catch_up, s.overlap, s.concurrency_key,
       s.slots_after, s.last_slot, t.status AS last_status, now() AS now
FROM tether_schedules s
LEFT JOIN tether_tasks t ON t.id = s.last_task_id
WHERE s.queue = ANY(%(queues)s) AND NOT s.paused AND s.removed_at IS NULL
  AND s.next_slot <= now()
ORDER BY s.name
FOR UPDATE OF s;

-- name: insert_slot_tasks
-- One task per slot; a slot that already has its task gets nothing (the unique
-- index). Notifies like a send when a worker waits for the queue.
WITH ins AS (
    INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries,
                              retry_policy, run_at, enqueued_at, schedule_name, schedule_slot,
                              concurrency_key)
    SELECT u.id, %(task_name)s, %(queue)s, %(priority)s, %(args)s::jsonb, %(kwargs)s::jsonb,
           %(max_retries)s, %(retry_policy)s::jsonb, now(), now(), %(schedule)s, u.slot,
           %(concurrency_key)s
    FROM unnest(%(ids)s::uuid[], %(slots)s::timestamptz[]) AS u (id, slot)
    ON CONFLICT (schedule_name, schedule_slot) WHERE schedule_name IS NOT NULL DO NOTHING
    RETURNING id, queue, run_at, schedule_slot
)
SELECT id, schedule_slot AS slot,
       CASE WHEN tether_work_is_awaited(queue)
            THEN pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text) END
           IS NOT NULL AS notified
FROM ins ORDER BY schedule_slot;

-- name: advance_schedule
UPDATE tether_schedules
SET last_slot = coalesce(%(last_slot)s, last_slot), next_slot = %(next_slot)s,
    last_task_id = coalesce(%(last_task_id)s, last_task_id),
    slots_sent = slots_sent + %(sent)s, slots_skipped = slots_skipped + %(skipped)s,
    updated_at = now()
WHERE name = %(name)s;

-- name: next_slot_in
-- Seconds until the next slot of these queues' live schedules (None: there is none).
SELECT extract(epoch FROM min(next_slot) - now())::float8 AS seconds
FROM tether_schedules
WHERE queue = ANY(%(queues)s) AND NOT paused AND removed_at IS NULL;

-- name: set_schedule_paused
-- Pause, or resume: a resumed schedule fires from its next slot after now, never
-- for the slots that passed while it was paused.
UPDATE tether_schedules
SET paused = %(paused)s, updated_at = now(),
    slots_after = CASE WHEN %(paused)s THEN slots_after ELSE now() END,
    next_slot = CASE WHEN %(paused)s THEN next_slot ELSE %(next_slot)s END
WHERE name = %(name)s AND paused <> %(paused)s
RETURNING queue;

-- name: get_schedule_timing
SELECT cron, timezone, paused, now() AS now FROM tether_schedules WHERE name = %(name)s FOR UPDATE;

-- name: list_schedules
SELECT s.name, s.task_name, s.cron, s.timezone, s.queue, s.catch_up, s.overlap, s.paused,
       s.removed_at, s.created_at, s.changed_at, s.next_slot, s.last_slot, s.last_task_id,
       t.status AS last_task_status, s.slots_sent, s.slots_skipped
FROM tether_schedules s
LEFT JOIN tether_tasks t ON t.id = s.last_task_id
ORDER BY s.removed_at IS NOT NULL, s.name;
