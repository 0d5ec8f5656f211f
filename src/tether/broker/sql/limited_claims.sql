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
-- The claim is the statement in tether_limited_claim (migration 0019, replaced by 0021, 0022 and 0023: a
-- PL/pgSQL function that keeps its generic plan for the session): planned on every execution, as a prepared
-- statement of its own it cost more server CPU than it took to run for the few tasks a sync
-- worker claims at a time (docs/limits.md, "What it costs"). What the statement does:
--
-- Keys are visited round-robin: a window of at most `window` distinct keys with due work,
-- from just after `cursor` (the end of the previous window, kept by the worker) wrapping to
-- the start, found by a skip scan of tether_tasks_key_claim_idx (one probe per key,
-- whatever each key's backlog; each key then costs a probe for its head and one for its
-- tasks in flight). Of the window, the keys with room, best head priority
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
SELECT * FROM tether_limited_claim(
    %(queue)s::text, %(cursor)s::text, %(window)s::int, %(wanted)s::int, %(skip_names)s::text[], %(unkeyed)s::boolean,
    %(unkeyed_window)s::int, %(other_limit)s::int, %(async_limit)s::int, %(async_names)s::text[],
    %(worker_id)s::text, %(idle)s::int
);

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
