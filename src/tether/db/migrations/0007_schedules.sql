-- tether schema, version 7: periodic tasks (docs/periodic.md).
--
-- One row per schedule declared in code (app.periodic). Workers write the rows
-- at start (for the queues they serve) and send each slot's task from them, so
-- every worker sends by the same definition, whatever code it runs.
CREATE TABLE tether_schedules (
    name          text        PRIMARY KEY,
    task_name     text        NOT NULL,
    cron          text        NOT NULL,
    timezone      text        NOT NULL,
    args          jsonb       NOT NULL,
    kwargs        jsonb       NOT NULL,
    queue         text        NOT NULL,
    priority      integer     NOT NULL,
    max_retries   integer     NOT NULL,
    retry_policy  jsonb,
    catch_up      text        NOT NULL CHECK (catch_up IN ('latest', 'all', 'none')),
    overlap       text        NOT NULL CHECK (overlap IN ('allow', 'skip')),
    paused        boolean     NOT NULL DEFAULT false,
    -- Set when the workers of its queue start without it in their code: it stops firing.
    removed_at    timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- The last change of its definition (expression, zone, arguments, options).
    changed_at    timestamptz NOT NULL DEFAULT now(),
    -- Only slots after this are due: the declaration, the last change, the last resume.
    slots_after   timestamptz NOT NULL DEFAULT now(),
    -- The next slot by its expression (NULL: it names no later time). Workers wake for it.
    next_slot     timestamptz,
    -- The latest slot decided (its task sent, or skipped by the catch-up or overlap rule).
    last_slot     timestamptz,
    last_task_id  uuid,
    slots_sent    bigint      NOT NULL DEFAULT 0,
    slots_skipped bigint      NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
-- The scheduler's due scan and its wake-up time: live schedules by next slot.
CREATE INDEX tether_schedules_due_idx ON tether_schedules (next_slot)
    WHERE NOT paused AND removed_at IS NULL;

-- The slot a task was sent for. The unique index is what makes a slot fire
-- exactly once, whichever worker sends it and whatever dies when: a second
-- insert for the same (schedule, slot) does nothing. It covers only the rows
-- of periodic tasks, so plain sends do not pay for it.
ALTER TABLE tether_tasks ADD COLUMN schedule_name text, ADD COLUMN schedule_slot timestamptz;
CREATE UNIQUE INDEX tether_tasks_schedule_slot_idx ON tether_tasks (schedule_name, schedule_slot)
    WHERE schedule_name IS NOT NULL;
