"""The OpenTelemetry SDK as an application would run it, for the benchmarks of tracing's cost.

With TETHER_BENCH_OTEL_SDK set, importing ``bench.apps`` or ``bench.async_apps`` installs a
TracerProvider with a BatchSpanProcessor whose exporter drops every span: what a process
pays to make, record and hand off its spans, without the network of a real exporter.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def install_if_asked() -> None:
    if not os.environ.get("TETHER_BENCH_OTEL_SDK"):
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping()))
    trace.set_tracer_provider(provider)
