"""``python manage.py tether_worker``: a tether worker for this project's Django tasks.

The same options as ``tether worker`` (docs/workers.md), plus ``--backend`` (the TASKS
alias whose TetherBackend to serve). Needs ``tether.contrib.django`` in INSTALLED_APPS.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.management.base import BaseCommand
from django.tasks import DEFAULT_TASK_BACKEND_ALIAS

from tether.config import LOG_FORMATS
from tether.contrib.django.worker import prepare
from tether.log_setup import setup_logging
from tether.worker.app_loader import load_app
from tether.worker.main import run_worker
from tether.worker_options import worker_config


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints
    help = "Run a tether worker for this project's Django tasks (tether.contrib.django.TetherBackend)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--backend",
            default=DEFAULT_TASK_BACKEND_ALIAS,
            help="The TASKS alias whose TetherBackend to serve (default: %(default)s).",
        )
        parser.add_argument("--processes", "-p", type=int, help="Child processes running tasks.")
        parser.add_argument("--queues", "-q", help="Comma-separated queues (default: all of QUEUES).")
        parser.add_argument("--prefetch", type=int, help="Claimed tasks held beyond running ones.")
        parser.add_argument("--grace-period", type=float, help="Seconds running tasks get on SIGTERM.")
        parser.add_argument("--poll-interval-ms", type=int, help="Fallback poll when no NOTIFY arrives.")
        parser.add_argument(
            "--log-level",
            default="INFO",
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            type=str.upper,
            help="tether's log level (default: %(default)s).",
        )
        parser.add_argument(
            "--log-format",
            choices=list(LOG_FORMATS),
            type=str.lower,
            default=None,
            help="human, or json: one JSON object per line (default: TETHER_LOG_FORMAT, else human).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # The format of `tether worker`; a no-op when the project's LOGGING set the root up
        # (the worker's children still log in the format asked for).
        setup_logging(options["log_level"], options["log_format"] or "human")
        logging.getLogger("tether").setLevel(options["log_level"])
        app_path = prepare(None, options["backend"])
        app = load_app(app_path)
        if options["log_format"] is None:
            setup_logging(options["log_level"], app.config.logging.format)
        overrides = {
            "processes": options["processes"],
            "queues": options["queues"],
            "prefetch": options["prefetch"],
            "grace_period_s": options["grace_period"],
            "poll_interval_ms": options["poll_interval_ms"],
        }
        run_worker(app, app_path, worker_config(app, overrides))
