"""An app with tracing on (AppConfig.tracing) for tests/integration/test_tracing.py.

In a worker (TETHER_TEST_SPANS_FILE set), every process of it exports its spans to that file,
one JSON object a line, as they end (a SimpleSpanProcessor: a child killed right after still
leaves what ended before). In the test's own process the test installs the SDK's
InMemorySpanExporter instead.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from tether import AppConfig, ErrorCode, RetryPolicy, TaskError, TaskResult, Tether, current_task

app = Tether(AppConfig(queues=["default"], tracing=True))


class FileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context = span.get_span_context()
            assert context is not None
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "kind": span.kind.name,
                        "trace_id": f"{context.trace_id:032x}",
                        "span_id": f"{context.span_id:016x}",
                        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                        "links": [f"{link.context.span_id:016x}" for link in span.links],
                        "attributes": dict(span.attributes or {}),
                        "events": [[e.name, dict(e.attributes or {})] for e in span.events],
                        "status": span.status.status_code.name,
                        "pid": os.getpid(),
                    },
                    default=str,
                )
                + "\n"
            )
        with open(self.path, "a", encoding="utf-8") as out:  # one write per batch, appended
            out.write("".join(lines))
        return SpanExportResult.SUCCESS


if os.environ.get("TETHER_TEST_SPANS_FILE"):
    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["TETHER_TEST_SPANS_FILE"])))
    trace.set_tracer_provider(_provider)


@app.task("greet")
def greet(name: str) -> TaskResult[str, TaskError]:
    with trace.get_tracer("tests").start_as_current_span("inside greet"):
        return TaskResult(ok=f"hello {name}")


@app.task("greet_async")
async def greet_async(name: str) -> TaskResult[str, TaskError]:
    with trace.get_tracer("tests").start_as_current_span("inside greet_async"):
        return TaskResult(ok=f"hello {name}")


@app.task("refuse")
def refuse() -> TaskResult[None, TaskError]:
    return TaskResult(err=TaskError("REFUSED", "no"))


@app.task(
    "crash_first",
    retry_policy=RetryPolicy.fixed(0.1, max_retries=1, auto_retry_for=[ErrorCode.WORKER_CRASHED], jitter=0),
)
def crash_first() -> TaskResult[int, TaskError]:
    """Its child dies on the first attempt; the retry succeeds."""
    running = current_task()
    assert running is not None
    if running.retry_count == 0:
        os._exit(13)
    return TaskResult(ok=running.retry_count)


@app.task("double")
def double(n: int) -> TaskResult[int, TaskError]:
    return TaskResult(ok=2 * n)


@app.task("linger")
def linger(seconds: float) -> TaskResult[float, TaskError]:
    time.sleep(seconds)
    return TaskResult(ok=seconds)


@app.task("relay")
def relay(n: int) -> TaskResult[str, TaskError]:
    """Sends ``double(n)`` from inside its run (in a span of its own); returns its task id."""
    with trace.get_tracer("tests").start_as_current_span("inside relay"):
        handle = double.send(n)
    return TaskResult(ok=str(handle.id))


@app.task("relay_async")
async def relay_async(n: int) -> TaskResult[str, TaskError]:
    """relay in the async child, where an unsampled send's run finds its context current
    without an attach of its own (tether.tracing.follow_runs)."""
    with trace.get_tracer("tests").start_as_current_span("inside relay_async"):
        handle = await double.send_async(n)
    return TaskResult(ok=str(handle.id))
