-- tether schema, version 5: notify new work only when a worker waits for it.
--
-- Every NOTIFY serialises commits on a database-wide lock (taken in
-- PreCommit_Notify and held through the commit's WAL flush), so concurrent
-- sends that each notify cannot share a WAL flush. A worker that has just
-- found a queue empty registers here; a send notifies only if some worker is
-- registered for its queue. A busy worker (its last claim filled its free
-- slots) is not registered: it claims again as soon as a slot frees, and does
-- not need to be told.
CREATE TABLE tether_queue_waiters (
    queue      text        NOT NULL,
    worker_id  text        NOT NULL REFERENCES tether_workers (id) ON DELETE CASCADE,
    since      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, worker_id)
);
-- Removing one worker's rows (it got busy, stopped or was found dead).
CREATE INDEX tether_queue_waiters_worker_idx ON tether_queue_waiters (worker_id);

-- Does a worker wait for new work on this queue? Called by every send that is
-- due now. The lost-wakeup race (a worker registers while a send is between
-- its check and its commit) is closed with one advisory lock per queue: the
-- send holds it shared until its commit, the registering worker takes it
-- exclusively (so it waits for sends in flight, whose rows its next claim then
-- sees) and claims again after registering. VOLATILE matters: the check runs
-- with a snapshot taken after the lock is granted (READ COMMITTED), so a send
-- that had to wait for a registration sees it.
CREATE FUNCTION tether_work_is_awaited(q text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('tether_queue_waiters:' || q, 0));
    RETURN EXISTS (SELECT 1 FROM tether_queue_waiters WHERE queue = q);
END;
$$;
