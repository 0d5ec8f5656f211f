-- tether schema, version 9: operator control (docs/tasks.md#cancelling-a-running-task,
-- docs/queues.md).
--
-- Cancelling a RUNNING task cannot end it at once: its code is executing in some
-- worker's child. The request is recorded on the row (when, and who asked if known);
-- the worker holding the task is told (NOTIFY, with its heartbeat as the fallback),
-- and every write that settles the attempt reads the request: a failure or a crash of
-- a task whose cancel was requested settles as CANCELLED, never as a retry.
ALTER TABLE tether_tasks
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN cancel_requested_by text;

-- A paused queue has a row here; resuming deletes it. Workers do not claim from a
-- paused queue (claims.sql claim_tasks); sends to it are still accepted. Keyed by the
-- queue name alone: the claim looks a queue up by its primary key.
CREATE TABLE tether_paused_queues (
    queue     text        PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text
);

-- An attempt can now end CANCELLED: its code stopped on a cancel request, or was
-- killed for ignoring one, or its worker died while the request was pending.
ALTER TABLE tether_task_attempts DROP CONSTRAINT tether_task_attempts_outcome_check;
ALTER TABLE tether_task_attempts
    ADD CONSTRAINT tether_task_attempts_outcome_check CHECK (outcome IN ('COMPLETED', 'FAILED', 'CANCELLED'));
