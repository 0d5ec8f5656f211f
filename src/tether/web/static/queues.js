// Queues (#/queues): tasks per status, the oldest due task's wait, pauses; pause and resume;
// the limits of flow-controlled queues with their use now (docs/limits.md).
import { ESTIMATE_NOTE, badge, countLink, el, link, route, seconds, table, time } from "./dom.js";
import { getJSON } from "./net.js";

export const refreshMs = 2000;
const STATUSES = ["PENDING", "CLAIMED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "EXPIRED"];

export async function render(view, ctx) {
  const { queues, limits } = await getJSON("api/queues");
  const headers = ["queue", "state", ...STATUSES, "oldest due waits"];
  if (ctx.canAct) headers.push("");
  const rows = queues.map(q => {
    const state = q.paused
      ? el("span", {}, badge("paused"), " since ", time(q.paused_at), q.paused_by ? " by " + q.paused_by : "")
      : badge("active");
    const count = st => q.counts[st]
      ? countLink(route("tasks", { queue: q.queue, status: st }), q.counts[st], (q.estimated || []).includes(st))
      : 0;
    const row = [link(route("tasks", { queue: q.queue }), q.queue), state, ...STATUSES.map(count),
                 seconds(q.oldest_pending_age_s)];
    if (ctx.canAct) {
      const name = q.paused ? "resume-queue" : "pause-queue";
      const button = el("button", { type: "button", "data-queue": q.queue, "data-action": name },
                        q.paused ? "Resume" : "Pause");
      button.addEventListener("click", () => { button.disabled = true; ctx.act(name, { queue: q.queue }); });
      row.push(button);
    }
    return row;
  });
  view.append(el("h2", { text: "Queues" }),
              el("p", { class: "muted", text: "A paused queue keeps its tasks and accepts sends; no worker " +
                                              "claims from it until it is resumed. Running tasks go on." }),
              table(headers, rows, "no queues", { id: "queues" }),
              queues.some(q => q.estimated && q.estimated.length)
                ? el("p", { class: "muted", id: "queues-estimated", text: ESTIMATE_NOTE }) : "");
  if (limits && limits.length) {
    const limitRows = limits.map(l => [
      l.queue,
      l.max_in_flight ? `${l.in_flight} / ${l.max_in_flight}` : String(l.in_flight),
      l.per_key ? String(l.per_key) : "",
      l.keys_in_flight ? String(l.busiest_key_in_flight) : "",
      l.per_key ? String(l.keys_at_limit) : "",
      l.rate_limit ? `${l.rate_limit} per ${l.rate_period_s}s` + (l.burst ? `, burst ${l.burst}` : "") : "",
      l.tokens === null ? "" : l.tokens.toFixed(1),
      l.key_rate_limit
        ? `${l.key_rate_limit} per ${l.key_rate_period_s}s` + (l.key_burst ? `, burst ${l.key_burst}` : "") : "",
      l.keys_out_of_tokens === null ? "" : String(l.keys_out_of_tokens),
      Object.entries(l.key_weights).map(([k, w]) => `${k}=${w}`).join(", "),
    ]);
    view.append(el("h2", { text: "Limits" }),
                el("p", { class: "muted", text: "Flow-controlled queues: tasks CLAIMED or RUNNING now against " +
                                                "each limit (tether queue limit NAME sets them)." }),
                table(["queue", "in flight", "per key", "busiest key", "keys at limit", "rate", "tokens",
                       "rate per key", "keys out of tokens", "weights"],
                      limitRows, "no limits", { id: "limits" }));
  }
}
