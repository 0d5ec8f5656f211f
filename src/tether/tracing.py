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

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, Tracer

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


class _Run:
    """What the consumer path uses of OpenTelemetry, looked up once: a run pays for its span,
    not for imports and attribute lookups (about 45 us a run before, measured with the SDK)."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import (
            Link,
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = _otel_tracer()
        self.attach, self.detach = context.attach, context.detach
        self.in_context = trace.set_span_in_context
        self.span_of = trace.get_current_span
        self.link, self.consumer = Link, SpanKind.CONSUMER
        self.status, self.error_code = Status, StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()
        self.non_recording = NonRecordingSpan
        self._span_context, self._flags, self._state = SpanContext, TraceFlags, TraceState
        # The two flags a traceparent carries today (sampled or not), made once: a run pays
        # for its span context, not for a TraceFlags per run.
        self._flags_of = {0: TraceFlags(0), 1: TraceFlags(1)}
        self.unsampled_send = _unsampled_send_class(NonRecordingSpan, self.remote)
        self.current = context.get_current
        # follow_runs(): the context an async child attaches once, whose span is the send of
        # whichever run is current; None until then.
        self.following: Context | None = None

    def remote(self, stored: str) -> SpanContext | None:
        """The send's span context from the stored traceparent ("00-<32 hex>-<16 hex>-<2 hex>",
        tracestate after a newline), parsed here: the propagator's regular expressions and
        carrier round trip cost a run more than the rest of its span."""
        parent, _, state = stored.partition("\n")
        parts = parent.split("-")
        try:
            trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        except (IndexError, ValueError):
            return None
        if len(parts) != 4 or not trace_id or not span_id:
            return None
        return self._span_context(
            trace_id,
            span_id,
            is_remote=True,
            trace_flags=self._flags_of.get(flags) or self._flags(flags),
            trace_state=self._state.from_header([state]) if state else None,
        )


_run: _Run | None = None


def _unsampled_send_class(base: type[NonRecordingSpan], parse: Callable[[str], SpanContext | None]) -> Any:
    """A non-recording span for a send that was not sampled, which parses its stored context
    only when something asks for it (a send or a call from inside the run, a log line):
    most unsampled runs never do, and the parse was most of what such a run paid."""
    from opentelemetry.trace import INVALID_SPAN_CONTEXT

    class UnsampledSend(base):  # type: ignore[valid-type, misc]
        def __init__(self, stored: str) -> None:
            self._stored = stored
            self._context: SpanContext | None = None

        def get_span_context(self) -> SpanContext:
            if self._context is None:
                self._context = parse(self._stored) or INVALID_SPAN_CONTEXT
            return self._context

    return UnsampledSend


# The sampled bit of every two-character hex flags field, either case: a dictionary lookup
# costs a run less than int() and its try (0.1 us against 0.45 us a run).
_HEX = "0123456789abcdefABCDEF"
_SAMPLED_OF = {a + b: bool(int(a + b, 16) & 1) for a in _HEX for b in _HEX}


def _current_run_send_class(base: type[NonRecordingSpan], parse: Callable[[str], SpanContext | None]) -> Any:
    """A non-recording span standing for the send of the run current where it is asked
    (tether.current_task(), set in each run's asyncio task), when that send was not sampled."""
    from opentelemetry.trace import INVALID_SPAN_CONTEXT

    from tether.current import current_task

    class CurrentRunSend(base):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__(INVALID_SPAN_CONTEXT)
            self._last: tuple[str | None, SpanContext] = (None, INVALID_SPAN_CONTEXT)

        def get_span_context(self) -> SpanContext:
            task = current_task()
            stored = task._trace_context if task is not None else None
            if not stored:
                return INVALID_SPAN_CONTEXT  # not in a run, or a run sent untraced
            last_stored, last = self._last
            if stored != last_stored:  # runs interleave: parsed again when asked again
                last = parse(stored) or INVALID_SPAN_CONTEXT
                self._last = (stored, last)
            return last

    return CurrentRunSend


def follow_runs() -> None:
    """Make current, for good in the caller's context (an async child's, before it starts any
    run), a span that stands for the send of whichever run is current when something asks.
    A run whose send was not sampled then finds its context already current (enter_run):
    it needs no span, context or attach of its own, which were most of what such a run paid
    (about 4 us of a 15 us no-op run in an event loop, bench/tracing_path.py). A sampled run,
    or one sent untraced, attaches its own context over it in its own asyncio task."""
    global _run
    run = _run or (_run := _Run())
    if run.following is None or run.current() is not run.following:
        run.following = run.in_context(_current_run_send_class(run.non_recording, run.remote)())
        run.attach(run.following)


def _sampled_flag(stored: str) -> bool | None:
    """The sampled bit of a stored version-00 traceparent ("00-<32 hex>-<16 hex>-<2 hex>",
    tracestate after a newline) read from its last two characters, or None when the text
    is not in that shape (then it is parsed whole)."""
    if len(stored) < 55 or stored[52] != "-" or (len(stored) > 55 and stored[55] != "\n"):
        return None
    return _SAMPLED_OF.get(stored[53:55])


def _consumer(payload: TaskPayload) -> tuple[Span, Context]:
    """The run's CONSUMER span, and the context that makes it current (not attached yet)."""
    global _run
    run = _run or (_run := _Run())
    sent_in = None
    links = None
    stored = payload.trace_context
    if stored and _sampled_flag(stored) is False:
        # Its send was not sampled: the run is not recorded either (what ParentBased, the
        # SDK's default sampler, decides), without asking the SDK. The send's context is
        # still made current, so what the run sends or calls follows the same decision.
        unsampled: Span = run.unsampled_send(stored)
        return unsampled, run.in_context(unsampled)
    if stored:
        sent = run.remote(stored)
        if sent is not None:
            sent_span = run.non_recording(sent)
            sent_in = run.in_context(sent_span)
            if not sent.trace_flags.sampled:
                # Its send was not sampled: the run is not recorded either (what ParentBased,
                # the SDK's default sampler, decides), without asking the SDK: its sampling
                # and span objects cost an unsampled run about 10 us of the 14. The send's
                # context is still made current, so what the run sends or calls follows
                # the same decision.
                return sent_span, sent_in
            links = [run.link(sent)]
    span = run.tracer.start_span(
        "process " + payload.queue,
        context=sent_in,
        kind=run.consumer,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.destination.name": payload.queue,
            "messaging.message.id": payload.id,
            "tether.task.name": payload.name,
            "tether.task.attempt": payload.attempt,
        },
    )
    return span, run.in_context(span)


_OUTCOME_OF = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "PENDING": "retried"}


def _end_consumer(span: Span, outcome: Outcome) -> None:
    if not span.is_recording():  # an unsampled run: nothing to set or end
        return
    run = _run
    assert run is not None
    settles = outcome.settles_as.value
    # A durable sleep or wait (docs/durable-steps.md) leaves the task PENDING too: not a retry.
    shown = "suspended" if outcome.suspension is not None else _OUTCOME_OF.get(settles, settles.lower())
    span.set_attribute("tether.task.outcome", shown)
    if outcome.error_code:
        span.set_attribute("error.type", outcome.error_code)
        if settles != "CANCELLED":
            span.set_status(run.status(run.error_code, outcome.error_message or outcome.error_code))
    span.end()


def process(payload: TaskPayload, run: Callable[[], Outcome]) -> Outcome:
    """``run()`` (a sync child's execution of ``payload``) inside its CONSUMER span."""
    span, current = _consumer(payload)
    attached = _run.attach(current)  # type: ignore[union-attr]
    try:
        outcome = run()
    except BaseException:
        _run.detach(attached)  # type: ignore[union-attr]
        span.end()
        raise
    _run.detach(attached)  # type: ignore[union-attr]
    _end_consumer(span, outcome)
    return outcome


def enter_run(payload: TaskPayload) -> Span | None:
    """The CONSUMER span of a run in an async child, made current for good in the caller's
    context: the asyncio task made for this one run (AsyncChild), whose copy of the context
    ends with it. Nothing is detached, and the run needs no wrapping coroutine. None: the
    run's send was not sampled and its context is current already (follow_runs), so there is
    nothing to make current or to end. Else end the span with leave_run (or span.end())."""
    run = _run
    stored = payload.trace_context
    if (
        stored
        and run is not None
        and run.following is not None
        and (
            _SAMPLED_OF.get(stored[53:55])
            if len(stored) == 55 and stored[52] == "-"
            else _sampled_flag(stored)
        )
        is False
        and run.current() is run.following
    ):
        return None
    span, current = _consumer(payload)
    _run.attach(current)  # type: ignore[union-attr]
    return span


def leave_run(span: Span, outcome: Outcome) -> None:
    """The run's outcome on its span (enter_run), which ends; nothing for an unsampled run."""
    _end_consumer(span, outcome)


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
