-- tether schema, version 3: fewer index entries per task row.
-- Every send wrote five index entries; the two dropped here served only
-- monitoring (counts per queue and status, listing by name), which can afford a
-- scan, while every send and every transition paid for them in WAL.
DROP INDEX IF EXISTS tether_tasks_queue_status_idx;
DROP INDEX IF EXISTS tether_tasks_name_idx;
