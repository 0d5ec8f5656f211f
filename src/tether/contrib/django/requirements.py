"""The one check every entry point of tether.contrib.django makes first: Django >= 6.0 is here.

Django 6 (its ``django.tasks``) needs Python >= 3.12, while tether supports 3.11: on 3.11,
or without the ``django`` extra, importing the integration fails at once with what to do,
instead of with an AttributeError deep inside Django.
"""

from __future__ import annotations

import sys

MIN_DJANGO = (6, 0)
MIN_PYTHON = (3, 12)


def require_django() -> None:
    """Raise ImportError naming what is missing unless Django >= 6.0 can be imported."""
    python = sys.version_info[:2]  # a variable: mypy (python_version 3.11) must check what follows
    if python < MIN_PYTHON:
        raise ImportError(
            "tether.contrib.django needs Django >= 6.0 (django.tasks), which needs Python >= 3.12; "
            f"this is Python {sys.version.split()[0]}"
        )
    try:
        import django
    except ImportError as exc:
        raise ImportError(
            "tether.contrib.django needs Django >= 6.0: install it with pip install 'tether[django]'"
        ) from exc
    if tuple(django.VERSION[:2]) < MIN_DJANGO:
        raise ImportError(
            f"tether.contrib.django needs Django >= 6.0 (django.tasks); Django {django.get_version()} "
            "is installed: upgrade it with pip install 'tether[django]'"
        )
