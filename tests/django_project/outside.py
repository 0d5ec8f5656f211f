"""A Django task outside every installed app: no tether worker may import this module.

Importing it leaves a mark (a file named by TETHER_TEST_IMPORT_MARK), so a test can tell
that a worker handed a row naming this task did not import it.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.tasks import task

_mark = os.environ.get("TETHER_TEST_IMPORT_MARK")
if _mark:
    Path(_mark).write_text(f"imported by pid {os.getpid()}\n")


@task
def outside_task() -> str:
    return "should never run"
