"""How the worker starts its child processes: from a fork server (the default) or by spawn.

A spawned child is a new interpreter that imports tether and the app again: about half a
second on a small machine, paid by every child at start-up and by every replacement after a
crash, a time limit or a hang. With a fork server, each child is forked from a process that
has imported both already, and is ready in milliseconds.

The fork server is multiprocessing's ``forkserver`` (its protocol, fd passing and exit
statuses), made one of two ways:

- forked from the worker's main process before that process starts its event loop, its
  threads or any connection (``run_worker`` does it right after loading the app): it is a
  clean copy that has tether and the app imported, at the cost of one fork;
- or, when the main process is no longer clean (a thread runs: an app that starts one at
  import, an embedding program, a running event loop), started the standard way: a new
  interpreter that imports tether and the app itself (tether.worker.fork_server_preload),
  a few hundred milliseconds during which the main process connects and registers.

The main process itself is never forked for a child: it holds an event loop, threads and
open sockets that a child must not inherit.

``spawn`` stays available (TETHER_WORKER_START_METHOD=spawn) for an app that must not be
forked at all (one that opens connections or starts threads at import).
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any, Literal

from tether.worker.heap import freeze_start_up

StartMethod = Literal["forkserver", "spawn"]
ChildContext = ForkServerContext | SpawnContext

# The app path the fork server's preload imports (it reads no argument but its module names).
APP_PATH_ENV = "TETHER_FORK_SERVER_APP"
PRELOAD_MODULE = "tether.worker.fork_server_preload"
# multiprocessing.forkserver.main's parameters in the Python versions this forks the server
# for (3.11 to 3.13); another signature: the standard start.
_SERVER_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def child_context(method: StartMethod, app_path: str) -> ChildContext:
    """The multiprocessing context children are made with; for ``forkserver``, its server is
    started now, forked from this process if it is still clean, so that it is ready by the
    first child."""
    if method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # For a server started the standard way: now, or later by multiprocessing if the forked
    # one dies (its children die with it; the worker records them and makes new ones).
    os.environ[APP_PATH_ENV] = app_path  # read by the server's preload, which it inherits
    context.set_forkserver_preload([PRELOAD_MODULE])
    if not _fork_the_server():
        multiprocessing.forkserver.ensure_running()
    return context


def _clean() -> bool:
    """No other thread and no running event loop: what a fork copies is whole."""
    if threading.active_count() > 1:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


def _fork_the_server() -> bool:
    """Fork this process into the fork server and register it as multiprocessing's, as
    ``ensure_running`` would have after starting one. False (nothing done): not possible here."""
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    serve = getattr(multiprocessing.forkserver, "main", None)
    if server is None or serve is None or getattr(server, "_forkserver_pid", 0) is not None:
        return False  # another Python's internals, or a server already runs
    if list(inspect.signature(serve).parameters) != _SERVER_MAIN_PARAMETERS or not _clean():
        return False
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(address)
        if not multiprocessing.util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the server: it never returns from here
            code = 0
            try:
                os.close(alive_w)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as fork_server_preload says why
                freeze_start_up()  # as fork_server_preload does
                serve(listener.fileno(), alive_r, [], None, None)
            except SystemExit:  # its way out once the main process is gone
                pass
            except BaseException:
                code = 1
            finally:
                os._exit(code)  # never the main process's exit handlers
        os.close(alive_r)
    finally:
        listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def leave_fork_server() -> None:
    """In a child the fork server made: let go of the server's "alive" pipe.

    multiprocessing hands every process the server forks the write end of the pipe whose
    closing tells the server that its clients are gone, so the server outlives the worker's
    main process for as long as any child lives. A child must not keep it alive: the server's
    exit is what kills the children when the main process dies (their parent-death signal,
    tether.worker.child.ParentGuard). Without this, a child whose main process was killed ran
    its task to the end, unsupervised. (multiprocessing's private names, the same in Python
    3.11 to 3.13; a test kills a main process and checks its child dies.)
    """
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None or getattr(server, "_forkserver_pid", None) is not None:
        return  # spawned, or the main process itself (the server's client, which must keep it)
    os.close(fd)
    server._forkserver_alive_fd = None
    # Task code that starts processes with a fork server then starts its own, not this one.
    server._forkserver_address = None
