// The overview (#/): what `tether status` shows, from /api/status, its charts (charts.js,
// from /api/charts; #/?range=24h for the last day), and manual recovery (`tether recover`:
// a dry run first, then the real one when confirmed).
import { ESTIMATE_NOTE, countLink, dryRunButton, el, link, route, seconds, table, taskLink, time } from "./dom.js";
import { getJSON } from "./net.js";
import { section } from "./charts.js";

const STATUSES = ["PENDING", "CLAIMED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "EXPIRED"];

export const refreshMs = 2000;

export async function render(view, ctx) {
  // The charts are read beside the status; if they cannot be, the tables still show.
  const [s, charts] = await Promise.all([
    getJSON("api/status"),
    section(view, ctx.params).catch(err => el("p", { class: "error", id: "charts-error",
                                                       text: "charts: " + err.message })),
  ]);
  const perQueue = new Map();
  for (const c of s.counts) {
    if (!perQueue.has(c.queue)) perQueue.set(c.queue, {});
    perQueue.get(c.queue)[c.status] = c;
  }
  const count = (q, st) => {
    const c = perQueue.get(q)[st];
    return c && c.n ? countLink(route("tasks", { queue: q, status: st }), c.n, c.estimated) : 0;
  };
  view.append(
    el("h2", { text: "Tasks per queue" }),
    table(["queue", ...STATUSES],
          [...perQueue.keys()].sort().map(q => [link(route("tasks", { queue: q }), q),
                                                ...STATUSES.map(st => count(q, st))]),
          "no tasks", { id: "counts" }),
    s.counts.some(c => c.estimated) ? el("p", { class: "muted", id: "counts-estimated", text: ESTIMATE_NOTE }) : "",
    charts,
    el("h2", { text: "Workers" }),
    table(["id", "status", "queues", "processes", "async processes", "claimed", "running", "heartbeat age"],
          s.workers.map(w => [w.id, w.status, w.queues.join(","), w.processes,
                              w.async_processes ? `${w.async_processes} x ${w.async_concurrency}` : "0",
                              w.claimed, w.running, seconds(w.heartbeat_age_s)]),
          "no active workers", { id: "workers" }),
    el("h2", { id: "stale-title",
               text: `Stale tasks (RUNNING, no runner heartbeat for over ${s.running_stale_threshold_s} s)` }),
    table(["task", "name", "worker", "host", "worker status", "silent"],
          s.stale_tasks.map(t => [taskLink(t.id), t.name, t.worker_id, t.worker_hostname, t.worker_status,
                                  seconds(t.silent_s)]),
          "none", { id: "stale" }),
    ctx.canAct ? recover(ctx) : "",
    el("h2", {}, "Recent failures ", link(route("tasks", { status: "FAILED" }), "(all)")),
    table(["failed at", "task", "name", "queue", "attempt", "error", "message"],
          s.recent_failures.map(f => [time(f.failed_at), taskLink(f.id), f.name, f.queue, f.attempt,
                                      f.error_code ? link(route("tasks", { status: "FAILED", error_code: f.error_code }),
                                                          f.error_code) : "",
                                      f.error_message]),
          "none", { id: "failures" }),
    el("h2", { text: "Schedules" }),
    table(["name", "task", "cron", "time zone", "next slot", "last slot", "last task", "state", "sent", "skipped"],
          s.schedules.map(x => [x.name, x.task_name, x.cron, x.timezone, time(x.next_slot), time(x.last_slot),
                                x.last_task_id ? taskLink(x.last_task_id, x.last_task_status || "?") : "",
                                x.removed_at ? "removed" : (x.paused ? "paused" : "active"),
                                x.slots_sent, x.slots_skipped]),
          "no periodic tasks", { id: "schedules" }),
  );
}

// "Recover now…": the dry run says what recovery would do; "Recover" does it.
function recover(ctx) {
  return dryRunButton(ctx, {
    label: "Recover now…",
    ids: { box: "recover-box", start: "recover", panel: "recover-preview", confirm: "confirm-recover" },
    action: "recover",
    body: {},
    preview: dry => dry.tasks.length ? el("p", {}, "Tasks: ",
      ...dry.tasks.map(t => [taskLink(t.id), ` ${t.action} `])) : null,
    confirmLabel: () => "Recover",
  });
}
