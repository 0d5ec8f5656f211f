-- Which database a connection is on, and whether tether's tables are there: a send
-- inside the caller's transaction (docs/transactions.md) compares the caller's
-- connection with the app's own before its first statement on it. Nothing here can
-- fail, so asking never aborts the caller's transaction.
--
-- The server is told apart by pg_control_system()'s system_identifier (unique per
-- cluster, the same on every address it listens on), the database by its oid, and
-- tether's tables by the oid that 'tether_tasks' resolves to through the
-- connection's own search_path (NULL when the caller cannot see them).

-- name: database_identity
SELECT (SELECT system_identifier FROM pg_control_system()) AS system_identifier,
       (SELECT oid FROM pg_database WHERE datname = current_database()) AS database_oid,
       to_regclass('tether_tasks')::oid AS tasks_table,
       current_database() AS database,
       coalesce(host(inet_server_addr()) || ':' || inet_server_port(), 'a local socket') AS address,
       current_setting('search_path') AS search_path;
