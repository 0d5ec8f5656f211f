# Sourced by scripts/test and .ci/run: the PgBouncer tests (tests/integration/test_pgbouncer.py,
# and the TETHER_TEST_PGBOUNCER=1 phase) start Debian's pgbouncer in front of the test server,
# and are never skipped, so the program must be there. As root (CI, containers) a missing one
# is installed with apt-get; anyone else is told how to install it. The tests find it on PATH
# or in /usr/sbin (where Debian puts it).
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing pgbouncer (apt-get) for the PgBouncer tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
    else
        echo "error: the PgBouncer tests need pgbouncer (Debian's package)." >&2
        echo "Install it with 'sudo apt-get install pgbouncer' (Debian, Ubuntu). The PgBouncer" >&2
        echo "tests are never skipped." >&2
        exit 1
    fi
fi
pgbouncer_bin=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)
"$pgbouncer_bin" --version >/dev/null 2>&1 || { echo "error: $pgbouncer_bin --version failed" >&2; exit 1; }
# Where Debian's package starts a system pgbouncer (systemd, port 6432, /etc/pgbouncer), the
# tests leave it alone: they start their own, on a free port.
