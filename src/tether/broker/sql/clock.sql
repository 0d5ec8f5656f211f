-- The server's wall clock. A tether_work notification carries its run_at as an epoch of
-- the server's clock; a worker reads it against this, never against its host's clock,
-- which may be minutes or hours off (docs/heartbeats-and-recovery.md, "Database time only").

-- name: server_clock
SELECT extract(epoch FROM clock_timestamp())::float8 AS epoch;
