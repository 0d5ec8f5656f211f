"""Test infrastructure: one fresh database per test process, real worker processes, cleanup by pid.

The server is the local/external one named by TETHER_TEST_DATABASE_URL when set,
otherwise a private embedded PostgreSQL started for this process in a temporary
folder and stopped (by its pid) at the end. Either way the process creates its own
database and drops it afterwards, so runs never share state. Under pytest-xdist each
worker is such a process: its own embedded server (tests that restart, stop or count
the sessions of a server never see another worker's), or its own database on the
external server. What a server shares between its databases (roles, server-wide
statistics, pg_locks and pg_stat_activity rows of every database) a test must filter
to its own database, name uniquely, or leave to the serial phase (the `timing` marker).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.apps.support import machinery_url

# The worker harness lives in tests/harness.py (the benchmarks use it too); tests import
# these names from here.
from tests.harness import REPO as REPO
from tests.harness import WorkerProcess as WorkerProcess
from tests.pgbouncer import PgBouncer, PoolMode

# A run started as a background job of a shell without job control (`nohup ... &`, `cmd &` in a
# script, some CI runners) inherits SIGINT ignored, and so would every process a test starts:
# Python keeps an inherited SIG_IGN for SIGINT, so a worker or `tether dashboard` sent SIGINT by
# a test would never see it. Tests send SIGINT as Ctrl-C would: processes they start get the
# default disposition back (an ignored signal is inherited across exec, a handler is not).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# -- how a run is split (scripts/test; README, "Two commands") ----------------------------------
#
# scripts/test runs the suite in two phases with the same arguments: `--phase parallel` runs
# every test not marked `timing` under pytest-xdist (each xdist worker is its own pytest
# process: its own embedded server, or its own database on an external one, see server_url),
# then `--phase serial` runs the `timing` tests alone, in one process, on a quiet machine.
# `--subset smoke` (the 3.12 run of .ci/run) and `--subset server` (the external-server run)
# keep a part of the suite; the rules are SMOKE_PATHS and SERVER_PATHS below.

#: Folders whose every test is in the smoke set: what differs between Python versions (the
#: unit tests, the seed documents' examples, the Django adapter). Tests elsewhere join it with
#: @pytest.mark.smoke. A folder not there yet (tests/seeds before it lands) matches nothing.
SMOKE_PATHS = ("unit", "seeds", "django")
#: Folders of the tests that run against the external server too, less those marked
#: server_agnostic: the tests whose outcome depends on PostgreSQL's version or configuration.
SERVER_PATHS = ("integration", "chaos")
#: Folders of the tests that the PgBouncer run (--subset pgbouncer, TETHER_TEST_PGBOUNCER=1)
#: runs through PgBouncer, less those marked direct_only.
PGBOUNCER_PATHS = ("integration",)
TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tether", "tether's test run (scripts/test)")
    group.addoption(
        "--phase",
        choices=("all", "parallel", "serial"),
        default="all",
        help="parallel: the tests not marked timing; serial: only those; all (default): every test",
    )
    group.addoption(
        "--subset",
        choices=("all", "smoke", "server", "pgbouncer"),
        default="all",
        help="smoke: the smoke set (SMOKE_PATHS and @pytest.mark.smoke); server: the tests of "
        "SERVER_PATHS not marked server_agnostic; pgbouncer: the tests of PGBOUNCER_PATHS not "
        "marked direct_only; all (default): every test",
    )


def _under(item: pytest.Item, folders: tuple[str, ...]) -> bool:
    try:
        relative = item.path.relative_to(TESTS)
    except ValueError:
        return False
    return relative.parts[0] in folders


def _kept(item: pytest.Item, phase: str, subset: str) -> bool:
    timing = item.get_closest_marker("timing") is not None
    if (phase == "parallel" and timing) or (phase == "serial" and not timing):
        return False
    if subset == "smoke":
        return _under(item, SMOKE_PATHS) or item.get_closest_marker("smoke") is not None
    if subset == "server":
        return _under(item, SERVER_PATHS) and item.get_closest_marker("server_agnostic") is None
    if subset == "pgbouncer":
        return _under(item, PGBOUNCER_PATHS) and item.get_closest_marker("direct_only") is None
    return True


def _check_direct_only_reasons(items: list[pytest.Item]) -> None:
    """Every direct_only test says why it cannot go through a pooler: the list stays justified."""
    for item in items:
        marker = item.get_closest_marker("direct_only")
        if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0]):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.direct_only needs its reason")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_direct_only_reasons(items)
    phase, subset = config.getoption("--phase"), config.getoption("--subset")
    if phase == "parallel":
        _longest_modules_first(config, items)
    if phase == "all" and subset == "all":
        return
    kept, dropped = [], []
    for item in items:
        (kept if _kept(item, phase, subset) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


# -- the parallel phase's order: the longest modules first ---------------------------------------
#
# xdist (--dist loadfile) hands out modules in the order they were collected, so a long module
# collected last (test_workflow_scale) would run alone at the end while the other processes
# idle. Each run records every test's seconds in pytest's cache (.pytest_cache); the parallel
# phase then starts with the modules that took longest, and short ones fill in at the end. In a
# fresh clone the first parallel phase keeps the collected order and fills the cache for the
# next ones (.ci/run: 3.11's embedded run orders the external, 3.13 and 3.12 runs). The order
# changes which process runs a module and when, never what runs.

SECONDS_KEY = "tether/test_seconds"
_SECONDS_INPUT = "tether_test_seconds"  # the controller's reading, as handed to the xdist workers
_seconds_this_run: dict[str, float] = {}


def _known_seconds(config: pytest.Config) -> dict[str, float]:
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:  # an xdist worker: what the controller read (one order for all)
        known: dict[str, float] = worker_input.get(_SECONDS_INPUT, {})
        return known
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    return dict(cache.get(SECONDS_KEY, {})) if cache is not None else {}


def _longest_modules_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = _known_seconds(config)
    if not known:
        return
    unknown = sum(known.values()) / len(known)  # a new test: as long as an average one
    module_seconds: dict[Path, float] = {}
    for item in items:
        module_seconds[item.path] = module_seconds.get(item.path, 0.0) + known.get(item.nodeid, unknown)
    items.sort(key=lambda item: -module_seconds[item.path])  # stable: a module's own order stays


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, in the controller: every worker gets the same reading, so all collect one order."""
    node.workerinput[_SECONDS_INPUT] = _known_seconds(node.config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # In the controller too: xdist hands it every worker's reports.
    _seconds_this_run[report.nodeid] = _seconds_this_run.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = getattr(session.config, "cache", None)
    if cache is None or hasattr(session.config, "workerinput") or not _seconds_this_run:
        return
    known = _known_seconds(session.config)
    known.update({nodeid: round(seconds, 3) for nodeid, seconds in _seconds_this_run.items()})
    cache.set(SECONDS_KEY, known)


# tests/django runs tether.contrib.django against Django 6, which needs Python >= 3.12:
# on 3.11 Django 6 cannot be installed (the test extra leaves it out there), so those
# tests are not collected at all; on 3.12 and newer they all run, none skipped.
collect_ignore = ["django"] if sys.version_info < (3, 12) else []


def _process_name() -> str:
    """This test process in names of folders and databases: its xdist worker id, or "main"."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _server_url() -> Iterator[str]:
    external = os.environ.get("TETHER_TEST_DATABASE_URL")
    if external:
        yield external
        return
    from tether.db.embedded import EmbeddedServer

    base = Path(tempfile.mkdtemp(prefix=f"tether-test-pg-{_process_name()}-", dir="/tmp"))
    base.chmod(0o755)  # the embedded server may run as its own system user
    server = EmbeddedServer.start(base / "data")
    try:
        yield server.url("postgres")
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    yield from _server_url()


# -- through PgBouncer (tests/pgbouncer.py, docs/pgbouncer.md) --------------------------------
#
# TETHER_TEST_PGBOUNCER=1 (scripts/test's PgBouncer phase) routes tether in every test through
# a PgBouncer in transaction mode that this process starts in front of its server: the
# `database_url` fixture (and so TETHER_DATABASE_URL, which producers, workers and the
# dashboard read) is the database's URL through PgBouncer, with TETHER_POOLER=transaction and
# TETHER_LISTEN_URL the direct URL. The tests' own looks at the database (the `db` fixture,
# the worker harness's) go directly (`direct_url`). Tests that cannot work through a pooler by
# nature are marked `direct_only` with the reason, and left out of that run.

PGBOUNCER_RUN = os.environ.get("TETHER_TEST_PGBOUNCER") == "1"


class PgBouncers:
    """This test process's PgBouncers, one per pool mode, each started on first use."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self._started: dict[str, PgBouncer] = {}

    def __getitem__(self, pool_mode: PoolMode) -> PgBouncer:
        if pool_mode not in self._started:
            self._started[pool_mode] = PgBouncer.start(self.server_url, pool_mode)
        return self._started[pool_mode]

    def stop(self) -> None:
        for bouncer in self._started.values():
            bouncer.stop()


@pytest.fixture(scope="session")
def pgbouncers(server_url: str) -> Iterator[PgBouncers]:
    started = PgBouncers(server_url)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def pgbouncer(pgbouncers: PgBouncers) -> PgBouncer:
    """A PgBouncer in transaction mode in front of this process's server."""
    return pgbouncers["transaction"]


def _with_dbname(server_url: str, name: str) -> str:
    """``server_url`` naming database ``name``, still a URL (PostgresConfig accepts only URLs)."""
    parts = urlsplit(server_url)
    if parts.scheme in ("postgresql", "postgres"):
        return urlunsplit(parts._replace(path="/" + name))
    params = conninfo_to_dict(server_url)
    params["dbname"] = name
    return make_conninfo(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def direct_url(server_url: str) -> Iterator[str]:
    """This process's test database, reached directly (never through PgBouncer)."""
    name = f"tether_test_{_process_name()}_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _with_dbname(server_url, name)
    from tether.db.migrate import migrate

    with psycopg.connect(url, autocommit=True) as conn:
        migrate(conn)
    try:
        yield url
    finally:
        _close_test_apps()
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def database_url(direct_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """The test database's URL as tether uses it (TETHER_DATABASE_URL): ``direct_url``, or in
    the PgBouncer run the same database through this process's PgBouncer in transaction mode."""
    # TETHER_TEST_DIRECT_URL: where the test apps' machinery connects (tests/apps/support.py).
    settings = {"TETHER_DATABASE_URL": direct_url, "TETHER_TEST_DIRECT_URL": direct_url}
    if PGBOUNCER_RUN:
        bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
        settings |= {
            "TETHER_DATABASE_URL": bouncer.url(urlsplit(direct_url).path.lstrip("/")),
            "TETHER_POOLER": "transaction",
            "TETHER_LISTEN_URL": direct_url,
        }
    old = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield settings["TETHER_DATABASE_URL"]
    finally:
        _close_test_apps()  # before their database goes, with the settings they were made with
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _close_test_apps() -> None:
    """Stop the test apps' pools and result listeners before their database is dropped.

    A result listener left running would try to reconnect to the dropped database and
    print its (correct) complaint after pytest's summary.
    """
    from tether import Tether

    for module_name, module in list(sys.modules.items()):
        app = getattr(module, "app", None)
        if module_name.startswith("tests.apps.") and isinstance(app, Tether):
            app.close()


@pytest.fixture
def db(database_url: str, direct_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A clean database: every tether table emptied before the test (a direct connection)."""
    from psycopg.rows import dict_row

    with psycopg.connect(direct_url, autocommit=True, row_factory=dict_row) as conn:
        clean_tables(conn)
        yield conn


@pytest.fixture
def basic(database_url: str, db: psycopg.Connection[Any]) -> ModuleType:
    """tests/apps/basic.py bound to this run's database, on clean tables with the ledger in place."""
    from tests.apps.support import ensure_ledger, load_app_module

    ensure_ledger(db)
    return load_app_module("basic", database_url)


def clean_tables(conn: psycopg.Connection[Any]) -> None:
    """Empty every tether table (and the tests' own ledger), keeping the schema."""
    rows = conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        " AND tablename LIKE 'tether%%' AND tablename <> 'tether_schema_version'"
    ).fetchall()
    tables = [r["tablename"] if isinstance(r, dict) else r[0] for r in rows]
    conn.execute(sql.SQL("TRUNCATE {} CASCADE").format(sql.SQL(", ").join(map(sql.Identifier, tables))))


class WorkerFactory:
    """Starts `tether worker` processes on the test database (tests/harness.py); kills them all at the end."""

    def __init__(self, database_url: str, tmp: Path, direct_url: str | None = None) -> None:
        self.database_url = database_url
        # Where the harness looks: directly, also when the workers go through PgBouncer.
        self.direct_url = direct_url or machinery_url(database_url)
        self.tmp = tmp
        self.started: list[WorkerProcess] = []

    def start(
        self,
        app_path: str = "tests.apps.basic:app",
        *args: str,
        wait: bool = True,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> WorkerProcess:
        """A worker of ``app_path``, or one started by ``command`` (a whole command line)."""
        worker = WorkerProcess(
            app_path,
            self.database_url,
            self.tmp / f"worker-{len(self.started)}.log",
            args=args,
            env={
                **os.environ,
                "TETHER_DATABASE_URL": self.database_url,
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            },
            log_level="INFO",
            command=command,
            check_url=self.direct_url,
        ).start()
        self.started.append(worker)
        if wait:
            worker.wait_registered()
        return worker

    def wait_registered(self, worker: WorkerProcess, timeout: float = 60) -> str:
        return worker.wait_registered(timeout)

    def cleanup(self) -> None:
        for worker in self.started:
            worker.kill()


@pytest.fixture
def workers(database_url: str, direct_url: str, tmp_path: Path) -> Iterator[WorkerFactory]:
    factory = WorkerFactory(database_url, tmp_path, direct_url)
    try:
        yield factory
    finally:
        factory.cleanup()


def wait_until(
    predicate: Any, timeout: float = 30, interval: float = 0.02, message: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy (database state has no push channel for tests)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
