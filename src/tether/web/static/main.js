// The dashboard's shell: hash routes, the token box, messages, and refreshing the current page.
//   #/                      overview (what `tether status` shows)
//   #/tasks?status=FAILED   task list with filters, a page at a time
//   #/task/<id>             one task
//   #/workflows, #/workflow/<id>, #/queues, #/workers
import { el } from "./dom.js";
import { HttpError, act, checkToken, getJSON, setToken, token } from "./net.js";
import * as overview from "./overview.js";
import * as tasks from "./tasks.js";
import * as task from "./task.js";
import * as workflow from "./workflow.js";
import * as queues from "./queues.js";
import * as workers from "./workers.js";

const ROUTES = {
  "": overview,
  "tasks": tasks,
  "task": task,
  "workflows": { render: workflow.renderList, refreshMs: 0 },
  "workflow": workflow,
  "queues": queues,
  "workers": workers,
};

let meta = { can_act: false, note: "" };
let generation = 0;
let timer = null;
let holds = 0;

function parseHash() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, query] = hash.split("?", 2);
  const [name, ...rest] = path.split("/");
  return { name: name || "", arg: rest.length ? decodeURIComponent(rest.join("/")) : null,
           params: new URLSearchParams(query || "") };
}

function flash(message, isError) {
  const box = document.getElementById("flash");
  box.textContent = message;
  box.className = isError ? "error" : "";
  box.hidden = !message;
}

function showState(text, down) {
  const state = document.getElementById("state");
  state.textContent = text;
  state.className = down ? "down" : "";
}

const ctx = {
  get canAct() { return meta.can_act && !!token(); },
  hold(on) { holds = Math.max(0, holds + (on ? 1 : -1)); },
  flash,
  // An action: POST it, show what it changed (or why not), draw the page again.
  async act(name, body) {
    try {
      const reply = await act(name, body);
      flash(reply.message, false);
      return reply;
    } catch (err) {
      flash(`${name}: ${err.message}`, true);
      return null;
    } finally {
      refresh();
    }
  },
  refresh: () => refresh(),
};

async function draw(mine) {
  const { name, arg, params } = parseHash();
  const page = ROUTES[name];
  for (const a of document.querySelectorAll("nav a")) {
    const current = a.dataset.route === (name || "overview") ||
      (a.dataset.route === "tasks" && name === "task") || (a.dataset.route === "workflows" && name === "workflow");
    a.classList.toggle("current", current);
  }
  const view = document.getElementById("view");
  if (!page) {
    view.replaceChildren(el("p", { text: "There is no page at " + location.hash + "." }));
    return 0;
  }
  if (meta.reads_need_token && !token()) {
    view.replaceChildren(el("p", { id: "needs-token", text: "This dashboard listens beyond this machine: " +
                                   "enter its token (top right) to see tasks, workflows, queues and workers." }));
    showState("", false);
    return 0;
  }
  const fresh = el("div", { class: "page page-" + (name || "overview") });
  try {
    await page.render(fresh, { ...ctx, canAct: ctx.canAct, arg, params });
  } catch (err) {
    if (mine !== generation) return 0;
    if (err instanceof HttpError && err.status >= 400 && err.status < 500) {
      view.replaceChildren(el("p", { class: "error", text: err.message }));
      showState("", false);
      return 0;
    }
    showState("cannot read: " + err.message + " (retrying)", true);
    return page.refreshMs || 2000;
  }
  if (mine !== generation) return 0;
  if (holds === 0) view.replaceChildren(fresh);
  const every = page.refreshMs;
  showState(every ? `as of ${new Date().toLocaleTimeString()} (refreshes every ${every / 1000} s)` : "", false);
  return every;
}

async function refresh() {
  clearTimeout(timer);
  const mine = ++generation;
  const every = await draw(mine);
  if (every && mine === generation) {
    timer = setTimeout(function again() {
      if (holds > 0) { timer = setTimeout(again, 500); return; }
      refresh();
    }, every);
  }
}

function drawAccess() {
  const box = document.getElementById("access");
  if (!meta.can_act) {
    box.replaceChildren(el("span", { class: "readonly", id: "read-only", text: meta.note }));
    return;
  }
  if (token()) {
    const lock = el("button", { type: "button", id: "lock" }, "Forget token");
    lock.addEventListener("click", () => { setToken(null); drawAccess(); refresh(); });
    box.replaceChildren(el("span", { id: "can-act", text: "actions enabled " }), lock);
    return;
  }
  const input = el("input", { type: "password", id: "token", autocomplete: "off",
                              placeholder: "dashboard token", "aria-label": "dashboard token" });
  const form = el("form", { id: "token-form" }, input, " ", el("button", { type: "submit" }, "Unlock actions"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const secret = input.value.trim();
    if (!secret) return;
    try {
      await checkToken(secret);
    } catch (err) {
      flash("token refused: " + err.message, true);
      return;
    }
    setToken(secret);
    flash("actions enabled for this tab", false);
    drawAccess();
    refresh();
  });
  box.replaceChildren(form);
}

async function start() {
  try {
    meta = await getJSON("api/meta");
  } catch (err) {
    showState("cannot reach the dashboard: " + err.message, true);
  }
  if (!meta.can_act) setToken(null);
  drawAccess();
  window.addEventListener("tether-token", () => { drawAccess(); if (meta.reads_need_token) refresh(); });
  window.addEventListener("hashchange", () => { flash("", false); holds = 0; refresh(); });
  refresh();
}

start();
