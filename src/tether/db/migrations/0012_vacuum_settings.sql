-- tether schema, version 12: autovacuum settings for the tables every task writes
-- (docs/schema.md, "Vacuum and a held-back vacuum").
--
-- PostgreSQL's defaults vacuum a table once a fifth of it is dead row versions
-- (autovacuum_vacuum_scale_factor 0.2) and analyze it once a tenth has changed. Those suit
-- tables that mostly grow. tether's are queues: a task's row is replaced three times
-- (claimed, running, finished), each time in every index whose rows it changes, and later
-- deleted by retention; and the table can hold millions of finished rows, so a fifth of it
-- is a great many dead versions before a vacuum starts. These settings start one after a
-- fixed number of dead versions plus a small share of the table, so the vacuum follows the
-- churn instead of the history's size. They only matter where autovacuum runs (it does by
-- default); none of tether's guarantees depends on a vacuum running.
--
-- ALTER TABLE ... SET (...) takes a SHARE UPDATE EXCLUSIVE lock: sends, claims and
-- outcomes go on while it is applied; it waits only for a vacuum or other DDL on the table.

-- Three replaced versions per task, then its deletion: vacuum after 10,000 dead versions
-- plus 1 % of the table (200,000 at 19 million rows rather than 4 million), analyze after
-- 10,000 changes plus 2 %, so the planner's counts of PENDING and finished rows stay near.
ALTER TABLE tether_tasks SET (
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);

-- Written once per outcome, deleted by retention with its task.
ALTER TABLE tether_task_attempts SET (
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_scale_factor = 0.02
);

-- Written once per held task per heartbeat interval, deleted by retention after 24 hours.
ALTER TABLE tether_heartbeats SET (
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_scale_factor = 0.02
);

-- A few rows, each replaced by every heartbeat of its worker (100 workers at 1 s beats:
-- 100 versions a second): vacuumed once 1,000 have piled up, whatever the table's size.
ALTER TABLE tether_workers SET (
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0
);

-- Rows inserted and deleted as workers start and stop waiting for a queue.
ALTER TABLE tether_queue_waiters SET (
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0
);
