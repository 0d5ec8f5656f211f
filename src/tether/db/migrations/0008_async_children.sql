-- tether schema, version 8: async children (docs/workers.md#the-executor-model).
--
-- A worker now runs two kinds of child: `processes` counts its sync children (one
-- task at a time each), `async_processes` its async children, each running up to
-- `async_concurrency` async tasks at once. Rows of older workers read 0 and NULL.
ALTER TABLE tether_workers
    ADD COLUMN async_processes integer NOT NULL DEFAULT 0,
    ADD COLUMN async_concurrency integer;
