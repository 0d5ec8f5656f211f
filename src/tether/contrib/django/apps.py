"""The Django app ``tether.contrib.django``: listed in INSTALLED_APPS for its management command."""

from __future__ import annotations

from django.apps import AppConfig


class TetherConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints
    name = "tether.contrib.django"
    label = "tether"  # the default, "django", would read as Django's own
    verbose_name = "tether"
