// Building the page from data. Every value goes in as text (textContent, attributes set
// one by one), never as HTML: task names, arguments, errors and hosts are data.
import { act } from "./net.js";

export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(node, child);
    else if (child instanceof Node) node.appendChild(child);
    else node.appendChild(document.createTextNode(String(child)));
  }
}

export function link(href, text, attrs) {
  return el("a", { href, ...(attrs || {}) }, text);
}

// A hash route with its query: route("tasks", {status: "FAILED"}) -> "#/tasks?status=FAILED".
export function route(path, params) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params || {})) {
    if (value !== null && value !== undefined && value !== "") query.set(key, value);
  }
  const text = query.toString();
  return "#/" + path + (text ? "?" + text : "");
}

// A count that leads to the tasks it counts (right-aligned in its table like any number).
// A count; an estimate (counted in a sample of the task table) shows as "≈12,000".
export function countLink(href, n, estimated) {
  return estimated
    ? link(href, "≈" + n.toLocaleString("en-US"), { class: "num estimate", title: "estimate" })
    : link(href, String(n), { class: "num" });
}

// Under a table that shows estimates.
export const ESTIMATE_NOTE = "≈ estimated from a sample of the task table: finished tasks, and more than " +
  "1,000 waiting in a queue. `tether status --exact` counts every row.";

export function taskLink(id, text) {
  return link("#/task/" + encodeURIComponent(id), text || shortId(id), { class: "id", title: id });
}

export function workflowLink(id, text) {
  return link("#/workflow/" + encodeURIComponent(id), text || shortId(id), { class: "id", title: id });
}

export function shortId(id) {
  return String(id).slice(0, 8) + "…" + String(id).slice(-4);
}

export function badge(status) {
  return el("span", { class: "status " + status, text: status });
}

function pad(n) { return String(n).padStart(2, "0"); }

// A time from the server (ISO 8601), shown in the browser's time zone; the exact value in its title.
export function time(value) {
  if (!value) return "";
  const at = new Date(value);
  if (Number.isNaN(at.getTime())) return String(value);
  const text = `${at.getFullYear()}-${pad(at.getMonth() + 1)}-${pad(at.getDate())} ` +
    `${pad(at.getHours())}:${pad(at.getMinutes())}:${pad(at.getSeconds())}`;
  return el("span", { title: value, text });
}

export function seconds(value) {
  if (value === null || value === undefined) return "";
  const s = Number(value);
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

export function json(value) {
  return el("pre", { class: "json", text: JSON.stringify(value, null, 2) });
}

// A table: headers, rows of cells (a cell is text, a number, a Node, or null), a text for none.
export function table(headers, rows, emptyText, attrs) {
  const node = el("table", attrs || {});
  const head = node.createTHead().insertRow();
  for (const h of headers) head.appendChild(el("th", { text: h }));
  const body = node.createTBody();
  if (rows.length === 0) {
    const cell = body.insertRow().insertCell();
    cell.colSpan = headers.length;
    cell.className = "empty";
    cell.textContent = emptyText || "none";
    return node;
  }
  for (const row of rows) {
    const tr = body.insertRow();
    for (const value of row) {
      const td = tr.insertCell();
      if (typeof value === "number" || (value instanceof Element && value.classList.contains("num"))) {
        td.className = "num";
      }
      if (value instanceof Node) td.appendChild(value);
      else td.textContent = value === null || value === undefined ? "" : String(value);
    }
  }
  return node;
}

// Label/value rows; rows whose value is null or "" are left out.
export function fields(pairs, attrs) {
  const node = el("table", { class: "fields", ...(attrs || {}) });
  const body = node.createTBody();
  for (const [label, value, key] of pairs) {
    if (value === null || value === undefined || value === "") continue;
    const tr = body.insertRow();
    if (key) tr.dataset.field = key;
    tr.appendChild(el("th", { text: label }));
    const td = tr.insertCell();
    if (value instanceof Node) td.appendChild(value);
    else td.textContent = String(value);
  }
  return node;
}

// A button that asks before it acts: the first click shows "question [yes] [no]".
export function confirmButton(label, question, yesLabel, onYes, ctx, attrs) {
  const holder = el("span", { class: "confirm-holder" });
  const button = el("button", { type: "button", ...(attrs || {}) }, label);
  holder.appendChild(button);
  button.addEventListener("click", () => {
    ctx.hold(true);
    const yes = el("button", { type: "button", class: "danger" }, yesLabel);
    const no = el("button", { type: "button" }, "Keep it");
    const box = el("span", { class: "confirm" }, question, yes, no);
    const close = () => { box.remove(); button.hidden = false; ctx.hold(false); };
    no.addEventListener("click", close);
    yes.addEventListener("click", async () => {
      close(); // before acting: the page is drawn afresh once the action has answered
      await onYes();
    });
    button.hidden = true;
    holder.appendChild(box);
  });
  return holder;
}

// A button for an action tried as a dry run first ("Retry matching…", "Recover now…"): the
// dry run's answer is shown in a panel (its message, then what preview(dry) adds), with a
// button that sends the real action (labelled confirmLabel(dry); none when that is null)
// and one that closes the panel. The page is not redrawn while the panel is open.
export function dryRunButton(ctx, { label, ids, action, body, preview, confirmLabel }) {
  const box = el("div", { class: "actions", id: ids.box });
  const start = el("button", { type: "button", id: ids.start }, label);
  box.appendChild(start);
  start.addEventListener("click", async () => {
    ctx.hold(true);
    start.disabled = true;
    let dry;
    try {
      dry = await act(action, { ...body, dry_run: true });
    } catch (err) {
      ctx.flash(`${action}: ${err.message}`, true);
      start.disabled = false;
      ctx.hold(false);
      return;
    }
    const close = () => { panel.remove(); start.disabled = false; ctx.hold(false); };
    const yesLabel = confirmLabel(dry);
    const yes = yesLabel === null ? null : el("button", { type: "button", class: "danger", id: ids.confirm }, yesLabel);
    const no = el("button", { type: "button" }, "Cancel");
    const panel = el("div", { class: "panel", id: ids.panel },
      el("p", { text: dry.message }), preview(dry), el("div", { class: "actions" }, yes, no));
    no.addEventListener("click", close);
    if (yes) {
      yes.addEventListener("click", async () => {
        yes.disabled = no.disabled = true;
        close();
        await ctx.act(action, { ...body, dry_run: false });
      });
    }
    box.appendChild(panel);
  });
  return box;
}
