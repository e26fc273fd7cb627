// Shared by the report and fleet pages: fetch the page's data (relative URL: the page may be served
// under a sub-path), a tooltip, SVG helpers and number formats. No dependencies.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

// The data URL of this page: /fsdp-report/runs/D/R -> /fsdp-report/api/runs/D/R (same for dags/).
function dataUrl() {
  const path = window.location.pathname;
  const at = path.search(/\/(runs|dags)\//);
  return path.slice(0, at) + "/api" + path.slice(at);
}

async function fetchData(url) {
  // credentials: the UI's login cookie authenticates the request (same origin).
  const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(`${response.status}: ${detail}`);
  }
  return response.json();
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svgEl(tag, attrs, parent) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// Hover: any element with data-tip shows it in #tip next to the pointer.
function installTooltip() {
  const tip = el("div", { id: "tip" });
  document.body.appendChild(tip);
  document.addEventListener("mouseover", (e) => {
    const target = e.target.closest ? e.target.closest("[data-tip]") : null;
    if (!target) { tip.style.display = "none"; return; }
    tip.textContent = target.getAttribute("data-tip");
    tip.style.display = "block";
  });
  document.addEventListener("mousemove", (e) => {
    tip.style.left = Math.min(e.clientX + 14, window.innerWidth - 430) + "px";
    tip.style.top = (e.clientY + 14) + "px";
  });
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "—";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(2) + " h";
}

function fmtNumber(x, digits) {
  return x === null || x === undefined ? "—" : Number(x).toFixed(digits);
}

function badgeClass(state) {
  if (state === "success") return "success";
  if (state === "running" || state === "queued") return "running";
  if (state === "not_started") return "not_started";
  return "failed";
}

// A table whose columns sort on a click of their header (numbers as numbers, missing last).
function sortableTable(columns, rows) {
  const table = el("table", { class: "sortable-table" });
  const head = table.createTHead().insertRow();
  const body = table.createTBody();
  let sortKey = null, ascending = true;
  const render = () => {
    body.innerHTML = "";
    const sorted = rows.slice();
    if (sortKey !== null) {
      const col = columns[sortKey];
      sorted.sort((a, b) => {
        const x = col.value(a), y = col.value(b);
        if (x === y) return 0;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * (ascending ? 1 : -1);
      });
    }
    for (const row of sorted) {
      const tr = body.insertRow();
      for (const col of columns) {
        const td = tr.insertCell();
        const shown = col.show ? col.show(row) : col.value(row);
        if (shown instanceof Node) td.appendChild(shown); else td.textContent = shown ?? "—";
      }
    }
  };
  columns.forEach((col, i) => {
    const th = el("th", { class: "sortable", title: "sort" }, col.title);
    th.addEventListener("click", () => {
      ascending = sortKey === i ? !ascending : col.descendingFirst !== true;
      sortKey = i;
      for (const h of head.cells) h.textContent = h.textContent.replace(/ [▲▼]$/, "");
      th.textContent = col.title + (ascending ? " ▲" : " ▼");
      render();
    });
    head.appendChild(th);
  });
  render();
  return table;
}
