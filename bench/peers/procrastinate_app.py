"""The procrastinate app of the peers bench: ``procrastinate --app bench.peers.procrastinate_app.app worker``.

``noop`` (sync: procrastinate runs a sync task in a thread of its asyncio worker),
``anoop`` (``async def``, returns at once) and ``hold(seconds)`` (awaits ``asyncio.sleep``).
The database comes from PROCRASTINATE_BENCH_DSN. The worker's heartbeat interval and
stalled-worker timeout come from PROCRASTINATE_BENCH_HEARTBEAT_S / _STALLED_S when set
(procrastinate's defaults: 10 s and 30 s); its CLI has no option for them, so they are
the app's ``worker_defaults``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from procrastinate import App, PsycopgConnector

_defaults: dict[str, Any] = {}
if os.environ.get("PROCRASTINATE_BENCH_HEARTBEAT_S"):
    _defaults["update_heartbeat_interval"] = float(os.environ["PROCRASTINATE_BENCH_HEARTBEAT_S"])
if os.environ.get("PROCRASTINATE_BENCH_STALLED_S"):
    _defaults["stalled_worker_timeout"] = float(os.environ["PROCRASTINATE_BENCH_STALLED_S"])

app = App(
    connector=PsycopgConnector(conninfo=os.environ.get("PROCRASTINATE_BENCH_DSN", "")),
    worker_defaults=_defaults,  # type: ignore[arg-type]
)


@app.task(name="noop")
def noop() -> None:
    return None


@app.task(name="anoop")
async def anoop() -> None:
    return None


@app.task(name="hold")
async def hold(seconds: float) -> None:
    await asyncio.sleep(seconds)
