"""tether.contrib.django on every supported Python: before 3.12 (where Django 6 cannot be
installed) its import fails at once, saying what it needs; from 3.12 on it gives the backend."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_importing_the_django_integration() -> None:
    if sys.version_info < (3, 12):
        with pytest.raises(
            ImportError, match=r"needs Django >= 6\.0 \(django\.tasks\), which needs Python >= 3\.12"
        ):
            importlib.import_module("tether.contrib.django")
    else:
        module = importlib.import_module("tether.contrib.django")  # the test extra installs Django 6 here
        backend = module.TetherBackend
        assert (backend.supports_defer, backend.supports_async_task) == (True, True)
        assert (backend.supports_get_result, backend.supports_priority) == (True, True)


def test_the_django_worker_command_does_not_import_the_cli() -> None:
    """``manage.py tether_worker`` builds its WorkerConfig as ``tether worker`` does
    (tether.worker_options), without importing the CLI (click, rich, every command)."""
    from tests.unit.test_import_cycles import _graph

    graph = _graph()
    command = "tether.contrib.django.management.commands.tether_worker"
    assert "tether.worker_options" in graph[command]
    reached: set[str] = set()
    todo = [command]
    while todo:  # everything it imports, directly or not, at import time or inside functions
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert sorted(m for m in reached if m == "tether.cli" or m.startswith("tether.cli.")) == []
