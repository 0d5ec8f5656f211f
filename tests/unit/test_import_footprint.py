"""What importing tether costs a program that only sends: no worker, dashboard, CLI, rich,
Django or psutil (bench/README.md "Start-up" has the -X importtime figures).

Each check runs in a new interpreter, since this one has imported much of tether already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import tether

# What a producer never uses: the worker (and psutil, which only it and the embedded server
# need), the dashboard, the CLI with click and rich, Django, and the optional extras.
NOT_FOR_A_PRODUCER = (
    "tether.worker",
    "tether.web",
    "tether.cli",
    "tether.contrib",
    "tether.metrics.serve",
    "click",
    "rich",
    "django",
    "psutil",
    "opentelemetry",
    "prometheus_client",
    "multiprocessing",
    # tether.env_settings reads TETHER_* itself: pydantic-settings imported ~200 modules.
    "pydantic_settings",
    "dotenv",
)


def _imported_after(code: str) -> set[str]:
    """The modules a new interpreter holds after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def _under(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(f"{p}.") for p in packages))


def test_import_tether_alone_imports_none_of_tether_s_modules() -> None:
    """``import tether`` costs nothing: the public names are imported on first use."""
    modules = _imported_after("import tether")
    assert _under(modules, ("psycopg", "pydantic", "asyncio", *NOT_FOR_A_PRODUCER)) == []
    assert sorted(m for m in modules if m.startswith("tether.")) == []


def test_a_producer_does_not_import_what_only_workers_and_commands_use() -> None:
    """A producer's imports, an app made and a TaskResult built: none of the worker's modules."""
    code = (
        "from tether import AppConfig, PostgresConfig, RetryPolicy, TaskResult, Tether, current_task\n"
        "app = Tether(AppConfig(broker=PostgresConfig(database_url='postgresql://u@h/d')))\n"
        "@app.task('t')\n"
        "def t() -> TaskResult[int, str]:\n"
        "    return TaskResult(ok=1)\n"
    )
    assert _under(_imported_after(code), NOT_FOR_A_PRODUCER) == []


# The broker's statement groups that only a worker, a command or a by-hand call uses: the
# seed's manual-recovery doors import manual_recovery (with recovery, claims, retention and
# their row dataclasses) on first use, a retry imports retrying (retries, the workflow reopen).
NOT_FOR_A_SEND = (
    "tether.broker.manual_recovery",
    "tether.broker.recovery",
    "tether.broker.claims",
    "tether.broker.retention",
    "tether.outcomes",
    "tether.retrying",
    "tether.broker.retries",
    "tether.workflow.reopen",
    # The public row types (TaskInfo, QueueInfo, WorkflowInfo, ...): imported by the reads
    # that return them, and by tether.handle & co. when a program names one.
    "tether.broker.rows",
)

# What a worker's start never needs: the reads' row types, by-hand retries.
NOT_FOR_A_WORKER = (
    "tether.broker.rows",
    "tether.retrying",
    "tether.broker.retries",
    "tether.workflow.reopen",
)


def test_a_send_does_not_import_the_recovery_or_retry_statement_groups() -> None:
    """A producer's imports and a send (refused: no server on the port) build none of the
    row types of recovery and retries; a worker gets them when its services import them."""
    code = (
        "from tether import AppConfig, PostgresConfig, Tether\n"
        "app = Tether(AppConfig(broker=PostgresConfig(database_url='postgresql://u@127.0.0.1:1/d')))\n"
        "@app.task('t')\n"
        "def t(x: int) -> int:\n"
        "    return x\n"
        "try:\n"
        "    t.send(1)\n"
        "except tether.errors.DatabaseUnreachableError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('sent to a closed port')\n"
    )
    modules = _imported_after(f"import tether.errors\n{code}")
    assert _under(modules, ("tether.sending",)) != []  # the send's own modules were imported
    assert _under(modules, NOT_FOR_A_SEND) == []


def test_a_worker_s_imports_leave_out_the_reads_row_types() -> None:
    """The CLI worker's import path (the app loaded, the worker's modules) builds none of the
    row types only reads and by-hand retries return."""
    code = (
        "import tether.cli, tether.cli.workers, tether.worker.app_loader, tether.worker.main\n"
        "from tether import Tether\n"
        "app = Tether()\n"
        "@app.task('t')\n"
        "def t() -> None: ...\n"
    )
    modules = _imported_after(code)
    assert "tether.worker.main" in modules
    assert _under(modules, NOT_FOR_A_WORKER) == []


def test_the_row_types_are_importable_from_where_they_always_were() -> None:
    """tether.handle, tether.queue_control, tether.workflow.handle and broker.suspensions
    give the row types on first use, the same objects as tether's names."""
    code = (
        "import tether, tether.broker.suspensions as s, tether.handle as h, tether.queue_control as qc\n"
        "import tether.workflow.handle as wh\n"
        "from tether.handle import AttemptInfo, TaskInfo, TaskStepInfo, TaskSuspension\n"
        "same = [TaskInfo is tether.TaskInfo, AttemptInfo is tether.AttemptInfo,\n"
        "        TaskStepInfo is tether.TaskStepInfo, TaskSuspension is tether.TaskSuspension,\n"
        "        qc.QueueInfo is tether.QueueInfo, wh.StepInfo is tether.StepInfo,\n"
        "        wh.WorkflowInfo is tether.WorkflowInfo, s.SuspensionState is tether.TaskSuspension,\n"
        "        tether.TaskInfo.__module__ == 'tether.broker.rows', hasattr(h, 'NoSuchName')]\n"
        "print(same)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str([True] * 9 + [False])


def test_every_public_name_is_importable_from_tether() -> None:
    """Each name of ``tether.__all__`` resolves (lazily), to the object its module defines."""
    code = "import tether\nprint([n for n in tether.__all__ if getattr(tether, n, None) is None])"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"
    from tether import AppConfig, Tether, current_task
    from tether.app import Tether as AppTether
    from tether.config import AppConfig as ConfigAppConfig
    from tether.current import current_task as current

    assert (Tether, AppConfig, current_task) == (AppTether, ConfigAppConfig, current)
    # A submodule as an attribute after a bare import, as when the package imported them all.
    code = "import tether\nprint(tether.config.AppConfig.__name__, hasattr(tether, 'no_such_name'))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["AppConfig", "False"]
    assert set(dir(tether)) >= set(tether.__all__)
