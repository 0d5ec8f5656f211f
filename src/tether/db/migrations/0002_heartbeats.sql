-- tether schema, version 2: heartbeats, worker snapshots, progress, recovery indexes.

-- One row per task per heartbeat interval: 'claimer' rows come from the worker's
-- main process for CLAIMED tasks, 'runner' rows for RUNNING tasks whose child
-- process stamped its slot in time. No foreign key: heartbeats are written in
-- bulk every interval and pruned on their own schedule.
CREATE TABLE tether_heartbeats (
    id         bigserial   PRIMARY KEY,
    task_id    uuid        NOT NULL,
    sender_id  text        NOT NULL,
    role       text        NOT NULL CHECK (role IN ('claimer', 'runner')),
    sent_at    timestamptz NOT NULL DEFAULT now(),
    hostname   text        NOT NULL,
    pid        integer     NOT NULL
);
-- The reaper's question, "latest heartbeat of this role for this task", is one index probe.
CREATE INDEX tether_heartbeats_task_idx ON tether_heartbeats (task_id, role, sent_at DESC);
CREATE INDEX tether_heartbeats_sent_idx ON tether_heartbeats (sent_at);

-- Periodic snapshots of each worker, for monitoring.
CREATE TABLE tether_worker_states (
    id            bigserial   PRIMARY KEY,
    worker_id     text        NOT NULL,
    captured_at   timestamptz NOT NULL DEFAULT now(),
    running       integer     NOT NULL,
    claimed       integer     NOT NULL,
    tasks_done    bigint      NOT NULL,
    rss_bytes     bigint,
    cpu_percent   real
);
CREATE INDEX tether_worker_states_worker_idx ON tether_worker_states (worker_id, captured_at DESC);
CREATE INDEX tether_worker_states_captured_idx ON tether_worker_states (captured_at);

-- report_progress(stage, progress, message) from inside a task.
ALTER TABLE tether_tasks ADD COLUMN progress jsonb;
ALTER TABLE tether_tasks ADD COLUMN progress_at timestamptz;

-- The task names a worker can run, so that a name no live worker knows can be
-- told from one that only this worker's app lacks (rolling deploys).
ALTER TABLE tether_workers ADD COLUMN task_names text[] NOT NULL DEFAULT '{}';
ALTER TABLE tether_workers ADD COLUMN inactive_at timestamptz;

-- Stale scans look at in-flight rows only, by status.
CREATE INDEX tether_tasks_in_flight_status_idx ON tether_tasks (status, claimed_at)
    WHERE status IN ('CLAIMED', 'RUNNING');
-- Retention prunes terminal rows by when they finished (updated_at is set by
-- every transition, so for a terminal row it is its finishing time).
CREATE INDEX tether_tasks_terminal_idx ON tether_tasks (updated_at)
    WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED');

-- Which kernel and pid namespace a worker's pid belongs to (boot id + pid
-- namespace): startup reconciliation only judges pids it can actually see.
ALTER TABLE tether_workers ADD COLUMN host_key text;
