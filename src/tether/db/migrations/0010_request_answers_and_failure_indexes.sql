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
