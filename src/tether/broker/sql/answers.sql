-- Answers of requests that change things (migration 0010; PostgresBroker.run_request).
-- A request's work and its answer commit together, so an answer found here means the
-- request's work committed, and this is what it answered.

-- name: record_answer
-- In the request's transaction, after its work. No row back: an earlier attempt of the
-- same request committed its answer meanwhile (it was still running on the server when
-- its connection was given up), and the caller rolls this attempt back. On the way,
-- answers older than an hour are deleted (a repeat comes seconds after its first
-- attempt), at most 100 per request and skipping rows another request is deleting, so
-- no request waits for another and the table stays as small as an hour of requests.
WITH expired AS (
    DELETE FROM tether_request_answers
    WHERE request_id IN (SELECT request_id FROM tether_request_answers
                         WHERE answered_at < now() - interval '1 hour'
                         ORDER BY answered_at
                         LIMIT 100
                         FOR UPDATE SKIP LOCKED)
)
INSERT INTO tether_request_answers (request_id, answer)
VALUES (%(id)s, %(answer)s::jsonb)
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id;

-- name: recorded_answer
SELECT answer::text AS answer FROM tether_request_answers WHERE request_id = %(id)s;
