// The overview's charts, from /api/charts (docs/dashboard.md#charts), drawn by uPlot
// (static/uPlot.iife.min.js, MIT, loaded before this module as the global `uPlot`):
// tasks ended per minute by status, recoveries by rule, depth and lag per queue.
import { el, link, route } from "./dom.js";
import { getJSON } from "./net.js";

export const RANGES = { "1h": "last hour", "24h": "last 24 hours" };

const STATUS_COLORS = { COMPLETED: "#2e8b3a", FAILED: "#c0392b", CANCELLED: "#7f8c8d", EXPIRED: "#d68910" };
const PALETTE = ["#1a4fa0", "#c0392b", "#2e8b3a", "#8e44ad", "#d68910", "#16a085", "#7f8c8d", "#b03a78",
                 "#5d6d7e", "#a04000", "#1f618d"];

// uPlot instances of earlier renders: destroyed once their page is gone (uPlot listens on
// the window until then).
let live = [];

export async function section(view, params) {
  const range = RANGES[params.get("range")] ? params.get("range") : "1h";
  const data = await getJSON("api/charts?range=" + range);
  live = live.filter(u => u.root.isConnected || (u.destroy(), false));
  const width = Math.max(320, Math.min(720, Math.floor((document.getElementById("view").clientWidth - 32) / 2)));
  const span = RANGES[range];
  const per = data.bucket_s === 60 ? "minute" : `${data.bucket_s / 60} minutes`;
  const f = data.finished;
  const statuses = Object.keys(f.by_status);
  const rec = data.recoveries;
  const rules = Object.keys(rec.by_rule);
  const q = data.queues;
  const queues = Object.keys(q.depth);
  return el("section", { id: "charts", "data-range": range },
    el("h2", {}, "Charts ", el("span", { class: "muted", text: `(${span})` }), " ",
       ...Object.entries(RANGES).map(([key, label]) => key === range ? "" :
         link(route("", { range: key }), label, { class: "range", id: "range-" + key }))),
    el("div", { class: "charts" },
      chart("chart-finished", `Tasks ended per ${per}, by status`, width, f.at,
            statuses.map(s => ({ label: `${s} (${f.total[s]})`, stroke: STATUS_COLORS[s], values: f.by_status[s] })),
            "tasks"),
      rules.length
        ? chart("chart-recoveries", `Recoveries per ${per}, by rule`, width, rec.at,
                rules.map((r, i) => ({ label: `${r} (${rec.total[r]})`, stroke: PALETTE[i % PALETTE.length],
                                       values: rec.by_rule[r] })), "tasks")
        : empty("chart-recoveries", `Recoveries per ${per}, by rule`, `no recovery in the ${span}`),
      queues.length && q.at.length
        ? chart("chart-depth", "Tasks waiting (PENDING), per queue", width, q.at,
                queues.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length], values: q.depth[name] })),
                "tasks")
        : empty("chart-depth", "Tasks waiting (PENDING), per queue", "no queue had tasks waiting or running when last sampled"),
      queues.length && q.at.length
        ? chart("chart-lag", "Lag: age of the oldest due PENDING task, per queue", width, q.at,
                queues.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length], values: q.lag_s[name] })),
                "seconds")
        : empty("chart-lag", "Lag: age of the oldest due PENDING task, per queue", "no queue had a due task waiting when last sampled"),
    ),
    Date.parse(data.complete_from) > Date.parse(data.from)
      ? el("p", { class: "muted", id: "charts-partial",
                  text: `Tasks ended are counted back to ${new Date(data.complete_from).toLocaleTimeString()} so far: ` +
                        "the older minutes are read back a little at a time (each read is bounded)." })
      : "",
    el("p", { class: "muted", id: "charts-note",
              text: `Depth and lag are sampled by this dashboard every ${data.sample_s} s since it started` +
                    (data.bucket_s > 60 ? " (the highest of each 5 minutes)" : "") + "." }),
  );
}

function empty(id, title, text) {
  return el("figure", { class: "chart", id, "data-points": 0 },
    el("figcaption", { text: title }), el("p", { class: "muted empty", text }));
}

// One chart: a time axis `at` (epoch seconds) and one line per series.
function chart(id, title, width, at, series, unit) {
  const box = el("figure", { class: "chart", id });
  box.append(el("figcaption", { text: title }));
  const points = series.reduce((n, s) => n + s.values.filter(v => v !== null && v !== 0).length, 0);
  box.dataset.points = String(points);
  box.dataset.series = series.map(s => s.label).join("|");
  const opts = {
    width, height: 190,
    series: [{}, ...series.map(s => ({
      label: s.label, stroke: s.stroke, width: 1.5, spanGaps: false,
      points: { show: at.length <= 120, size: 4 },
      value: (u, v) => v === null || v === undefined ? "–" : String(v),
    }))],
    axes: [{}, { label: unit, size: 52 }],
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max)] } },
    legend: { live: false },
    cursor: { drag: { x: false, y: false } },
  };
  live.push(new uPlot(opts, [at, ...series.map(s => s.values)], box));
  return box;
}
