// The report view of one training run: polls its data while the run goes on and draws the status,
// the report's tables (rendered by the server from the same Markdown as report.md) and three
// figures in SVG: the timeline (zoom, hover), where the time went, and the loss.
"use strict";

const LAYER_COLORS = { inprocess: "#38a169", injob: "#d69e2e", relaunch: "#e53e3e", rollback: "#805ad5" };
const GOODPUT_COLORS = ["#3182ce", "#a0aec0", "#d69e2e", "#e53e3e", "#805ad5", "#38a169", "#dd6b20", "#718096", "#319795"];
const POLL_MS = 5000;
const view = { data: null, zoom: null };

function xScale(domain, x0, x1) {
  const [d0, d1] = domain;
  return (v) => x0 + ((v - d0) / (d1 - d0 || 1)) * (x1 - x0);
}

function axis(svg, scale, domain, ticks, x, y, vertical, label) {
  const [d0, d1] = domain;
  for (let i = 0; i <= ticks; i++) {
    const v = d0 + ((d1 - d0) * i) / ticks;
    const p = scale(v);
    const text = Math.abs(d1 - d0) >= 10 ? Math.round(v) : v.toFixed(1);
    if (vertical) {
      svgEl("line", { x1: x - 4, x2: x, y1: p, y2: p, stroke: "#a0aec0" }, svg);
      svgEl("text", { x: x - 6, y: p + 4, "text-anchor": "end", "font-size": 11, fill: "#4a5568" }, svg).textContent = text;
    } else {
      svgEl("line", { x1: p, x2: p, y1: y, y2: y + 4, stroke: "#a0aec0" }, svg);
      svgEl("text", { x: p, y: y + 16, "text-anchor": "middle", "font-size": 11, fill: "#4a5568" }, svg).textContent = text;
    }
  }
  const middle = (scale(d0) + scale(d1)) / 2;
  const t = svgEl("text", { "font-size": 11, fill: "#4a5568", "text-anchor": "middle" }, svg);
  if (vertical) t.setAttribute("transform", `translate(14, ${middle}) rotate(-90)`);
  else { t.setAttribute("x", middle); t.setAttribute("y", y + 32); }
  t.textContent = label;
}

function drawTimeline(data) {
  const box = document.getElementById("timeline");
  box.innerHTML = "";
  const f = data.figures;
  const width = Math.max(600, Math.min(1400, box.clientWidth || 1000)), height = 340;
  const m = { l: 60, r: 16, t: 12, b: 44 };
  const full = [0, Math.max(f.wall_s || 0, 1)];
  const domain = view.zoom || full;
  const maxStep = Math.max(1, ...f.steps.map((s) => s[0]));
  const x = xScale(domain, m.l, width - m.r);
  const y = (step) => height - m.b - (step / (maxStep * 1.05)) * (height - m.t - m.b);
  const svg = svgEl("svg", { width, height, id: "timeline-svg", role: "img", "aria-label": "training timeline" }, null);
  svgEl("clipPath", { id: "plot-area" }, svg).appendChild(svgEl("rect", { x: m.l, y: m.t, width: width - m.l - m.r, height: height - m.t - m.b }));
  const plot = svgEl("g", { "clip-path": "url(#plot-area)" }, svg);
  const bottom = height - m.b;

  for (const r of f.restarts) {  // recovery windows: fault -> training resumed
    const lo = x(r.t - (r.latency_s || 0)), hi = x(r.t);
    svgEl("rect", {
      x: lo, y: m.t, width: Math.max(hi - lo, 2), height: bottom - m.t, fill: LAYER_COLORS[r.layer] || "#718096", opacity: 0.22,
      class: "restart", "data-tip": `${r.layer} restart: resumed at step ${r.step} after ${fmtSeconds(r.latency_s)}` + (r.reason ? `\nreason: ${r.reason}` : ""),
    }, plot);
  }
  for (const l of f.launches) {
    svgEl("line", { x1: x(l.t), x2: x(l.t), y1: m.t, y2: bottom, stroke: "#4a5568", "stroke-dasharray": "4 3", "data-tip": `launch ${l.launch_id} started` }, plot);
  }
  for (const e of f.escalations) {
    svgEl("line", {
      x1: x(e.t), x2: x(e.t), y1: m.t, y2: bottom, stroke: "#805ad5", "stroke-width": 3, class: "escalation",
      "data-tip": `escalation (rung ${e.rung}): ${e.failure_class}; nodes replaced: ${(e.nodes || []).join(", ") || "none"}\nevidence: ${e.evidence || "—"}`,
    }, plot);
  }
  for (const s of f.spares) {
    const waiting = s.event === "waiting_for_nodes";
    const tip = waiting
      ? `waiting for nodes: ${s.node_id}; ${s.until !== null && s.until !== undefined ? `until ${fmtSeconds(s.until)}` : "nothing coming, the launch ends"}\n${s.why || ""}`
      : `${s.event.replace("_", " ")}: ${s.node_id}`;
    svgEl("line", { x1: x(s.t), x2: x(s.t), y1: m.t, y2: bottom, stroke: waiting ? "#dd6b20" : "#319795", "stroke-width": 2, class: waiting ? "waiting" : "spare", "data-tip": tip }, plot);
  }
  for (const s of f.steps) {  // [step, start, end, loss, replayed]
    svgEl("line", {
      x1: x(s[1]), x2: x(s[2]), y1: y(s[0]), y2: y(s[0]), stroke: s[4] ? "#e53e3e" : "#3182ce", "stroke-width": 4,
      "data-tip": `step ${s[0]}${s[4] ? " (replayed later: lost work)" : ""}: ${fmtSeconds(s[2] - s[1])}` + (s[3] !== null ? `, loss ${fmtNumber(s[3], 4)}` : ""),
    }, plot);
  }
  for (const c of f.checkpoints) {
    const committed = c.event === "checkpoint_commit";
    svgEl("rect", {
      x: x(c.t) - 2, y: bottom - 10, width: 4, height: 10, fill: committed ? "#38a169" : "#dd6b20",
      "data-tip": `checkpoint step ${c.step}: ${c.event.replace("checkpoint_", "")}`,
    }, plot);
  }
  for (const i of f.injected) {
    svgEl("circle", { cx: x(i.t), cy: m.t + 8, r: 5, fill: "#dd6b20", "data-tip": `drill injected: ${i.kind} at step ${i.step} on rank ${i.rank}` }, plot);
  }
  for (const fault of f.faults) {
    const cx = x(fault.t), cy = y(fault.step || 0);
    svgEl("path", {
      d: `M${cx},${cy - 9} l6,10 l-12,0 z`, fill: fault.recovered === false ? "#c53030" : "#e53e3e", stroke: "#fff", class: "fault",
      "data-tip": `fault on rank ${fault.rank} at step ${fault.step}: ${fault.kind}\ntaken by: ${fault.taken_by || "—"}\n${fault.outcome}` + (fault.error ? `\n${fault.error}` : ""),
    }, plot);
  }
  axis(svg, x, domain, 6, m.l, bottom, false, "seconds since the first launch");
  axis(svg, y, [0, maxStep * 1.05], 4, m.l, bottom, true, "step");
  svgEl("rect", { x: m.l, y: m.t, width: width - m.l - m.r, height: bottom - m.t, fill: "none", stroke: "#cbd5e0" }, svg);

  // Zoom: drag a range, scroll around the pointer, double-click to reset.
  const toTime = (px) => domain[0] + ((px - m.l) / (width - m.l - m.r)) * (domain[1] - domain[0]);
  const pointerX = (e) => e.clientX - svg.getBoundingClientRect().left;
  let dragFrom = null, brush = null;
  svg.addEventListener("mousedown", (e) => {
    dragFrom = pointerX(e);
    brush = svgEl("rect", { x: dragFrom, y: m.t, width: 0, height: bottom - m.t, fill: "#3182ce", opacity: 0.15 }, svg);
    e.preventDefault();
  });
  svg.addEventListener("mousemove", (e) => {
    if (dragFrom === null) return;
    const px = pointerX(e);
    brush.setAttribute("x", Math.min(px, dragFrom));
    brush.setAttribute("width", Math.abs(px - dragFrom));
  });
  svg.addEventListener("mouseup", (e) => {
    if (dragFrom === null) return;
    const px = pointerX(e);
    if (Math.abs(px - dragFrom) > 5) view.zoom = [toTime(Math.min(px, dragFrom)), toTime(Math.max(px, dragFrom))];
    dragFrom = null;
    drawTimeline(view.data);
  });
  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    const at = toTime(pointerX(e)), k = e.deltaY > 0 ? 1.25 : 0.8;
    const lo = Math.max(full[0], at - (at - domain[0]) * k), hi = Math.min(full[1], at + (domain[1] - at) * k);
    view.zoom = hi - lo >= (full[1] - full[0]) ? null : [lo, hi];
    drawTimeline(view.data);
  }, { passive: false });
  svg.addEventListener("dblclick", () => { view.zoom = null; drawTimeline(view.data); });
  box.appendChild(svg);
}

function drawLegend() {
  const legend = document.getElementById("timeline-legend");
  legend.innerHTML = "";
  const items = [["#3182ce", "step (kept)"], ["#e53e3e", "step replayed after a restart / fault"], ["#38a169", "in-process restart"],
    ["#d69e2e", "in-job restart"], ["#805ad5", "escalation"], ["#319795", "hot spare"], ["#dd6b20", "drill injected"], ["#4a5568", "launch"]];
  for (const [color, label] of items) {
    const span = el("span");
    span.appendChild(el("span", { class: "swatch", style: `background:${color}` }));
    span.appendChild(document.createTextNode(label));
    legend.appendChild(span);
  }
}

function drawGoodput(data) {
  const box = document.getElementById("goodput");
  box.innerHTML = "";
  const parts = data.figures.goodput.filter((g) => g.seconds > 0);
  const total = parts.reduce((a, g) => a + g.seconds, 0);
  if (!total) { box.appendChild(el("div", { class: "muted" }, "no time recorded yet")); return; }
  const width = Math.max(600, Math.min(1400, box.clientWidth || 1000)), height = 34;
  const svg = svgEl("svg", { width, height: height + 22, id: "goodput-svg" }, null);
  let at = 0;
  parts.forEach((g, i) => {
    const w = (g.seconds / total) * width;
    svgEl("rect", {
      x: at, y: 0, width: Math.max(w, 1), height, fill: GOODPUT_COLORS[i % GOODPUT_COLORS.length],
      "data-tip": `${g.category}: ${fmtSeconds(g.seconds)} (${((100 * g.seconds) / total).toFixed(1)} % of wall time)`,
    }, svg);
    if (w > 70) svgEl("text", { x: at + 4, y: height + 15, "font-size": 11, fill: "#4a5568" }, svg).textContent = g.category;
    at += w;
  });
  box.appendChild(svg);
}

function drawLoss(data) {
  const box = document.getElementById("loss");
  box.innerHTML = "";
  const points = data.figures.steps.filter((s) => s[3] !== null);
  if (!points.length) { box.appendChild(el("div", { class: "muted" }, "no loss logged yet")); return; }
  const width = Math.max(600, Math.min(1400, box.clientWidth || 1000)), height = 240, m = { l: 60, r: 16, t: 10, b: 40 };
  const steps = points.map((p) => p[0]), losses = points.map((p) => p[3]);
  const sx = [Math.min(...steps), Math.max(...steps) + 1], sy = [Math.min(...losses), Math.max(...losses)];
  if (sy[1] - sy[0] < 1e-9) { sy[0] -= 0.5; sy[1] += 0.5; }
  const x = xScale(sx, m.l, width - m.r);
  const y = (v) => height - m.b - ((v - sy[0]) / (sy[1] - sy[0])) * (height - m.t - m.b);
  const svg = svgEl("svg", { width, height, id: "loss-svg" }, null);
  const kept = points.filter((p) => !p[4]).sort((a, b) => a[0] - b[0]);
  svgEl("polyline", { points: kept.map((p) => `${x(p[0])},${y(p[3])}`).join(" "), fill: "none", stroke: "#3182ce", "stroke-width": 1.5 }, svg);
  for (const p of points) {
    svgEl("circle", { cx: x(p[0]), cy: y(p[3]), r: p[4] ? 3 : 2.5, fill: p[4] ? "#e53e3e" : "#3182ce",
      "data-tip": `step ${p[0]}: loss ${fmtNumber(p[3], 4)}${p[4] ? " (replayed later)" : ""}` }, svg);
  }
  axis(svg, x, sx, 6, m.l, height - m.b, false, "step");
  axis(svg, y, sy, 4, m.l, height - m.b, true, "loss");
  box.appendChild(svg);
}

function drawStatus(data) {
  document.getElementById("run-id").textContent = data.run_id;
  const box = document.getElementById("status");
  box.innerHTML = "";
  const s = data.status, b = data.brief, a = data.airflow;
  box.appendChild(el("span", { class: `badge ${badgeClass(s.state)}`, id: "run-state" }, s.state.replace("_", " ")));
  const facts = [
    `steps ${b.last_step ?? 0}${b.steps ? " / " + b.steps : ""}`,
    `ETTR ${fmtNumber(b.ettr, 3)}`,
    `restarts ${b.restarts_total}` + (b.restarts_total ? ` (${Object.entries(b.restarts).map(([k, v]) => `${k} ${v}`).join(", ")})` : ""),
    `escalations ${b.escalations}`,
    `wall ${fmtSeconds(b.wall_s)}`,
    `DAG run: ${a.state}`,
  ];
  for (const fact of facts) box.appendChild(el("span", {}, fact));
  if (s.message) box.appendChild(el("div", { class: "muted", style: "flex-basis:100%" }, s.message));
  box.appendChild(el("span", { class: "muted", id: "updated" },
    `updated ${new Date().toLocaleTimeString()} · ${data.events_read} events read from ${data.source}`));
}

function drawSections(data) {
  // The server renders the report's Markdown with raw HTML disabled: event text is escaped.
  const html = data.sections_html || "";
  const cut = html.indexOf("<h2>", 1);
  document.getElementById("summary").innerHTML = cut > 0 ? html.slice(0, cut) : html;
  document.getElementById("sections").innerHTML = cut > 0 ? html.slice(cut) : "";
}

function finished(data) {
  return data.status.state !== "running" && data.status.state !== "not_started" && !["running", "queued"].includes(data.airflow.state);
}

async function refresh() {
  let data;
  try {
    data = await fetchData(dataUrl());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = `could not load the report: ${e.message}`;
    setTimeout(refresh, POLL_MS * 2);
    return;
  }
  view.data = data;
  drawStatus(data);
  drawSections(data);
  drawTimeline(data);
  drawGoodput(data);
  drawLoss(data);
  document.body.setAttribute("data-loaded", String(data.events_read));
  if (!finished(data)) setTimeout(refresh, POLL_MS);
}

installTooltip();
drawLegend();
refresh();
