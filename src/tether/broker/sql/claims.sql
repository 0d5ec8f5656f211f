-- Worker-side transitions. Every write after the claim is fenced: it names the
-- status it expects, the attempt number the claim produced and the owner. A
-- worker that lost its claim (declared dead, task requeued, cancelled) matches
-- no row and changes nothing.
--
-- A write of one task found by id compares its status with COLLATE "C" (the same
-- answer for these ASCII words): the planner then cannot prove the partial in-flight
-- indexes' predicate (status IN ('CLAIMED', 'RUNNING')) from it, and finds the row by
-- its primary key, one probe. With a plain `status = 'RUNNING'` it read the in-flight
-- index instead (its statistics say it is tiny), and that index holds an entry for
-- every CLAIMED and RUNNING row version not yet vacuumed away: on a large table VACUUM
-- skips index cleanup while dead rows are under 2 % of its pages (151,000 dead rows of
-- 11 million here), and autovacuum comes at 20 % dead rows. A completion read 300-4,000
-- buffers instead of 8, and no-op throughput fell to 0.6x (bench/README.md, millions).

-- name: claim_tasks
-- One ordered, limited index scan per queue and priority (LATERAL), then the best of
-- those: `queue = ANY(...)` in one scan would read and sort every ready row instead.
-- skip_names: names this worker cannot run but another live worker can.
-- A worker with both kinds of child (worker/lanes.py) has room for so many async
-- tasks (named in async_names) and so many others: the scan reads as many rows as
-- both together, in queue order, and takes from them what fits each kind. The rows
-- it read but did not take stay PENDING (locked until this statement commits). A
-- filter by name inside the scan would read past every row of the other kind.
--
-- One range per priority, highest first: the claim index orders a queue's tasks by
-- (priority DESC, run_at, id), so tasks due later (delayed sends, retries waiting out
-- their backoff) sit at the end of their priority's range, before the next priority's due
-- ones. One scan over the queue checked `run_at <= now()` on each entry and walked every
-- one of them, on every claim (3,000 delayed tasks at priority 10 in a queue of 300,000: a
-- claim took 960 us instead of 375). Per priority, `run_at <= now()` bounds the range and
-- the scan stops at the first task not yet due. The LIMITs are `(SELECT %(limit)s)`, a
-- value the planner does not see: a plan for it is as good for every call, and PostgreSQL
-- keeps one generic plan for the prepared statement (with the value itself it planned
-- every claim afresh: 0.6 ms a claim, 12 % off the throughput).
--
-- Marks (docs/schema.md#the-claim-under-a-held-back-vacuum): for each queue and priority
-- the worker claimed from, the last row its claims passed (worker/claim_marks.py). A row
-- that left PENDING keeps its entry in tether_tasks_claim_idx until a vacuum removes it,
-- and while a transaction holds back the vacuum every read of a range from its start reads
-- every such entry and its row. So a marked priority's range is read from just after its
-- mark. The other priorities in use come from the index itself, one probe each (a
-- recursive skip scan), lowest first, within each stretch of priorities between marks
-- (above the highest, and below each down to the next), so that no probe walks a marked
-- priority's entries: a probe reads backwards from the end of the next priority's range,
-- its newest tasks, and would read every entry of a priority drained since the hold began.
-- Each unmarked priority is then read from its start. No marks: every priority is probed.
-- A mark can only delay a row behind it (sent by a transaction that committed after a
-- claim passed its place), never lose it: the worker drops marks when told of work at or
-- before them, and claims without marks at least once per poll. advance: no row of its
-- queue and priority that this statement read but left comes before it (the worker moves
-- its mark only over such rows).
WITH marks AS (
    SELECT m.queue, m.priority, m.run_at, m.id
    FROM unnest(%(mark_queues)s::text[], %(mark_priorities)s::int[], %(mark_run_ats)s::timestamptz[],
                %(mark_ids)s::uuid[]) AS m (queue, priority, run_at, id)
), open_queues AS (
    -- A paused queue (a row in tether_paused_queues, docs/queues.md) is not claimed
    -- from: read here, in every claim, so a pause holds from its commit on for every
    -- worker, notified or not. The anti-join drops the queue before its scans run.
    SELECT wanted.queue FROM unnest(%(queues)s::text[]) AS wanted (queue)
    WHERE NOT EXISTS (SELECT 1 FROM tether_paused_queues p WHERE p.queue = wanted.queue)
      -- A flow-controlled queue (docs/limits.md) is claimed only by limited_claims.sql,
      -- which counts the slots in use under a lock: read here in every claim, as the pause.
      AND NOT EXISTS (SELECT 1 FROM tether_queue_limits l WHERE l.queue = wanted.queue)
), marked AS (
    SELECT m.* FROM marks m JOIN open_queues o ON o.queue = m.queue
), stretches AS (
    -- Priorities strictly between `above` and `below` (both outside -100..100 when open).
    SELECT o.queue, 101 AS below, coalesce(max(m.priority), -101) AS above
    FROM open_queues o LEFT JOIN marked m ON m.queue = o.queue
    GROUP BY o.queue
    UNION ALL
    SELECT m.queue, m.priority,
           coalesce(lead(m.priority) OVER (PARTITION BY m.queue ORDER BY m.priority DESC), -101)
    FROM marked m
), levels AS (
    WITH RECURSIVE probed AS (
        SELECT s.queue, s.below,
               (SELECT t.priority FROM tether_tasks t
                WHERE t.status = 'PENDING' AND t.queue = s.queue
                  AND t.priority > s.above AND t.priority < s.below
                ORDER BY t.priority LIMIT 1) AS priority
        FROM stretches s
        UNION ALL
        SELECT p.queue, p.below,
               (SELECT t.priority FROM tether_tasks t
                WHERE t.status = 'PENDING' AND t.queue = p.queue
                  AND t.priority > p.priority AND t.priority < p.below
                ORDER BY t.priority LIMIT 1)
        FROM probed p WHERE p.priority IS NOT NULL
    )
    SELECT queue, priority FROM probed WHERE priority IS NOT NULL
), ranges AS (
    -- Where each priority's read starts: after its mark, or at its start.
    SELECT queue, priority, run_at, id FROM marked
    UNION ALL
    SELECT queue, priority, '-infinity'::timestamptz, '00000000-0000-0000-0000-000000000000'::uuid
    FROM levels
), scanned AS (
    SELECT c.id, c.queue, c.priority, c.run_at, c.name = ANY(%(async_names)s::text[]) AS is_async
    FROM open_queues o
    CROSS JOIN LATERAL (
        SELECT due.* FROM (SELECT * FROM ranges r WHERE r.queue = o.queue ORDER BY r.priority DESC) r
        CROSS JOIN LATERAL (
            SELECT t.id, t.queue, t.priority, t.run_at, t.name FROM tether_tasks t
            WHERE t.status = 'PENDING' AND t.queue = r.queue AND t.priority = r.priority
              AND (t.run_at, t.id) > (r.run_at, r.id) AND t.run_at <= now()
              AND (t.good_until IS NULL OR t.good_until > now())
              AND t.name <> ALL(%(skip_names)s::text[])
            ORDER BY t.run_at, t.id
            LIMIT (SELECT %(limit)s)
            FOR UPDATE SKIP LOCKED
        ) due
        LIMIT (SELECT %(limit)s)
    ) c
), best AS (
    SELECT * FROM scanned ORDER BY priority DESC, run_at, id LIMIT %(limit)s
), ranked AS (
    SELECT id, queue, priority, run_at,
           row_number() OVER (PARTITION BY is_async ORDER BY priority DESC, run_at, id)
               <= CASE WHEN is_async THEN %(async_limit)s ELSE %(other_limit)s END AS taken
    FROM best
), picked AS (
    SELECT id, taken,
           taken AND NOT bool_or(NOT taken) OVER (PARTITION BY queue, priority ORDER BY run_at, id) AS advance
    FROM ranked
)
-- The claim's commit does not wait for its WAL flush (synchronous_commit off for
-- this statement's transaction only). Safe: if the server crashed before the flush,
-- the claim is lost and the task is PENDING again, and no code can have run on it:
-- the child's start is a fenced, durable commit, and its flush would have carried
-- the claim too (the claim comes earlier in the log), so a start that succeeded
-- implies a durable claim. What it saves: one fsync wait on every pickup.
UPDATE tether_tasks t
SET status = 'CLAIMED', attempt = t.attempt + 1, claimed_at = now(), updated_at = now(),
    claimed_by_worker_id = %(worker_id)s
FROM picked, (SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait
WHERE t.id = picked.id AND picked.taken
RETURNING t.id, t.name, t.queue, t.args::text, t.kwargs::text, t.attempt, t.retry_count,
          t.max_retries, t.retry_policy::text, t.workflow_id, t.priority, t.run_at, picked.advance,
          t.trace_context,
          -- the queue wait metric: from due (run_at, not the send: a delay asked for is no lag)
          extract(epoch FROM now() - t.run_at)::float8 AS waited_s;

-- name: start_task
UPDATE tether_tasks SET status = 'RUNNING', started_at = now(), updated_at = now()
WHERE id = %(id)s AND status COLLATE "C" = 'CLAIMED' AND attempt = %(attempt)s
  AND claimed_by_worker_id = %(worker_id)s
RETURNING id;

-- name: complete_task
-- RUNNING -> COMPLETED, with the attempt's row, in one statement: a sync child's
-- hot path. A completion wins over a cancel request that came too late: the code
-- finished its work, and the row says so. Every other outcome goes through
-- write_batch, which applies the cancel rule. A child that already holds its next
-- task starts it in the same statement (next_id NULL: nothing to start): one round
-- trip and one commit per task, without a transaction block. One row always:
-- recorded (this write matched), next_started.
WITH done AS (
    UPDATE tether_tasks
    SET status = 'COMPLETED', result = %(result)s::jsonb, error_code = NULL,
        completed_at = now(), next_retry_at = NULL, updated_at = now()
    WHERE id = %(id)s AND status COLLATE "C" = %(expect)s AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING id, attempt, started_at, notify_on_done
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at, outcome)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at, 'COMPLETED'
    FROM done
), next_start AS (
    UPDATE tether_tasks SET status = 'RUNNING', started_at = now(), updated_at = now()
    WHERE id = %(next_id)s::uuid AND status COLLATE "C" = 'CLAIMED' AND attempt = %(next_attempt)s::int
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING id
), told AS (
    SELECT pg_notify('tether_done', id::text) FROM done WHERE notify_on_done
)
SELECT EXISTS (SELECT 1 FROM done) AS recorded, EXISTS (SELECT 1 FROM next_start) AS next_started,
       (SELECT count(*) FROM told) AS notified;

-- name: release_claimed
-- Graceful shutdown or a child that died before starting: the code never ran,
-- so the claim is simply undone. Fenced like every write: only the claim this
-- worker holds with exactly that attempt number (the number stays bumped).
WITH back AS (
    UPDATE tether_tasks t
    SET status = 'PENDING', claimed_at = NULL, claimed_by_worker_id = NULL, updated_at = now()
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS mine (id, attempt)
    WHERE t.id = mine.id AND t.attempt = mine.attempt AND t.status COLLATE "C" = 'CLAIMED'
      AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id, t.queue, t.run_at
), woken AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM back GROUP BY queue
)
SELECT (SELECT count(*) FROM back) AS released, (SELECT count(*) FROM woken) AS queues,
       coalesce((SELECT array_agg(id::text) FROM back), '{}') AS released_ids;

-- name: unstart_task
-- A child started this task in the same commit as its previous outcome, then
-- found its supervisor dead before running any of its code: give it back.
WITH back AS (
    UPDATE tether_tasks
    SET status = 'PENDING', claimed_at = NULL, started_at = NULL, claimed_by_worker_id = NULL,
        updated_at = now()
    WHERE id = %(id)s AND status COLLATE "C" = 'RUNNING' AND attempt = %(attempt)s
      AND claimed_by_worker_id = %(worker_id)s
    RETURNING queue, run_at
)
SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM run_at)::text) FROM back;

-- name: get_fence
-- After an ambiguous write (connection lost around COMMIT): who holds the row now,
-- and which process wrote the outcome of its current attempt (NULL: a reaper).
SELECT t.status, t.attempt, t.claimed_by_worker_id, a.pid AS recorded_by_pid
FROM tether_tasks t
LEFT JOIN tether_task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt
WHERE t.id = %(id)s;

-- name: write_batch
-- Many outcomes and many starts in ONE statement and one commit: the async
-- executor writes everything that became ready during one turn of its event
-- loop this way, the worker's main process records all the tasks of a dead
-- child this way, and every outcome other than a completion goes through here.
-- Each row keeps its own fence (expected status, attempt and owner): a row that
-- lost its claim matches nothing and the others are written all the same. An
-- outcome with a delay is a retry (back to PENDING after it); one without is final.
--
-- The cancel rule (docs/tasks.md#cancelling-a-running-task): an outcome other than
-- COMPLETED settles as CANCELLED, never retried, when the outcome is a cancellation
-- or when a cancel of the task was requested (cancel_requested_at). The request is
-- read from the row being written (t.*, re-read after any concurrent update), never
-- from the statement's snapshot: a cancel committed while this write waited for the
-- row lock must still turn a retry into CANCELLED. The message says "while running"
-- and who asked; data keeps the error the attempt ended with.
WITH given AS (
    SELECT g.*, g.delay_s IS NOT NULL AS again
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(expects)s::text[], %(statuses)s::text[],
                %(results)s::text[], %(error_codes)s::text[], %(delays)s::float8[])
         AS g (id, attempt, expect, status, result, error_code, delay_s)
), done AS (
    UPDATE tether_tasks t
    SET status = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN 'CANCELLED'
            WHEN g.again THEN 'PENDING'
            ELSE g.status END,
        result = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN jsonb_build_object('err', jsonb_build_object(
                    'code', 'TASK_CANCELLED',
                    'message', CASE WHEN g.status = 'CANCELLED' THEN g.result::jsonb -> 'err' ->> 'message'
                                    ELSE 'cancelled while running' END
                               || coalesce(' (requested by ' || t.cancel_requested_by || ')', ''),
                    'data', CASE WHEN g.status = 'CANCELLED' THEN g.result::jsonb -> 'err' -> 'data'
                                 ELSE jsonb_build_object('error', g.result::jsonb -> 'err') END))
            ELSE g.result::jsonb END,
        error_code = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN 'TASK_CANCELLED'
            ELSE g.error_code END,
        completed_at = CASE WHEN g.status = 'COMPLETED' THEN now() END,
        failed_at = CASE WHEN g.status = 'FAILED' AND NOT g.again AND t.cancel_requested_at IS NULL
                         THEN now() END,
        cancelled_at = CASE
            WHEN g.status <> 'COMPLETED' AND (g.status = 'CANCELLED' OR t.cancel_requested_at IS NOT NULL)
                THEN now() END,
        retry_count = t.retry_count + (g.again AND t.cancel_requested_at IS NULL)::int,
        next_retry_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                             THEN now() + make_interval(secs => g.delay_s) END,
        run_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                      THEN now() + make_interval(secs => g.delay_s) ELSE t.run_at END,
        enqueued_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                           THEN now() + make_interval(secs => g.delay_s) ELSE t.enqueued_at END,
        claimed_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN g.again AND t.cancel_requested_at IS NULL THEN NULL ELSE t.started_at END,
        claimed_by_worker_id = CASE WHEN g.again AND t.cancel_requested_at IS NULL
                                    THEN NULL ELSE t.claimed_by_worker_id END,
        updated_at = now()
    FROM given g, tether_tasks before
    WHERE t.id = g.id AND before.id = t.id AND t.status COLLATE "C" = g.expect AND t.attempt = g.attempt
      AND t.claimed_by_worker_id = %(worker_id)s
    -- t.* here is the row as written; before.started_at the start this attempt had.
    RETURNING t.id, t.attempt, t.queue, t.run_at, t.notify_on_done, before.started_at,
              t.status AS settled, t.error_code, t.result -> 'err' ->> 'message' AS error_message
), history AS (
    INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at,
                                      outcome, will_retry, error_code, error_message)
    SELECT id, attempt, %(worker_id)s, %(hostname)s, %(pid)s, started_at,
           CASE WHEN settled = 'PENDING' THEN 'FAILED' ELSE settled END, settled = 'PENDING',
           error_code, error_message
    FROM done
), started AS (
    UPDATE tether_tasks t SET status = 'RUNNING', started_at = now(), updated_at = now()
    FROM unnest(%(start_ids)s::uuid[], %(start_attempts)s::int[]) AS s (id, attempt)
    WHERE t.id = s.id AND t.status COLLATE "C" = 'CLAIMED' AND t.attempt = s.attempt
      AND t.claimed_by_worker_id = %(worker_id)s
    RETURNING t.id
), told_done AS (
    SELECT pg_notify('tether_done', id::text) FROM done WHERE notify_on_done AND settled <> 'PENDING'
), told_work AS (
    SELECT pg_notify('tether_work', queue || ' ' || extract(epoch FROM min(run_at))::text)
    FROM done WHERE settled = 'PENDING' GROUP BY queue
)
SELECT coalesce((SELECT array_agg(id::text ORDER BY id) FROM done), '{}') AS recorded,
       coalesce((SELECT array_agg(settled ORDER BY id) FROM done), '{}') AS settled,
       coalesce((SELECT array_agg(id::text) FROM started), '{}') AS started,
       (SELECT count(*) FROM told_done) + (SELECT count(*) FROM told_work) AS notified;

-- name: get_fences
-- get_fence for many tasks at once (after an ambiguous batch write).
SELECT t.id::text AS id, t.status, t.attempt, t.claimed_by_worker_id, a.pid AS recorded_by_pid
FROM tether_tasks t
LEFT JOIN tether_task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt
WHERE t.id = ANY(%(ids)s::uuid[]);
