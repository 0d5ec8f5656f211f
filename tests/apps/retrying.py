"""The app of the retry-by-hand tests (tests/integration/test_retry.py).

A *gated* task fails with GATE_CLOSED until the test opens its gate (a row in
tether_test_gates), then completes: the test decides when a retried task can succeed,
with no timing involved. Every run writes its token to the ledger (tests.apps.basic), so
tests count how many times each task's code ran.
"""

from __future__ import annotations

from tests.apps import basic
from tests.apps.basic import ledger
from tether import AppConfig, RetryPolicy, TaskError, TaskResult, Tether

app = Tether(AppConfig(queues=["default", "other"]))

GATES_DDL = "CREATE TABLE IF NOT EXISTS tether_test_gates (gate text PRIMARY KEY)"


def gate_open(gate: str) -> bool:
    conn = basic._ledger_connection()
    return conn.execute("SELECT 1 FROM tether_test_gates WHERE gate = %s", (gate,)).fetchone() is not None


def _through(gate: str, token: str, value: int) -> TaskResult[int, TaskError]:
    ledger(token or gate)
    if not gate_open(gate):
        return TaskResult(err=TaskError("GATE_CLOSED", f"gate {gate} is closed", {"gate": gate}))
    return TaskResult(ok=value)


@app.task("retry.gated")
def gated(gate: str, token: str = "", value: int = 1) -> TaskResult[int, TaskError]:
    """GATE_CLOSED until the gate is open, then ``value``. No retry policy."""
    return _through(gate, token, value)


@app.task(
    "retry.gated_policy",
    retry_policy=RetryPolicy.fixed(0.05, max_retries=1, auto_retry_for=["GATE_CLOSED"], jitter=0),
)
def gated_policy(gate: str, token: str = "") -> TaskResult[int, TaskError]:
    """As gated, with one automatic retry of GATE_CLOSED."""
    return _through(gate, token, 1)


@app.task("retry.fail")
def fail(code: str, token: str = "") -> TaskResult[None, TaskError]:
    """Always fails with ``code``."""
    if token:
        ledger(token)
    return TaskResult(err=TaskError(code, "failed on purpose"))


@app.task("retry.number")
def number(value: int) -> TaskResult[int, TaskError]:
    return TaskResult(ok=value)


@app.task("retry.add")
def add(a: int = 0, b: int = 0, token: str = "") -> TaskResult[int, TaskError]:
    if token:
        ledger(token)
    return TaskResult(ok=a + b)


@app.task("retry.report")
def report(upstream: TaskResult[int, TaskError], token: str = "") -> TaskResult[str, TaskError]:
    """Runs anyway (run_anyway=True): says what its dependency did."""
    if token:
        ledger(token)
    return TaskResult(ok="ok" if upstream.is_ok else f"err {upstream.err.code if upstream.err else ''}")


@app.task("retry.sleep")
def sleep(seconds: float, token: str = "") -> TaskResult[float, TaskError]:
    import time

    if token:
        ledger(token)
    time.sleep(seconds)
    return TaskResult(ok=seconds)
