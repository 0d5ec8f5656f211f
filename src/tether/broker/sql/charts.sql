-- The dashboard's charts (broker/charts.py, docs/dashboard.md#charts).

-- name: charts_now
-- The database's clock, inside the charts' read: it stamped the ends the read counts.
SELECT now() AS now;

-- name: finished_per_bucket
-- Tasks that ended in [since, until), per bucket of `bucket_s` seconds, queue and status. A
-- range scan of the partial index of terminal tasks (tether_tasks_terminal_idx on
-- updated_at, which is a terminal row's finishing time): it reads the rows that ended in
-- the range and no other, however many older ones the table holds. The dashboard reads each
-- minute once (web/charts.py): a refresh reads the last two or three minutes.
SELECT to_timestamp(floor(extract(epoch FROM updated_at) / %(bucket_s)s) * %(bucket_s)s) AS at,
       queue, status, count(*) AS n
FROM tether_tasks
WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')
  AND updated_at >= %(since)s AND updated_at < %(until)s
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3;

-- name: recoveries_per_bucket
-- Recoveries from `since` on, per bucket and rule: a range of the primary key (minute, rule).
SELECT to_timestamp(floor(extract(epoch FROM minute) / %(bucket_s)s) * %(bucket_s)s) AS at,
       rule, sum(n)::bigint AS n
FROM tether_recovery_minutes
WHERE minute >= %(since)s
GROUP BY 1, 2
ORDER BY 1, 2;

-- name: record_recoveries
-- A worker's tally since its last heartbeat, one element per (minute, rule), added to what
-- other workers recorded for the same minute.
INSERT INTO tether_recovery_minutes (minute, rule, n)
SELECT m, r, k FROM unnest(%(minutes)s::timestamptz[], %(rules)s::text[], %(ns)s::bigint[]) AS t (m, r, k)
ON CONFLICT (minute, rule) DO UPDATE SET n = tether_recovery_minutes.n + EXCLUDED.n;
