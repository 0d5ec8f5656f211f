"""Imported by the worker's fork server only (tether.worker.start_method), never elsewhere:
importing it is what readies the server, so the work is done at import.

- SIGTERM is ignored. A service manager's stop (systemd signals the whole control group)
  reaches the server too, and its death would kill every child (their parent-death signal,
  tether.worker.child.ParentGuard) in the middle of the grace period the main process is
  giving their tasks. The server still ends with the main process: it exits when its pipe
  from the main process closes. SIGINT is ignored by multiprocessing itself.
- The children's modules and the app are imported, so a forked child has them already.
  An app that fails to import here is left alone: each child imports it again and reports
  the error as a spawned child would.
"""

from __future__ import annotations

import contextlib
import os
import signal

from tether.worker.heap import pause_collection, resume_collection

pause_collection()  # no collection pass while the children's modules are imported (heap.py)

from tether.worker import async_child, child  # noqa: E402, F401 - imported for the children
from tether.worker.app_loader import load_app  # noqa: E402
from tether.worker.start_method import APP_PATH_ENV  # noqa: E402

signal.signal(signal.SIGTERM, signal.SIG_IGN)

_app_path = os.environ.get(APP_PATH_ENV)
if _app_path:
    with contextlib.suppress(Exception):
        load_app(_app_path)
# What the children inherit is frozen, out of their collections (heap.py), and collection resumes.
resume_collection()
