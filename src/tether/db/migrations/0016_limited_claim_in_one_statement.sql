-- tether schema, version 16: the limited claim in one statement, rate limits per key, and
-- concurrency keys on workflow steps and periodic sends (docs/limits.md).
--
-- The limited claim (broker/sql/limited_claims.sql) takes its locks and claims in ONE
-- statement. A statement's snapshot is taken when it starts, before its locks are granted,
-- so it could miss a claim committed by whoever held a lock while it waited (or just
-- before its try-lock succeeded). What must be exact is therefore read by these VOLATILE
-- functions, called with an argument that comes from the lock (so they run after it): in
-- READ COMMITTED each statement inside a VOLATILE function takes a fresh snapshot, newer
-- than the lock, and a lock holder releases its advisory locks only after its commit is
-- visible. PL/pgSQL, not SQL: never inlined into the caller (which would bring back the
-- caller's snapshot), and its plans are cached for the session.
--
-- `_after` is unused inside: it is the lock's result, passed so that the call depends on it.

-- Slots in use in a queue (its tasks CLAIMED or RUNNING), read after the queue's lock.
CREATE FUNCTION tether_queue_in_flight(q text, _after boolean) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (SELECT count(*) FROM tether_tasks
            WHERE queue = q AND status IN ('CLAIMED', 'RUNNING'));
END $$;

-- Slots in use by each of these keys of a queue (keys with none are left out), read after
-- the keys' locks: `keys` is the array of the locked keys, which exists only once every
-- lock of the claim was tried. One call for all the claim's keys, not one per key.
CREATE FUNCTION tether_keys_in_flight(q text, keys text[]) RETURNS TABLE (key text, n integer)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY
        SELECT f.concurrency_key, count(*)::int FROM tether_tasks f
        WHERE f.queue = q AND f.concurrency_key = ANY(keys) AND f.status IN ('CLAIMED', 'RUNNING')
        GROUP BY f.concurrency_key;
END $$;

-- A queue's rate tokens at `at` (a time taken after the queue's lock), refilled evenly
-- from its last claim, at most its burst. NULL: the queue has no rate limit.
CREATE FUNCTION tether_queue_tokens(q text, at timestamptz) RETURNS float8
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (SELECT least(coalesce(l.burst, l.rate_limit)::float8,
                         coalesce(l.tokens, coalesce(l.burst, l.rate_limit)::float8)
                         + extract(epoch FROM at - coalesce(l.refilled_at, at)) * 1000.0
                           / l.rate_period_ms * l.rate_limit)
            FROM tether_queue_limits l WHERE l.queue = q AND l.rate_limit IS NOT NULL);
END $$;

-- Rate limits per key: at most key_rate_limit claims per key_rate_period_ms for each key
-- of the queue, a token bucket of key_burst tokens (default key_rate_limit) per key.
ALTER TABLE tether_queue_limits
    ADD COLUMN key_rate_limit     integer CHECK (key_rate_limit >= 1),
    ADD COLUMN key_rate_period_ms integer CHECK (key_rate_period_ms >= 1),
    ADD COLUMN key_burst          integer CHECK (key_burst >= 1),
    ADD CONSTRAINT tether_queue_limits_key_rate_check
        CHECK ((key_rate_limit IS NULL) = (key_rate_period_ms IS NULL));

-- The buckets of keys that spent tokens lately. No row: a full bucket. Written by the
-- limited claim under the key's lock; rows that have refilled to full are deleted by the
-- reaper's pass (reaper_passes.sql prune_key_tokens), as are those of a queue that no
-- longer has a key rate.
CREATE TABLE tether_key_tokens (
    queue           text        NOT NULL,
    concurrency_key text        NOT NULL,
    tokens          float8      NOT NULL,
    refilled_at     timestamptz NOT NULL,
    PRIMARY KEY (queue, concurrency_key)
);

-- The tokens of each of these keys at `at` (a time taken after the keys' locks), refilled
-- evenly, at most `burst`; a key without a row has a full bucket. No rows when the queue
-- has no per-key rate (`rate` NULL).
CREATE FUNCTION tether_keys_tokens(q text, keys text[], at timestamptz, rate integer, period_ms integer,
                                   burst integer) RETURNS TABLE (key text, tokens float8)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF rate IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
        SELECT k.key, least(burst::float8,
                            coalesce(t.tokens + extract(epoch FROM at - t.refilled_at) * 1000.0 / period_ms * rate,
                                     burst::float8))
        FROM unnest(keys) AS k (key)
        LEFT JOIN tether_key_tokens t ON t.queue = q AND t.concurrency_key = k.key;
END $$;

-- Concurrency keys of workflow steps and periodic sends: the key their tasks are sent with
-- (from with_options(concurrency_key=...), or the argument the task declares, read from the
-- step's or the schedule's own arguments). NULL: none.
ALTER TABLE tether_workflow_tasks ADD COLUMN concurrency_key text;
ALTER TABLE tether_schedules ADD COLUMN concurrency_key text;
