"""What tasks, handles and workflows use of the app that made them.

A task, a handle or a workflow keeps the app it came from and calls back into it. Annotating
that with the ``Tether`` class would close an import circle (app.py creates all three), so
they name this Protocol instead: the few members they use. ``Tether`` satisfies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from tether.broker import PostgresBroker
from tether.config import AppConfig
from tether.options import SendOptions
from tether.result_listener import ResultListener


class AppView(Protocol):
    @property
    def config(self) -> AppConfig: ...

    @property
    def broker(self) -> PostgresBroker: ...

    @property
    def result_listener(self) -> ResultListener:
        """One LISTEN connection per app, shared by every wait for a result."""
        ...

    @property
    def tasks(self) -> Mapping[str, object]:
        """The registered tasks by name: a workflow checks its nodes' tasks belong to the app."""
        ...

    def check_options(self, task_name: str, options: SendOptions) -> SendOptions: ...
