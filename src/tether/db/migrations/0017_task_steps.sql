-- tether schema, version 17: checkpointed steps of a task (docs/durable-steps.md).
--
-- One row per step a task's code completed with current_task().step(...): the step's
-- JSON result, kept so that a later attempt of the same task (a WORKER_CRASHED retry,
-- later a durable sleep's resume) returns it instead of running the step again.
-- A name may be used many times in one task (a loop): `occurrence` counts the calls of
-- that name within an attempt, 0 for the first, so the n-th call of a name in every
-- attempt maps to the same row.
--
-- Written by the running attempt only, one fenced statement per step (broker/sql/steps.sql):
-- a zombie attempt can never add a row. Read once per attempt, by primary key prefix.
-- The rows go with their task (retention, workflow deletes): ON DELETE CASCADE, along the
-- primary key. Names starting with "tether." are reserved for tether's own steps (durable
-- sleep and events, to come), which will live in this same table.
CREATE TABLE tether_task_steps (
    task_id    uuid        NOT NULL REFERENCES tether_tasks (id) ON DELETE CASCADE,
    name       text        NOT NULL,
    occurrence integer     NOT NULL CHECK (occurrence >= 0),
    result     jsonb       NOT NULL,
    attempt    integer     NOT NULL,  -- the attempt (fencing token) that ran the step
    written_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, name, occurrence)
);
