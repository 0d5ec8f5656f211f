"""Keeping the garbage collector's full passes off a worker's pickup path.

A worker process imports tether, psycopg, pydantic and the app: a few hundred thousand
objects that live as long as the process. CPython's full collection (generation 2) walks
every one of them, and it comes whenever enough allocations add up, wherever the process
is: in a worker's main process it took 60 ms on the benchmark machine, and a task sent
meanwhile waited for it (a pickup's p99 is three tasks in 300, so one such pass in a run
was its p99).

``gc.freeze()`` moves every object tracked so far into a generation that no collection
walks; collections then walk only what the process made since. It is the standard remedy
(the gc module's documentation, for processes that fork): O(1) (a list splice), nothing
is collected or moved in memory. What it gives up: a reference cycle made before the
freeze that becomes garbage later is never freed. What is frozen is the start-up (imports,
the app, the connections and services that live until the process ends), so that is a
bounded, one-time amount.

Each process freezes once its start-up is over: the main process before its claim loop,
a child before it serves its first task, and the fork server before it forks children
(they inherit the frozen objects, and their own full passes never touch those objects'
memory, which then stays shared with the server instead of copied page by page).
"""

from __future__ import annotations

import gc


def freeze_start_up() -> None:
    """Everything this process made so far is exempt from garbage collection from now on."""
    gc.freeze()


# Whether pause_collection turned the collector off (and resume_collection must turn it on).
_paused = False


def pause_collection() -> None:
    """No collection runs until ``resume_collection``: for the imports that begin a process.

    Importing tether, psycopg, pydantic and the app makes a few hundred thousand objects
    that all live as long as the process; as each import adds to them, the collector walks
    them again and again (about 130 young, 11 middle and one full pass for `tether worker`'s
    imports, 30-60 ms of its 0.4 s of CPU), and finds almost nothing: every pass is wasted.
    """
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collection() -> None:
    """End ``pause_collection``'s pause: what the imports made is frozen (``freeze_start_up``:
    no collection walks it, as it would once the collector is on again) and collection resumes.
    Nothing if the collector was not paused by ``pause_collection``."""
    global _paused
    if _paused:
        _paused = False
        freeze_start_up()
        gc.enable()
