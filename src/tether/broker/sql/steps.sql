-- Checkpointed steps of a running task (tether/steps.py, docs/durable-steps.md).

-- name: load_steps
-- Every step the task completed in earlier attempts: read once per attempt, at its
-- first step() call. The attempt's own steps are kept in memory from then on.
SELECT name, occurrence, result::text AS result
FROM tether_task_steps
WHERE task_id = %(id)s;

-- name: write_step
-- One completed step, fenced like an outcome: written only while the task is RUNNING
-- under this attempt and owner. FOR SHARE holds the row until this statement commits,
-- so a recovery (the reaper's or a dead child's record) that moves the task on either
-- commits first, and then this write re-reads the row, matches nothing and adds nothing
-- (held = false: the attempt is a zombie), or waits until the step is in. ON CONFLICT:
-- a write retried after a connection lost around its COMMIT finds its own row (no
-- other attempt can have written one while this attempt holds the task).
-- The stored text comes back: jsonb orders keys its own way, and the first run of a
-- step returns exactly what a later attempt will read.
WITH fence AS (
    SELECT id FROM tether_tasks
    WHERE id = %(id)s AND status COLLATE "C" = 'RUNNING' AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    FOR SHARE
), written AS (
    INSERT INTO tether_task_steps (task_id, name, occurrence, result, attempt)
    SELECT id, %(name)s, %(occurrence)s, %(result)s::jsonb, %(attempt)s FROM fence
    ON CONFLICT (task_id, name, occurrence) DO NOTHING
    RETURNING result::text AS result
)
SELECT EXISTS (SELECT 1 FROM fence) AS held, (SELECT result FROM written) AS stored;

-- name: write_steps
-- Many steps, of many tasks of one worker, in ONE statement and one commit: an async child
-- writes together the steps its tasks completed while its previous write was in flight.
-- Each row keeps its own fence, as in write_step: its task RUNNING under that attempt and
-- this worker, its row held FOR SHARE (in id order, as other batch writers lock) and
-- re-read after a concurrent recovery. A row whose attempt lost its task adds nothing;
-- the others are written all the same. Rows come back with the task's fence: held or not,
-- and the stored text of what was inserted.
WITH given AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(names)s::text[],
                         %(occurrences)s::int[], %(results)s::text[])
         AS g (task_id, attempt, name, occurrence, result)
), fence AS (
    SELECT t.id, t.attempt FROM tether_tasks t
    WHERE t.id IN (SELECT task_id FROM given) AND t.status COLLATE "C" = 'RUNNING'
      AND t.claimed_by_worker_id = %(worker_id)s
    ORDER BY t.id
    FOR SHARE
), held AS (
    SELECT g.* FROM given g JOIN fence f ON f.id = g.task_id AND f.attempt = g.attempt
), written AS (
    INSERT INTO tether_task_steps (task_id, name, occurrence, result, attempt)
    SELECT task_id, name, occurrence, result::jsonb, attempt FROM held
    ON CONFLICT (task_id, name, occurrence) DO NOTHING
    RETURNING task_id, name, occurrence, result::text AS result
)
SELECT h.task_id::text AS task_id, h.name, h.occurrence, w.result AS stored
FROM held h
LEFT JOIN written w ON w.task_id = h.task_id AND w.name = h.name AND w.occurrence = h.occurrence;

-- name: list_steps
-- The steps a task recorded, for `tether task ID`, the dashboard and handle.info(): what
-- each is and who wrote it, in the order recorded (steps written in one transaction share
-- written_at: then by attempt, name, occurrence). The result is not sent: its size is
-- measured here, as the bytes of the JSON text a later attempt reads back. By the primary
-- key's prefix, like load_steps.
SELECT name, occurrence, attempt, written_at, octet_length(result::text) AS size
FROM tether_task_steps
WHERE task_id = %(id)s
ORDER BY written_at, attempt, name, occurrence;
