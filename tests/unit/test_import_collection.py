"""The collector is off while a process imports its start-up's modules, and on again after
(tether.worker.heap): `tether worker` must never run its tasks with it off, even when its
start fails, and a program that turned it off itself keeps it off.

Each check runs in a new interpreter: a pause freezes what the process holds.
"""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_a_pause_covers_the_imports_and_what_they_made_is_frozen() -> None:
    code = (
        "import gc\n"
        "from tether.worker.heap import pause_collection, resume_collection\n"
        "pause_collection()\n"
        "off = not gc.isenabled()\n"
        "import tether.app\n"
        "resume_collection()\n"
        "print(off, gc.isenabled(), gc.get_freeze_count() > 10_000)\n"
    )
    assert _run(code) == "True True True"


def test_resume_leaves_a_collector_the_program_turned_off_itself_off() -> None:
    code = (
        "import gc\n"
        "from tether.worker.heap import pause_collection, resume_collection\n"
        "gc.disable()\n"
        # Not 0 at the start on every version: Python 3.12 starts with objects frozen of its own.
        "before = gc.get_freeze_count()\n"
        "pause_collection()\n"
        "resume_collection()\n"
        "print(gc.isenabled(), gc.get_freeze_count() == before)\n"
    )
    assert _run(code) == "False True"


def test_the_cli_resumes_collection_when_a_worker_cannot_load_its_app() -> None:
    code = (
        "import gc\n"
        "from click.testing import CliRunner\n"
        "from tether.cli import cli\n"
        "from tether.worker.heap import pause_collection\n"
        "pause_collection()  # as the entry point does (tether.__main__)\n"
        "result = CliRunner().invoke(cli, ['worker', 'no_such_module_here:app'])\n"
        "print(result.exit_code != 0, gc.isenabled())\n"
    )
    assert _run(code) == "True True"


def test_python_m_tether_runs_a_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tether", "worker", "--help"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "Run a worker for APP_PATH" in out
