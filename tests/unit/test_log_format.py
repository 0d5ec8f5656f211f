"""The two log formats without a worker: the JSON object of a line (its keys, a traceback, a
message with newlines, the task fields from a line's ``extra`` or from the running task), the
human line unchanged, and the setting that picks one."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from tether import AppConfig, LoggingConfig
from tether.current import RunningTask, set_current_task
from tether.log_fields import MAX_TASK_IDS, TaskFieldsFilter, about_task, about_tasks, set_worker
from tether.log_setup import HUMAN_FORMAT, JsonFormatter, formatter


def record(
    message: str, *args: Any, extra: dict[str, Any] | None = None, exc: bool = False
) -> logging.LogRecord:
    exc_info = sys.exc_info() if exc else None
    made = logging.getLogger("tether.test").makeRecord(
        "tether.test", logging.WARNING, __file__, 1, message, args, exc_info, extra=extra
    )
    TaskFieldsFilter().filter(made)
    return made


@pytest.fixture(autouse=True)
def no_worker_no_task() -> Iterator[None]:
    yield
    set_worker(None)
    set_current_task(None)


def running(name: str = "resize") -> RunningTask:
    return RunningTask(
        id=uuid.uuid4(), name=name, queue="images", attempt=3, retry_count=1, worker_id="w-1-ab"
    )


def test_a_json_line_is_one_object_with_a_utc_timestamp_and_the_message() -> None:
    line = JsonFormatter().format(record("two\nlines about %s", "it"))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "two\nlines about it"
    assert (entry["level"], entry["logger"]) == ("WARNING", "tether.test")
    at = datetime.fromisoformat(entry["timestamp"])
    assert at.utcoffset() == timedelta(0) and abs(datetime.now(at.tzinfo) - at) < timedelta(minutes=1)
    assert isinstance(entry["pid"], int) and entry["process_name"] == "MainProcess"
    assert not {"task_id", "worker_id", "exception"} & entry.keys()


def test_an_exception_s_traceback_is_in_the_object() -> None:
    try:
        raise ValueError("the cause")
    except ValueError:
        line = JsonFormatter().format(record("it failed", exc=True))
    entry = json.loads(line)
    assert entry["exception"].startswith("Traceback (most recent call last):")
    assert entry["exception"].rstrip().endswith("ValueError: the cause")


def test_a_line_about_a_task_carries_its_fields_and_its_worker() -> None:
    task = running()
    entry = json.loads(JsonFormatter().format(record("x", extra=about_task(task, "w-2-cd"))))
    assert {k: entry[k] for k in ("task_id", "attempt", "worker_id", "queue", "task_name")} == {
        "task_id": str(task.id),
        "attempt": 3,
        "worker_id": "w-2-cd",
        "queue": "images",
        "task_name": "resize",
    }


def test_lines_logged_while_a_task_runs_carry_it_and_a_line_s_own_fields_win() -> None:
    set_worker("w-9-ef")
    assert json.loads(JsonFormatter().format(record("idle")))["worker_id"] == "w-9-ef"
    task = running("thumbnail")
    set_current_task(task)
    entry = json.loads(JsonFormatter().format(record("inside")))
    assert (entry["task_id"], entry["task_name"], entry["worker_id"]) == (str(task.id), "thumbnail", "w-1-ab")
    other = running("other")
    given = json.loads(JsonFormatter().format(record("about another", extra=about_task(other))))
    assert (given["task_id"], given["task_name"], given["worker_id"]) == (str(other.id), "other", "w-9-ef")


def test_a_line_about_many_tasks_names_them_up_to_a_bound() -> None:
    tasks = [running() for _ in range(MAX_TASK_IDS + 5)]
    entry = json.loads(JsonFormatter().format(record("many", extra=about_tasks(tasks))))
    assert entry["task_count"] == MAX_TASK_IDS + 5
    assert entry["task_ids"] == [str(t.id) for t in tasks[:MAX_TASK_IDS]] and "task_id" not in entry
    assert about_tasks([]) == {}
    assert about_tasks(tasks[:1]) == about_task(tasks[0])


def test_other_extra_fields_go_in_as_they_are_or_as_text() -> None:
    entry = json.loads(JsonFormatter().format(record("x", extra={"rows": 3, "when": datetime(2024, 1, 2)})))
    assert entry["rows"] == 3 and entry["when"] == "2024-01-02 00:00:00"


def test_the_human_line_is_unchanged_task_fields_or_not() -> None:
    assert HUMAN_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    set_current_task(running())
    line = formatter("human").format(record("said %d", 7, extra={"rows": 3}))
    assert line.endswith(" WARNING tether.test: said 7")
    assert formatter("human", "child")._fmt is not None and "[child " in formatter("human", "child")._fmt


def test_the_format_setting_reads_tether_log_format_and_names_it_when_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert LoggingConfig().format == "human" and AppConfig().logging.format == "human"
    monkeypatch.setenv("TETHER_LOG_FORMAT", "JSON")
    assert LoggingConfig().format == "json" and AppConfig().logging.format == "json"
    assert AppConfig(logging=LoggingConfig(format="human")).logging.format == "human"
    monkeypatch.setenv("TETHER_LOG_FORMAT", "xml")
    with pytest.raises(ValidationError, match=r"(?s)format.*TETHER_LOG_FORMAT.*human, json.*'xml'"):
        AppConfig()
