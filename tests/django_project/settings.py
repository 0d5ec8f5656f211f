"""Settings of the test project: its database is the test run's (TETHER_DATABASE_URL).

The `database_url` fixture (tests/conftest.py) creates a database per test run and puts
its URL in TETHER_DATABASE_URL, in the test process and in every worker it starts; the
DATABASES entry is built from it, so Django, the TetherBackend and the workers all use
that one database.
"""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured
from psycopg.conninfo import conninfo_to_dict

from tether import ErrorCode

_url = os.environ.get("TETHER_DATABASE_URL")
if not _url:
    raise ImproperlyConfigured(
        "tests.django_project needs TETHER_DATABASE_URL (the tests' database_url fixture sets it)"
    )
_db = conninfo_to_dict(_url)

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["tether.contrib.django", "tests.django_project.shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db["dbname"],
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    },
    # Never connected to: the tests check that a TetherBackend refuses a non-PostgreSQL alias.
    "legacy": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}

TASKS = {
    "default": {
        "BACKEND": "tether.contrib.django.TetherBackend",
        "QUEUES": ["default", "emails", "batch"],
        "OPTIONS": {
            "DATABASE": "default",
            "TASK_OPTIONS": {
                # Safe to run twice: retried once if its worker dies while it runs.
                "tests.django_project.shop.tasks.crash_once": {
                    "RETRY_POLICY": {
                        "kind": "fixed",
                        "base_seconds": 0.1,
                        "max_retries": 1,
                        "auto_retry_for": [ErrorCode.WORKER_CRASHED],
                        "jitter": 0,
                    },
                },
            },
        },
    },
}
