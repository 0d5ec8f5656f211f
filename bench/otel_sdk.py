"""The OpenTelemetry SDK as an application would run it, for the benchmarks of tracing's cost.

With TETHER_BENCH_OTEL_SDK set, importing ``bench.apps`` or ``bench.async_apps`` installs a
TracerProvider with a BatchSpanProcessor whose exporter drops every span: what a process
pays to make, record and hand off its spans, without the network of a real exporter. Its
sampler is ParentBased(TraceIdRatioBased(TETHER_BENCH_OTEL_RATIO)), 1.0 when unset: a run
follows its send's decision, as in production with a sampled front end.

``install(ratio)`` does the same in the benchmark's own process (the producer), with a
ratio that ``set_ratio`` changes between runs (a process has one tracer provider).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

_ratio = [1.0]


def install_if_asked() -> None:
    if os.environ.get("TETHER_BENCH_IDLE_THREAD"):
        import threading

        threading.Thread(target=threading.Event().wait, daemon=True, name="bench-idle").start()
    if os.environ.get("TETHER_BENCH_OTEL_SDK"):
        install(float(os.environ.get("TETHER_BENCH_OTEL_RATIO", "1.0")))


def set_ratio(ratio: float) -> None:
    _ratio[0] = ratio


def install(ratio: float) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, SamplingResult, TraceIdRatioBased

    class Dropping(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class Ratio(Sampler):
        """TraceIdRatioBased with the ratio of the moment."""

        def __init__(self) -> None:
            self._by_ratio: dict[float, TraceIdRatioBased] = {}

        def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
            ratio = _ratio[0]
            sampler = self._by_ratio.get(ratio) or self._by_ratio.setdefault(ratio, TraceIdRatioBased(ratio))
            return sampler.should_sample(*args, **kwargs)

        def get_description(self) -> str:
            return "bench ratio"

    set_ratio(ratio)
    provider = TracerProvider(sampler=ParentBased(Ratio()))
    provider.add_span_processor(BatchSpanProcessor(Dropping()))
    trace.set_tracer_provider(provider)
