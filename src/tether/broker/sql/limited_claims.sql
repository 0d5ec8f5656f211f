-- The limited claim (docs/limits.md): how a worker claims from a flow-controlled queue
-- (one with a row in tether_queue_limits; the plain claim_tasks leaves such a queue alone).
--
-- The slot IS the row: a task holds a slot while its row is CLAIMED or RUNNING, so a
-- claim counts those rows, under a lock, and takes no more than the room left. One
-- statement (one round trip, its own transaction):
--   - it takes the locks: the queue's (blocking, only when the queue has a max_in_flight or
--     a rate limit) and one per key it means to claim from (pg_try_advisory_xact_lock: a
--     key another claimer holds is skipped, as SKIP LOCKED skips a row, so nobody waits
--     and nobody deadlocks);
--   - it counts the slots in use, and reads the rate's tokens, AFTER the locks, through the
--     VOLATILE functions of migration 0016 (tether_queue_in_flight, tether_keys_in_flight,
--     tether_queue_tokens, tether_keys_tokens), each called with an argument that comes
--     from the lock: each of their statements takes a snapshot newer than the lock, so it
--     sees every claim committed by whoever held it before. The statement's own snapshot
--     is older (taken before it waited), which is harmless where it is used: to choose
--     candidates (the key window, the heads), and to lock PENDING rows FOR UPDATE, which
--     rechecks a row another claimer changed since (READ COMMITTED: its status is no longer
--     PENDING, so it is skipped).
-- Nothing else adds to a limited queue's in-flight rows (the plain claim skips the queue),
-- and whatever ends a task (outcome, retry, give-back, reaper, operator) can only free
-- slots, so the count is exact whatever dies: a dead worker's task holds its slot until
-- recovery settles its row.

-- name: limited_claim
-- Its LIMITs are (SELECT %(x)s), values the planner does not see, as in claim_tasks, so that
-- the prepared statement could keep one generic plan. Measured (PostgreSQL 15, 2026-11-27):
-- it does not; pg_prepared_statements shows only custom plans, about 1.5 ms of planning a
-- claim on the test machine (the same for the two statements this one replaced).
--
-- Keys are visited round-robin: a window of at most `window` distinct keys with due work,
-- from just after `cursor` (the end of the previous window, kept by the worker) wrapping to
-- the start, found by a skip scan of tether_tasks_key_claim_idx (one probe per key,
-- whatever each key's backlog). Of the window, the keys with room, best head priority
-- first, then the least busy for their weight, then in turn from the cursor, as many as
-- `wanted`, each try-locked (`chosen`). Then the claim from the locked keys (and, when
-- `unkeyed`, from the queue's tasks without a key): the room per key (per_key minus its
-- busy rows, and its rate's tokens), per queue (max_in_flight minus the queue's busy rows),
-- per rate (the queue's token bucket), and per kind of child (as claim_tasks). Between keys
-- the turn is round-robin: a row's turn is its key's busy count plus its place in the key,
-- divided by the key's weight; rows are taken best priority first, then lowest turn.
--
-- Time: the rates' tokens are refilled up to clock_timestamp() read after the lock (the
-- queue's, or the key's), not to now(): this statement may have started before the last
-- holder of the lock claimed, and refilling from a time before its claim would reorder the
-- bucket. claimed_at is clock_timestamp() too, so claims of a queue are stamped in the
-- order they were made.
--
-- One row per claimed task, or one row of NULLs, with the claim's summary: the keys it
-- locked in turn order with their weights, whether a key was held by another claimer,
-- whether the window was full and its last key, and whether tasks without a key were found.
WITH RECURSIVE
queue_lock AS MATERIALIZED (
    SELECT l.max_in_flight, l.per_key, coalesce(l.key_weights, '{}') AS key_weights, l.rate_limit,
           l.key_rate_limit, l.key_rate_period_ms, coalesce(l.key_burst, l.key_rate_limit) AS key_burst,
           CASE WHEN l.max_in_flight IS NOT NULL OR l.rate_limit IS NOT NULL
                -- true once granted (the lock returns void): an argument for what runs after it
                THEN pg_advisory_xact_lock(hashtextextended('tether_queue_limit ' || l.queue, 0))::text = '' END
               AS locked
    FROM (SELECT %(queue)s::text AS queue) q
    LEFT JOIN tether_queue_limits l ON l.queue = q.queue
),
queue_time AS MATERIALIZED (
    -- After the queue's lock (this reads its row): the time its tokens are refilled to.
    SELECT ql.*, clock_timestamp() AS at FROM queue_lock ql
),
lim AS MATERIALIZED (
    SELECT qt.max_in_flight, qt.per_key, qt.key_weights, qt.key_rate_limit, qt.key_rate_period_ms,
           qt.key_burst,
           CASE WHEN qt.max_in_flight IS NOT NULL THEN tether_queue_in_flight(%(queue)s, qt.locked) END
               AS queue_busy,
           CASE WHEN qt.rate_limit IS NOT NULL THEN tether_queue_tokens(%(queue)s, qt.at) END AS tokens
    FROM queue_time qt
),
after_cursor (key) AS (
    (SELECT t.concurrency_key FROM tether_tasks t
     WHERE t.status = 'PENDING' AND t.queue = %(queue)s AND t.concurrency_key > %(cursor)s
     ORDER BY t.concurrency_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.concurrency_key FROM tether_tasks t
            WHERE t.status = 'PENDING' AND t.queue = %(queue)s AND t.concurrency_key > seen.key
            ORDER BY t.concurrency_key LIMIT 1)
    FROM after_cursor seen WHERE seen.key IS NOT NULL
),
from_start (key) AS (
    (SELECT t.concurrency_key FROM tether_tasks t
     WHERE t.status = 'PENDING' AND t.queue = %(queue)s AND t.concurrency_key IS NOT NULL
       AND t.concurrency_key <= %(cursor)s
     ORDER BY t.concurrency_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.concurrency_key FROM tether_tasks t
            WHERE t.status = 'PENDING' AND t.queue = %(queue)s AND t.concurrency_key > seen.key
              AND t.concurrency_key <= %(cursor)s
            ORDER BY t.concurrency_key LIMIT 1)
    FROM from_start seen WHERE seen.key IS NOT NULL
),
key_window AS MATERIALIZED (
    SELECT key, part FROM (
        (SELECT key, 1 AS part FROM after_cursor WHERE key IS NOT NULL LIMIT (SELECT %(window)s::int))
        UNION ALL
        (SELECT key, 2 AS part FROM from_start WHERE key IS NOT NULL LIMIT (SELECT %(window)s::int))
    ) both_parts
    LIMIT (SELECT %(window)s::int)
),
heads AS (
    -- busy here is read with the statement's snapshot: good enough to order the keys; the
    -- count the limit is held to is read after the key's lock (keys, below).
    SELECT w.key, w.part, h.priority, h.run_at,
           coalesce((queue_lock.key_weights ->> w.key)::float8, 1.0) AS weight,
           (SELECT count(*) FROM tether_tasks f
            WHERE f.queue = %(queue)s AND f.concurrency_key = w.key
              AND f.status IN ('CLAIMED', 'RUNNING'))::int AS busy,
           -- the key's rate tokens, as good as this snapshot knows (a key with none left is
           -- passed over, so it does not take the place of a key that has some)
           (SELECT t.tokens + extract(epoch FROM now() - t.refilled_at) * 1000.0
                   / queue_lock.key_rate_period_ms * queue_lock.key_rate_limit
            FROM tether_key_tokens t
            WHERE queue_lock.key_rate_limit IS NOT NULL AND t.queue = %(queue)s AND t.concurrency_key = w.key)
               AS tokens
    FROM key_window w CROSS JOIN queue_lock
    CROSS JOIN LATERAL (
        SELECT t.priority, t.run_at FROM tether_tasks t
        WHERE t.status = 'PENDING' AND t.queue = %(queue)s AND t.concurrency_key = w.key
          AND t.run_at <= now() AND (t.good_until IS NULL OR t.good_until > now())
          AND t.name <> ALL(%(skip_names)s::text[])
        ORDER BY t.priority DESC, t.run_at, t.id
        LIMIT 1
    ) h
),
chosen AS MATERIALIZED (
    SELECT ranked.key, ranked.part, ranked.weight,
           pg_try_advisory_xact_lock(hashtextextended(%(queue)s || chr(31) || ranked.key, 0)) AS locked
    FROM (
        SELECT heads.key, heads.part, heads.busy, heads.weight FROM heads, queue_lock
        WHERE (queue_lock.per_key IS NULL OR heads.busy < queue_lock.per_key)
          AND (heads.tokens IS NULL OR heads.tokens >= 1)
        -- Round-robin: among keys of one priority and load, the first after the previous
        -- claim's last key (where the window starts), not the key with the oldest head,
        -- which would be the same key on every claim for as long as its backlog lasts.
        -- Load in whole rounds (a key of weight w takes w tasks a round), so that keys a
        -- round apart do not reorder the turn by fractions.
        ORDER BY heads.priority DESC, floor(heads.busy / heads.weight), heads.part, heads.key
        LIMIT (SELECT %(wanted)s::int)
    ) ranked
),
key_locks AS MATERIALIZED (
    -- The keys locked, as one array: an aggregate, so it exists only once every key's lock
    -- was tried, and so does the time read with it (projected after the aggregate).
    SELECT coalesce(array_agg(c.key) FILTER (WHERE c.locked), '{}') AS keys, clock_timestamp() AS at
    FROM chosen c
),
keys AS MATERIALIZED (
    -- What the limits are held to, read after the locks (one call each for all the keys).
    SELECT c.key, row_number() OVER (ORDER BY c.part, c.key) AS place, c.weight, kl.at, lim.per_key,
           coalesce(b.n, 0) AS busy, r.tokens
    FROM chosen c
    CROSS JOIN key_locks kl
    CROSS JOIN lim
    LEFT JOIN LATERAL tether_keys_in_flight(%(queue)s, kl.keys) b ON b.key = c.key
    LEFT JOIN LATERAL tether_keys_tokens(%(queue)s, kl.keys, kl.at, lim.key_rate_limit, lim.key_rate_period_ms,
                                         lim.key_burst) r ON r.key = c.key
    WHERE c.locked
),
room AS (
    SELECT greatest(0, least(
        %(wanted)s::int,
        coalesce(lim.max_in_flight - lim.queue_busy, %(wanted)s::int),
        coalesce(floor(lim.tokens)::int, %(wanted)s::int)
    )) AS n,
    -- Past the idle children, a claim prefetches (tasks held until a child is free) only
    -- while the queue stays within half its max_in_flight: a limit that binds gives its
    -- slots to tasks that start at once, one that does not keeps the plain claim's speed.
    greatest(0, least(coalesce(lim.max_in_flight / 2 - lim.queue_busy, %(wanted)s::int), %(wanted)s::int))
        AS prefetch_room
    FROM lim
), level AS (
    -- Water-filling: the turn every key would reach if this claim's tasks were shared out
    -- by weight on top of what each key has in flight. A key reads only the rows that can
    -- come before it (+1), so a claim locks about `wanted` + keys rows, not `wanted` per key.
    SELECT (%(wanted)s + coalesce(sum(busy), 0))::float8 / greatest(coalesce(sum(weight), 1), 0.001) AS turn
    FROM keys
), keyed AS (
    -- The round a row would run in: a key of weight w takes w rows a round (ceil), so every
    -- key's first row shares round 1 and their order is the turn (place), not the weight.
    SELECT c.id, c.priority, c.run_at, c.name, ceil((keys.busy + c.nth)::float8 / keys.weight) AS turn,
           keys.place,
           -- the same rule per key: prefetched only while the key stays within half its limit
           keys.per_key IS NULL OR 2 * (keys.busy + c.nth) <= keys.per_key AS may_wait
    FROM keys
    CROSS JOIN LATERAL (
        SELECT x.*, row_number() OVER (ORDER BY x.priority DESC, x.run_at, x.id) AS nth
        FROM (
            SELECT t.id, t.priority, t.run_at, t.name FROM tether_tasks t
            WHERE t.status = 'PENDING' AND t.queue = %(queue)s AND t.concurrency_key = keys.key
              AND t.run_at <= now() AND (t.good_until IS NULL OR t.good_until > now())
              AND t.name <> ALL(%(skip_names)s::text[])
            ORDER BY t.priority DESC, t.run_at, t.id
            LIMIT greatest(0, least(coalesce(keys.per_key - keys.busy, %(wanted)s::int), %(wanted)s::int,
                                    coalesce(floor(keys.tokens)::int, %(wanted)s::int),
                                    ceil((SELECT turn FROM level) * keys.weight)::int - keys.busy + 1))
            FOR UPDATE SKIP LOCKED
        ) x
    ) c
), unkeyed_window AS MATERIALIZED (
    -- Tasks without a key: looked for among the first `unkeyed_window` due rows of the
    -- queue in claim order (the plain claim index); a queue whose tasks all carry keys
    -- skips this (the worker passes unkeyed false when its last look found none).
    -- Materialized, then joined by primary key: as an IN (...) the planner may pick a
    -- nested loop over the queue's whole backlog.
    SELECT s.id FROM tether_tasks s
    WHERE %(unkeyed)s AND s.status = 'PENDING' AND s.queue = %(queue)s AND s.run_at <= now()
    ORDER BY s.priority DESC, s.run_at, s.id
    LIMIT (SELECT %(unkeyed_window)s::int)
), unkeyed AS (
    SELECT x.id, x.priority, x.run_at, x.name,
           row_number() OVER (ORDER BY x.priority DESC, x.run_at, x.id)::float8 AS turn,
           NULL::bigint AS place, true AS may_wait
    FROM (
        SELECT t.id, t.priority, t.run_at, t.name
        FROM unkeyed_window w JOIN tether_tasks t ON t.id = w.id
        -- COLLATE "C": not the partial indexes' predicate, so the planner reads each row by
        -- its primary key instead of scanning the claim index once per window row.
        WHERE t.status COLLATE "C" = 'PENDING' AND t.concurrency_key IS NULL
          AND (t.good_until IS NULL OR t.good_until > now())
          AND t.name <> ALL(%(skip_names)s::text[])
        ORDER BY t.priority DESC, t.run_at, t.id
        LIMIT (SELECT %(wanted)s::int)
        FOR UPDATE OF t SKIP LOCKED
    ) x
), candidates AS (
    SELECT id, priority, run_at, name = ANY(%(async_names)s::text[]) AS is_async, turn, place, may_wait
    FROM keyed
    UNION ALL
    SELECT id, priority, run_at, name = ANY(%(async_names)s::text[]) AS is_async, turn, place, may_wait
    FROM unkeyed
), picked AS (
    -- The first `idle` rows go to children that start them now; the others wait for one
    -- (prefetch), when their key and queue allow it (above), in the order of their turn.
    SELECT id FROM (
        SELECT id, is_async, may_wait,
               -- place: the key's turn in the round-robin (keys come in that order), so equal
               -- turns go to the key next after the last one served, not the oldest task
               row_number() OVER (ORDER BY priority DESC, turn, place, run_at, id) AS nth,
               row_number() OVER (PARTITION BY is_async ORDER BY priority DESC, turn, place, run_at, id)
                   AS nth_kind
        FROM candidates
    ) ranked
    WHERE nth <= (SELECT n FROM room)
      AND nth_kind <= CASE WHEN is_async THEN %(async_limit)s ELSE %(other_limit)s END
      AND (nth <= %(idle)s OR (may_wait AND nth <= %(idle)s + (SELECT prefetch_room FROM room)))
), claimed AS (
    -- synchronous_commit off: as claim_tasks (claims.sql) explains.
    UPDATE tether_tasks t
    SET status = 'CLAIMED', attempt = t.attempt + 1, claimed_at = clock_timestamp(), updated_at = now(),
        claimed_by_worker_id = %(worker_id)s, limited = true
    FROM picked, (SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait
    WHERE t.id = picked.id
    RETURNING t.id, t.name, t.queue, t.args::text, t.kwargs::text, t.attempt, t.retry_count,
              t.max_retries, t.retry_policy::text, t.workflow_id, t.concurrency_key, t.trace_context
), spent AS (
    -- The rate's tokens: refilled up to the lock's time, less what this claim took. Written
    -- only when it took some (the refill is computed from refilled_at, so skipping a write
    -- loses none). The row is updated in its newest version (READ COMMITTED), under the lock.
    UPDATE tether_queue_limits l
    SET tokens = (SELECT tokens FROM lim) - (SELECT count(*) FROM claimed),
        refilled_at = (SELECT at FROM queue_time)
    WHERE l.queue = %(queue)s AND l.rate_limit IS NOT NULL AND EXISTS (SELECT 1 FROM claimed)
), key_spent AS (
    -- The same per key, for the keys this claim took tasks of (under each key's lock).
    INSERT INTO tether_key_tokens AS kt (queue, concurrency_key, tokens, refilled_at)
    SELECT %(queue)s, keys.key, keys.tokens - n.taken, keys.at
    FROM keys
    JOIN (SELECT concurrency_key, count(*) AS taken FROM claimed GROUP BY concurrency_key) n
        ON n.concurrency_key = keys.key
    WHERE keys.tokens IS NOT NULL
    ON CONFLICT (queue, concurrency_key) DO UPDATE SET tokens = EXCLUDED.tokens, refilled_at = EXCLUDED.refilled_at
), summary AS (
    SELECT coalesce((SELECT array_agg(k.key ORDER BY k.place) FROM keys k), '{}') AS keys_locked,
           coalesce((SELECT array_agg(k.weight ORDER BY k.place) FROM keys k), '{}') AS weights,
           EXISTS (SELECT 1 FROM chosen c WHERE NOT c.locked) AS contended,
           (SELECT key FROM key_window ORDER BY part DESC, key DESC LIMIT 1) AS window_end,
           (SELECT count(*) FROM key_window) >= %(window)s AS window_full,
           EXISTS (SELECT 1 FROM unkeyed) AS unkeyed_seen
)
-- The summary's arrays (one entry per key) on the first row only: not parsed once per task.
SELECT c.*,
       CASE WHEN row_number() OVER () = 1 THEN s.keys_locked END AS keys_locked,
       CASE WHEN row_number() OVER () = 1 THEN s.weights END AS weights,
       s.contended, s.window_end, s.window_full, s.unkeyed_seen
FROM summary s
LEFT JOIN claimed c ON true;

-- name: queue_limits_of
-- The limits of these queues (the worker's: which of its queues take the limited claim).
SELECT queue, max_in_flight, per_key, rate_limit, rate_period_ms, burst, key_weights::text AS key_weights,
       key_rate_limit, key_rate_period_ms, key_burst
FROM tether_queue_limits WHERE queue = ANY(%(queues)s::text[]) ORDER BY queue;

-- name: all_queue_limits
-- Every limit with its use now: tasks in flight in the queue, the busiest key and how many
-- keys are at their per-key limit (from the in-flight index: only in-flight rows), the
-- rate's tokens refilled up to now, and how many keys have spent their own rate's tokens.
SELECT l.queue, l.max_in_flight, l.per_key, l.rate_limit, l.rate_period_ms, l.burst,
       l.key_weights::text AS key_weights, l.set_by, l.updated_at,
       l.key_rate_limit, l.key_rate_period_ms, l.key_burst,
       -- keys whose bucket holds less than one token now (a key with no row is full)
       CASE WHEN l.key_rate_limit IS NOT NULL THEN
           (SELECT count(*) FROM tether_key_tokens kt
            WHERE kt.queue = l.queue
              AND kt.tokens + extract(epoch FROM now() - kt.refilled_at) * 1000.0
                  / l.key_rate_period_ms * l.key_rate_limit < 1)::int
       END AS keys_out_of_tokens,
       coalesce(u.in_flight, 0)::int AS in_flight,
       coalesce(u.keys_in_flight, 0)::int AS keys_in_flight,
       coalesce(u.busiest_key_in_flight, 0)::int AS busiest_key_in_flight,
       coalesce(u.keys_at_limit, 0)::int AS keys_at_limit,
       CASE WHEN l.rate_limit IS NOT NULL THEN
           least(coalesce(l.burst, l.rate_limit)::float8,
                 coalesce(l.tokens, coalesce(l.burst, l.rate_limit)::float8)
                 + extract(epoch FROM now() - coalesce(l.refilled_at, now())) * 1000.0
                   / l.rate_period_ms * l.rate_limit)
       END AS tokens
FROM tether_queue_limits l
LEFT JOIN LATERAL (
    SELECT sum(n) AS in_flight, count(k) AS keys_in_flight, max(n) FILTER (WHERE k IS NOT NULL) AS busiest_key_in_flight,
           count(*) FILTER (WHERE k IS NOT NULL AND n >= l.per_key) AS keys_at_limit
    FROM (SELECT f.concurrency_key AS k, count(*) AS n FROM tether_tasks f
          WHERE f.queue = l.queue AND f.status IN ('CLAIMED', 'RUNNING')
          GROUP BY f.concurrency_key) per_key
) u ON true
ORDER BY l.queue;

-- name: set_queue_limits
-- Declare (or replace) a queue's limits. The tokens start full when the rate changes, and
-- so do every key's when the per-key rate changes (their buckets are dropped).
-- A change tells the workers ('limits <queue>' on tether_control): they look at once.
WITH before AS (
    SELECT key_rate_limit, key_rate_period_ms, key_burst FROM tether_queue_limits WHERE queue = %(queue)s
), written AS (
INSERT INTO tether_queue_limits AS l (queue, max_in_flight, per_key, rate_limit, rate_period_ms, burst,
                                      key_weights, key_rate_limit, key_rate_period_ms, key_burst, set_by)
VALUES (%(queue)s, %(max_in_flight)s, %(per_key)s, %(rate_limit)s, %(rate_period_ms)s, %(burst)s,
        %(key_weights)s::jsonb, %(key_rate_limit)s, %(key_rate_period_ms)s, %(key_burst)s, %(set_by)s)
ON CONFLICT (queue) DO UPDATE
SET max_in_flight = EXCLUDED.max_in_flight, per_key = EXCLUDED.per_key,
    rate_limit = EXCLUDED.rate_limit, rate_period_ms = EXCLUDED.rate_period_ms, burst = EXCLUDED.burst,
    tokens = CASE WHEN (l.rate_limit, l.rate_period_ms, l.burst)
                       IS NOT DISTINCT FROM (EXCLUDED.rate_limit, EXCLUDED.rate_period_ms, EXCLUDED.burst)
                  THEN l.tokens END,
    refilled_at = CASE WHEN (l.rate_limit, l.rate_period_ms, l.burst)
                            IS NOT DISTINCT FROM (EXCLUDED.rate_limit, EXCLUDED.rate_period_ms, EXCLUDED.burst)
                       THEN l.refilled_at END,
    key_rate_limit = EXCLUDED.key_rate_limit, key_rate_period_ms = EXCLUDED.key_rate_period_ms,
    key_burst = EXCLUDED.key_burst,
    key_weights = EXCLUDED.key_weights, set_by = EXCLUDED.set_by, updated_at = now()
WHERE (l.max_in_flight, l.per_key, l.rate_limit, l.rate_period_ms, l.burst, l.key_weights,
       l.key_rate_limit, l.key_rate_period_ms, l.key_burst)
      IS DISTINCT FROM (EXCLUDED.max_in_flight, EXCLUDED.per_key, EXCLUDED.rate_limit,
                        EXCLUDED.rate_period_ms, EXCLUDED.burst, EXCLUDED.key_weights,
                        EXCLUDED.key_rate_limit, EXCLUDED.key_rate_period_ms, EXCLUDED.key_burst)
RETURNING queue
), refilled AS (
    DELETE FROM tether_key_tokens kt
    WHERE kt.queue = %(queue)s AND EXISTS (SELECT 1 FROM written)
      AND NOT EXISTS (SELECT 1 FROM before b
                      WHERE (b.key_rate_limit, b.key_rate_period_ms, b.key_burst)
                            IS NOT DISTINCT FROM (%(key_rate_limit)s::int, %(key_rate_period_ms)s::int,
                                                  %(key_burst)s::int))
)
SELECT queue, pg_notify('tether_control', 'limits ' || queue) AS told FROM written;

-- name: drop_queue_limits
-- The queue is no longer flow-controlled: the plain claim takes it again. Workers are told
-- at once (they look again at their limits, and claim).
WITH gone AS (DELETE FROM tether_queue_limits WHERE queue = %(queue)s RETURNING queue),
buckets AS (DELETE FROM tether_key_tokens WHERE queue = %(queue)s)
SELECT queue, pg_notify('tether_control', 'limits ' || queue) AS told FROM gone;

-- name: prune_key_tokens
-- The reaper's pass: drop the buckets of keys that have refilled to full (no row means a full
-- bucket, so dropping one changes nothing) and those of queues without a per-key rate now.
-- A claim that holds the key's lock writes the key's row afresh (an upsert from a value it
-- read after the lock), so a row dropped under it comes back as it should.
DELETE FROM tether_key_tokens kt
WHERE NOT EXISTS (
    SELECT 1 FROM tether_queue_limits l
    WHERE l.queue = kt.queue AND l.key_rate_limit IS NOT NULL
      AND kt.tokens + extract(epoch FROM now() - kt.refilled_at) * 1000.0
          / l.key_rate_period_ms * l.key_rate_limit < coalesce(l.key_burst, l.key_rate_limit)
);
