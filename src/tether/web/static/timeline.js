// A task's timeline (#/task/<id>): one lane per attempt (from its start to its end, coloured
// by outcome; the attempt in flight up to now) and one per heartbeat role, a tick per beat,
// over the time from its sending on. Drawn as SVG elements, every value set as text.
const NS = "http://www.w3.org/2000/svg";
const WIDTH = 900;
const LABELS = 120;
const LANE = 22;
const OPEN = new Set(["CLAIMED", "RUNNING"]);

function svg(tag, attrs, text) {
  const node = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function ms(value) {
  return value ? Date.parse(value) : null;
}

export function timeline(t, attempts, beats, now) {
  const end = ms(now);
  const lanes = attempts.map(a => ({
    label: `attempt ${a.attempt}`,
    from: ms(a.started_at) ?? ms(a.finished_at), to: ms(a.finished_at),
    cls: a.outcome, title: `attempt ${a.attempt}: ${a.outcome}${a.will_retry ? ", will retry" : ""}` +
      `${a.error_code ? " " + a.error_code : ""}${a.worker_id ? " on " + a.worker_id : ""}`,
  }));
  if (OPEN.has(t.status) && !attempts.some(a => a.attempt === t.attempt)) {
    lanes.push({ label: `attempt ${t.attempt}`, from: ms(t.started_at) ?? ms(t.claimed_at), to: end,
                 cls: t.status, title: `attempt ${t.attempt}: ${t.status} now` });
  }
  const roles = ["claimer", "runner"].filter(r => beats.some(b => b.role === r));
  const times = [ms(t.sent_at), ...lanes.flatMap(l => [l.from, l.to]), ...beats.map(b => ms(b.sent_at))]
    .filter(x => x !== null);
  const finished = ms(t.completed_at || t.failed_at || t.cancelled_at || t.expired_at);
  if (OPEN.has(t.status) || t.status === "PENDING") times.push(end);
  else if (finished) times.push(finished);
  const lo = Math.min(...times);
  const hi = Math.max(lo + 1000, ...times);
  const pad = (hi - lo) * 0.02;
  const x0 = lo - pad;
  const scale = (WIDTH - LABELS - 10) / (hi + pad - x0);
  const x = when => LABELS + (when - x0) * scale;
  const rows = lanes.length + roles.length;
  const height = 28 + rows * LANE;
  const root = svg("svg", { class: "timeline", id: "timeline", viewBox: `0 0 ${WIDTH} ${height}`,
                            width: WIDTH, height, role: "img", "aria-label": "attempts and heartbeats over time" });
  // The time axis: five ticks, at the bottom.
  const axisY = height - 18;
  root.append(svg("line", { class: "axis", x1: LABELS, x2: WIDTH - 10, y1: axisY, y2: axisY }));
  // Milliseconds when the whole story is a few seconds long: else every tick reads the same.
  const label = when => {
    const d = new Date(when);
    return hi - lo < 10_000 ? `${d.toLocaleTimeString([], { hour12: false })}.${String(d.getMilliseconds()).padStart(3, "0")}`
                            : d.toLocaleTimeString();
  };
  for (let i = 0; i <= 4; i++) {
    const when = lo + (hi - lo) * i / 4;
    root.append(svg("text", { class: "tick", x: x(when), y: height - 4,
                              "text-anchor": i === 4 ? "end" : (i === 0 ? "start" : "middle") }, label(when)));
  }
  if (t.sent_at) {
    const sent = svg("line", { class: "sent", x1: x(ms(t.sent_at)), x2: x(ms(t.sent_at)), y1: 4, y2: axisY });
    sent.append(svg("title", {}, "sent " + t.sent_at));
    root.append(sent);
  }
  lanes.forEach((lane, i) => {
    const y = 6 + i * LANE;
    root.append(svg("text", { class: "lane-label", x: 4, y: y + 13 }, lane.label));
    const rect = svg("rect", { class: "attempt " + lane.cls, x: x(lane.from), y, rx: 3, height: LANE - 6,
                               width: Math.max(3, x(lane.to) - x(lane.from)) });
    rect.append(svg("title", {}, lane.title));
    root.append(rect);
  });
  roles.forEach((role, j) => {
    const y = 6 + (lanes.length + j) * LANE;
    root.append(svg("text", { class: "lane-label", x: 4, y: y + 13 }, `${role} beats`));
    for (const b of beats.filter(b => b.role === role)) {
      const tick = svg("line", { class: "beat " + role, x1: x(ms(b.sent_at)), x2: x(ms(b.sent_at)),
                                 y1: y + 1, y2: y + LANE - 7 });
      tick.append(svg("title", {}, `${role} heartbeat ${b.sent_at}`));
      root.append(tick);
    }
  });
  return root;
}
