from __future__ import annotations

from typing import Any

from tests.conftest import WorkerProcess
from tests.django.conftest import finished, token


def test_a_task_runs(worker: WorkerProcess, backend: Any) -> None:
    from tests.django_project.shop import tasks

    tok = token()
    result = finished(tasks.record.enqueue(tok))
    assert str(result.status) == "SUCCESSFUL", result.errors
    assert result.return_value == tok
