-- tether schema, version 23: the limited claim's held_back read in one pass over what it
-- claimed (docs/limits.md, "The held-back check in one pass").
--
-- Migration 22's held_back column counted, for each key the claim locked, the claimed rows of
-- that key with a subquery over every claimed row: keys x claimed rows. A claim of 100 tasks
-- over 100 keys (the async executor's) read 10,000 rows there, 0.8 of its 5.8 ms of server
-- CPU (auto_explain). The rows claimed are now counted per key once and joined, the same
-- answer (a key that took none still counts its busy rows, as before). The function is
-- otherwise migration 22's, restated whole as every migration restates what it replaces.
CREATE OR REPLACE FUNCTION tether_limited_claim(
    _queue text, _cursor text, _window integer, _wanted integer, _skip_names text[], _unkeyed boolean,
    _unkeyed_window integer, _other_limit integer, _async_limit integer, _async_names text[],
    _worker_id text, _idle integer
) RETURNS TABLE (
    id uuid, name text, queue text, args text, kwargs text, attempt integer, retry_count integer,
    max_retries integer, retry_policy text, workflow_id uuid, concurrency_key text, trace_context text,
    keys_locked text[], weights float8[], contended boolean, window_end text, window_full boolean,
    unkeyed_seen boolean, held_back boolean
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        WITH RECURSIVE
        queue_lock AS MATERIALIZED (
            SELECT l.max_in_flight, l.per_key, coalesce(l.key_weights, '{}') AS key_weights, l.rate_limit,
                   l.key_rate_limit, l.key_rate_period_ms, coalesce(l.key_burst, l.key_rate_limit) AS key_burst,
                   CASE WHEN l.max_in_flight IS NOT NULL OR l.rate_limit IS NOT NULL
                        -- true once granted (the lock returns void): an argument for what runs after it
                        THEN pg_advisory_xact_lock(hashtextextended('tether_queue_limit ' || l.queue, 0))::text = '' END
                       AS locked
            FROM (SELECT _queue::text AS queue) q
            LEFT JOIN tether_queue_limits l ON l.queue = q.queue
        ),
        queue_time AS MATERIALIZED (
            -- After the queue's lock (this reads its row): the time its tokens are refilled to.
            SELECT ql.*, clock_timestamp() AS at FROM queue_lock ql
        ),
        lim AS MATERIALIZED (
            SELECT qt.max_in_flight, qt.per_key, qt.key_weights, qt.key_rate_limit, qt.key_rate_period_ms,
                   qt.key_burst,
                   CASE WHEN qt.max_in_flight IS NOT NULL THEN tether_queue_in_flight(_queue, qt.locked) END
                       AS queue_busy,
                   CASE WHEN qt.rate_limit IS NOT NULL THEN tether_queue_tokens(_queue, qt.at) END AS tokens
            FROM queue_time qt
        ),
        after_cursor (key, priority, run_at, name, good_until) AS (
            -- The skip scan: each key's first PENDING row in the index's order, which is the key's
            -- head (priority DESC, run_at, id) whenever that row is due, not expired and not skipped
            -- by name; `heads` probes the key again only when it is not.
            (SELECT t.concurrency_key, t.priority, t.run_at, t.name, t.good_until FROM tether_tasks t
             WHERE t.status = 'PENDING' AND t.queue = _queue AND t.concurrency_key > _cursor
             ORDER BY t.concurrency_key, t.priority DESC, t.run_at, t.id LIMIT 1)
            UNION ALL
            SELECT n.* FROM after_cursor seen
            CROSS JOIN LATERAL (
                SELECT t.concurrency_key, t.priority, t.run_at, t.name, t.good_until FROM tether_tasks t
                WHERE t.status = 'PENDING' AND t.queue = _queue AND t.concurrency_key > seen.key
                ORDER BY t.concurrency_key, t.priority DESC, t.run_at, t.id LIMIT 1
            ) n
        ),
        from_start (key, priority, run_at, name, good_until) AS (
            (SELECT t.concurrency_key, t.priority, t.run_at, t.name, t.good_until FROM tether_tasks t
             WHERE t.status = 'PENDING' AND t.queue = _queue AND t.concurrency_key IS NOT NULL
               AND t.concurrency_key <= _cursor
             ORDER BY t.concurrency_key, t.priority DESC, t.run_at, t.id LIMIT 1)
            UNION ALL
            SELECT n.* FROM from_start seen
            CROSS JOIN LATERAL (
                SELECT t.concurrency_key, t.priority, t.run_at, t.name, t.good_until FROM tether_tasks t
                WHERE t.status = 'PENDING' AND t.queue = _queue AND t.concurrency_key > seen.key
                  AND t.concurrency_key <= _cursor
                ORDER BY t.concurrency_key, t.priority DESC, t.run_at, t.id LIMIT 1
            ) n
        ),
        key_window AS MATERIALIZED (
            SELECT key, part, priority, run_at,
                   -- the first row is the head: due, not expired, not skipped by name
                   run_at <= now() AND (good_until IS NULL OR good_until > now())
                       AND name <> ALL(_skip_names::text[]) AS first_is_head
            FROM (
                (SELECT key, 1 AS part, priority, run_at, name, good_until FROM after_cursor
                 LIMIT (SELECT _window::int))
                UNION ALL
                (SELECT key, 2 AS part, priority, run_at, name, good_until FROM from_start
                 LIMIT (SELECT _window::int))
            ) both_parts
            LIMIT (SELECT _window::int)
        ),
        heads AS (
            -- busy here is read with the statement's snapshot: good enough to order the keys; the
            -- count the limit is held to is read after the key's lock (keys, below). A lateral
            -- join, counted once per key: as a scalar subquery PostgreSQL counted it twice (in
            -- `chosen`'s filter and in its ORDER BY).
            SELECT w.key, w.part,
                   CASE WHEN w.first_is_head THEN w.priority ELSE h.priority END AS priority,
                   coalesce((queue_lock.key_weights ->> w.key)::float8, 1.0) AS weight,
                   b.n AS busy,
                   -- the key's rate tokens, as good as this snapshot knows (a key with none left is
                   -- passed over, so it does not take the place of a key that has some)
                   (SELECT t.tokens + extract(epoch FROM now() - t.refilled_at) * 1000.0
                           / queue_lock.key_rate_period_ms * queue_lock.key_rate_limit
                    FROM tether_key_tokens t
                    WHERE queue_lock.key_rate_limit IS NOT NULL AND t.queue = _queue AND t.concurrency_key = w.key)
                       AS tokens
            FROM key_window w CROSS JOIN queue_lock
            CROSS JOIN LATERAL (
                SELECT count(*)::int AS n FROM tether_tasks f
                WHERE f.queue = _queue AND f.concurrency_key = w.key AND f.status IN ('CLAIMED', 'RUNNING')
            ) b
            -- The head, probed only for a key whose first row is not it (a one-time filter per key).
            LEFT JOIN LATERAL (
                SELECT t.priority FROM tether_tasks t
                WHERE NOT w.first_is_head
                  AND t.status = 'PENDING' AND t.queue = _queue AND t.concurrency_key = w.key
                  AND t.run_at <= now() AND (t.good_until IS NULL OR t.good_until > now())
                  AND t.name <> ALL(_skip_names::text[])
                ORDER BY t.priority DESC, t.run_at, t.id
                LIMIT 1
            ) h ON true
            WHERE w.first_is_head OR h.priority IS NOT NULL
        ),
        chosen AS MATERIALIZED (
            SELECT ranked.key, ranked.part, ranked.weight,
                   pg_try_advisory_xact_lock(hashtextextended(_queue || chr(31) || ranked.key, 0)) AS locked
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
                LIMIT (SELECT _wanted::int)
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
            LEFT JOIN LATERAL tether_keys_in_flight(_queue, kl.keys) b ON b.key = c.key
            LEFT JOIN LATERAL tether_keys_tokens(_queue, kl.keys, kl.at, lim.key_rate_limit, lim.key_rate_period_ms,
                                                 lim.key_burst) r ON r.key = c.key
            WHERE c.locked
        ),
        room AS (
            -- A paused queue (tether_paused_queues, docs/queues.md) gives no room: read in every
            -- claim, with this statement's snapshot, as the plain claim does (claims.sql), so a
            -- pause holds from its commit on for limited queues too.
            SELECT CASE WHEN EXISTS (SELECT 1 FROM tether_paused_queues p WHERE p.queue = _queue) THEN 0
                   ELSE greatest(0, least(
                _wanted::int,
                coalesce(lim.max_in_flight - lim.queue_busy, _wanted::int),
                coalesce(floor(lim.tokens)::int, _wanted::int)
            )) END AS n,
            -- Past the idle children, a claim prefetches (tasks held until a child is free) only
            -- while the queue stays within half its max_in_flight: a limit that binds gives its
            -- slots to tasks that start at once, one that does not keeps the plain claim's speed.
            greatest(0, least(coalesce(lim.max_in_flight / 2 - lim.queue_busy, _wanted::int), _wanted::int))
                AS prefetch_room
            FROM lim
        ), level AS (
            -- Water-filling: the turn every key would reach if this claim's tasks were shared out
            -- by weight on top of what each key has in flight. A key reads only the rows that can
            -- come before it (+1), so a claim locks about `wanted` + keys rows, not `wanted` per key.
            SELECT (_wanted + coalesce(sum(busy), 0))::float8 / greatest(coalesce(sum(weight), 1), 0.001) AS turn
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
                    WHERE t.status = 'PENDING' AND t.queue = _queue AND t.concurrency_key = keys.key
                      AND t.run_at <= now() AND (t.good_until IS NULL OR t.good_until > now())
                      AND t.name <> ALL(_skip_names::text[])
                    ORDER BY t.priority DESC, t.run_at, t.id
                    LIMIT greatest(0, least(coalesce(keys.per_key - keys.busy, _wanted::int), _wanted::int,
                                            coalesce(floor(keys.tokens)::int, _wanted::int),
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
            WHERE _unkeyed AND s.status = 'PENDING' AND s.queue = _queue AND s.run_at <= now()
            ORDER BY s.priority DESC, s.run_at, s.id
            LIMIT (SELECT _unkeyed_window::int)
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
                  AND t.name <> ALL(_skip_names::text[])
                ORDER BY t.priority DESC, t.run_at, t.id
                LIMIT (SELECT _wanted::int)
                FOR UPDATE OF t SKIP LOCKED
            ) x
        ), candidates AS (
            SELECT id, priority, run_at, name = ANY(_async_names::text[]) AS is_async, turn, place, may_wait
            FROM keyed
            UNION ALL
            SELECT id, priority, run_at, name = ANY(_async_names::text[]) AS is_async, turn, place, may_wait
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
              AND nth_kind <= CASE WHEN is_async THEN _async_limit ELSE _other_limit END
              AND (nth <= _idle OR (may_wait AND nth <= _idle + (SELECT prefetch_room FROM room)))
        ), claimed AS (
            -- synchronous_commit off: as claim_tasks (claims.sql) explains.
            UPDATE tether_tasks t
            SET status = 'CLAIMED', attempt = t.attempt + 1, claimed_at = clock_timestamp(), updated_at = now(),
                claimed_by_worker_id = _worker_id, limited = true
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
            WHERE l.queue = _queue AND l.rate_limit IS NOT NULL AND EXISTS (SELECT 1 FROM claimed)
        ), key_spent AS (
            -- The same per key, for the keys this claim took tasks of (under each key's lock).
            INSERT INTO tether_key_tokens AS kt (queue, concurrency_key, tokens, refilled_at)
            SELECT _queue, keys.key, keys.tokens - n.taken, keys.at
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
                   (SELECT count(*) FROM key_window) >= _window AS window_full,
                   EXISTS (SELECT 1 FROM unkeyed) AS unkeyed_seen,
                   -- A slot limit binds (migration 22): the queue is at max_in_flight after this
                   -- claim, or a key of the window with a due head is at per_key (skipped), or a
                   -- key this claim took from is at per_key now. A worker whose claim took less
                   -- than it had room for asks to be told of freed slots only then (rate tokens
                   -- come back with time, not with a freed slot: the worker's timer looks).
                   coalesce((SELECT l.queue_busy + (SELECT count(*) FROM claimed) >= l.max_in_flight FROM lim l), false)
                   OR EXISTS (SELECT 1 FROM heads h, queue_lock ql WHERE h.busy >= ql.per_key)
                   OR EXISTS (SELECT 1 FROM keys k
                              LEFT JOIN (SELECT c.concurrency_key, count(*) AS taken FROM claimed c
                                         GROUP BY c.concurrency_key) n ON n.concurrency_key = k.key
                              WHERE k.busy + coalesce(n.taken, 0) >= k.per_key) AS held_back
        )
        -- The summary's arrays (one entry per key) on the first row only: not parsed once per task.
        SELECT c.*,
               CASE WHEN row_number() OVER () = 1 THEN s.keys_locked END AS keys_locked,
               CASE WHEN row_number() OVER () = 1 THEN s.weights END AS weights,
               s.contended, s.window_end, s.window_full, s.unkeyed_seen, s.held_back
        FROM summary s
        LEFT JOIN claimed c ON true;
END $$;
