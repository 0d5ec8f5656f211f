"""The WorkerConfig a worker started from a command line runs with: its app's, with the
options given there. Shared by ``tether worker`` and Django's ``manage.py tether_worker``,
which must not import the CLI (click, rich) for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tether.app_view import AppView
from tether.config import WorkerConfig


def worker_config(app: AppView, overrides: Mapping[str, Any]) -> WorkerConfig:
    """The app's WorkerConfig with the options given on the command line (None: not given)."""
    base = app.config.worker.model_dump()
    base.update({k: v for k, v in overrides.items() if v is not None})
    return WorkerConfig(**base)
