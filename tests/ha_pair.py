"""A primary and a synchronous standby of the tests' own, built from Debian's PostgreSQL.

``initdb``, ``pg_ctl`` and ``pg_basebackup`` of the newest /usr/lib/postgresql/<version>/bin
(scripts/_ha.sh installs the ``postgresql`` package as root), in a fresh folder under /tmp,
on loopback ports the OS picked, with their Unix sockets in that folder too. The standby is
made by ``pg_basebackup -R`` from the running primary and streams from it; the primary then
waits for it on every commit (``synchronous_standby_names = '*'``, ``synchronous_commit =
on``): what a ``send()`` acknowledged is on both. ``HaPair(synchronous=False)`` leaves the
standby asynchronous, PostgreSQL's default: the last commits before a failover can be lost.
Both are stopped by their postmaster's pid and the folder removed at the end, whatever
happened.

initdb refuses to run as root: as root both servers run as the ``postgres`` system user
(``runuser``), which owns the folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

_ROOT = os.geteuid() == 0
SERVER_USER = "postgres"


def bindir() -> Path:
    """The newest Debian PostgreSQL's programs, or an error that says how to install them."""
    found = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "pg_basebackup").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not found:
        raise RuntimeError(
            "Debian's PostgreSQL is not installed: the failover tests build a primary and a standby "
            "from it. As root, scripts/test installs it (apt-get install postgresql); otherwise run "
            "'sudo apt-get install postgresql'"
        )
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One PostgreSQL server of the pair: its data folder, port and postmaster."""

    def __init__(self, pair: HaPair, name: str) -> None:
        self.pair = pair
        self.name = name
        self.data = pair.base / name
        self.port = _free_port()

    @property
    def pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(pidfile.read_text().splitlines()[0])
        return None

    def configure(self, extra: str = "") -> None:
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.pair.base}'\nmax_connections = 100\n"
                "wal_level = replica\nmax_wal_senders = 5\nhot_standby = on\n"
                "wal_keep_size = '256MB'\nlogging_collector = off\n" + extra
            )

    def start(self) -> None:
        self.pair.run("pg_ctl", "-D", str(self.data), "-l", str(self.pair.base / f"{self.name}.log"),
                      "-w", "-t", "60", "start")  # fmt: skip

    def stop_immediately(self) -> None:
        """``pg_ctl stop -m immediate``: the postmaster and every backend die at once."""
        self.pair.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def promote(self) -> None:
        self.pair.run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def kill(self) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"


class HaPair:
    """A primary streaming to a standby, synchronous unless ``synchronous=False``; ``close()``
    stops both and removes them."""

    def __init__(self, *, synchronous: bool = True) -> None:
        self.synchronous = synchronous
        self.bin = bindir()
        self.base = Path(tempfile.mkdtemp(prefix="tether-ha-", dir="/tmp"))
        if _ROOT:
            shutil.chown(self.base, SERVER_USER, SERVER_USER)
        self.primary = Server(self, "primary")
        self.standby = Server(self, "standby")

    def run(self, program: str, *args: str) -> None:
        command = [str(self.bin / program), *args]
        if _ROOT:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.base)
        if done.returncode != 0:
            raise RuntimeError(f"{program} {' '.join(args)} failed: {done.stdout}{done.stderr}")

    def start(self) -> HaPair:
        self.run("initdb", "-D", str(self.primary.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                 "--no-instructions")  # fmt: skip
        self.primary.configure()
        self.primary.start()
        self.run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
                 "-D", str(self.standby.data), "-R", "-X", "stream", "-c", "fast")  # fmt: skip
        self.standby.configure()
        self.standby.start()
        wanted = "sync" if self.synchronous else "async"
        with psycopg.connect(self.primary.url("postgres"), autocommit=True) as conn:
            if self.synchronous:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 60
            while True:  # until the standby streams (and, synchronous, every commit waits for it)
                row = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
                if row is not None and row[0] == wanted:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby never became synchronous ({row})")
                time.sleep(0.05)
        return self

    def multi_host_url(self, dbname: str, **params: str) -> str:
        """Both servers, primary first, as a failover-ready client names them."""
        query = "&".join(f"{k}={v}" for k, v in {"target_session_attrs": "read-write", **params}.items())
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
            f"/{dbname}?{query}"
        )

    def close(self) -> None:
        for server in (self.primary, self.standby):
            with contextlib.suppress(Exception):
                if server.pid is not None:
                    server.stop_immediately()
            server.kill()  # if pg_ctl could not stop it
        shutil.rmtree(self.base, ignore_errors=True)
