"""The worker's first round trip, begun while the CLI imports the worker's modules.

A worker's start-up first resolves its database URL and checks the schema version
(``broker.url``: one connection, one read, closed again). ``tether worker`` begins that in a
thread as soon as the app is loaded, so the connect and the read wait on the server while the
main process imports tether.worker (about a hundred milliseconds of a cold start), instead of
after it. The thread is over before ``run_worker`` forks the fork server, which needs a
process with no other thread (tether.worker.start_method), and it leaves no connection open
that the fork would copy.

Only for a configured URL: the embedded server's start (no URL) stays where it was, inside
the start-up. A failure here is left for the start-up to meet again and report as it always
did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from tether.app import Tether


def begin_schema_check(app: Tether) -> Callable[[], None]:
    """Start ``app.broker.url`` in a thread; returns what waits for it to be over."""
    if not app.config.broker.database_url:
        return lambda: None

    def check() -> None:
        with contextlib.suppress(Exception):  # run() asks again, and reports it
            app.broker.url  # noqa: B018 (a property with side effects: the check)

    thread = threading.Thread(target=check, name="tether schema check", daemon=True)
    thread.start()
    return thread.join
