"""The recovery rules a worker applies, as the ``rule`` label of tether_recoveries_total.

Each counts tasks whose row the rule changed (docs/monitoring.md#recoveries), never attempts
to change one that matched nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from tether.broker.recovery import Recovered

# The reaper's pass (worker/reaper.py, broker/recovery.py)
EXPIRED: Final = "expired"  # PENDING past good_until -> EXPIRED
STALE_CLAIMED_REQUEUED: Final = "stale_claimed_requeued"  # CLAIMED, claimer silent -> PENDING
STALE_RUNNING_RETRIED: Final = "stale_running_retried"  # RUNNING, runner silent -> PENDING (retry)
STALE_RUNNING_FAILED: Final = "stale_running_failed"  # RUNNING, runner silent -> FAILED (or CANCELLED)
WORKFLOW_STEP_RECONCILED: Final = "workflow_step_reconciled"  # step settled from its terminal task
# CLAIMED or RUNNING, settled as above, of a worker (opted in) whose listener session closed
SESSION_CLOSED: Final = "session_closed"
# The worker itself (worker/dispatch.py, supervisor.py, time_limits.py, cancels.py)
DEAD_CHILD: Final = "dead_child"  # the child running it exited by itself
HUNG_CHILD: Final = "hung_child"  # killed: its heartbeat thread (or event loop) went silent
TIME_LIMIT: Final = "time_limit"  # killed at the task's time limit
CANCELLED_WHILE_RUNNING: Final = "cancelled_while_running"  # killed: ignored its cancel past the grace
# worker/reconcile.py: tasks of a dead worker of this host, recovered at start
STARTUP_RECONCILIATION: Final = "startup_reconciliation"
# worker/isolation.py: work this worker stopped (froze or dropped) when its heartbeats failed
SELF_ISOLATION: Final = "self_isolation"

RULES: Final = (
    EXPIRED,
    STALE_CLAIMED_REQUEUED,
    STALE_RUNNING_RETRIED,
    STALE_RUNNING_FAILED,
    WORKFLOW_STEP_RECONCILED,
    SESSION_CLOSED,
    DEAD_CHILD,
    HUNG_CHILD,
    TIME_LIMIT,
    CANCELLED_WHILE_RUNNING,
    STARTUP_RECONCILIATION,
    SELF_ISOLATION,
)


def of_pass(done: Recovered) -> list[tuple[str, int]]:
    """The tasks a reaper pass recovered, per rule (those it recovered none by left out)."""
    found = (
        (EXPIRED, done.expired),
        (STALE_CLAIMED_REQUEUED, len(done.requeued)),
        (STALE_RUNNING_RETRIED, len(done.retried)),
        (STALE_RUNNING_FAILED, len(done.failed)),
        (WORKFLOW_STEP_RECONCILED, done.workflow_steps),
        (SESSION_CLOSED, len(done.session_closed)),
    )
    return [(rule, n) for rule, n in found if n]
