// Workflows: the list (#/workflows) and one workflow (#/workflow/<id>) with its steps drawn
// as a graph (a column per depth, an arrow per dependency) and listed in a table.
import { badge, confirmButton, el, fields, link, route, table, taskLink, time, workflowLink } from "./dom.js";
import { getJSON } from "./net.js";

export const refreshMs = 2000;
const MAX_DRAWN = 200; // larger workflows get the table only
const STATUSES = ["", "RUNNING", "PAUSED", "COMPLETED", "FAILED", "CANCELLED"];

export async function renderList(view, ctx) {
  const status = ctx.params.get("status") || "";
  const name = ctx.params.get("name") || "";
  const before = ctx.params.get("before");
  const query = new URLSearchParams({ ...(status ? { status } : {}), ...(name ? { name } : {}),
                                      ...(before ? { before } : {}) });
  const page = await getJSON("api/workflows?" + query.toString());
  const select = el("select", { name: "status" },
    ...STATUSES.map(s => el("option", { value: s, selected: s === status }, s || "any status")));
  const nameInput = el("input", { type: "text", name: "name", value: name });
  const form = el("form", { class: "filters" }, el("label", {}, "status", select),
    el("label", {}, "name", nameInput), el("button", { type: "submit", class: "primary" }, "Apply"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    location.hash = route("workflows", { status: select.value, name: nameInput.value.trim() });
  });
  view.append(el("h2", { text: "Workflows" }), form, table(
    ["id", "name", "status", "steps done", "failed", "of", "on error", "created", "finished"],
    page.workflows.map(w => [workflowLink(w.id), w.name, badge(w.status), w.steps_done, w.steps_failed,
                             w.steps_total, w.on_error, time(w.created_at), time(w.finished_at)]),
    "no workflow", { id: "workflow-list" }));
  const pager = el("div", { class: "pager" });
  if (before) pager.append(link(route("workflows", { status, name }), "« first page"));
  if (page.next) pager.append(link(route("workflows", { status, name, before: page.next }), "next page »"));
  view.append(pager);
}

export async function render(view, ctx) {
  const { workflow: w, steps } = await getJSON("api/workflows/" + encodeURIComponent(ctx.arg));
  view.append(el("h2", {}, "Workflow ", el("span", { text: w.name }), " ", badge(w.status)));
  view.dataset.status = w.status;
  view.append(actions(w, ctx));
  view.append(fields([
    ["id", el("code", { text: w.id })],
    ["status", badge(w.status), "status"],
    ["steps", `${w.steps_done} of ${w.steps_total} done, ${w.steps_failed} failed or cancelled`],
    ["on error", w.on_error],
    ["created", time(w.created_at)],
    ["paused", time(w.paused_at)],
    ["finished", time(w.finished_at)],
  ], { id: "workflow-fields" }));
  view.append(el("h3", { text: "Steps" }));
  if (steps.length <= MAX_DRAWN) view.append(graph(steps));
  else view.append(el("p", { class: "muted", text: `${steps.length} steps: too many to draw; the table lists them all.` }));
  const byNode = new Map(steps.map(s => [s.node, s]));
  view.append(table(
    ["node", "step", "task", "status", "task status", "after", "error", "attempt", "finished"],
    steps.map(s => [s.node, s.node_name, s.task_status ? taskLink(s.task_id, s.task_name) : s.task_name,
                    badge(s.status), s.task_status ? badge(s.task_status) : "",
                    s.depends_on.map(n => (byNode.get(n) || {}).node_name || n).join(", "),
                    s.error_code ? `${s.error_code}: ${s.error_message || ""}` : "", s.attempt ?? "",
                    time(s.finished_at)]),
    "no steps", { id: "steps" }));
}

function actions(w, ctx) {
  const bar = el("div", { class: "actions", id: "workflow-actions" });
  if (!ctx.canAct) return bar;
  if (w.status === "PAUSED") {
    const resume = el("button", { type: "button", id: "resume-workflow" }, "Resume workflow");
    resume.addEventListener("click", () => ctx.act("resume-workflow", { workflow_id: w.id }));
    bar.append(resume);
  }
  if (w.status === "RUNNING") {
    const pause = el("button", { type: "button", id: "pause-workflow" }, "Pause workflow");
    pause.addEventListener("click", () => ctx.act("pause-workflow", { workflow_id: w.id }));
    bar.append(pause);
  }
  if (w.status === "RUNNING" || w.status === "PAUSED") {
    bar.append(confirmButton("Cancel workflow", "Cancel it? Steps not started are cancelled; running ones finish.",
      "Yes, cancel it", () => ctx.act("cancel-workflow", { workflow_id: w.id }), ctx,
      { class: "danger", id: "cancel-workflow" }));
  }
  return bar;
}

// Steps in columns by depth (a step's column is one past its deepest dependency), with an
// arrow from each dependency to its dependent, drawn once the boxes have their places.
function graph(steps) {
  const depth = new Map();
  const byNode = new Map(steps.map(s => [s.node, s]));
  const depthOf = (s, seen) => {
    if (depth.has(s.node)) return depth.get(s.node);
    if (seen.has(s.node)) return 0; // never in a DAG; guards the page against a bad row
    seen.add(s.node);
    let d = 0;
    for (const n of s.depends_on) if (byNode.has(n)) d = Math.max(d, depthOf(byNode.get(n), seen) + 1);
    depth.set(s.node, d);
    return d;
  };
  const layers = [];
  for (const s of steps) {
    const d = depthOf(s, new Set());
    (layers[d] = layers[d] || []).push(s);
  }
  const box = el("div", { class: "graph", id: "workflow-graph" });
  const boxes = new Map();
  for (const layer of layers) {
    const column = el("div", { class: "layer" });
    for (const s of layer || []) {
      const inner = [el("div", { class: "node", text: s.node_name }),
                     el("div", { class: "task", text: s.task_name }), badge(s.status)];
      const node = s.task_status
        ? link("#/task/" + encodeURIComponent(s.task_id), "", { class: "step " + s.status, title: s.task_id })
        : el("div", { class: "step " + s.status, title: "no task yet" });
      node.dataset.node = s.node_name;
      node.append(...inner);
      boxes.set(s.node, node);
      column.append(node);
    }
    box.append(column);
  }
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "edges");
  box.prepend(svg);
  // Drawn when the graph is in the document (its boxes have positions then).
  let frames = 0;
  const draw = () => {
    if (!box.isConnected) { if (++frames < 300) requestAnimationFrame(draw); return; }
    const origin = box.getBoundingClientRect();
    svg.setAttribute("width", String(box.scrollWidth));
    svg.setAttribute("height", String(box.scrollHeight));
    for (const s of steps) {
      const to = boxes.get(s.node).getBoundingClientRect();
      for (const n of s.depends_on) {
        const fromBox = boxes.get(n);
        if (!fromBox) continue;
        const from = fromBox.getBoundingClientRect();
        const x1 = from.right - origin.left + box.scrollLeft, y1 = from.top + from.height / 2 - origin.top;
        const x2 = to.left - origin.left + box.scrollLeft, y2 = to.top + to.height / 2 - origin.top;
        const mid = (x1 + x2) / 2;
        const path = document.createElementNS(ns, "path");
        path.setAttribute("d", `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`);
        svg.append(path);
      }
    }
  };
  requestAnimationFrame(draw);
  return box;
}
