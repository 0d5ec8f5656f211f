-- tether schema, version 20: a worker's listener session, so that a reaper can see a dead
-- worker on another host at once (docs/heartbeats-and-recovery.md, "A worker whose session
-- closed").
--
-- When a worker's process dies (SIGKILL, the OOM killer, a container killed, its host's
-- kernel still up), the kernel closes its TCP connections and their server processes exit:
-- the worker's listener session (the one direct, long-lived connection a worker keeps)
-- leaves pg_stat_activity within milliseconds. A worker that opts in
-- (RecoveryConfig.session_closed_threshold_ms) records that session here each time its
-- listener connects: the server process's pid and backend_start (a pid alone can be reused)
-- and the server's incarnation, pg_postmaster_start_time(), so that a restart or a failover,
-- which ends every session, is never read as deaths. session_closed_after is how long after
-- its last heartbeat such a worker may be judged dead once its session is gone: its own
-- setting, since its heartbeat interval is its own. NULL: the worker did not opt in (or has
-- no listener), and only the stale thresholds judge it.
ALTER TABLE tether_workers
    ADD COLUMN listener_pid           integer,
    ADD COLUMN listener_backend_start timestamptz,
    ADD COLUMN server_started_at      timestamptz,
    ADD COLUMN session_closed_after   interval;
