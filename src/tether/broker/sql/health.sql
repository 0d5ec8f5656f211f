-- What `tether health` reads (tether/health.py judges it, docs/health.md explains it).
-- Every statement reads the server's statistics views or small tables, or walks an index
-- by its keys: none counts rows of the history, so each costs the same with ten rows or
-- ten million.

-- name: horizon_holders
-- What holds this database's MVCC horizon back, oldest first: sessions in an open
-- transaction or holding a snapshot (this one, and autovacuum, excepted), prepared
-- transactions, and replication slots holding an xmin. xmin_age: transactions started
-- since the horizon it holds (age() of the older of its snapshot's xmin and its own xid);
-- transaction_age_s: how long its transaction has been open (NULL for a slot, and for a
-- session of another role unless we may read all statistics: pg_read_all_stats). A
-- walsender (no database) counts: with hot_standby_feedback it holds the standby's horizon.
SELECT 'session' AS kind, a.pid, a.usename::text AS username, a.application_name,
       a.state, a.backend_type,
       NULL::text AS name,
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS transaction_age_s,
       greatest(age(a.backend_xmin), age(a.backend_xid))::bigint AS xmin_age
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid()
  AND (a.datname = current_database() OR a.datid IS NULL)
  AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
  AND (a.xact_start IS NOT NULL OR a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
UNION ALL
SELECT 'prepared transaction', NULL, p.owner::text, NULL, NULL, NULL, p.gid,
       extract(epoch FROM clock_timestamp() - p.prepared)::float8,
       age(p.transaction)::bigint
FROM pg_prepared_xacts p
WHERE p.database = current_database()
UNION ALL
SELECT 'replication slot', s.active_pid, NULL, NULL,
       CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.slot_type, s.slot_name::text,
       NULL, age(s.xmin)::bigint
FROM pg_replication_slots s
WHERE s.xmin IS NOT NULL AND (s.database IS NULL OR s.database = current_database())
ORDER BY xmin_age DESC NULLS LAST, transaction_age_s DESC NULLS LAST;

-- name: tether_tables
-- Each tether table of this schema: the statistics' estimates of live and dead rows (no
-- count), its last vacuum and analyze (by hand or by autovacuum), and its size on disk
-- (heap with TOAST, and all its indexes).
SELECT s.relname::text AS table_name,
       s.n_live_tup AS live_rows,
       s.n_dead_tup AS dead_rows,
       greatest(s.last_vacuum, s.last_autovacuum) AS last_vacuum_at,
       greatest(s.last_analyze, s.last_autoanalyze) AS last_analyze_at,
       s.vacuum_count + s.autovacuum_count AS vacuums,
       pg_table_size(s.relid) AS table_bytes,
       pg_indexes_size(s.relid) AS index_bytes
FROM pg_stat_user_tables s
WHERE s.schemaname = current_schema() AND s.relname LIKE 'tether\_%'
ORDER BY s.relname;

-- name: worker_liveness
-- Each active worker: its heartbeat's age, and whether its work listener's connection is
-- in the server (named 'tether-listener ' and the last 47 characters of the worker's id,
-- tether.worker.work_listener.listener_role: 63 bytes is the most an application_name
-- keeps, and the end of the id, pid and random part, is what tells workers apart).
WITH listeners AS (
    SELECT DISTINCT application_name FROM pg_stat_activity
    WHERE datname = current_database() AND application_name LIKE 'tether-listener %'
)
SELECT w.id, w.hostname, w.pid, w.queues, w.last_heartbeat_at,
       -- clock_timestamp(): a heartbeat committed after this statement began would
       -- otherwise come out in the future.
       greatest(0, extract(epoch FROM clock_timestamp() - w.last_heartbeat_at))::float8 AS heartbeat_age_s,
       l.application_name IS NOT NULL AS listening
FROM tether_workers w
LEFT JOIN listeners l ON l.application_name = 'tether-listener ' || right(w.id, 47)
WHERE w.status = 'active'
ORDER BY w.started_at;

-- name: queue_lag
-- Per queue with PENDING tasks: the oldest one that is due (run_at <= now()), found
-- through the claim index (queue, priority DESC, run_at, id) WHERE status = 'PENDING'
-- by skipping from one (queue, priority) to the next, then one probe each for its
-- earliest due run_at: as many index probes as there are (queue, priority) pairs, however
-- many tasks wait. oldest_due_age_s is NULL when nothing is due yet. Also whether the
-- queue is paused and whether an active worker serves it.
WITH RECURSIVE heads AS (
    (SELECT queue, priority FROM tether_tasks
     WHERE status = 'PENDING'
     ORDER BY queue, priority DESC LIMIT 1)
    UNION ALL
    SELECT n.queue, n.priority
    FROM heads h
    CROSS JOIN LATERAL (
        (SELECT t.queue, t.priority FROM tether_tasks t
         WHERE t.status = 'PENDING' AND t.queue = h.queue AND t.priority < h.priority
         ORDER BY t.priority DESC LIMIT 1)
        UNION ALL
        (SELECT t.queue, t.priority FROM tether_tasks t
         WHERE t.status = 'PENDING' AND t.queue > h.queue
         ORDER BY t.queue, t.priority DESC LIMIT 1)
        LIMIT 1
    ) n
), due AS (
    SELECT DISTINCT ON (h.queue) h.queue, d.run_at, d.id
    FROM heads h
    LEFT JOIN LATERAL (
        SELECT t.run_at, t.id FROM tether_tasks t
        WHERE t.status = 'PENDING' AND t.queue = h.queue AND t.priority = h.priority
          AND t.run_at <= now()
        ORDER BY t.run_at, t.id LIMIT 1
    ) d ON true
    ORDER BY h.queue, d.run_at NULLS LAST, d.id
)
SELECT due.queue,
       extract(epoch FROM now() - due.run_at)::float8 AS oldest_due_age_s,
       due.id AS oldest_due_task_id,
       p.queue IS NOT NULL AS paused,
       EXISTS (SELECT 1 FROM tether_workers w
               WHERE w.status = 'active' AND due.queue = ANY(w.queues)) AS served,
       -- A flow-controlled queue (docs/limits.md) with tasks in flight: its due tasks wait
       -- for a slot, which is not lateness. NULL: not flow-controlled.
       CASE WHEN l.queue IS NOT NULL THEN
           (SELECT count(*) FROM tether_tasks f
            WHERE f.queue = due.queue AND f.status IN ('CLAIMED', 'RUNNING'))::int
       END AS limited_in_flight
FROM due
LEFT JOIN tether_paused_queues p ON p.queue = due.queue
LEFT JOIN tether_queue_limits l ON l.queue = due.queue
ORDER BY due.queue;
