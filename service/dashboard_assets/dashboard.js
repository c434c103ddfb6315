// kvshelf admin dashboard. On load it asks, at once and together, for one snapshot (/api/data) and the server's
// kept history (/api/history); then it polls /api/data every second. Snapshots hold cumulative counts: rates,
// windowed hit rates and latency quantiles are differences over a window. Plain canvases, no library, nothing
// fetched from elsewhere. Until the first answer every number shows a neutral placeholder, never a zero.
"use strict";

const POLL_MS = 1000;
const LIVE_S = 300;        // full snapshots kept (per-series hit rates, latency windows)
const KEEP_S = 3600;       // chart points kept (history and polls, thinned to one per THIN_S past LIVE_S)
const THIN_S = 5;
const HIT_WINDOW_S = 10;   // hit rates over the last 10 s
const RATE_WINDOW_S = 10;  // per-second rates averaged over 10 s
const LATENCY_WINDOW_S = 60;
const SERIES_LINES = 6;    // per namespace/model hit-rate lines drawn (the busiest)
const TABLE_ROWS = 50;
const PLACEHOLDER = "\u2013";
const COLORS = ["#2f6fdf", "#e0672f", "#2a9d5c", "#b03aa8", "#c9a227", "#1aa3b8", "#8a5a3c", "#5a6acf", "#d6336c",
                "#6b8e23"];
const snapshots = [];  // full /api/data answers, the last LIVE_S seconds
let timeline = [];     // compact points {t, totals, tiers: {name: {bytes, blocks, evictions}}, events}, oldest first
let spanS = 300;
const state = { polls: 0, draws: 0, firstPaintMs: null, firstDataMs: null, lastError: null, historyPoints: 0,
                historyError: null, chartPoints: {}, firstDrawPoints: null, lastDrawMs: null };
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

function count(v) { return Number.isInteger(v) ? String(v) : v >= 10 ? v.toFixed(0) : v >= 1 ? v.toFixed(1) : v.toFixed(2); }

function ms(seconds) {
  if (seconds === null || seconds === undefined) return PLACEHOLDER;
  const v = seconds * 1000;
  return v >= 100 ? `${v.toFixed(0)} ms` : v >= 10 ? `${v.toFixed(1)} ms` : `${v.toFixed(2)} ms`;
}

// a model as people know it: its name where the server learned one, else what the client called it (a
// fingerprint, 32 hex digits, shortened to 16)
function modelName(r) { return r.model_name || (/^[0-9a-f]{32}$/.test(r.model) ? short(r.model, 16) : short(r.model, 40)); }

function modelTitle(r) {
  return [`fingerprint ${r.model}`, r.model_shape].filter(Boolean).join("\n");
}

// -- the timeline ------------------------------------------------------------------------------------------------

function compact(snap) {
  const tiers = {};
  for (const t of snap.tiers) tiers[t.name] = { bytes: t.bytes, blocks: t.blocks, evictions: t.evictions };
  return { t: snap.t, totals: snap.totals || null, tiers, events: snap.events };
}

function addPoint(point) {
  timeline.push(point);
  const now = point.t;
  // past LIVE_S, keep one point per THIN_S; past KEEP_S, none
  const kept = [];
  let last = -Infinity;
  for (const p of timeline) {
    if (p.t < now - KEEP_S) continue;
    if (p.t < now - LIVE_S && p.t - last < THIN_S) continue;
    kept.push(p);
    last = p.t;
  }
  timeline = kept;
}

function addHistory(points) {
  const first = timeline.length ? timeline[0].t : Infinity;
  const older = points.filter((p) => p.t < first).map((p) => ({ t: p.t, totals: p.totals, tiers: p.tiers,
                                                                 events: null }));
  timeline = older.concat(timeline);
  state.historyPoints = older.length;
  if (older.length >= 2) {
    const step = (older[older.length - 1].t - older[0].t) / (older.length - 1);
    el("history-note").textContent = `${older.length} points of the server's history (one per ` +
      `${step < 10 ? step.toFixed(1) : step.toFixed(0)} s), ` +
      "then one per second from this page";
  } else {
    el("history-note").textContent = "the server kept no history yet: points from this page, one per second";
  }
}

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
  const now = timeline.length ? timeline[timeline.length - 1].t : Date.now() / 1000;
  const t0 = now - spanS;
  let yMax = opts.yMax;
  if (yMax === undefined) {
    yMax = 0;
    for (const s of series) for (const [t, v] of s.points) if (v !== null && t >= t0 && v > yMax) yMax = v;
    yMax = niceMax(yMax, opts.binary);
  }
  const x = (t) => left + (w - left - right) * (t - t0) / spanS;
  const y = (v) => top + (h - top - bottom) * (1 - v / yMax);
  ctx.strokeStyle = "#dde2e8"; ctx.fillStyle = "#5b6676"; ctx.lineWidth = 1; ctx.font = "11px system-ui, sans-serif";
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4, yy = y(v);
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(opts.format(v), left - 4, yy + 4);
  }
  ctx.textAlign = "center";
  const step = spanS / 5;
  for (let m = 0; m <= 5; m++) {
    const ago = spanS - step * m;
    ctx.fillText(m === 5 ? "now" : `-${ago >= 60 ? `${(ago / 60).toFixed(0)} min` : `${ago.toFixed(0)} s`}`, x(t0 + step * m), h - 6);
  }
  let drawn = 0;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = s.width || 2; ctx.setLineDash(s.dash || []); ctx.beginPath();
    let pen = false;
    for (const [t, v] of s.points) {
      if (v === null || t < t0) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      pen = true;
      drawn++;
    }
    ctx.stroke();
    ctx.setLineDash([]);
    const last = s.points.filter(([t, v]) => v !== null && t >= t0).pop();
    if (last) { ctx.fillStyle = s.color; ctx.beginPath(); ctx.arc(x(last[0]), y(last[1]), 3, 0, 2 * Math.PI); ctx.fill(); }
  }
  state.chartPoints[id] = drawn;
  const legend = el(`legend-${id}`);
  legend.replaceChildren(...series.map((s) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = s.color;
    item.append(swatch, s.label);
    if (s.title) item.title = s.title;
    return item;
  }));
  if (!series.length) legend.textContent = opts.empty || "no data yet";
}

// the top of a chart's axis: 4 steps of 1, 2, 2.5 or 5 x 10^k (of 1024^j bytes when binary), at least 1
function niceMax(v, binary) {
  if (!(v > 0)) return binary ? 1024 : 1;
  let unit = 1;
  if (binary) while (v / unit >= 1024) unit *= 1024;
  const rough = v / unit / 4, p = Math.pow(10, Math.floor(Math.log10(rough))), m = rough / p;
  const step = (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
  return Math.max(binary ? 4 : 1, 4 * step * unit);
}

// points [t, value] of a windowed figure: fn(a, b) for each point b and the latest point a at least windowS
// before it (the oldest when none is), null where fn gives none
function windowed(points, windowS, fn) {
  const out = [];
  let j = 0;
  for (let i = 0; i < points.length; i++) {
    const b = points[i];
    while (j + 1 < i && points[j + 1].t <= b.t - windowS) j++;
    out.push([b.t, j < i ? fn(points[j], b) : null]);
  }
  return out;
}

// per-second rate of a cumulative count, averaged over RATE_WINDOW_S (over the points that have the count)
function perSecond(get) {
  const points = timeline.filter((p) => get(p) !== null && get(p) !== undefined);
  return windowed(points, RATE_WINDOW_S, (a, b) => {
    const va = get(a), vb = get(b);
    return va === null || va === undefined || vb === null || vb === undefined || vb < va ? null : (vb - va) / (b.t - a.t);
  });
}

// hit rate in % over HIT_WINDOW_S; get(point) is the point's counts (a missing row: none counted yet, unless
// strict: a point without the counts, as history points of a dashboard of some namespaces)
function hitRate(points, get, kind, strict) {
  return windowed(points, HIT_WINDOW_S, (a, b) => {
    const ra = get(a), rb = get(b);
    if (!rb || (strict && !ra)) return null;
    const asked = rb[`${kind}_blocks`] - (ra ? ra[`${kind}_blocks`] : 0);
    const hits = rb[`${kind}_hit_blocks`] - (ra ? ra[`${kind}_hit_blocks`] : 0);
    return asked > 0 ? 100 * hits / asked : null;
  });
}

function seriesKey(s) { return `${s.namespace}\u0000${s.model}`; }

function indexed(snap) {
  if (!snap._index) snap._index = new Map(snap.series.map((r) => [seriesKey(r), r]));
  return snap._index;
}

function hitRateSeries() {
  const out = [];
  let color = 0;
  for (const kind of ["lookup", "retrieve"]) {
    const points = hitRate(timeline, (p) => p.totals, kind, true);
    if (points.some(([, v]) => v !== null)) {
      out.push({ label: `${kind} \u00b7 all`, color: COLORS[color % COLORS.length], width: 3, points });
    }
    color++;
  }
  const latest = snapshots[snapshots.length - 1];
  if (!latest || latest.series.length < 2) return out;
  const busiest = latest.series.slice().sort((a, b) => (b.lookup_blocks + b.retrieve_blocks) -
                                                       (a.lookup_blocks + a.retrieve_blocks)).slice(0, SERIES_LINES);
  for (const s of busiest) {
    const key = seriesKey(s);
    for (const kind of ["lookup", "retrieve"]) {
      const points = hitRate(snapshots, (snap) => indexed(snap).get(key), kind);
      if (points.some(([, v]) => v !== null)) {
        out.push({ label: `${kind} \u00b7 ${s.namespace} \u00b7 ${short(modelName(s), 24)}`, title: modelTitle(s),
                   color: COLORS[color % COLORS.length], dash: [5, 3], points });
        color++;
      }
    }
  }
  return out;
}

function tierNames() {
  const names = [];
  for (const p of timeline) for (const name of Object.keys(p.tiers)) if (!names.includes(name)) names.push(name);
  return names;
}

function tierValue(p, name, field) {
  const tier = p.tiers[name];
  return tier && tier[field] !== null && tier[field] !== undefined ? tier[field] : null;
}

function drawCharts() {
  const tiers = tierNames();
  drawChart("hit-rate", hitRateSeries(), { yMax: 100, format: (v) => `${v.toFixed(0)}%`,
                                          empty: "no lookups or retrievals in this span" });
  const perTier = (field) => tiers.map((name, i) => ({ label: name, color: COLORS[i % COLORS.length],
                                                      points: timeline.map((p) => [p.t, tierValue(p, name, field)]) }));
  drawChart("bytes", perTier("bytes"), { format: size, binary: true });
  drawChart("blocks", perTier("blocks"), { format: count });
  drawChart("evictions", tiers.map((name, i) => ({ label: name, color: COLORS[i % COLORS.length],
                                                   points: perSecond((p) => tierValue(p, name, "evictions")) })),
            { format: count });
  drawChart("events", [{ label: "events / s", color: COLORS[0], points: perSecond((p) => p.events) }],
            { format: count });
  state.draws++;
  if (state.firstDrawPoints === null) state.firstDrawPoints = { ...state.chartPoints };
  if (state.firstPaintMs === null) {
    state.firstPaintMs = performance.now();
    performance.mark("kvshelf-first-chart");
  }
}

// -- latency -----------------------------------------------------------------------------------------------------

// the q-quantile of histogram buckets [[upper bound | null (+Inf), count in the window]] (linear within a bucket,
// as Prometheus' histogram_quantile; past the last finite bound: that bound)
function quantile(buckets, total, q) {
  if (!total) return null;
  const rank = q * total;
  let below = 0, lower = 0;
  for (const [bound, count] of buckets) {
    if (count >= rank) {
      if (bound === null) return lower;
      const inBucket = count - below;
      return inBucket > 0 ? lower + (bound - lower) * (rank - below) / inBucket : bound;
    }
    below = count;
    if (bound !== null) lower = bound;
  }
  return lower;
}

function latencyRows() {
  const latest = snapshots[snapshots.length - 1];
  if (!latest || !latest.latency) return null;
  let base = null;
  for (const snap of snapshots) if (snap.t <= latest.t - LATENCY_WINDOW_S) base = snap;
  if (!base && snapshots.length > 1) base = snapshots[0];
  const before = new Map(((base && base.latency) || []).map((m) => [m.method, m]));
  const seconds = base ? latest.t - base.t : null;
  const rows = [];
  for (const m of latest.latency) {
    const b = before.get(m.method);
    const count = m.count - (b ? b.count : 0);
    if (count <= 0) continue;
    const buckets = m.buckets.map(([bound, n], i) => [bound, n - (b ? b.buckets[i][1] : 0)]);
    rows.push({ method: m.method, count, rate: seconds ? count / seconds : null,
                p50: quantile(buckets, count, 0.5), p99: quantile(buckets, count, 0.99),
                mean: (m.sum - (b ? b.sum : 0)) / count });
  }
  rows.sort((a, b) => b.count - a.count);
  return { rows, seconds };
}

function drawLatency() {
  const got = latencyRows();
  if (got === null) {
    el("latency-note").textContent = "not measured by this dashboard (a remote server's latency is on its /metrics)";
    fill("table-latency", [], "not measured here");
    return;
  }
  el("latency-note").textContent = got.seconds === null ? "since the server started (a window once polled longer)"
    : `over the last ${got.seconds.toFixed(0)} s (quantiles interpolated within histogram buckets)`;
  fill("table-latency", got.rows.map((r) => row([[r.method], [String(r.count)],
    [r.rate === null ? PLACEHOLDER : `${r.rate.toFixed(1)}`], [ms(r.p50)], [ms(r.p99)], [ms(r.mean)]])),
    got.seconds === null ? "no requests yet" : `no requests in the last ${got.seconds.toFixed(0)} s`);
}

// -- tiles and tables --------------------------------------------------------------------------------------------

function cell(content, cls, title) {
  const td = document.createElement("td");
  if (content instanceof Node) td.append(content); else td.textContent = content;
  if (cls) td.className = cls;
  if (title) td.title = title;
  return td;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const [content, cls, title] of cells) tr.append(cell(content, cls, title));
  return tr;
}

function fill(id, rows, empty) {
  const body = el(id).tBodies[0];
  const cols = el(id).tHead.rows[0].cells.length;
  if (rows.length) { body.replaceChildren(...rows); return; }
  const td = cell(empty, "empty");
  td.colSpan = cols;
  const tr = document.createElement("tr");
  tr.append(td);
  body.replaceChildren(tr);
}

function modelCell(r) {
  const span = document.createElement("span");
  span.append(modelName(r));
  const sub = document.createElement("small");
  sub.textContent = r.model_name ? short(r.model, 16) : (r.model_shape || "");
  if (sub.textContent) span.append(sub);
  return span;
}

function stateBadge(t) {
  const badge = document.createElement("span");
  badge.className = `badge ${t.state}`;
  badge.textContent = t.state;
  return badge;
}

function usageBar(t) {
  const wrap = document.createElement("span");
  wrap.className = "usage";
  const text = document.createElement("span");
  if (t.bytes === null || t.bytes === undefined) {
    text.textContent = "unreachable";
    wrap.append(text);
    return wrap;
  }
  text.textContent = t.capacity_bytes ? `${size(t.bytes)} of ${size(t.capacity_bytes)}` : `${size(t.bytes)} (no cap)`;
  if (t.capacity_bytes) {
    const bar = document.createElement("span");
    bar.className = "bar";
    const fillEl = document.createElement("i");
    const share = Math.min(1, t.bytes / t.capacity_bytes);
    fillEl.style.width = `${(100 * share).toFixed(1)}%`;
    if (share > 0.9) fillEl.className = "full";
    bar.append(fillEl);
    wrap.append(bar);
  }
  wrap.append(text);
  return wrap;
}

function setTile(id, text) {
  const node = el(id);
  node.textContent = text;
  node.classList.remove("pending");
}

function drawNumbers(snap) {
  const totals = snap.totals || {
    lookup_blocks: sum(snap.series, (r) => r.lookup_blocks), lookup_hit_blocks: sum(snap.series, (r) => r.lookup_hit_blocks),
    retrieve_blocks: sum(snap.series, (r) => r.retrieve_blocks),
    retrieve_hit_blocks: sum(snap.series, (r) => r.retrieve_hit_blocks) };
  setTile("tile-lookup-rate", pct(totals.lookup_hit_blocks, totals.lookup_blocks));
  setTile("tile-lookup-counts", `${totals.lookup_hit_blocks} of ${totals.lookup_blocks} blocks`);
  setTile("tile-retrieve-rate", pct(totals.retrieve_hit_blocks, totals.retrieve_blocks));
  setTile("tile-retrieve-counts", `${totals.retrieve_hit_blocks} of ${totals.retrieve_blocks} blocks`);
  const widest = snap.tiers.reduce((best, t) => ((t.blocks || 0) > (best ? best.blocks || 0 : -1) ? t : best), null);
  setTile("tile-blocks", widest ? (widest.blocks === null ? "unreachable" : String(widest.blocks)) : "no tier");
  setTile("tile-bytes", widest ? `${size(widest.bytes)} in ${widest.name}` : "no tier");
  setTile("tile-evictions", String(sum(snap.tiers, (t) => t.evictions)));
  setTile("tile-events", snap.events === null ? "not kept" : String(snap.events));
  const rates = perSecond((p) => p.events).slice(-1).filter(([, v]) => v !== null);
  setTile("tile-event-rate", rates.length ? `${rates[0][1].toFixed(1)} / s (last 10 s)` : "rate after a few polls");
  const down = snap.tiers.filter((t) => t.state !== "up");
  setTile("tile-health", down.length ? down.map((t) => `${t.name} ${t.state}`).join(", ") : "all up");
  el("tile-health").className = `value ${down.length ? "warn" : "ok"}`;
  setTile("tile-health-sub", `${snap.tiers.length} tier${snap.tiers.length === 1 ? "" : "s"}`);
  const byTraffic = snap.series.slice().sort((a, b) => (b.lookup_blocks + b.retrieve_blocks) -
                                                       (a.lookup_blocks + a.retrieve_blocks)).slice(0, TABLE_ROWS);
  fill("table-series", byTraffic.map((r) => row([[r.namespace], [modelCell(r), "model", modelTitle(r)],
    [String(r.lookup_blocks)], [pct(r.lookup_hit_blocks, r.lookup_blocks)], [String(r.retrieve_blocks)],
    [pct(r.retrieve_hit_blocks, r.retrieve_blocks)]])), "no lookups or retrievals yet");
  const total = snap.series_total === undefined ? snap.series.length : snap.series_total;
  el("series-note").textContent = total > byTraffic.length ? `the ${byTraffic.length} busiest of ${total}` : "";
  fill("table-tiers", snap.tiers.map((t) => row([[t.name], [stateBadge(t)], [usageBar(t), "usage-cell"],
    [t.blocks === null ? "-" : String(t.blocks)], [String(t.hits)], [String(t.misses)], [String(t.evictions)],
    [String((t.unavailable || 0) + (t.corrupt || 0)), "", "calls the tier could not answer + damaged values read"]])),
    "no tiers");
  fill("table-prefixes", snap.top_prefixes.map((p) => row([[p.namespace], [p.key.slice(0, 16), "key", p.key],
    [String(p.blocks)], [p.tokens === null ? "-" : String(p.tokens)], [String(p.hits)], [String(p.error)],
    [new Date(p.last_seen * 1000).toLocaleTimeString()]])), "no prefix reused yet");
  document.body.classList.remove("loading");
}

// -- loading and polling -----------------------------------------------------------------------------------------

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store", credentials: "same-origin" });
  if (response.status === 401) throw new Error("401: this dashboard needs its token (reload the page to log in)");
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  return response.json();
}

function take(snap) {
  snapshots.push(snap);
  while (snapshots.length && snapshots[0].t < snap.t - LIVE_S) snapshots.shift();
  addPoint(compact(snap));
  state.polls++;
  if (state.firstDataMs === null) state.firstDataMs = performance.now();
  el("title").textContent = snap.title ? `\u00b7 ${snap.title}` : "";
  el("status").textContent = `${snap.scope} \u00b7 updated ${new Date(snap.t * 1000).toLocaleTimeString()}`;
  document.body.classList.remove("stale");
  drawNumbers(snap);
  drawLatency();
}

function failed(err) {
  state.lastError = String(err);
  el("status").textContent = `no data: ${err.message || err}`;
  document.body.classList.add("stale");
}

async function poll() {
  try {
    const snap = await getJSON("/api/data");
    const began = performance.now();
    take(snap);
    drawCharts();
    state.lastDrawMs = performance.now() - began;  // the page's own work per poll
    state.lastError = null;
  } catch (err) {
    failed(err);
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  const data = getJSON("/api/data");  // both asked at once: the first paint waits for one round trip
  const history = getJSON("/api/history");
  try {
    take(await data);
    state.lastError = null;
  } catch (err) {
    failed(err);
  }
  try {
    addHistory((await history).points || []);
  } catch (err) {
    state.historyError = String(err);
    el("history-note").textContent = `no history from the server (${err.message || err})`;
  }
  if (snapshots.length) drawCharts();
  setTimeout(poll, POLL_MS);
}

el("range").addEventListener("change", (event) => {
  spanS = Number(event.target.value);
  if (timeline.length) drawCharts();
});

start();
