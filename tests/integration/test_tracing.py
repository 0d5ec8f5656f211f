"""OpenTelemetry tracing (AppConfig.tracing): a real producer (this process, the SDK's
InMemorySpanExporter) and a real worker (its processes export to a file, tests/apps/traced.py).
The consumer span of each run is parented on, and linked to, the producer span of its send."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.apps.support import load_app_module
from tests.conftest import WorkerFactory, wait_until
from tether import AppConfig, Tether

APP = "tests.apps.traced:app"
WAIT = 30.0
_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This process's spans: the SDK installed once (a process has one tracer provider)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


@pytest.fixture
def traced(database_url: str, db: psycopg.Connection[Any]) -> ModuleType:
    return load_app_module("traced", database_url)


def worker_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def test_each_run_is_a_consumer_span_in_the_trace_of_its_send_sync_async_and_after_a_crash(
    traced: ModuleType,
    db: psycopg.Connection[Any],
    workers: WorkerFactory,
    spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    spans_file = tmp_path / "worker-spans.jsonl"
    workers.start(APP, "--processes", "1", env={"TETHER_TEST_SPANS_FILE": str(spans_file)})
    with trace.get_tracer("tests").start_as_current_span("web request") as request:
        handles = {
            "greet": traced.greet.send("ann"),
            "greet_async": traced.greet_async.send("bob"),
            "refuse": traced.refuse.send(),
            "crash_first": traced.crash_first.send(),
        }
    request_trace = f"{request.get_span_context().trace_id:032x}"
    assert handles["greet"].get(timeout=WAIT).ok == "hello ann"
    assert handles["greet_async"].get(timeout=WAIT).ok == "hello bob"
    assert handles["refuse"].get(timeout=WAIT).err.code == "REFUSED"
    assert handles["crash_first"].get(timeout=WAIT).ok == 1

    # The producer side: one PRODUCER span per send, in the request's trace, its context stored.
    sent = {
        s.attributes["tether.task.name"]: s for s in spans.get_finished_spans() if s.name == "send default"
    }
    assert set(sent) == set(handles)
    for name, span in sent.items():
        assert span.kind is trace.SpanKind.PRODUCER
        assert span.parent is not None and span.parent.span_id == request.get_span_context().span_id
        attrs = dict(span.attributes or {})
        assert attrs["messaging.system"] == "tether" and attrs["messaging.operation.type"] == "send"
        assert attrs["messaging.destination.name"] == "default"
        assert attrs["messaging.message.id"] == str(handles[name].id)
        trace_id, span_id = hex_ids(span)
        stored = db.execute(
            "SELECT trace_context FROM tether_tasks WHERE id = %s", (handles[name].id,)
        ).fetchone()
        assert stored["trace_context"].split("-")[1:3] == [trace_id, span_id]
        assert trace_id == request_trace

    # The worker side: a CONSUMER span per run, parented on and linked to its send's span.
    def consumer_spans() -> list[dict[str, Any]]:
        return [s for s in worker_spans(spans_file) if s["kind"] == "CONSUMER"]

    wait_until(lambda: len(consumer_spans()) >= 4, message="the worker's consumer spans")
    by_task: dict[str, list[dict[str, Any]]] = {}
    for span in consumer_spans():
        by_task.setdefault(span["attributes"]["tether.task.name"], []).append(span)
    for name, runs in by_task.items():
        producer_trace, producer_span = hex_ids(sent[name])
        for run in runs:
            assert run["name"] == "process default"
            assert run["trace_id"] == producer_trace == request_trace
            assert run["parent_id"] == producer_span and run["links"] == [producer_span]
            attrs = run["attributes"]
            assert attrs["messaging.system"] == "tether" and attrs["messaging.operation.type"] == "process"
            assert attrs["messaging.destination.name"] == "default"
            assert attrs["messaging.message.id"] == str(handles[name].id)
    assert [r["attributes"]["tether.task.outcome"] for r in by_task["greet"]] == ["completed"]
    assert [r["attributes"]["tether.task.outcome"] for r in by_task["greet_async"]] == ["completed"]
    (refused,) = by_task["refuse"]
    assert refused["attributes"]["tether.task.outcome"] == "failed" and refused["status"] == "ERROR"
    assert refused["attributes"]["error.type"] == "REFUSED"
    # The crashed attempt's span died with its child; the retry is the second consumer span
    # of the same trace (attempt 2), and the recovery of the first is a span there too.
    (retry,) = by_task["crash_first"]
    assert retry["attributes"]["tether.task.attempt"] == 2
    assert retry["attributes"]["tether.task.outcome"] == "completed"
    (recovery,) = [s for s in worker_spans(spans_file) if s["name"] == "recover default"]
    assert recovery["trace_id"] == request_trace and recovery["parent_id"] == hex_ids(sent["crash_first"])[1]
    assert recovery["attributes"]["tether.task.attempt"] == 1
    [[event, event_attrs]] = recovery["events"]
    assert event == "tether.recovery" and event_attrs["tether.recovery.rule"] == "dead_child"
    # The task's own spans nest in its run's span, in the sync and the async child.
    inner = {s["name"]: s for s in worker_spans(spans_file) if s["name"].startswith("inside")}
    assert inner["inside greet"]["parent_id"] == by_task["greet"][0]["span_id"]
    assert inner["inside greet_async"]["parent_id"] == by_task["greet_async"][0]["span_id"]


def test_the_steps_of_a_workflow_run_in_the_trace_of_its_start(
    traced: ModuleType, workers: WorkerFactory, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    spans_file = tmp_path / "worker-spans.jsonl"
    workers.start(APP, "--processes", "1", env={"TETHER_TEST_SPANS_FILE": str(spans_file)})
    first = traced.double.node(args=(1,), name="first")
    second = traced.double.node(args_from={"n": first}, name="second")  # sent by the worker
    handle = traced.app.workflow("twice", [first, second]).start()
    assert handle.get(timeout=WAIT).ok == 4
    (start,) = [s for s in spans.get_finished_spans() if s.name == "start workflow twice"]
    assert start.kind is trace.SpanKind.PRODUCER
    assert dict(start.attributes or {})["tether.workflow.id"] == str(handle.id)
    trace_id, span_id = hex_ids(start)
    runs = wait_until(
        lambda: len(r := [s for s in worker_spans(spans_file) if s["kind"] == "CONSUMER"]) == 2 and r,
        message="both steps' consumer spans",
    )
    assert all(r["trace_id"] == trace_id and r["parent_id"] == span_id for r in runs), runs


@pytest.mark.parametrize("relay", ["relay", "relay_async"])  # a sync child, the async child
def test_a_run_whose_send_was_not_sampled_records_nothing_and_what_it_sends_follows_that_decision(
    relay: str,
    traced: ModuleType,
    db: psycopg.Connection[Any],
    workers: WorkerFactory,
    spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    """The unsampled run skips the SDK (tracing.py) but must still make its send's context
    current: a task it sends carries the same trace, unsampled, instead of a new root trace
    that the worker's sampler would decide again."""
    spans_file = tmp_path / "worker-spans.jsonl"
    workers.start(APP, "--processes", "1", env={"TETHER_TEST_SPANS_FILE": str(spans_file)})
    request_trace = 0x0AF7651916CD43DD8448EB211C80319C
    not_sampled = trace.NonRecordingSpan(
        trace.SpanContext(request_trace, 0x00F067AA0BA902B7, is_remote=True, trace_flags=trace.TraceFlags(0))
    )
    token = otel_context.attach(trace.set_span_in_context(not_sampled))
    try:
        handle = getattr(traced, relay).send(21)
    finally:
        otel_context.detach(token)
    sent_id = handle.get(timeout=WAIT).ok
    assert traced.app.handle(sent_id).get(timeout=WAIT).ok == 42
    rows = db.execute(
        "SELECT id::text AS id, trace_context FROM tether_tasks WHERE id = ANY(%s::uuid[])",
        ([str(handle.id), sent_id],),
    ).fetchall()
    stored = {row["id"]: row["trace_context"] for row in rows}
    for task_id in (str(handle.id), sent_id):
        version, trace_id, _span_id, flags = stored[task_id].split("-")
        assert (version, trace_id, flags) == ("00", f"{request_trace:032x}", "00"), stored
    # The worker's SDK samples every root trace: only the second task's run, in the same
    # unsampled trace, would have shown a span had the decision not been followed.
    assert spans.get_finished_spans() == ()
    assert worker_spans(spans_file) == []


@pytest.mark.timing
def test_the_reaper_s_recovery_log_line_carries_the_trace_of_the_task_it_recovered(
    traced: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory, spans: InMemorySpanExporter
) -> None:
    fast = {
        "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
        "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
        "TETHER_CHECK_INTERVAL_MS": "1000",
    }
    a = workers.start(APP, "--processes", "1", env=fast)
    handle = traced.linger.send(60)
    (sent,) = [s for s in spans.get_finished_spans() if s.name == "send default"]
    trace_id, span_id = hex_ids(sent)
    wait_until(
        lambda: (
            db.execute("SELECT status FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone()["status"]
            == "RUNNING"
        ),
        message="the task to run",
    )
    b = workers.start(APP, "--processes", "1", "--log-format", "json", env=fast)
    a.kill()  # its whole process group: only B's reaper can recover the task
    assert handle.get(timeout=WAIT).err.code == "WORKER_CRASHED"

    def recovery_line() -> dict[str, Any] | None:
        for line in b.log().splitlines():
            if line.startswith("{") and str(handle.id) in line and "no runner heartbeat" in line:
                return dict(json.loads(line))
        return None

    line = wait_until(recovery_line, timeout=10, message="B's recovery line")
    assert (line["task_id"], line["trace_id"], line["span_id"]) == (str(handle.id), trace_id, span_id)


def test_without_tracing_no_context_is_stored_and_opentelemetry_is_not_imported(
    database_url: str, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    import subprocess
    import sys

    from tether import PostgresConfig

    app = Tether(AppConfig(broker=PostgresConfig(database_url=database_url)))
    assert app.config.tracing is False
    task = app.task("plain")(lambda: None)
    handle = task.send()
    assert db.execute("SELECT trace_context FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone() == {
        "trace_context": None
    }
    app.close()
    # A process that sends and runs without tracing never imports OpenTelemetry.
    code = (
        "import sys, tether.worker.main, tether.sending.route, tether.worker.execute;"
        "print(any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
