-- PLACEHOLDER (branch wip-liveness25 only): keeps the numbering contiguous so that 0022
-- applies on this branch. Drop this file at merge; the lead renumbers 0022.
SELECT 1;
