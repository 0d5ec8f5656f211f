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
