// One task (#/task/<id>): its fields, arguments, result or error with its traceback, its
// current durable sleep or wait, attempts and heartbeats on a timeline (timeline.js), every
// attempt, its recorded steps,
// the latest heartbeats, the workflow it is a step of; cancel, retry (from its last
// recorded step) and retry from scratch.
import { badge, confirmButton, el, fields, json, link, route, table, time, workflowLink } from "./dom.js";
import { getJSON } from "./net.js";
import { timeline } from "./timeline.js";

export const refreshMs = 2000;

const OPEN = new Set(["PENDING", "CLAIMED", "RUNNING"]);
const RETRYABLE = new Set(["FAILED", "CANCELLED", "EXPIRED"]);

export async function render(view, ctx) {
  const id = ctx.arg;
  const { task: t, attempts, steps, steps_total: stepsTotal, heartbeats, timeline_heartbeats: beats, now } =
    await getJSON("api/tasks/" + encodeURIComponent(id));
  view.append(el("h2", {}, "Task ", el("span", { text: t.name }), " ", badge(t.status)));
  view.dataset.status = t.status;
  view.append(actions(t, stepsTotal, ctx));
  const finished = t.completed_at || t.failed_at || t.cancelled_at || t.expired_at;
  view.append(fields([
    ["id", el("code", { text: t.id })],
    ["status", badge(t.status), "status"],
    // A PENDING task after a durable sleep or a wait: what it waits for, the line
    // `tether task ID` prints after "Suspended:" (docs/durable-steps.md).
    ["suspended", t.suspension ? t.suspension.state : null, "suspension"],
    ["name", link(route("tasks", { name: t.name }), t.name)],
    ["queue", link(route("tasks", { queue: t.queue }), t.queue)],
    ["priority", t.priority],
    ["attempt", t.attempt],
    ["retries", `${t.retry_count} of ${t.max_retries}`],
    ["error code", t.error_code, "error_code"],
    ["workflow", t.workflow_id ? el("span", {}, "step ", el("b", { text: t.step_name || "?" }), " of ",
                                    workflowLink(t.workflow_id, t.workflow_name || t.workflow_id),
                                    " ", t.workflow_status ? badge(t.workflow_status) : "") : null, "workflow"],
    ["sent", time(t.sent_at)],
    ["runs from", t.run_at !== t.sent_at ? time(t.run_at) : null],
    ["good until", time(t.good_until)],
    ["claimed", time(t.claimed_at)],
    ["started", time(t.started_at)],
    ["finished", time(finished)],
    ["next retry at", time(t.next_retry_at)],
    ["worker", t.claimed_by_worker_id ? link(route("workers"), t.claimed_by_worker_id) : null],
    ["cancel requested", t.cancel_requested_at ? el("span", {}, time(t.cancel_requested_at),
                                                    t.cancel_requested_by ? " by " + t.cancel_requested_by : "") : null,
     "cancel_requested"],
    ["progress", t.progress !== null && t.progress !== undefined ?
      el("span", {}, JSON.stringify(t.progress), " ", el("span", { class: "muted" }, "at ", time(t.progress_at))) : null],
    ["unique key", t.unique_key],
    ["schedule", t.schedule_name ? `${t.schedule_name} (slot ${t.schedule_slot})` : null],
    ["retry policy", t.retry_policy ? JSON.stringify(t.retry_policy) : null],
    ["updated", time(t.updated_at)],
  ], { id: "task-fields" }));

  view.append(el("h3", { text: "Arguments" }),
              el("div", { id: "task-args" }, "args ", json(t.args), "kwargs ", json(t.kwargs)));
  view.append(el("h3", { text: "Result" }), result(t.result));

  view.append(el("h3", { text: "Timeline" }),
              el("div", { id: "task-timeline" }, timeline(t, attempts, beats, now),
                 el("p", { class: "muted", text: "Each attempt from its start to its end (the one in flight up to " +
                                                  "now); a tick per heartbeat, by role (the latest " +
                                                  `${beats.length}); the dashed line is its sending.` })));
  view.append(el("h3", { text: "Attempts" }), table(
    ["attempt", "outcome", "will retry", "error", "message", "worker", "host", "pid", "started", "finished"],
    attempts.map(a => [a.attempt, badge(a.outcome), a.will_retry ? "yes" : "no", a.error_code || "",
                       a.error_message || "", a.worker_id || "", a.hostname || "", a.pid ?? "",
                       time(a.started_at), time(a.finished_at)]),
    "no finished attempt", { id: "attempts" }));
  view.append(el("h3", { text: "Steps" }), table(
    ["step", "#", "attempt", "recorded", "bytes"],
    steps.map(s => [s.name, s.occurrence, s.attempt, time(s.written_at), s.size]),
    "no recorded step", { id: "steps" }));
  if (stepsTotal > steps.length) {
    view.append(el("p", { class: "muted", id: "steps-more",
                          text: `the first ${steps.length} of ${stepsTotal} steps (tether task ${t.id} lists them all)` }));
  }
  view.append(el("h3", { text: "Latest heartbeats" }), table(
    ["sent", "role", "sender", "host", "pid"],
    heartbeats.map(h => [time(h.sent_at), h.role, h.sender_id, h.hostname, h.pid]),
    "none", { id: "heartbeats" }));
}

function result(value) {
  const box = el("div", { id: "task-result" });
  if (value === null || value === undefined) {
    box.append(el("p", { class: "muted", text: "none yet" }));
  } else if (value.err) {
    const err = value.err;
    const data = err.data && typeof err.data === "object" && !Array.isArray(err.data) ? { ...err.data } : err.data;
    const traceback = data && typeof data === "object" && typeof data.traceback === "string" ? data.traceback : null;
    if (traceback) delete data.traceback;
    box.append(fields([["error code", err.code], ["message", err.message]]));
    if (data !== null && data !== undefined && !(typeof data === "object" && Object.keys(data).length === 0)) {
      box.append(el("div", {}, "data ", json(data)));
    }
    if (traceback) box.append(el("div", {}, "traceback", el("pre", { class: "traceback", text: traceback })));
  } else if ("ok" in value) {
    box.append(el("div", {}, "ok ", json(value.ok)));
  } else {
    box.append(json(value));
  }
  return box;
}

function actions(t, stepsTotal, ctx) {
  const bar = el("div", { class: "actions", id: "task-actions" });
  if (!ctx.canAct) return bar;
  if (OPEN.has(t.status)) {
    if (t.status === "RUNNING" && t.cancel_requested_at) {
      bar.append(el("span", { class: "muted", text: "cancel requested: it ends CANCELLED when its code stops" }));
    } else {
      const question = t.status === "RUNNING" ? "Ask its code to stop? It ends CANCELLED." : "Cancel it? None of its code will run.";
      bar.append(confirmButton("Cancel task", question, "Yes, cancel it",
        () => ctx.act("cancel-task", { task_id: t.id }), ctx, { class: "danger", id: "cancel-task" }));
    }
  }
  if (RETRYABLE.has(t.status)) {
    // A retry keeps the recorded steps: the new attempt resumes after the last one.
    const retry = el("button", { type: "button", id: "retry-task",
                                 title: stepsTotal ? `resumes after its ${stepsTotal} recorded step(s)` : null },
                     "Retry task");
    retry.addEventListener("click", async () => {
      retry.disabled = true;
      await ctx.act("retry-task", { task_id: t.id });
    });
    bar.append(retry);
    if (stepsTotal) {
      bar.append(confirmButton("Retry from scratch",
        `Delete its ${stepsTotal} recorded step(s) and run every step again?`, "Yes, from scratch",
        () => ctx.act("retry-task", { task_id: t.id, from_scratch: true }), ctx, { id: "retry-from-scratch" }));
    }
  }
  return bar;
}
