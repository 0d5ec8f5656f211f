"""A backend for Django's ``django.tasks`` (Django >= 6.0) that runs on tether.

    TASKS = {"default": {"BACKEND": "tether.contrib.django.TetherBackend", "QUEUES": [...],
                         "OPTIONS": {...}}}

Add ``"tether.contrib.django"`` to INSTALLED_APPS for ``python manage.py tether_worker``.
See docs/django.md.
"""

from tether.contrib.django.requirements import require_django

require_django()

from tether.contrib.django.backend import TetherBackend  # noqa: E402  (after the check, on purpose)

__all__ = ["TetherBackend"]
