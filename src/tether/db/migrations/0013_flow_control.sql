-- tether schema, version 13: flow control (docs/limits.md): concurrency limits per queue
-- and per concurrency key, rate limits per queue, round-robin between keys.
--
-- The slot IS the row: a limited task holds a slot exactly while its row is CLAIMED or
-- RUNNING. There is no counter to keep right: whatever settles the task (its worker, a
-- reaper, an operator) frees the slot in the same transaction, because it changes the
-- row's status. Claims of a limited queue count those rows under a lock (broker/sql/
-- limited_claims.sql), so two claimers never both see the same free slot.

-- The key a task was sent with (send(..., concurrency_key=...), or the argument its task
-- declares); NULL: none. `limited`: claimed through the limited claim (set by it, never
-- cleared): a trigger tells waiting workers at once when such a task gives its slot back.
ALTER TABLE tether_tasks
    ADD COLUMN concurrency_key text,
    ADD COLUMN limited boolean NOT NULL DEFAULT false;

-- The keys of a limited queue's PENDING tasks, each key's rows in claim order: the limited
-- claim walks the distinct keys (a skip scan, one probe each) and reads each key's head.
CREATE INDEX tether_tasks_key_claim_idx ON tether_tasks (queue, concurrency_key, priority DESC, run_at, id)
    WHERE status = 'PENDING' AND concurrency_key IS NOT NULL;
-- The slots in use: per queue (its prefix) and per key. Holds only in-flight rows.
CREATE INDEX tether_tasks_key_in_flight_idx ON tether_tasks (queue, concurrency_key)
    WHERE status IN ('CLAIMED', 'RUNNING');

-- A queue with a row here is flow-controlled: the plain claim (claims.sql claim_tasks)
-- leaves it alone and only the limited claim takes its tasks. NULL: no such limit.
CREATE TABLE tether_queue_limits (
    queue          text        PRIMARY KEY,
    max_in_flight  integer     CHECK (max_in_flight >= 1),   -- tasks CLAIMED or RUNNING at once
    per_key        integer     CHECK (per_key >= 1),         -- the same, per concurrency key
    -- Rate: at most rate_limit starts per rate_period_ms, as a token bucket of `burst`
    -- tokens refilled continuously in database time (tokens, refilled_at).
    rate_limit     integer     CHECK (rate_limit >= 1),
    rate_period_ms integer     CHECK (rate_period_ms >= 1),
    burst          integer     CHECK (burst >= 1),
    tokens         float8,
    refilled_at    timestamptz,
    -- Weights of keys in the round-robin ({"key": 2.5}); a key not named weighs 1.
    key_weights    jsonb       NOT NULL DEFAULT '{}',
    set_by         text,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((rate_limit IS NULL) = (rate_period_ms IS NULL))
);

-- A limited task leaving CLAIMED/RUNNING frees a slot: wake the workers waiting for one
-- at once (work_listener reads 'queue epoch' on tether_work). A trigger rather than a
-- line in every statement that settles a task (completions, retries, give-backs, every
-- reaper step, operator actions): none can forget it. Its WHEN is checked per updated
-- row before anything is queued, so an unlimited task pays one boolean test.
-- Identical payloads in one transaction are delivered once. As a send, it notifies only
-- when a worker waits for the queue (tether_work_is_awaited, migration 0005: every NOTIFY
-- serialises commits): a worker whose claim was held back by a limit took less than it had
-- room for, so it registered as waiting; busy workers claim again without being told.
CREATE FUNCTION tether_slot_freed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF tether_work_is_awaited(NEW.queue) THEN
        PERFORM pg_notify('tether_work', NEW.queue || ' ' || extract(epoch FROM now())::text);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER tether_tasks_slot_freed AFTER UPDATE OF status ON tether_tasks
    FOR EACH ROW
    WHEN (OLD.limited AND OLD.status IN ('CLAIMED', 'RUNNING') AND NEW.status NOT IN ('CLAIMED', 'RUNNING'))
    EXECUTE FUNCTION tether_slot_freed();
