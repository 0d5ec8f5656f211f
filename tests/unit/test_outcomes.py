"""tether.outcomes without a database: the retry rule and what a failure stores.

Every path that ends an attempt (the child, the worker's main process, the reaper) goes
through these functions, so what they return is what the task row gets
(``broker.claims.record_outcome`` writes it).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tether import outcomes
from tether.config import RetryPolicy
from tether.outcomes import Outcome
from tether.result import ErrorCode, TaskError, TaskStatus


def policy_json(policy: RetryPolicy) -> str:
    """The policy as a task row stores it (tether_tasks.retry_policy)."""
    return json.dumps(policy.to_json())


# Retries BOOM and WORKER_CRASHED twice, 5 s apart, no jitter: every delay is exact.
FIXED = policy_json(
    RetryPolicy.fixed(5, max_retries=2, auto_retry_for=["BOOM", ErrorCode.WORKER_CRASHED], jitter=0)
)
# 1 s, 2 s, then capped at 3 s; five retries of X.
EXPONENTIAL = policy_json(
    RetryPolicy.exponential(1, max_retries=5, auto_retry_for="X", max_seconds=3, jitter=0)
)


# -- retry_delay -----------------------------------------------------------------------------


def test_the_stored_policy_json_is_what_retry_delay_reads() -> None:
    assert json.loads(FIXED) == {
        "kind": "fixed",
        "max_retries": 2,
        "base_seconds": 5.0,
        "max_seconds": 3600,
        "jitter": 0.0,
        "auto_retry_for": ["BOOM", "WORKER_CRASHED"],
    }


@pytest.mark.parametrize(("retry_count", "delay"), [(0, 5.0), (1, 5.0), (2, None), (3, None)])
def test_a_listed_code_is_retried_while_retries_are_left(retry_count: int, delay: float | None) -> None:
    assert outcomes.retry_delay(FIXED, retry_count, "BOOM") == delay


def test_a_code_the_policy_does_not_list_is_not_retried() -> None:
    assert outcomes.retry_delay(FIXED, 0, "OTHER") is None
    assert outcomes.retry_delay(FIXED, 0, "boom") is None  # codes are compared exactly


def test_no_policy_no_retry() -> None:
    assert outcomes.retry_delay(None, 0, "BOOM") is None
    assert outcomes.retry_delay(None, 0, ErrorCode.WORKER_CRASHED) is None


@pytest.mark.parametrize(("retry_count", "delay"), [(0, 1.0), (1, 2.0), (2, 3.0), (4, 3.0), (5, None)])
def test_the_delay_is_for_the_next_retry_number(retry_count: int, delay: float | None) -> None:
    """retry_count retries so far: the delay is that of retry retry_count + 1."""
    assert outcomes.retry_delay(EXPONENTIAL, retry_count, "X") == delay


def test_jitter_stays_within_its_bounds() -> None:
    jittered = policy_json(RetryPolicy.fixed(10, max_retries=1, auto_retry_for="X", jitter=0.5))
    delays = {outcomes.retry_delay(jittered, 0, "X") for _ in range(50)}
    assert all(d is not None and 5.0 <= d <= 15.0 for d in delays), delays
    assert len(delays) > 1  # 50 draws of a uniform factor are not all equal


# -- failure / crashed -----------------------------------------------------------------------


def test_a_retried_failure_settles_as_pending() -> None:
    outcome = outcomes.failure(TaskError("BOOM", "bad", {"x": 1}), FIXED, 0)
    assert outcome == Outcome(
        status="FAILED",
        result_json='{"err":{"code":"BOOM","message":"bad","data":{"x":1}}}',
        error_code="BOOM",
        error_message="bad",
        retry_delay_s=5.0,
    )
    assert outcome.will_retry is True
    assert outcome.settles_as == "PENDING"


def test_a_failure_without_retries_left_settles_as_failed() -> None:
    outcome = outcomes.failure(TaskError("BOOM", "bad", {"x": 1}), FIXED, 2)
    assert outcome.retry_delay_s is None
    assert outcome.will_retry is False
    assert outcome.settles_as == "FAILED"
    assert outcome.result_json == '{"err":{"code":"BOOM","message":"bad","data":{"x":1}}}'


def test_a_failure_without_policy_is_final_and_stores_null_data() -> None:
    outcome = outcomes.failure(TaskError("OTHER"), None, 0)
    assert outcome == Outcome(
        "FAILED", '{"err":{"code":"OTHER","message":"","data":null}}', "OTHER", "", None
    )


def test_the_stored_result_is_the_err_object() -> None:
    outcome = outcomes.failure(TaskError(ErrorCode.UNHANDLED_EXCEPTION, "ValueError: no", ["a", 2]), None, 0)
    assert json.loads(outcome.result_json) == {
        "err": {"code": "UNHANDLED_EXCEPTION", "message": "ValueError: no", "data": ["a", 2]}
    }
    assert outcome.error_code == "UNHANDLED_EXCEPTION"
    assert type(outcome.error_code) is str  # a plain str for the column, not the enum


def test_crashed_is_worker_crashed_with_the_policy_applied() -> None:
    retried = outcomes.crashed(FIXED, 1, "child pid 42 exited with code -9")
    assert retried == Outcome(
        "FAILED",
        '{"err":{"code":"WORKER_CRASHED","message":"child pid 42 exited with code -9","data":null}}',
        "WORKER_CRASHED",
        "child pid 42 exited with code -9",
        5.0,
    )
    assert retried.settles_as == "PENDING"
    final = outcomes.crashed(FIXED, 2, "gone")
    assert (final.error_code, final.retry_delay_s, final.settles_as) == ("WORKER_CRASHED", None, "FAILED")
    assert outcomes.crashed(None, 0, "gone").retry_delay_s is None
    assert outcomes.crashed(EXPONENTIAL, 0, "gone").retry_delay_s is None  # X only


def test_a_completed_outcome_settles_as_completed() -> None:
    outcome = Outcome(TaskStatus.COMPLETED, '{"ok":1}', None, None, None)
    assert (outcome.will_retry, outcome.settles_as) == (False, "COMPLETED")


# -- what jsonb cannot store -----------------------------------------------------------------


class Odd:
    """Not serialisable, with a repr that holds a NUL and a lone surrogate."""

    def __repr__(self) -> str:
        return "<odd \x00 \ud800>"


def test_printable_escapes_nul_and_lone_surrogates() -> None:
    assert outcomes.printable("a\x00b") == "a\\x00b"
    assert outcomes.printable("x\ud800y") == "x\\ud800y"
    assert outcomes.printable("plain é ✓") == "plain é ✓"  # valid text is untouched
    assert outcomes.printable("") == ""


def test_storable_keeps_the_shape() -> None:
    data: dict[Any, Any] = {
        "traceback": "line\x00",
        3: "int key",
        "key\x00": "a key jsonb refuses",
        "nested": {"deep": ["ok", ("t\ud801", 2)]},
        "odd": Odd(),
        "fine": {"n": 1.5, "none": None, "flag": True},
    }
    assert outcomes.storable(data) == {
        "traceback": "line\\x00",
        "3": "int key",
        "key\\x00": "a key jsonb refuses",
        "nested": {"deep": ["ok", ["t\\ud801", 2]]},
        "odd": "<odd \\x00 \\ud800>",
        "fine": {"n": 1.5, "none": None, "flag": True},
    }
    assert outcomes.storable(object) == "<class 'object'>"
    assert outcomes.storable(7) == 7
    assert outcomes.storable(None) is None


def test_a_failure_that_jsonb_would_refuse_is_made_storable() -> None:
    error = TaskError(
        "BOOM", "nul\x00 and \ud800 lone", {"tb": "a\x00b", "obj": Odd(), "n": [1, (2, "\ud801")]}
    )
    outcome = outcomes.failure(error, FIXED, 0)
    assert outcome.error_code == "BOOM"  # the code survives, and with it the retry
    assert outcome.retry_delay_s == 5.0
    assert outcome.error_message == "nul\\x00 and \\ud800 lone"
    assert json.loads(outcome.result_json) == {
        "err": {
            "code": "BOOM",
            "message": "nul\\x00 and \\ud800 lone",
            "data": {"tb": "a\\x00b", "obj": "<odd \\x00 \\ud800>", "n": [1, [2, "\\ud801"]]},
        }
    }
    assert "\\u0000" not in outcome.result_json
    outcome.result_json.encode("utf-8")  # no lone surrogate left


def test_an_unserialisable_payload_alone_keeps_the_message() -> None:
    outcome = outcomes.failure(TaskError("BOOM", "fine message", Odd()), None, 0)
    assert outcome.error_message == "fine message"
    assert json.loads(outcome.result_json) == {
        "err": {"code": "BOOM", "message": "fine message", "data": "<odd \\x00 \\ud800>"}
    }


def test_outcome_statuses_are_task_status_members() -> None:
    """The rule hands the recorder and the reaper enum members, which they compare with ``is``."""
    failed = outcomes.failure(TaskError("BOOM", "bad"), None, 0)
    retried = outcomes.crashed(FIXED, 1, "gone")
    cancelled = outcomes.cancelled("stop")
    assert failed.status is TaskStatus.FAILED and failed.settles_as is TaskStatus.FAILED
    assert retried.status is TaskStatus.FAILED and retried.settles_as is TaskStatus.PENDING
    assert cancelled.status is TaskStatus.CANCELLED and cancelled.settles_as is TaskStatus.CANCELLED
