-- What a scrape of /metrics reads beyond what queue_counts (counts.sql) and queue_lag
-- (health.sql) give (tether/metrics/queue_state.py, docs/monitoring.md).

-- name: workers_by_status
-- How many workers the registry holds in each status ('active', 'stopped', 'inactive').
-- The registry is small (one row per worker start, pruned by worker_state_retention_hours).
SELECT status, count(*)::bigint AS n FROM tether_workers GROUP BY status ORDER BY status;
