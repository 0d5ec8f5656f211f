-- Which workers wait for new work, per queue (see migration 0005). A send
-- due now NOTIFYs only when tether_work_is_awaited(queue) says someone waits.

-- name: lock_queues_for_waiting
-- First statement of a registration's transaction: one exclusive advisory lock
-- per queue, in a fixed order (no deadlock between two registering workers).
-- It waits for sends in flight on these queues to commit, and holds back new
-- ones until the registration is committed.
SELECT count(pg_advisory_xact_lock(k))
FROM (SELECT hashtextextended('tether_queue_waiters:' || q, 0) AS k
      FROM unnest(%(queues)s::text[]) AS q ORDER BY 1) AS keys;

-- name: register_waiting
-- for_slots (migration 22): the limited queues whose last claim a slot limit held back; a
-- limited task's end notifies only workers waiting for a slot of its queue.
INSERT INTO tether_queue_waiters (queue, worker_id, for_slots)
SELECT q, %(worker_id)s, q = ANY(%(slot_queues)s::text[]) FROM unnest(%(queues)s::text[]) AS q
ON CONFLICT (queue, worker_id) DO UPDATE SET for_slots = EXCLUDED.for_slots;

-- name: stop_waiting_for_slots
-- No lock needed: fewer notifications can only leave this worker to claim when its own
-- children free, which it does anyway.
UPDATE tether_queue_waiters SET for_slots = false WHERE worker_id = %(worker_id)s AND for_slots;

-- name: unregister_waiting
DELETE FROM tether_queue_waiters WHERE worker_id = %(worker_id)s;
