"""Label values with a bound: a series per value, so no id, argument or free text becomes one.

- task: the names the app registers; any other name (a row of an app this worker does not
  load) is counted as OTHER.
- code: the built-in ErrorCodes, every code a registered task's retry policy names, and the
  first MAX_EXTRA_CODES others seen by this process (user codes are plain strings that no
  declaration lists); past those, OTHER. "" when the outcome has no code.
- queue: a queue the worker serves (declared in the app's config) or that the database holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from tether.task_error import ErrorCode

OTHER = "_other"
MAX_EXTRA_CODES = 50


class Labels:
    def __init__(self, task_names: Iterable[str], policy_codes: Iterable[str] = ()) -> None:
        self.task_names = frozenset(task_names)
        self._codes: set[str] = {code.value for code in ErrorCode} | set(policy_codes)
        self._extra = 0

    def task(self, name: str) -> str:
        return name if name in self.task_names else OTHER

    def code(self, code: str | None) -> str:
        if not code:
            return ""
        if code in self._codes:
            return code
        if self._extra < MAX_EXTRA_CODES:
            self._extra += 1
            self._codes.add(code)
            return code
        return OTHER
