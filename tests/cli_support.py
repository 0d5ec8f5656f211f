"""Running the `tether` command from tests: in-process (click's runner) or as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from click.testing import CliRunner, Result

import tether.cli
from tests.conftest import REPO


def run(database_url: str, *args: str) -> Result:
    result = CliRunner().invoke(tether.cli.cli, [*args, "--database-url", database_url])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def run_json(database_url: str, *args: str) -> Any:
    return json.loads(run(database_url, *args, "--json").stdout)


def tether_command(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real entry point in a process of its own, as a user runs it (errors included)."""
    return subprocess.run(
        [sys.executable, "-m", "tether", *args, "--database-url", database_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
