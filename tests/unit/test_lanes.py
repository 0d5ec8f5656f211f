"""Which children a worker starts for an app, and which kind of child runs which task."""

from __future__ import annotations

import os

import pytest

from tether import AppConfig, PostgresConfig, Tether
from tether.config import WorkerConfig
from tether.errors import InvalidOptionError
from tether.worker.lanes import Lanes, plan_lanes

CPUS = min(os.cpu_count() or 1, 256)


def app_with(*, sync: bool, asynchronous: bool) -> Tether:
    app = Tether(AppConfig(broker=PostgresConfig(database_url="postgresql://nowhere/none")))
    if sync:

        @app.task("plain")
        def plain() -> None:
            return None

    if asynchronous:

        @app.task("waits")
        async def waits() -> None:
            return None

    return app


def test_an_app_with_both_kinds_gets_both_children_by_default() -> None:
    lanes = plan_lanes(WorkerConfig(), app_with(sync=True, asynchronous=True))
    assert (lanes.sync_processes, lanes.async_processes, lanes.async_concurrency) == (CPUS, 1, 100)
    assert (lanes.sync_prefetch, lanes.async_prefetch) == (4 * CPUS, 100)
    assert lanes.async_per_child == 200
    assert lanes.capacity == CPUS + 4 * CPUS + 200


def test_an_async_only_app_starts_no_sync_child() -> None:
    lanes = plan_lanes(WorkerConfig(), app_with(sync=False, asynchronous=True))
    assert (lanes.sync_processes, lanes.async_processes) == (0, 1)
    assert lanes.capacity == 200  # sync prefetch does not count without sync children


def test_a_sync_only_app_starts_no_async_child() -> None:
    lanes = plan_lanes(WorkerConfig(), app_with(sync=True, asynchronous=False))
    assert (lanes.sync_processes, lanes.async_processes) == (CPUS, 0)
    assert lanes.async_per_child == 0


def test_explicit_counts_and_prefetch_are_honoured() -> None:
    config = WorkerConfig(processes=3, async_processes=2, async_concurrency=50, prefetch=7)
    lanes = plan_lanes(config, app_with(sync=False, asynchronous=True))
    assert (lanes.sync_processes, lanes.async_processes) == (3, 2)
    assert (lanes.sync_prefetch, lanes.async_prefetch) == (7, 7)
    assert lanes.async_per_child == 50 + 4  # each async child: its concurrency and half of 7, rounded up
    assert lanes.capacity == 3 + 7 + 2 * 54


def test_each_kind_runs_in_the_other_when_the_worker_has_none_of_its_own() -> None:
    both = Lanes(2, 1, 10, 8, 10)
    assert (both.kind_of(is_async=True), both.kind_of(is_async=False)) == ("async", "sync")
    only_sync = Lanes(2, 0, 10, 8, 0)
    assert only_sync.kind_of(is_async=True) == "sync"
    only_async = Lanes(0, 1, 10, 0, 10)
    assert only_async.kind_of(is_async=False) == "async"


def test_no_child_at_all_is_refused_naming_both_options() -> None:
    with pytest.raises(InvalidOptionError, match=r"processes is 0.*async_processes >= 1"):
        plan_lanes(WorkerConfig(processes=0), app_with(sync=True, asynchronous=False))
