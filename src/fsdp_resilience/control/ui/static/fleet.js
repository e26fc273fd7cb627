// The fleet page: every run of the DAG with its status, ETTR, time lost, restarts and escalations,
// sortable; and the nodes escalations replaced. Each run links to its report view.
"use strict";

function runLink(row) {
  const a = el("a", { href: `../../runs/${encodeURIComponent(row.airflow.dag_id)}/${encodeURIComponent(row.airflow.dag_run_id)}` }, row.run_id || row.airflow.dag_run_id);
  return a;
}

function statusBadge(row) {
  const state = row.state || "unknown";
  return el("span", { class: `badge ${badgeClass(state)}` }, state.replace("_", " "));
}

async function load() {
  let data;
  try {
    data = await fetchData(dataUrl());
  } catch (e) {
    document.getElementById("error").textContent = `could not load the fleet: ${e.message}`;
    return;
  }
  document.getElementById("dag-id").textContent = data.dag_id;
  const runs = document.getElementById("runs");
  runs.innerHTML = "";
  if (!data.runs.length) runs.appendChild(el("div", { class: "muted" }, "no runs yet"));
  else runs.appendChild(sortableTable([
    { title: "run", value: (r) => r.run_id || r.airflow.dag_run_id, show: runLink },
    { title: "started", value: (r) => r.airflow.start_date, show: (r) => (r.airflow.start_date || "").replace("T", " ").slice(0, 19) },
    { title: "status", value: (r) => r.state, show: statusBadge },
    { title: "DAG run", value: (r) => r.airflow.state },
    { title: "steps", value: (r) => r.last_step, show: (r) => `${r.last_step ?? 0}${r.steps ? " / " + r.steps : ""}` },
    { title: "ETTR", value: (r) => r.ettr, show: (r) => fmtNumber(r.ettr, 3) },
    { title: "time lost", value: (r) => r.lost_s, show: (r) => fmtSeconds(r.lost_s), descendingFirst: true },
    { title: "restarts", value: (r) => r.restarts_total ?? 0, show: (r) => `${r.restarts_total ?? 0}` + (r.restarts_total ? ` (${Object.entries(r.restarts).map(([k, v]) => `${k} ${v}`).join(", ")})` : ""), descendingFirst: true },
    { title: "escalations", value: (r) => r.escalations ?? 0, descendingFirst: true },
    { title: "nodes replaced", value: (r) => Object.keys(r.nodes_replaced || {}).length, show: (r) => Object.keys(r.nodes_replaced || {}).join(", ") || "—", descendingFirst: true },
  ], data.runs));
  const nodes = document.getElementById("nodes");
  nodes.innerHTML = "";
  if (!data.nodes.length) nodes.appendChild(el("div", { class: "muted" }, "none"));
  else nodes.appendChild(sortableTable([
    { title: "node", value: (n) => n.node },
    { title: "replacements", value: (n) => n.replacements, descendingFirst: true },
    { title: "runs", value: (n) => n.runs.length, show: (n) => n.runs.join(", "), descendingFirst: true },
  ], data.nodes));
  document.body.setAttribute("data-loaded", String(data.runs.length));
}

installTooltip();
load();
setInterval(load, 30000);
