-- tether schema, version 15: recoveries per minute and rule, for the dashboard's charts
-- (docs/dashboard.md#charts).
--
-- The rows of tasks say what a recovery did (a requeue, a retry, WORKER_CRASHED) but not
-- which rule did it: a dead child and a reaper's stale-RUNNING pass leave the same row, and
-- self-isolation changes no row at all. The worker knows the rule when it acts
-- (tether/metrics/rules.py, the `rule` label of tether_recoveries_total). Its main process
-- tallies them in memory and adds the tally here with its next heartbeat (one statement, on
-- the heartbeat's connection, only after a beat that had something to add), so nothing is
-- written on the path that ends tasks and a healthy fleet writes no row at all.
-- One row per minute and rule that saw a recovery: a few rows an hour, pruned by retention
-- with the terminal tasks (terminal_record_retention_hours), oldest minute first along the
-- primary key.
CREATE TABLE tether_recovery_minutes (
    minute timestamptz NOT NULL,  -- the minute the worker recovered the tasks in, its clock
    rule   text        NOT NULL,
    n      bigint      NOT NULL CHECK (n > 0),
    PRIMARY KEY (minute, rule)
);
