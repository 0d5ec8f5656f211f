"""A PgBouncer of the tests' own, in front of their PostgreSQL (embedded or external).

Debian's ``pgbouncer`` (scripts/test installs it as root), started in the foreground with a
config, a log and a Unix socket folder of its own in a fresh folder under /tmp, listening on
127.0.0.1 at a port the OS picked, and stopped by its pid. Every database of the server is
reachable through it under its own name (``* =`` in [databases]).

PgBouncer refuses to run as root: as root it runs as the owner of the server's socket folder
(the embedded server's user, whose 0700 data folder holds its socket) or, for a server on
TCP, as ``nobody``.

Settings (docs/pgbouncer.md lists them as the ones tether is tested with):

- ``pool_mode``: ``transaction`` (or ``session`` for the session-mode test);
- ``max_client_conn = 500``: a test process's clients at their most (a few workers with
  their children and pools, a producer's pool, the dashboard) stay well under it, and its
  descriptors stay under the default soft limit of 1024 (PgBouncer needs one per client
  and one per server connection);
- ``default_pool_size = 20``: server connections per database and user. Fewer than the
  clients of a test with several workers, so transactions of different clients do share
  server sessions (what breaks session state), and well under max_connections (200 on the
  embedded server, 100 on an external one shared by two test processes);
- ``idle_transaction_timeout = 30``: PgBouncer's stand-in for the
  ``idle_in_transaction_session_timeout`` a worker sets on direct connections (a pooler
  refuses that startup option), so a frozen client cannot hold a server session's locks;
- no ``ignore_startup_parameters``: a startup option tether must not send through a pooler
  fails the connection, as it would in production;
- ``server_login_retry = 1``: after a failed server login, try again within a second, not 15.
- ``server_idle_timeout = 5``: a server connection idle for 5 s is closed (PgBouncer's default
  keeps them 10 minutes). A test process's PgBouncers live as long as the process, and their
  idle server connections counted against the shared server's max_connections for the rest
  of its tests: CI's external run met "too many clients already" in the soak test.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

PoolMode = Literal["transaction", "session"]

MAX_CLIENT_CONN = 500
DEFAULT_POOL_SIZE = 20
IDLE_TRANSACTION_TIMEOUT_S = 30
SERVER_IDLE_TIMEOUT_S = 5  # see the module's docstring

_ROOT = os.geteuid() == 0


def binary() -> str:
    """The pgbouncer program, or an error that says how to install it."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError(
            "pgbouncer is not installed: the PgBouncer tests run a real one. As root, scripts/test "
            "installs it (apt-get install pgbouncer); otherwise run 'sudo apt-get install pgbouncer'"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as(host: str) -> tuple[int, int] | None:
    """(uid, gid) PgBouncer runs as: None (ourselves) unless we are root."""
    if not _ROOT:
        return None
    if host.startswith("/"):
        folder = Path(host).stat()
        return folder.st_uid, folder.st_gid
    nobody = pwd.getpwnam("nobody")
    return nobody.pw_uid, nobody.pw_gid


@dataclass
class PgBouncer:
    """One running pgbouncer process in front of one PostgreSQL server."""

    pool_mode: PoolMode
    port: int
    user: str
    folder: Path
    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, server_url: str, pool_mode: PoolMode = "transaction") -> PgBouncer:
        """Start one in front of the server ``server_url`` names; ready when this returns."""
        server: dict[str, Any] = conninfo_to_dict(server_url)
        host = str(server.get("host") or "/var/run/postgresql")
        user = str(server.get("user") or pwd.getpwuid(os.geteuid()).pw_name)
        owner = _run_as(host)
        folder = Path(tempfile.mkdtemp(prefix=f"tether-pgbouncer-{pool_mode}-", dir="/tmp"))
        folder.chmod(0o755)
        (folder / "users.txt").write_text(f'"{user}" "{server.get("password") or ""}"\n')
        if owner is not None:
            for path in (folder, folder / "users.txt"):
                os.chown(path, *owner)
        problem = ""
        for attempt in range(5):  # another process may take the free port first: pick another
            port = _free_port()
            ini = folder / "pgbouncer.ini"
            ini.write_text(
                "[databases]\n"
                f"* = host={host} port={server.get('port') or 5432}\n"
                "[pgbouncer]\n"
                "listen_addr = 127.0.0.1\n"
                f"listen_port = {port}\n"
                f"unix_socket_dir = {folder}\n"
                "auth_type = trust\n"
                f"auth_file = {folder / 'users.txt'}\n"
                f"admin_users = {user}\n"
                f"pool_mode = {pool_mode}\n"
                f"max_client_conn = {MAX_CLIENT_CONN}\n"
                f"default_pool_size = {DEFAULT_POOL_SIZE}\n"
                f"idle_transaction_timeout = {IDLE_TRANSACTION_TIMEOUT_S}\n"
                "server_login_retry = 1\n"
                f"server_idle_timeout = {SERVER_IDLE_TIMEOUT_S}\n"
                f"logfile = {folder / 'pgbouncer.log'}\n"
            )
            log = folder / "pgbouncer.log"
            with contextlib.suppress(FileNotFoundError):
                log.unlink()
            process = subprocess.Popen(
                [binary(), str(ini)],
                cwd=folder,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                user=owner[0] if owner else None,
                group=owner[1] if owner else None,
                extra_groups=[] if owner else None,
            )
            bouncer = cls(pool_mode, port, user, folder, process)
            if bouncer._wait_listening():
                return bouncer
            problem = bouncer.log_tail()
            bouncer.stop(remove=False)
            # Taken ports are the usual cause; anything else gets one more try (a start that
            # did not listen in time under the parallel phase's load) before it fails the run.
            if "Address already in use" not in problem and attempt >= 1:
                break
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"pgbouncer did not start:\n{problem}")

    def _wait_listening(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return True
            time.sleep(0.02)
        return False

    def url(self, database: str) -> str:
        """The URL of ``database`` through this PgBouncer."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (POOLS, CLIENTS, SERVERS, CONFIG...).

        The console speaks the simple query protocol only: a ClientCursor sends it that way.
        """
        with psycopg.connect(
            self.url("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor, row_factory=dict_row
        ) as conn:
            return conn.execute(f"SHOW {what}").fetchall()  # type: ignore[arg-type]  # SHOW takes no parameter

    def log_tail(self, lines: int = 30) -> str:
        path = self.folder / "pgbouncer.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"
        )

    def stop(self, *, remove: bool = True) -> None:
        """SIGTERM to its pid (PgBouncer's immediate shutdown), SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
