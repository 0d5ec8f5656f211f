# Sourced by scripts/test and .ci/run: the failover tests (tests/chaos/test_failover.py) build a
# primary and a synchronous standby of their own from Debian's PostgreSQL (initdb, pg_ctl and
# pg_basebackup in /usr/lib/postgresql/<version>/bin; tests/ha_pair.py), and are never
# skipped, so those programs must be there. As root (CI, containers) a missing server package
# is installed with apt-get, without the "main" cluster Debian would otherwise create and
# start on port 5432 (the tests start their own servers, on ports the OS picks); anyone else
# is told how to install it.
if ! ls /usr/lib/postgresql/*/bin/pg_basebackup >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing postgresql (apt-get) for the failover tests"
        mkdir -p /etc/postgresql-common
        if [ ! -e /etc/postgresql-common/createcluster.conf ]; then
            echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.conf
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "error: the failover tests need Debian's PostgreSQL server programs." >&2
        echo "Install them with 'sudo apt-get install postgresql' (Debian, Ubuntu). The failover" >&2
        echo "tests are never skipped." >&2
        exit 1
    fi
fi
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    echo "error: the failover tests run their servers as the 'postgres' user as root; it is missing" >&2
    exit 1
fi
