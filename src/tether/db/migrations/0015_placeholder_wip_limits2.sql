-- PLACEHOLDER of branch wip-limits2, NOT to be merged: migration numbers must run 1..n
-- without gaps, 0015 belongs to another branch and this branch was given 0016. Drop this
-- file when merging (the real 0015 takes its place). It changes nothing.
SELECT 1;
