"""The consumer span's reading of a stored trace context (tether.tracing), without a worker:
the unsampled shortcut must agree with the full parse on every shape the text can have."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from tether import tracing

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
