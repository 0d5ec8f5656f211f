-- Unique sends: a task is created only if no task of the same name holds the key
-- (migration 0006 explains the table and its trigger; docs/tasks.md#unique-sends
-- the rules). Plain sends never come here: they keep insert_task as it is.
--
-- The whole decision is ONE statement on ONE row: INSERT into tether_unique_keys,
-- and on conflict lock that key row and decide from it alone whether the key is
-- free. ON CONFLICT DO UPDATE evaluates its SET against the newest committed
-- version of the row it locked, even one committed after this statement's
-- snapshot, so concurrent senders of one key are ordered by the row lock and
-- each sees the one before it. A subquery on tether_tasks here would read this
-- statement's snapshot instead (READ COMMITTED) and could let a second copy in.
--
-- Free: the key's task has ended (the release trigger cleared `active`) and,
-- when this send gives a window, it was sent at least that long ago. Then the
-- row is taken over for the proposed task; otherwise it is rewritten with the
-- values it has (a no-op update: the price of always getting the row back
-- from RETURNING, which a DO UPDATE ... WHERE that fails would not give).
-- The task row is inserted only when the key now names the proposed id.
-- Repeated by PostgresBroker.run after a lost commit, the statement finds the
-- key naming its own id and the task row present (ON CONFLICT DO NOTHING): it
-- answers as the first run did, "created".

-- name: insert_unique_task
WITH commit_mode AS (
    -- durable false: as insert_task (tasks.sql)
    SELECT CASE WHEN NOT %(durable)s THEN set_config('synchronous_commit', 'off', true) END
), key AS (
    INSERT INTO tether_unique_keys AS k (task_name, unique_key, task_id, sent_at, active)
    SELECT %(name)s, %(unique_key)s, %(id)s, now(), true FROM commit_mode
    ON CONFLICT (task_name, unique_key) DO UPDATE
    SET task_id = CASE WHEN tether_unique_key_is_free(k.active, k.sent_at, %(unique_for)s::interval)
                       THEN excluded.task_id ELSE k.task_id END,
        sent_at = CASE WHEN tether_unique_key_is_free(k.active, k.sent_at, %(unique_for)s::interval)
                       THEN excluded.sent_at ELSE k.sent_at END,
        active = k.active OR tether_unique_key_is_free(k.active, k.sent_at, %(unique_for)s::interval)
    RETURNING k.task_id
), ins AS (
    INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries,
                              retry_policy, good_until, run_at, enqueued_at, unique_key, trace_context,
                              concurrency_key)
    SELECT %(id)s, %(name)s, %(queue)s, %(priority)s, %(args)s::jsonb, %(kwargs)s::jsonb,
           %(max_retries)s, %(retry_policy)s::jsonb, %(good_until)s,
           coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval),
           coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval), %(unique_key)s,
           %(trace_context)s, %(concurrency_key)s::text
    FROM key WHERE key.task_id = %(id)s
    ON CONFLICT (id) DO NOTHING
    RETURNING queue, run_at
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text) FROM ins
    WHERE run_at > now() OR CASE WHEN %(notify_always)s THEN true ELSE tether_work_is_awaited(queue) END
)
SELECT task_id, (SELECT count(*) FROM woken) AS woken FROM key;

-- name: insert_unique_tasks
-- send_many with keys: one statement per chunk, one proposed task per distinct
-- key (the caller folds repeated keys into one: one statement cannot update a
-- key row twice). Keys are locked in one order ("C" collation: the code-point
-- order the caller sorts chunks by), so two batches that share keys never
-- wait for each other in a cycle. Returns every key with the task that holds it.
WITH proposed AS (
    SELECT u.id::uuid AS id, u.unique_key, u.args, u.kwargs
    FROM ROWS FROM (
        unnest(string_to_array(%(ids)s, ',')),
        jsonb_array_elements_text(%(keys)s::jsonb),
        jsonb_array_elements(%(args)s::jsonb),
        jsonb_array_elements(%(kwargs)s::jsonb)
    ) AS u (id, unique_key, args, kwargs)
), commit_mode AS (
    -- durable false: as insert_task (tasks.sql)
    SELECT CASE WHEN NOT %(durable)s THEN set_config('synchronous_commit', 'off', true) END
), key AS (
    INSERT INTO tether_unique_keys AS k (task_name, unique_key, task_id, sent_at, active)
    SELECT %(name)s, p.unique_key, p.id, now(), true FROM proposed p, commit_mode
    ORDER BY p.unique_key COLLATE "C"
    ON CONFLICT (task_name, unique_key) DO UPDATE
    SET task_id = CASE WHEN tether_unique_key_is_free(k.active, k.sent_at, %(unique_for)s::interval)
                       THEN excluded.task_id ELSE k.task_id END,
        sent_at = CASE WHEN tether_unique_key_is_free(k.active, k.sent_at, %(unique_for)s::interval)
                       THEN excluded.sent_at ELSE k.sent_at END,
        active = k.active OR tether_unique_key_is_free(k.active, k.sent_at, %(unique_for)s::interval)
    RETURNING k.unique_key, k.task_id
), ins AS (
    INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, max_retries,
                              retry_policy, good_until, run_at, enqueued_at, unique_key, trace_context,
                              concurrency_key)
    SELECT p.id, %(name)s, %(queue)s, %(priority)s, p.args, p.kwargs,
           %(max_retries)s, %(retry_policy)s::jsonb, %(good_until)s,
           coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval),
           coalesce(%(run_at)s::timestamptz, now() + %(delay)s::interval), p.unique_key,
           %(trace_context)s, %(concurrency_key)s::text
    FROM proposed p JOIN key ON key.task_id = p.id
    ON CONFLICT (id) DO NOTHING
    RETURNING queue, run_at
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM ins GROUP BY queue
    HAVING min(run_at) > now() OR CASE WHEN %(notify_always)s THEN true ELSE tether_work_is_awaited(queue) END
)
SELECT unique_key, task_id, (SELECT count(*) FROM woken) AS woken FROM key;
