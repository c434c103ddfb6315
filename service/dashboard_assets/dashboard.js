// kvshelf admin dashboard: polls /api/data every second, keeps the last 5 minutes of snapshots (cumulative counts)
// and draws rates from their differences on plain canvases. No library, nothing fetched from elsewhere.
"use strict";

const POLL_MS = 1000;
const KEEP_S = 300;
const WINDOW_S = 10;
const COLORS = ["#2f6fdf", "#e0672f", "#2a9d5c", "#b03aa8", "#c9a227", "#1aa3b8", "#8a5a3c", "#5a6acf", "#d6336c",
                "#6b8e23"];
const snapshots = [];
const state = { polls: 0, draws: 0, firstPaintMs: null, lastError: null };
window.__kvshelf = state;

function el(id) { return document.getElementById(id); }

function size(n) {
  if (n === null || n === undefined) return "unreachable";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${units[i]}`;
}

function pct(hit, asked) { return asked ? `${(100 * hit / asked).toFixed(1)}%` : "n/a"; }

function short(text, n) { return text.length > n ? text.slice(0, n) + "\u2026" : text; }

function sum(list, fn) { return list.reduce((acc, x) => acc + (fn(x) || 0), 0); }

// -- charts ------------------------------------------------------------------------------------------------------

function drawChart(id, series, opts) {
  const canvas = el(`chart-${id}`);
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 560, h = canvas.clientHeight || 220;
  if (canvas.width !== Math.round(w * ratio)) { canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 62, right = 10, top = 8, bottom = 22;
  const now = snapshots.length ? snapshots[snapshots.length - 1].t : Date.now() / 1000;
  const t0 = now - KEEP_S;
  let yMax = opts.yMax;
  if (yMax === undefined) {
    yMax = 0;
    for (const s of series) for (const [, v] of s.points) if (v !== null && v > yMax) yMax = v;
    yMax = yMax > 0 ? yMax * 1.1 : 1;
  }
  const x = (t) => left + (w - left - right) * (t - t0) / KEEP_S;
  const y = (v) => top + (h - top - bottom) * (1 - v / yMax);
  ctx.strokeStyle = "#dde2e8"; ctx.fillStyle = "#5b6676"; ctx.lineWidth = 1; ctx.font = "11px system-ui, sans-serif";
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4, yy = y(v);
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(opts.format(v), left - 4, yy + 4);
  }
  ctx.textAlign = "center";
  for (let m = 0; m <= 5; m++) ctx.fillText(m === 5 ? "now" : `-${5 - m} min`, x(t0 + 60 * m), h - 6);
  ctx.lineWidth = 2;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.beginPath();
    let pen = false;
    for (const [t, v] of s.points) {
      if (v === null || t < t0) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      pen = true;
    }
    ctx.stroke();
    const last = s.points.filter(([, v]) => v !== null).pop();
    if (last) { ctx.fillStyle = s.color; ctx.beginPath(); ctx.arc(x(last[0]), y(last[1]), 3, 0, 2 * Math.PI); ctx.fill(); }
  }
  const legend = el(`legend-${id}`);
  legend.replaceChildren(...series.map((s) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = s.color;
    item.append(swatch, s.label);
    return item;
  }));
  if (!series.length) legend.textContent = opts.empty || "no data yet";
}

// per-second rate of a cumulative count between consecutive snapshots
function perSecond(get) {
  const points = [];
  for (let i = 1; i < snapshots.length; i++) {
    const a = snapshots[i - 1], b = snapshots[i], va = get(a), vb = get(b);
    points.push([b.t, va === null || vb === null || b.t <= a.t ? null : Math.max(0, vb - va) / (b.t - a.t)]);
  }
  return points;
}

function seriesKey(s) { return `${s.namespace}\u0000${s.model}`; }

function hitRateSeries() {
  const keys = new Map();
  for (const snap of snapshots) for (const s of snap.series) keys.set(seriesKey(s), s);
  const out = [];
  let color = 0;
  for (const [key, s] of keys) {
    for (const kind of ["lookup", "retrieve"]) {
      const points = [];
      let start = 0;
      for (let i = 0; i < snapshots.length; i++) {
        const b = snapshots[i];
        while (snapshots[start].t < b.t - WINDOW_S) start++;
        const a = snapshots[start];
        const row = (snap) => snap.series.find((r) => seriesKey(r) === key);
        const ra = row(a), rb = row(b);
        const asked = (rb ? rb[`${kind}_blocks`] : 0) - (ra && a !== b ? ra[`${kind}_blocks`] : 0);
        const hits = (rb ? rb[`${kind}_hit_blocks`] : 0) - (ra && a !== b ? ra[`${kind}_hit_blocks`] : 0);
        points.push([b.t, asked > 0 ? 100 * hits / asked : null]);
      }
      if (points.some(([, v]) => v !== null)) {
        out.push({ label: `${kind} \u00b7 ${s.namespace} \u00b7 ${short(s.model, 16)}`, color: COLORS[color % COLORS.length], points });
        color++;
      }
    }
  }
  return out;
}

function tierNames() {
  const names = [];
  for (const snap of snapshots) for (const t of snap.tiers) if (!names.includes(t.name)) names.push(t.name);
  return names;
}

function tierValue(snap, name, field) {
  const tier = snap.tiers.find((t) => t.name === name);
  return tier && tier[field] !== null && tier[field] !== undefined ? tier[field] : null;
}

function drawCharts() {
  const tiers = tierNames();
  drawChart("hit-rate", hitRateSeries(), { yMax: 100, format: (v) => `${v.toFixed(0)}%`,
                                          empty: "no lookups or retrievals in the last 10 s" });
  const perTier = (field) => tiers.map((name, i) => ({ label: name, color: COLORS[i % COLORS.length],
                                                      points: snapshots.map((s) => [s.t, tierValue(s, name, field)]) }));
  drawChart("bytes", perTier("bytes"), { format: size });
  drawChart("blocks", perTier("blocks"), { format: (v) => v.toFixed(0) });
  drawChart("evictions", tiers.map((name, i) => ({ label: name, color: COLORS[i % COLORS.length],
                                                   points: perSecond((s) => tierValue(s, name, "evictions")) })),
            { format: (v) => v.toFixed(1) });
  drawChart("events", [{ label: "events / s", color: COLORS[0], points: perSecond((s) => s.events) }],
            { format: (v) => v.toFixed(1) });
  state.draws++;
  if (state.firstPaintMs === null) {
    state.firstPaintMs = performance.now();
    performance.mark("kvshelf-first-chart");
  }
}

// -- tiles and tables --------------------------------------------------------------------------------------------

function row(cells) {
  const tr = document.createElement("tr");
  for (const [text, cls] of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.append(td);
  }
  return tr;
}

function fill(id, rows, empty) {
  const body = el(id).tBodies[0];
  body.replaceChildren(...(rows.length ? rows : [row([[empty]])]));
}

function drawNumbers(snap) {
  const s = snap.series;
  const lookups = sum(s, (r) => r.lookup_blocks), lookupHits = sum(s, (r) => r.lookup_hit_blocks);
  const gets = sum(s, (r) => r.retrieve_blocks), getHits = sum(s, (r) => r.retrieve_hit_blocks);
  el("tile-lookup-rate").textContent = pct(lookupHits, lookups);
  el("tile-lookup-counts").textContent = `${lookupHits} of ${lookups} blocks`;
  el("tile-retrieve-rate").textContent = pct(getHits, gets);
  el("tile-retrieve-counts").textContent = `${getHits} of ${gets} blocks`;
  const widest = snap.tiers.reduce((best, t) => ((t.blocks || 0) > (best ? best.blocks || 0 : -1) ? t : best), null);
  el("tile-blocks").textContent = widest ? String(widest.blocks || 0) : "0";
  el("tile-bytes").textContent = widest ? `${size(widest.bytes)} in ${widest.name}` : "no tier";
  el("tile-evictions").textContent = String(sum(snap.tiers, (t) => t.evictions));
  el("tile-events").textContent = snap.events === null ? "n/a" : String(snap.events);
  const rates = perSecond((x) => x.events).slice(-5).filter(([, v]) => v !== null);
  el("tile-event-rate").textContent = rates.length ? `${(sum(rates, ([, v]) => v) / rates.length).toFixed(1)} / s` : "0 / s";
  fill("table-series", s.map((r) => row([[r.namespace], [short(r.model, 24)], [String(r.lookup_blocks)],
    [pct(r.lookup_hit_blocks, r.lookup_blocks)], [String(r.retrieve_blocks)], [pct(r.retrieve_hit_blocks, r.retrieve_blocks)]])),
    "no lookups or retrievals yet");
  fill("table-tiers", snap.tiers.map((t) => row([[t.name + (t.available ? "" : " (unreachable)")],
    [t.blocks === null ? "-" : String(t.blocks)], [size(t.bytes)], [t.capacity_bytes ? size(t.capacity_bytes) : "-"],
    [String(t.hits)], [String(t.misses)], [String(t.evictions)]])), "no tiers");
  fill("table-prefixes", snap.top_prefixes.map((p) => row([[p.namespace], [p.key.slice(0, 16), "key"], [String(p.blocks)],
    [p.tokens === null ? "-" : String(p.tokens)], [String(p.hits)], [String(p.error)],
    [new Date(p.last_seen * 1000).toLocaleTimeString()]])), "no prefix reused yet");
}

// -- polling -----------------------------------------------------------------------------------------------------

async function poll() {
  try {
    const response = await fetch("/api/data", { cache: "no-store", credentials: "same-origin" });
    if (response.status === 401) throw new Error("401: this dashboard needs its token (reload the page to log in)");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snap = await response.json();
    snapshots.push(snap);
    while (snapshots.length && snapshots[0].t < snap.t - KEEP_S) snapshots.shift();
    state.polls++;
    el("title").textContent = snap.title ? `\u00b7 ${snap.title}` : "";
    el("status").textContent = `${snap.scope} \u00b7 updated ${new Date(snap.t * 1000).toLocaleTimeString()}`;
    drawNumbers(snap);
    drawCharts();
    state.lastError = null;
  } catch (err) {
    state.lastError = String(err);
    el("status").textContent = `no data: ${err.message || err}`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
