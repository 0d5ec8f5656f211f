"""Database access: connections, schema migrations and the embedded PostgreSQL server."""
