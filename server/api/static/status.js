// Polls /status once a second and fills the page; no build step, no dependencies.
"use strict";
const $ = (id) => document.getElementById(id);
const LAYERS = ["exact", "shared", "semantic", "semantic-similar", "miss", "bypass"];

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
  return tr;
}

function replaceRows(table, rows) {
  while (table.rows.length > 1) table.deleteRow(1);
  for (const r of rows) table.appendChild(row(r));
}

function showHealth(state, reason) {
  const el = $("health");
  el.className = "health " + state;
  el.textContent = "health " + state + (reason ? ": " + reason : "");
}

function render(s) {
  showHealth(s.health.status, s.health.reason);
  $("model").textContent = s.model;
  $("pending").textContent = s.pending;
  for (const k of ["used", "free", "cached", "total"]) $("kv-" + k).textContent = s.kv[k];
  $("kv-bar").style.width = (100 * s.kv.used / Math.max(1, s.kv.total)).toFixed(1) + "%";
  $("tps-engine").textContent = s.tokens_per_second.engine.toFixed(1);
  $("tps-cache").textContent = s.tokens_per_second.cache.toFixed(1);
  const by = s.requests.by_layer, share = s.requests.share;
  replaceRows($("layers"), LAYERS.map((l) => [l, by[l] || 0, ((share[l] || 0) * 100).toFixed(1) + "%"]));
  const hist = $("hist");
  hist.replaceChildren();
  if (s.similarity) {
    const max = Math.max(1, ...s.similarity.counts);
    s.similarity.counts.forEach((n, i) => {
      const bar = document.createElement("div");
      bar.style.height = (100 * n / max) + "%";
      bar.title = "≤ " + s.similarity.le[i] + ": " + n;
      hist.appendChild(bar);
    });
    $("hist-labels").textContent = "buckets ≤ " + s.similarity.le.join(", ") + " · hits " + s.similarity.count;
  }
  replaceRows($("recent"), s.recent.map((r) => [
    new Date(r.time * 1000).toLocaleTimeString(), r.endpoint, r.cache,
    r.similarity == null ? "" : r.similarity.toFixed(3), r.latency_ms, r.tokens, r.status]));
  $("updated").textContent = new Date().toLocaleTimeString();
}

// With API keys on, /status takes the admin token: open the page as /#token=<admin-token>. The fragment never
// leaves the browser, so the token is not written to any access log.
const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");
const HEADERS = TOKEN ? { Authorization: "Bearer " + TOKEN } : {};

async function poll() {
  try {
    const res = await fetch("/status", { cache: "no-store", headers: HEADERS });
    if (res.ok) render(await res.json());
    else $("updated").textContent = res.status === 401 || res.status === 403
      ? "status needs the admin token: open this page as /#token=<admin-token>" : "error: HTTP " + res.status;
  } catch (e) {
    showHealth("unreachable", String(e));
    $("updated").textContent = "error: " + e;
  }
}
poll();
setInterval(poll, 1000);
