"""The worker's bookkeeping of claimed tasks, without a database: what it holds and counts."""

from __future__ import annotations

from dataclasses import replace

from tether import TaskError, TaskResult, Tether
from tether.broker.claims import TaskPayload
from tether.config import WorkerConfig
from tether.worker.main import Worker


def make_worker() -> Worker:
    app = Tether()

    @app.task("noop")
    def noop() -> TaskResult[None, TaskError]:
        return TaskResult(ok=None)

    return Worker(app, "tests:app", WorkerConfig(processes=1, prefetch=4))


def payload(task_id: str, attempt: int = 1) -> TaskPayload:
    return TaskPayload(
        id=task_id,
        name="noop",
        queue="default",
        args="[]",
        kwargs="{}",
        attempt=attempt,
        retry_count=0,
        max_retries=0,
        retry_policy=None,
    )


def test_a_task_claimed_again_in_the_same_attempt_is_held_once() -> None:
    """After a database crash lost a claim that did not wait for its flush, the same worker
    can claim the same attempt again. It must not buffer the task twice."""
    worker = make_worker()
    first = payload("a")
    assert worker.hold([first, payload("b")]) == []
    assert worker.hold([replace(first), payload("c")]) == []
    assert [t.id for t in worker.holdings.unhanded_tasks()] == ["a", "b", "c"]
    assert len(worker.holdings) == 3
    assert worker.holdings.unhanded_tasks()[0] is first  # the copy already held is the one kept


def test_a_new_attempt_of_a_task_is_taken() -> None:
    worker = make_worker()
    worker.hold([payload("a", attempt=1)])
    worker.hold([payload("a", attempt=2)])
    assert [t.attempt for t in worker.holdings.unhanded_tasks()] == [1, 2]
    assert len(worker.holdings) == 1  # one task, its newer attempt held


def test_a_task_whose_name_the_app_lacks_is_handed_back_not_held() -> None:
    """The worker then gives it to a worker that knows the name, or fails it (TASK_NOT_REGISTERED)."""
    worker = make_worker()
    stranger = replace(payload("x"), name="not.here")
    assert worker.hold([payload("a"), stranger]) == [stranger]
    assert [t.id for t in worker.holdings.unhanded_tasks()] == ["a"]
