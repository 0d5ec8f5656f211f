"""Settings read from ``TETHER_*`` environment variables: the base of tether.config's classes.

A setting given as an argument wins; one left out comes from its environment variable
(``env_prefix`` + the field's name, any case), else its default. The variable's text goes
to the field's own validation, as an argument would, so a bad value is refused with the
same message naming the field. A field that holds a model or a mapping (``AppConfig.broker``,
``queue_limits``) reads its variable as JSON; every other field reads the text (its
validators split lists and know the words for None).

This is what pydantic-settings' ``BaseSettings`` did for these classes, without its import:
about 200 modules (dotenv, its cloud providers' modules, argparse) on the path of every
worker's and producer's start (bench/README.md, "Start-up").
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar, get_origin

from pydantic import BaseModel

__all__ = ["EnvSettings"]


def _is_json(annotation: Any) -> bool:
    """Whether a field of this type reads its variable as JSON: a model or a mapping."""
    origin = get_origin(annotation) or annotation
    return origin is dict or (isinstance(origin, type) and issubclass(origin, BaseModel))


class EnvSettings(BaseModel):
    """A model whose left-out fields come from ``TETHER_*`` environment variables."""

    #: The variables' common start, e.g. ``TETHER_WORKER_`` for ``TETHER_WORKER_PROCESSES``.
    env_prefix: ClassVar[str] = "TETHER_"

    def __init__(self, **values: Any) -> None:
        super().__init__(**_with_environment(type(self), values))


def _with_environment(cls: type[EnvSettings], values: dict[str, Any]) -> dict[str, Any]:
    # Any case, as a shell user may write it (tether_database_url).
    environment = {
        name.lower(): text
        for name, text in os.environ.items()
        if name.lower().startswith(cls.env_prefix.lower())
    }
    if not environment:
        return values
    merged = dict(values)
    for name, field in cls.model_fields.items():
        variable = f"{cls.env_prefix}{name}"
        text = environment.get(variable.lower())
        if text is None:
            continue
        if not _is_json(field.annotation):
            merged.setdefault(name, text)
            continue
        try:
            decoded = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{name}: {variable.upper()} is not JSON ({exc})") from None
        # A dict argument is laid over the variable's: what the argument leaves out of a
        # nested setting still comes from the environment.
        merged[name] = _laid_over(decoded, merged[name]) if name in merged else decoded
    return merged


def _laid_over(under: Any, over: Any) -> Any:
    if not (isinstance(under, dict) and isinstance(over, dict)):
        return over
    return {**under, **{key: _laid_over(under.get(key), value) for key, value in over.items()}}
