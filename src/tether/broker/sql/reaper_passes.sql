-- The fleet's reaper passes: one row (tether_reaper, migration 11) says when the next one
-- is due; a reaper tick claims it, or learns when to look again.

-- name: reaper_pass_due_in
-- Seconds until the fleet's next pass is due (<= 0: due now): the moment the last pass
-- set, or this worker's own check interval after the last pass, whichever comes first.
-- One read outside any transaction: what most ticks of most workers are. When due, also
-- whether a pass is running (its worker holds the reaper's advisory lock, in this
-- database): the worker then need not try to claim it.
SELECT d.due_in_s,
       CASE WHEN d.due_in_s > 0 THEN false ELSE EXISTS (
           SELECT 1 FROM pg_locks l
           WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = 2122188290
             AND l.objsubid = 1 AND l.granted
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
       END AS running
FROM (SELECT extract(epoch FROM least(next_pass_at, last_pass_at + %(check_interval)s::interval)
                                - now())::float8 AS due_in_s
      FROM tether_reaper WHERE singleton) d;

-- name: ensure_reaper_row
-- Migration 11 makes the row and tether never deletes it; someone emptying the tables by
-- hand (TRUNCATE) must not stop recovery, so a tick that finds none makes it again.
INSERT INTO tether_reaper DEFAULT VALUES ON CONFLICT DO NOTHING;

-- name: claim_reaper_pass
-- In the caller's transaction. Claims the pass when it is due (the moment the last pass
-- set, or this worker's own check interval since the last pass, whichever comes first)
-- and no other pass is running (the advisory lock, held to COMMIT, as is the row's lock).
-- The CASE takes the lock only when the pass is due, so a worker that is early never
-- holds it. A worker that lost a race re-reads the row once the winner commits and finds
-- it no longer due. pass is NULL when not claimed; due_in_s then says when the pass is
-- due, as this statement's snapshot saw it (<= 0: due, but another worker holds it).
-- `early`: how long before its moment the pass may be claimed (0 but for a pass that rides
-- on its worker's heartbeat, worker/beat_rides.py: the beat is sent on the worker's clock,
-- and must not miss the moment it was planned for by a few milliseconds).
-- For the rest of the pass's transaction: no parallel workers (serial). Each of its
-- statements reads a few hundred rows through partial indexes; with parallel workers
-- allowed, the planner read every workflow step ever kept in parallel (stuck_steps: a
-- parallel seq scan of tether_workflow_tasks, 66-160 ms with 55,000 steps on a busy
-- 2-core machine) rather than the ENQUEUED ones through their index (31 ms), and
-- starting workers costs milliseconds of its own.
WITH claimed AS (
    UPDATE tether_reaper
    SET last_pass_at = now(), last_worker_id = %(worker_id)s, passes = passes + 1
    WHERE singleton
      AND CASE WHEN next_pass_at <= now() + %(early)s::interval OR last_pass_at <= now() - %(check_interval)s::interval
               THEN pg_try_advisory_xact_lock(2122188290)
               ELSE false END
    RETURNING passes
)
SELECT (SELECT passes FROM claimed) AS pass,
       extract(epoch FROM least(r.next_pass_at, r.last_pass_at + %(check_interval)s::interval)
                          - now())::float8 AS due_in_s,
       set_config('max_parallel_workers_per_gather', '0', true) AS serial
FROM tether_reaper r WHERE r.singleton;

-- name: schedule_next_reaper_pass
-- In the claiming pass's transaction, at its end: when the fleet's next pass is due.
UPDATE tether_reaper SET next_pass_at = now() + %(after)s::interval WHERE singleton;

-- name: schedule_reaper_pass_at
-- The same, for a pass planned on a heartbeat (worker/beat_rides.py): counted from the
-- statement's own moment, not the transaction's start, so that the moment is the beat's
-- however long the pass took to begin.
UPDATE tether_reaper SET next_pass_at = clock_timestamp() + %(after)s::interval WHERE singleton;
