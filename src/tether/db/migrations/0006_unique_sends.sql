-- tether schema, version 6: unique sends (with_options(unique_key=..., unique_for=...)).
--
-- A send with a unique key creates a task only when no task of the same name
-- holds that key: one that is not terminal yet (PENDING, CLAIMED, RUNNING), or,
-- when the send gives a window, one sent within it whatever its status. The
-- decision is made on ONE row of tether_unique_keys, found by its primary key
-- and locked by INSERT ... ON CONFLICT DO UPDATE (broker/sql/unique.sql): the
-- check and the write are one row lock, so concurrent producers of one key
-- serialise on it and exactly one of them creates the task. Reading
-- tether_tasks instead would be a read-then-write that lets copies in.

-- The key each task was sent with (NULL for most tasks): shown by info(),
-- `tether task ID` and the dashboard, and read by the release trigger below.
ALTER TABLE tether_tasks ADD COLUMN unique_key text;

-- One row per (task name, key) ever sent, pointing at the task that holds or
-- last held it. active: that task is not terminal yet (cleared by the trigger
-- below); sent_at: when that task was sent (the window is measured from it).
-- The row is kept after its task ends, so a window can still find it; it goes
-- when its task is deleted (retention, workflow pruning) through the foreign
-- key, whose cascade keeps pruning correct without a step of its own.
CREATE TABLE tether_unique_keys (
    task_name   text        NOT NULL,
    unique_key  text        NOT NULL,
    task_id     uuid        NOT NULL REFERENCES tether_tasks (id) ON DELETE CASCADE,
    sent_at     timestamptz NOT NULL,
    active      boolean     NOT NULL,
    PRIMARY KEY (task_name, unique_key)
);
-- The release trigger and the foreign key's cascade find a key by its task.
CREATE INDEX tether_unique_keys_task_idx ON tether_unique_keys (task_id);

-- Is a key row free for a new task? Its task has ended and, when the send
-- gives a window, was sent at least that long ago. Reads only the locked key
-- row's own values (see broker/sql/unique.sql for why); a SQL function so the
-- rule is written once, inlined by the planner.
CREATE FUNCTION tether_unique_key_is_free(active boolean, sent_at timestamptz, unique_for interval)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT NOT active AND (unique_for IS NULL OR sent_at <= now() - unique_for)
$$;

-- A task that reaches a terminal state frees its key. A trigger rather than a
-- clause in each statement: every terminal transition (a recorded outcome,
-- cancel, expiry, the reaper's crash verdict, a workflow cancel, a row edited
-- by hand) frees the key without any of them knowing about keys. The WHEN
-- clause is evaluated per updated row before the function is called, so tasks
-- without a key (and non-terminal transitions: a retry back to PENDING keeps
-- the key held) cost one comparison. Lock order: the task row (locked by the
-- UPDATE that fired this) then the key row; a sender only ever locks key rows
-- and its own new task rows, so the two never wait for each other in a cycle.
CREATE FUNCTION tether_release_unique_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE tether_unique_keys SET active = false
    WHERE task_id = NEW.id AND active;
    RETURN NULL;
END;
$$;

CREATE TRIGGER tether_tasks_release_unique_key
    AFTER UPDATE OF status ON tether_tasks
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL
          AND NEW.status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
          AND OLD.status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED'))
    EXECUTE FUNCTION tether_release_unique_key();

-- A workflow step may carry a key: it is taken when the step's task is
-- enqueued (broker/sql/workflows.sql: enqueue_steps), not when the workflow starts.
ALTER TABLE tether_workflow_tasks ADD COLUMN unique_key text;
ALTER TABLE tether_workflow_tasks ADD COLUMN unique_for interval;
