// Workers (#/workers, #/workers?all=1): the registry, and the tasks each worker holds now.
import { badge, el, link, route, seconds, table, taskLink, time } from "./dom.js";
import { getJSON } from "./net.js";

export const refreshMs = 2000;

export async function render(view, ctx) {
  const everyone = ctx.params.get("all") === "1";
  const { workers, in_flight: held } = await getJSON("api/workers" + (everyone ? "?all=1" : ""));
  const toggle = everyone ? link(route("workers"), "active workers only")
                          : link(route("workers", { all: "1" }), "show stopped and inactive workers too");
  view.append(el("h2", { text: "Workers" }), el("p", {}, toggle), table(
    ["id", "status", "host", "pid", "queues", "processes", "async processes", "started", "heartbeat age",
     "claimed", "running"],
    workers.map(w => [w.id, badge(w.status), w.hostname, w.pid, w.queues.join(", "), w.processes,
                      w.async_processes ? `${w.async_processes} x ${w.async_concurrency}` : "0",
                      time(w.started_at), seconds(w.heartbeat_age_s), w.claimed, w.running]),
    everyone ? "no workers" : "no active workers", { id: "worker-list" }));
  view.append(el("h3", { text: "Tasks held now" }), table(
    ["worker", "task", "name", "queue", "status", "attempt", "claimed", "started", "progress"],
    held.map(t => [t.claimed_by_worker_id || "", taskLink(t.id), t.name, t.queue,
                   el("span", {}, badge(t.status), t.cancel_requested_at ? " cancel requested" : ""),
                   t.attempt, time(t.claimed_at), time(t.started_at),
                   t.progress === null || t.progress === undefined ? "" : JSON.stringify(t.progress)]),
    "no task is claimed or running", { id: "in-flight" }));
}
