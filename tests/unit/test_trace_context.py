"""The consumer span's reading of a stored trace context (tether.tracing), without a worker:
the unsampled shortcut must agree with the full parse on every shape the text can have."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from opentelemetry import trace

from tether import tracing
from tether.broker.claims import TaskPayload
from tether.current import RunningTask, set_current_task_in_context

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-"


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (PARENT + "00", False),
        (PARENT + "01", True),
        (PARENT + "03", True),  # another flag beside sampled
        (PARENT + "00\nvendor=value", False),  # tracestate after the newline
        (PARENT + "0", None),  # too short: parsed whole
        (PARENT + "zz", None),
        (PARENT + "00x", None),
        ("01-" + PARENT[3:] + "00-extra", None),  # a later version's longer form
    ],
)
def test_the_sampled_flag_is_read_from_the_last_characters_or_left_to_the_full_parse(
    stored: str, expected: bool | None
) -> None:
    assert tracing._sampled_flag(stored) is expected


def test_an_unsampled_send_s_span_parses_its_context_when_asked_and_carries_the_tracestate() -> None:
    run = tracing._Run()
    span = run.unsampled_send(PARENT + "00\nvendor=value")
    assert not span.is_recording()
    context = span.get_span_context()
    assert (context.trace_id, context.span_id) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    assert context.is_remote and not context.trace_flags.sampled
    assert context.trace_state.get("vendor") == "value"
    assert span.get_span_context() is context  # parsed once


def test_an_unsampled_send_whose_text_is_not_a_traceparent_has_the_invalid_context() -> None:
    span = tracing._Run().unsampled_send("00-nothex-" + "b7ad6b7169203331-00")
    assert span.get_span_context() is trace.INVALID_SPAN_CONTEXT


def test_unsampled_runs_in_an_event_loop_make_nothing_of_their_own_and_each_finds_its_own_send() -> None:
    """An async child's unsampled runs (tracing.follow_runs, enter_run): no span and no attach
    per run, yet the current span, asked from inside each of many interleaved runs, is that
    run's own send, and outside any run there is none."""
    sends = {f"{i:032x}": f"{i + 1000:016x}" for i in range(1, 21)}

    async def one(trace_id: str, span_id: str) -> trace.SpanContext:
        stored = f"00-{trace_id}-{span_id}-00"
        task_id = uuid.uuid4()
        set_current_task_in_context(RunningTask(task_id, "t", "default", 1, 0, "w", _trace_context=stored))
        payload = TaskPayload(str(task_id), "t", "default", "[]", "{}", 1, 0, 0, None, trace_context=stored)
        assert tracing.enter_run(payload) is None
        await asyncio.sleep(0)  # the others run meanwhile
        return trace.get_current_span().get_span_context()

    async def child() -> None:
        tracing.follow_runs()  # what AsyncChild.serve does before its first run
        assert trace.get_current_span().get_span_context() is trace.INVALID_SPAN_CONTEXT
        found = await asyncio.gather(*(asyncio.create_task(one(t, s)) for t, s in sends.items()))
        for (trace_id, span_id), context in zip(sends.items(), found, strict=True):
            assert (context.trace_id, context.span_id) == (int(trace_id, 16), int(span_id, 16))
            assert context.is_remote and not context.trace_flags.sampled
        assert trace.get_current_span().get_span_context() is trace.INVALID_SPAN_CONTEXT

    asyncio.run(child())
