-- PLACEHOLDER on branch wip-fleet only, so that migration 13 can run here (versions must
-- have no gaps). DROP THIS FILE AT MERGE: the real migration 0011 comes from its own branch.
SELECT 1;
