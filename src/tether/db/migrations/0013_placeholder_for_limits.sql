-- PLACEHOLDER on branch wip-metrics only: migration 13 belongs to wip-limits (flow control).
-- Files must be numbered without gaps, so this empty one lets 14 apply here. The merger
-- replaces it with wip-limits' real 0013 and never ships this file.
SELECT 1;
