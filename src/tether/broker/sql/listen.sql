-- A worker's listener: LISTEN for new work, schedule changes and operators' requests, and
-- read the server's wall clock, in one round trip. A tether_work notification carries its
-- run_at as an epoch of the server's clock; the worker reads it against this, never against
-- its host's clock, which may be minutes or hours off (docs/heartbeats-and-recovery.md,
-- "Database time only"). Sent again now and then to read the clock anew (LISTEN on a
-- channel already listened to does nothing). The LISTENs come first: pg_stat_activity shows
-- a session's last statement, and tools look for a worker's listener as 'LISTEN tether_work%'.

-- read_only: the session sits on a standby, or on a primary turned read-only (a failover in
-- progress): nothing sent to the primary is announced here, and the listener goes elsewhere
-- (db/read_only.py). A standby refuses the LISTENs themselves, with the same SQLSTATE.
--
-- name: listen_worker
LISTEN tether_work; LISTEN tether_schedules; LISTEN tether_control;
SELECT extract(epoch FROM clock_timestamp())::float8 AS epoch,
       pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' AS read_only;

-- name: session_read_only
-- Whether this session can write: a producer's result listener checks it after its LISTEN.
SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' AS read_only;
