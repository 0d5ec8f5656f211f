-- tether schema, version 18: durable sleep and events (docs/durable-steps.md#durable-sleep).
--
-- A task that sleeps (current_task().sleep) or waits for an event (wait_for_event) ends
-- its attempt and goes back to PENDING with its due time in run_at: no new task status.
-- The attempt's history row says so: outcome SUSPENDED, with the time it resumes at and,
-- for a wait, the event key. A suspension is no failure: it leaves retry_count alone, so
-- it never counts against the retry policy (which counts retry_count, not attempts).
ALTER TABLE tether_task_attempts DROP CONSTRAINT tether_task_attempts_outcome_check;
ALTER TABLE tether_task_attempts
    ADD CONSTRAINT tether_task_attempts_outcome_check
        CHECK (outcome IN ('COMPLETED', 'FAILED', 'CANCELLED', 'SUSPENDED')),
    ADD COLUMN resume_at timestamptz,  -- SUSPENDED: when it is due again (a wait: its timeout)
    ADD COLUMN event_key text;         -- SUSPENDED by wait_for_event: the key it waits for

-- Events sent with app.send_event(key, payload) / `tether send-event`. Each send is one
-- event; each wait takes one, the oldest of its key first, and waiters get them in the
-- order they began waiting. An event no waiter took is kept for the terminal record
-- retention (terminal_record_retention_hours, pruned by sent_at); a delivered one goes
-- with the task it was delivered to (ON DELETE CASCADE), its payload kept in that task's
-- step.
CREATE TABLE tether_events (
    id           bigserial   PRIMARY KEY,
    key          text        NOT NULL,
    payload      jsonb       NOT NULL,
    sent_at      timestamptz NOT NULL DEFAULT now(),
    delivered_to uuid        REFERENCES tether_tasks (id) ON DELETE CASCADE,
    delivered_at timestamptz
);
-- The oldest undelivered event of a key: read by every wait, small (taken events leave it).
CREATE INDEX tether_events_undelivered_idx ON tether_events (key, id) WHERE delivered_at IS NULL;
CREATE INDEX tether_events_delivered_to_idx ON tether_events (delivered_to) WHERE delivered_to IS NOT NULL;
CREATE INDEX tether_events_sent_idx ON tether_events (sent_at) WHERE delivered_at IS NULL;

-- A task waiting for an event: one row while its wait is open (a task waits for one
-- thing at a time). `attempt` is the attempt that suspended: a send delivers only to a
-- task still PENDING under that attempt, so a wait left behind by a cancel or an expiry
-- is never delivered to. The row is removed when the wait ends (delivered, or timed out
-- and seen by the next attempt).
CREATE TABLE tether_event_waits (
    task_id    uuid        PRIMARY KEY REFERENCES tether_tasks (id) ON DELETE CASCADE,
    attempt    integer     NOT NULL,
    occurrence integer     NOT NULL,
    key        text        NOT NULL,
    since      timestamptz NOT NULL DEFAULT now(),
    until      timestamptz           -- NULL: no timeout (the task's run_at is then 9999-12-31)
);
CREATE INDEX tether_event_waits_key_idx ON tether_event_waits (key, since, task_id);
