// The task list (#/tasks?status=&queue=&name=&error_code=&since=&until=&before=): filters,
// a page at a time by keyset (the next page is the tasks below the last id shown), and a
// bulk retry of what the filter matches, tried as a dry run first.
import { badge, dryRunButton, el, link, route, table, taskLink, time, workflowLink } from "./dom.js";
import { getJSON } from "./net.js";

export const refreshMs = 0; // a list does not move under the reader: "Refresh" reads it again

const FILTERS = ["status", "queue", "name", "error_code", "since", "until"];
const STATUS_CHOICES = [
  ["", "any status"], ["PENDING", "PENDING"], ["CLAIMED", "CLAIMED"], ["RUNNING", "RUNNING"],
  ["CLAIMED,RUNNING", "in flight (CLAIMED, RUNNING)"], ["COMPLETED", "COMPLETED"], ["FAILED", "FAILED"],
  ["CANCELLED", "CANCELLED"], ["EXPIRED", "EXPIRED"], ["FAILED,CANCELLED,EXPIRED", "ended without success"],
];
const RETRYABLE = new Set(["FAILED", "CANCELLED", "EXPIRED"]);

function pad(n) { return String(n).padStart(2, "0"); }

// An ISO time (UTC) as a datetime-local input's value in the browser's zone, and back.
function toLocalInput(iso) {
  const at = new Date(iso);
  if (!iso || Number.isNaN(at.getTime())) return "";
  return `${at.getFullYear()}-${pad(at.getMonth() + 1)}-${pad(at.getDate())}T${pad(at.getHours())}:${pad(at.getMinutes())}`;
}

function fromLocalInput(value) {
  if (!value) return "";
  const at = new Date(value); // a datetime-local value is read in the browser's zone
  return Number.isNaN(at.getTime()) ? "" : at.toISOString();
}

function filtersOf(params) {
  const found = {};
  for (const key of FILTERS) if (params.get(key)) found[key] = params.get(key);
  return found;
}

function filterForm(current) {
  const select = el("select", { name: "status", id: "filter-status" });
  for (const [value, label] of STATUS_CHOICES) {
    select.appendChild(el("option", { value, selected: (current.status || "") === value }, label));
  }
  if (current.status && !STATUS_CHOICES.some(([v]) => v === current.status)) {
    select.appendChild(el("option", { value: current.status, selected: true }, current.status));
  }
  const text = (key, label) => el("label", {}, label,
    el("input", { type: "text", name: key, id: "filter-" + key, value: current[key] || "" }));
  const when = (key, label) => el("label", {}, label,
    el("input", { type: "datetime-local", name: key, id: "filter-" + key, value: toLocalInput(current[key]) }));
  const form = el("form", { class: "filters", id: "task-filters" },
    el("label", {}, "status", select), text("queue", "queue"), text("name", "task name"),
    text("error_code", "error code"), when("since", "made since"), when("until", "made before"),
    el("button", { type: "submit", class: "primary" }, "Apply"),
    link(route("tasks"), "Clear"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(form);
    const wanted = {};
    for (const key of FILTERS) {
      const value = String(data.get(key) || "").trim();
      wanted[key] = key === "since" || key === "until" ? fromLocalInput(value) : value;
    }
    if (current.limit) wanted.limit = current.limit;
    location.hash = route("tasks", wanted);
  });
  return form;
}

export async function render(view, ctx) {
  const current = filtersOf(ctx.params);
  const before = ctx.params.get("before");
  const limit = ctx.params.get("limit"); // page size (default 50); kept by the page links
  if (limit) current.limit = limit;
  const query = new URLSearchParams({ ...current, ...(before ? { before } : {}) });
  const page = await getJSON("api/tasks?" + query.toString());
  view.append(el("h2", { text: "Tasks" }), filterForm(current));
  if (ctx.canAct) view.append(bulkRetry(current, ctx));
  view.append(table(
    ["id", "name", "queue", "status", "attempt", "error", "sent", "started", "finished", "worker", "workflow"],
    page.tasks.map(t => [taskLink(t.id), t.name, t.queue,
                         el("span", {}, badge(t.status), t.cancel_requested_at && t.status === "RUNNING" ? " cancel requested" : ""),
                         t.attempt, t.error_code || "", time(t.sent_at), time(t.started_at), time(t.finished_at),
                         t.claimed_by_worker_id || "", t.workflow_id ? workflowLink(t.workflow_id) : ""]),
    page.searched_to ? "none in this part" : (before ? "no more tasks" : "no task matches"), { id: "task-list" }));
  if (page.searched_to) { // the page stopped after reading its share of rows: older ones are not searched yet
    view.append(el("p", { class: "muted", id: "searched-to" },
      "Searched back to tasks made at ", time(page.searched_to),
      ` (a page reads at most ${page.scan.toLocaleString("en-US")} tasks): older tasks are not searched yet. `,
      link(route("tasks", { ...current, before: page.next }), "Search further »", { id: "search-further" })));
  }
  const pager = el("div", { class: "pager" });
  if (before) pager.appendChild(link(route("tasks", current), "« first page", { id: "first-page" }));
  if (page.next) pager.appendChild(link(route("tasks", { ...current, before: page.next }), "next page »", { id: "next-page" }));
  const again = el("button", { type: "button" }, "Refresh");
  again.addEventListener("click", () => ctx.refresh());
  pager.appendChild(again);
  view.append(pager);
}

// "Retry matching…": a dry run shows how many tasks match and a sample; "Retry N tasks" does it.
function bulkRetry(current, ctx) {
  const statuses = (current.status || "FAILED").split(",");
  if (!statuses.every(s => RETRYABLE.has(s))) { // only ended tasks can be retried
    return el("div", { class: "actions", id: "bulk-retry" });
  }
  const filter = { ...current, status: statuses.join(",") };
  delete filter.limit;
  return dryRunButton(ctx, {
    label: "Retry matching…",
    ids: { box: "bulk-retry", start: "retry-matching", panel: "retry-preview", confirm: "confirm-retry" },
    action: "retry-tasks",
    body: { filter },
    preview: dry => dry.sample && dry.sample.length ? el("p", {}, "For example: ",
      ...dry.sample.map(s => [taskLink(typeof s === "object" ? s.id : s), " "])) : null,
    confirmLabel: dry => dry.matched ? `Retry ${dry.matched} task${dry.matched === 1 ? "" : "s"}` : null,
  });
}
