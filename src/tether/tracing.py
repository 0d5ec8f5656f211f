"""OpenTelemetry tracing of sends and runs (docs/monitoring.md#tracing), when enabled.

``AppConfig.tracing`` (TETHER_TRACING) turns it on; it needs the ``tether[otel]`` extra (the
OpenTelemetry API; the application configures the SDK and its exporter). Off, nothing here
imports OpenTelemetry and a send or a run pays one test of a bool (and a send one read of a
context variable).

- A send opens a PRODUCER span (``send <queue>``) around its insert and stores its W3C
  trace context (traceparent, and tracestate after a newline) in the task's row
  (tether_tasks.trace_context, migration 0014). The insert statements read it from the
  context variable set here (``outgoing()``), so no send path passes it along.
- Each run of the task's code in a child is a CONSUMER span (``process <queue>``) parented
  on that context and linked to it, as the messaging semantic conventions allow for a
  single message: every attempt of a task, a retry after a crash included, is in the trace
  of the request that sent it.
- A recovery decided outside the child (a dead, hung or killed child) is a short span
  (``recover <queue>``) in the task's trace with a ``tether.recovery`` event: the crashed
  attempt's own span ended with its process and was never exported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from tether.broker.claims import TaskPayload
    from tether.outcomes import Outcome

T = TypeVar("T")

SYSTEM = "tether"
# The trace context of the send being written, read by the insert statements' parameters.
_outgoing: ContextVar[str | None] = ContextVar("tether_outgoing_trace_context", default=None)
_tracer: Tracer | None = None


def outgoing() -> str | None:
    """The trace context to store with the tasks being inserted now (None: not traced)."""
    return _outgoing.get()


def _otel_tracer() -> Tracer:
    global _tracer
    if _tracer is None:
        from importlib.metadata import version

        from opentelemetry import trace

        _tracer = trace.get_tracer("tether", version("tether"))
    return _tracer


def _carrier_of_current() -> str | None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    parent = carrier.get("traceparent")
    if parent is None:
        return None
    state = carrier.get("tracestate")
    return parent if not state else f"{parent}\n{state}"


def context_of(stored: str | None) -> Context | None:
    """The OpenTelemetry context a task was sent in, from its row's trace_context."""
    if not stored:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent, _, state = stored.partition("\n")
    carrier = {"traceparent": parent}
    if state:
        carrier["tracestate"] = state
    return TraceContextTextMapPropagator().extract(carrier)


def traced_send(plan: Any, write: Callable[[], T]) -> T:
    """``write()`` (a send's insert) inside a PRODUCER span whose context goes into the rows."""
    from opentelemetry.trace import SpanKind

    spec, attributes = _send_attributes(plan)
    with _otel_tracer().start_as_current_span(
        f"send {spec.queue}", kind=SpanKind.PRODUCER, attributes=attributes
    ):
        token = _outgoing.set(_carrier_of_current())
        try:
            return write()
        finally:
            _outgoing.reset(token)


def _send_attributes(plan: Any) -> tuple[Any, dict[str, Any]]:
    """A send plan's (tether.sending) spec, and its span's attributes."""
    spec = getattr(plan, "spec", None) or plan.send.spec
    ids = getattr(plan, "ids", None)
    one = getattr(plan, "task_id", None) or getattr(getattr(plan, "send", None), "task_id", None)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": spec.queue,
        "tether.task.name": spec.name,
    }
    if one is not None:
        attributes["messaging.message.id"] = str(one)
    elif ids is not None:
        attributes["messaging.batch.message_count"] = len(ids)
    return spec, attributes


async def traced_send_async(plan: Any, write: Callable[[], Awaitable[T]]) -> T:
    """traced_send() of a send on the caller's async connection."""
    from opentelemetry.trace import SpanKind

    spec, attributes = _send_attributes(plan)
    with _otel_tracer().start_as_current_span(
        f"send {spec.queue}", kind=SpanKind.PRODUCER, attributes=attributes
    ):
        token = _outgoing.set(_carrier_of_current())
        try:
            return await write()
        finally:
            _outgoing.reset(token)


def _start_attributes(name: str, workflow_id: Any) -> dict[str, Any]:
    return {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "start",
        "tether.workflow.name": name,
        "tether.workflow.id": str(workflow_id),
    }


def traced_start(name: str, workflow_id: Any, write: Callable[[], T]) -> T:
    """A workflow's start in a PRODUCER span: its steps' tasks are sent in that span's trace."""
    from opentelemetry.trace import SpanKind

    with _otel_tracer().start_as_current_span(
        f"start workflow {name}", kind=SpanKind.PRODUCER, attributes=_start_attributes(name, workflow_id)
    ):
        token = _outgoing.set(_carrier_of_current())
        try:
            return write()
        finally:
            _outgoing.reset(token)


async def traced_start_async(name: str, workflow_id: Any, write: Callable[[], Awaitable[T]]) -> T:
    """traced_start() on the caller's async connection."""
    from opentelemetry.trace import SpanKind

    with _otel_tracer().start_as_current_span(
        f"start workflow {name}", kind=SpanKind.PRODUCER, attributes=_start_attributes(name, workflow_id)
    ):
        token = _outgoing.set(_carrier_of_current())
        try:
            return await write()
        finally:
            _outgoing.reset(token)


def _start_consumer(payload: TaskPayload) -> tuple[Span, Context | None]:
    from opentelemetry.trace import Link, SpanKind, get_current_span

    sent_in = context_of(payload.trace_context)
    links = []
    if sent_in is not None:
        links.append(Link(get_current_span(sent_in).get_span_context()))
    span = _otel_tracer().start_span(
        f"process {payload.queue}",
        context=sent_in,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": payload.queue,
            "messaging.message.id": payload.id,
            "tether.task.name": payload.name,
            "tether.task.attempt": payload.attempt,
        },
    )
    return span, sent_in


def _end_consumer(span: Span, outcome: Outcome) -> None:
    from opentelemetry.trace import Status, StatusCode

    status = outcome.settles_as.value.lower()
    span.set_attribute("tether.task.outcome", "retried" if status == "pending" else status)
    if outcome.error_code:
        span.set_attribute("error.type", outcome.error_code)
        if status != "cancelled":
            span.set_status(Status(StatusCode.ERROR, outcome.error_message or outcome.error_code))
    span.end()


@contextlib.contextmanager
def _current(span: Span) -> Iterator[None]:
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        yield


def process(payload: TaskPayload, run: Callable[[], Outcome]) -> Outcome:
    """``run()`` (a sync child's execution of ``payload``) inside its CONSUMER span."""
    span, _ = _start_consumer(payload)
    with _current(span):
        outcome = run()
    _end_consumer(span, outcome)
    return outcome


async def process_async(payload: TaskPayload, run: Callable[[], Awaitable[Outcome]]) -> Outcome:
    """process() for an async child: the span is current in this task's context only."""
    span, _ = _start_consumer(payload)
    with _current(span):
        outcome = await run()
    _end_consumer(span, outcome)
    return outcome


def recovered(task: TaskPayload, rule: str, settled: str) -> None:
    """A recovery decided outside the task's process, as a span with an event in its trace."""
    from opentelemetry.trace import SpanKind

    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "settle",
        "messaging.operation.name": "recover",
        "messaging.destination.name": task.queue,
        "messaging.message.id": task.id,
        "tether.task.name": task.name,
        "tether.task.attempt": task.attempt,
        "tether.recovery.rule": rule,
    }
    span = _otel_tracer().start_span(
        f"recover {task.queue}",
        context=context_of(task.trace_context),
        kind=SpanKind.INTERNAL,
        attributes=attributes,
    )
    span.add_event("tether.recovery", {"tether.recovery.rule": rule, "tether.task.outcome": settled})
    span.end()
