-- PLACEHOLDER on branch wip-limits only: migration 12 belongs to wip-storage (claim marks,
-- retention batches). Files must be numbered without gaps, so this empty one lets 13 apply
-- here. The merger replaces it with storage's real 0012 and never ships this file.
SELECT 1;
