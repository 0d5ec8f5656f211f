"""Finding the user's Tether app from a ``module:attribute`` path."""

from __future__ import annotations

import importlib
import os
import sys

from tether.app import Tether


class AppLoadError(ValueError):
    """The ``module:attribute`` path does not name a Tether app."""


def load_app(path: str) -> Tether:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise AppLoadError(f"app path {path!r} must look like 'package.module:app'")
    # Like `python -m`, let the current directory's modules be found.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppLoadError(f"cannot import module {module_name!r} from app path {path!r}: {exc}") from exc
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise AppLoadError(f"module {module_name!r} has no attribute {attr!r} (app path {path!r})") from None
    if not isinstance(app, Tether):
        raise AppLoadError(f"{path!r} is a {type(app).__name__}, not a tether.Tether app")
    return app
