"""Checkpointed steps: ``current_task().step(name, fn, ...)`` runs ``fn`` once per task, across attempts.

A ``StepBook`` keeps the steps of one attempt of one task: the steps earlier attempts
completed (read once, at the attempt's first step call) and a count of the calls of each
name. A step found there returns its stored result without calling ``fn``; any other runs
``fn``, stores its JSON result with one fenced write, then returns it. Where the reads and
writes go is the business of the child process running the task (a ``StepStore``,
worker/step_writes.py); this module checks the arguments and keeps the book.

The rules (docs/durable-steps.md says them to users):
- the n-th call of a name in an attempt maps to the n-th stored result of that name, so a
  step in a loop needs no unique name, but the calls of one name must come in the same
  order in every attempt;
- a step returns its result as stored (decoded from its JSON), on its first run too, so the
  code after it sees the same value in every attempt;
- an exception in ``fn`` stores nothing and goes on up (the task's retry policy decides);
- a result past STEP_RESULT_MAX_BYTES of JSON, or one that is not JSON, is refused with a
  clear error and nothing stored.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tether import codec
from tether.errors import StepError, StepLostError

if TYPE_CHECKING:
    from tether.broker.suspensions import Taken

T = TypeVar("T")

#: The largest step result, in bytes of its JSON text (UTF-8): 1 MiB. A step's result is
#: read back by every later attempt, and all of a task's steps in one read: large data
#: belongs in a store of its own, with its key as the step's result.
STEP_RESULT_MAX_BYTES = 1024 * 1024
#: The longest step name, in characters.
STEP_NAME_MAX_CHARS = 200
#: Names with this prefix are tether's own (durable sleep and events will record theirs).
RESERVED_PREFIX = "tether."

StepKey = tuple[str, int]


class StepStore(Protocol):
    """Where one attempt's steps are read and written (set by the child process running it).

    ``write`` returns the stored JSON text (possibly reordered by the database), or None
    when the attempt lost its task and nothing was written.
    """

    def load(self) -> dict[StepKey, str]: ...

    def write(self, name: str, occurrence: int, result: str) -> str | None: ...

    async def load_async(self) -> dict[StepKey, str]: ...

    async def write_async(self, name: str, occurrence: int, result: str) -> str | None: ...

    # For wait_for_event (tether.suspending): take the key's event, or the wait's timeout.
    def take_event(self, occurrence: int, key: str) -> Taken: ...

    async def take_event_async(self, occurrence: int, key: str) -> Taken: ...


class StepBook:
    """The steps of one attempt of one task."""

    def __init__(self, store: StepStore, task_label: str) -> None:
        self.store = store
        self.task_label = task_label  # for messages: "task <id> (<name>) attempt <n>"
        self._done: dict[StepKey, str] | None = None  # None until read, once per attempt
        self._calls: dict[str, int] = {}  # calls of each name so far in this attempt
        self._lock = threading.Lock()  # a sync task's threads may call steps too
        self._loading: asyncio.Future[dict[StepKey, str]] | None = None
        self.ran = 0  # steps whose fn ran in this attempt
        self.replayed = 0  # steps answered from an earlier attempt

    # -- sync ---------------------------------------------------------------------------

    def step(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` once for this task; see RunningTask.step."""
        _check(name, fn)
        if inspect.iscoroutinefunction(fn):
            raise StepError(
                f"step {name!r}: fn is an async function; in an async def task use "
                "`await current_task().step_async(...)`"
            )
        if _in_event_loop():
            raise StepError(
                f"step {name!r}: step() was called inside a running event loop, where its database "
                "wait would block every task of the loop; use `await current_task().step_async(...)`"
            )
        occurrence, stored = self.lookup(name)
        if stored is not None:
            replayed: T = codec.loads(stored)
            return replayed
        try:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                _close(value)
                raise StepError(
                    f"step {name!r}: fn returned an awaitable; in an async def task use "
                    "`await current_task().step_async(...)`"
                )
            text = _encoded(name, value)
        except BaseException:
            self._give_back(name, occurrence)
            raise
        kept: T = self._kept(name, occurrence, self.store.write(name, occurrence, text))
        return kept

    # -- async --------------------------------------------------------------------------

    async def step_async(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Like step, without blocking the event loop; ``fn`` may be an ``async def``."""
        _check(name, fn)
        occurrence, stored = await self.lookup_async(name)
        if stored is not None:
            return codec.loads(stored)
        try:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
            text = _encoded(name, value)
        except BaseException:
            self._give_back(name, occurrence)
            raise
        written = await self.store.write_async(name, occurrence, text)
        return self._kept(name, occurrence, written)

    async def _loaded_async(self) -> dict[StepKey, str]:
        if self._done is not None:
            return self._done
        if self._loading is None:  # the first caller reads; concurrent steps wait for it
            self._loading = asyncio.ensure_future(self.store.load_async())
        try:
            done = await asyncio.shield(self._loading)
        except BaseException:
            if self._loading.done():
                self._loading = None  # a failed read is tried again by the next step
            raise
        self._done = done
        return done

    # -- the lookup behind step() and tether's own steps (sleep and events: tether.suspending)

    def lookup(self, name: str) -> tuple[int, str | None]:
        """The next occurrence of step ``name`` and its stored JSON (None: not stored; a
        stored one counts as replayed). tether's own steps are counted like any step: the
        n-th sleep of an attempt is occurrence n."""
        occurrence = self._next_occurrence(name)
        with self._lock:
            if self._done is None:
                self._done = self.store.load()
            stored = self._done.get((name, occurrence))
        if stored is not None:
            self.replayed += 1
        return occurrence, stored

    async def lookup_async(self, name: str) -> tuple[int, str | None]:
        """lookup() without blocking the event loop."""
        occurrence = self._next_occurrence(name)  # before any await: call order decides
        stored = (await self._loaded_async()).get((name, occurrence))
        if stored is not None:
            self.replayed += 1
        return occurrence, stored

    def remember(self, name: str, occurrence: int, stored: str) -> None:
        """A step of tether's own stored by this attempt (an event taken at once)."""
        with self._lock:
            if self._done is not None:
                self._done[(name, occurrence)] = stored

    # -- shared -------------------------------------------------------------------------

    def _next_occurrence(self, name: str) -> int:
        with self._lock:
            occurrence = self._calls.get(name, 0)
            self._calls[name] = occurrence + 1
        return occurrence

    def _give_back(self, name: str, occurrence: int) -> None:
        """A step that raised stored nothing: its call does not count, so calling the same name
        again (a retry loop) maps to the same stored result in every attempt. Only the last
        call of the name gives its number back (concurrent calls keep theirs)."""
        with self._lock:
            if self._calls.get(name) == occurrence + 1:
                self._calls[name] = occurrence

    def _kept(self, name: str, occurrence: int, written: str | None) -> Any:
        if written is None:
            raise StepLostError(
                f"{self.task_label}: step {name!r} could not be stored: this attempt lost its task "
                "(it was recovered elsewhere); the attempt stops here"
            )
        with self._lock:
            if self._done is not None:
                self._done[(name, occurrence)] = written
        self.ran += 1
        return codec.loads(written)


def _check(name: Any, fn: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > STEP_NAME_MAX_CHARS:
        raise StepError(
            f"step: name must be a non-empty string of at most {STEP_NAME_MAX_CHARS} characters, "
            f"got {_shown(name)}"
        )
    if name.startswith(RESERVED_PREFIX):
        raise StepError(
            f"step: name {name!r} starts with {RESERVED_PREFIX!r}, reserved for tether's own steps"
        )
    if not name.isprintable():
        raise StepError(f"step: name {name!r} contains control characters")
    if not callable(fn):
        raise StepError(f"step {name!r}: fn must be callable, got {type(fn).__name__}")


def _shown(value: Any) -> str:
    if isinstance(value, str) and len(value) > 60:
        return f"a string of {len(value)} characters"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _encoded(name: str, value: Any) -> str:
    text = codec.dumps(value, what=f"the result of step {name!r}")  # SerializationError names it
    size = len(text.encode("utf-8")) if len(text) * 4 > STEP_RESULT_MAX_BYTES else len(text)
    if size > STEP_RESULT_MAX_BYTES:
        raise StepError(
            f"step {name!r}: its result is {size} bytes of JSON, over the limit of "
            f"{STEP_RESULT_MAX_BYTES} bytes (STEP_RESULT_MAX_BYTES); store large data elsewhere "
            "and return its key"
        )
    return text


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _close(value: Any) -> None:
    close = getattr(value, "close", None)
    if callable(close):  # a coroutine never awaited: close it, no "never awaited" warning
        close()
