-- tether schema, version 10: operators' requests answered once, whatever the connection
-- does (docs/internals.md, "Requests that change things").
--
-- PostgresBroker.run repeats work once more on another connection when its pooled one
-- turns out dead. A statement sent on it may have run and committed before the
-- connection broke; repeated, a request would then answer for the state its first
-- attempt left ("already paused") instead of for what it did. So a request that changes
-- something (pause or resume a queue, a schedule or a workflow; cancel or retry a task)
-- runs in a transaction that also records its answer here, under an id the client made
-- for that one call (PostgresBroker.run_request). A repeat looks for its id first and
-- returns the answer it finds; the primary key catches a first attempt that commits
-- while the repeat works (the repeat is rolled back and returns the recorded answer).
-- A row is needed for seconds; rows older than an hour are deleted by later requests
-- (broker/sql/answers.sql), so the table holds about an hour of operator requests.
CREATE TABLE tether_request_answers (
    request_id  uuid        PRIMARY KEY,
    answer      jsonb       NOT NULL,
    answered_at timestamptz NOT NULL DEFAULT now()
);
-- Deleting the expired rows, oldest first.
CREATE INDEX tether_request_answers_answered_idx ON tether_request_answers (answered_at);

-- The dashboard's lists of unsuccessful tasks (broker/sql/browse.sql browse_tasks, docs/
-- dashboard.md): newest first by id, from a keyset cursor (id < before), filtered by
-- `status = ANY(statuses)` and optionally `error_code = X`. Without these, a filter that
-- few rows match reads the primary key backwards until it finds a page, or the whole
-- table: a rare error code among 2,000,000 tasks took 0.5-0.8 s, a rare status over 1 s.
--
-- FAILED with an error code: one backward range scan of the code's entries, from the
-- cursor. The planner proves `status = ANY('{FAILED}')` implies the predicate.
CREATE INDEX tether_tasks_failed_code_idx ON tether_tasks (error_code, id)
    WHERE status = 'FAILED';
-- Any of FAILED, CANCELLED, EXPIRED (one, some or all: "ended without success"), with or
-- without an error code: a backward scan of the unsuccessful rows only. status is a key
-- column so that `status = ANY(...)` is checked in the index (an Index Cond), without a
-- heap visit per row of another status: a rare status costs a read of these entries, not
-- of their rows.
CREATE INDEX tether_tasks_unsuccessful_idx ON tether_tasks (id, status)
    WHERE status IN ('FAILED', 'CANCELLED', 'EXPIRED');
-- The price: one entry in each per failed task, one in the second per cancelled or expired
-- task, written by the statement that ends it. COMPLETED tasks (the bulk), and every
-- transition before the end, write none: PostgreSQL only adds entries to a partial index
-- whose predicate the new row version matches. Building them reads the whole table once,
-- under a lock that holds writes to tether_tasks back meanwhile (about 3 s for 2,000,000
-- rows (917 MB) here, docs/schema.md).
