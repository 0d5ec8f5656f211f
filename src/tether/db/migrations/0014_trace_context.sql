-- tether schema, version 14: the W3C trace context a task was sent with (docs/monitoring.md#tracing).
--
-- With tracing enabled (AppConfig.tracing, the tether[otel] extra), a send stores the
-- traceparent of its PRODUCER span (and the tracestate, if any, after a newline); the
-- worker's child reads it with the claim and parents the CONSUMER span of each run on it,
-- so every attempt of the task, retries after crashes included, lands in the sender's trace.
-- A column of its own, not a key in a JSON column: it is read by the claim as plain text,
-- and NULL (tracing off) costs a bit of the null bitmap. Adding a nullable column without a
-- default changes only the catalog: no rewrite of the table.
ALTER TABLE tether_tasks ADD COLUMN trace_context text;
-- A workflow's, from the call that started it: its steps' tasks are sent with it.
ALTER TABLE tether_workflows ADD COLUMN trace_context text;
