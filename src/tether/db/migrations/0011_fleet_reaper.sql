-- tether schema, version 11: one reaper pass per due moment for the whole fleet.
--
-- Every worker runs a reaper, and until now each one did the full pass whenever its own
-- timer fired and nobody else was in the middle of one (an advisory lock): with N workers
-- ticking at different moments, the fleet did about N passes per check interval (81 % of
-- 100 idle workers' ticks). This one row says when the fleet's next pass is due. A reaper
-- tick claims the pass with a conditional UPDATE of it (broker/sql/reaper_passes.sql):
-- only when the moment has come by the database's clock, and only if no other pass holds
-- the reaper's advisory lock. The pass writes the next moment before it commits; every
-- other worker reads that moment and sleeps until then. A pass whose worker dies rolls
-- back with its transaction, the moment stays due, and the next worker to wake takes it.
CREATE TABLE tether_reaper (
    -- Exactly one row: the primary key can only be true.
    singleton      boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    -- The fleet's next pass is due at this moment (the database's clock).
    next_pass_at   timestamptz NOT NULL DEFAULT now(),
    -- The last pass that committed: when it started, which worker, and how many so far.
    last_pass_at   timestamptz NOT NULL DEFAULT now(),
    last_worker_id text,
    passes         bigint      NOT NULL DEFAULT 0
) WITH (fillfactor = 20);  -- room on its page, so each pass's update stays a HOT update

INSERT INTO tether_reaper DEFAULT VALUES;
