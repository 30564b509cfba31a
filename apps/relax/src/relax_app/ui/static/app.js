// relax ui: the run explorer's page. Polls the server's JSON (relax_app/ui/server.py) and draws with SVG.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const state = { rows: [], lastStep: 0, sampleSteps: [], step: null, colour: "version", samples: null };

const CHARTS = [
  ["reward", [["rollout/reward_mean", "reward"]]],
  ["held-out accuracy", [["eval/accuracy", "accuracy"]]],
  ["samples/s", [["samples_per_s", "trained samples/s"], ["rollout/tokens_per_s", "rollout tokens/s / 100", 0.01]]],
  ["staleness", [["train/staleness_mean", "mean"], ["train/staleness_max", "max"]]],
  ["staleness histogram (samples per step)", "hist"],
  ["rollout–trainer mismatch", [["train/rollout_kl_k3", "k3"], ["train/rollout_abs_logp_diff", "|Δ log-prob|"]]],
  ["weight sync (MB)", [["perf/weight_sync_bytes", "full", 1e-6], ["perf/weight_sync_sent_bytes", "sent", 1e-6]]],
  ["weight sync time (s)", [["perf/weight_sync_s", "sync"], ["perf/weight_pause_s", "engine pause"]]],
  ["critic", [["critic/explained_variance", "explained variance"], ["critic/values_mean", "values mean"]]],
];
const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

function api(path) {
  const url = path + (TOKEN ? (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : "");
  return fetch(url).then((r) => r.json());
}

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

// -- curves ------------------------------------------------------------------------------------------
function withRates(rows) {
  // samples/s of each step: its samples over the time since the previous step's line
  return rows.map((r, i) => {
    const prev = rows[i - 1];
    const dt = prev && r.time && prev.time ? r.time - prev.time : null;
    return { ...r, samples_per_s: dt > 0 && r["perf/samples"] ? r["perf/samples"] / dt : null };
  });
}

function histogram(rows) {
  // bus/staleness_hist/<k> are running counts: a step's histogram is the difference to the previous line
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r).filter((k) => k.startsWith("bus/staleness_hist/"))))].sort();
  return keys.map((k) => [k, "staleness " + k.split("/").pop(),
    rows.map((r, i) => (r[k] != null && i > 0 && rows[i - 1][k] != null ? r[k] - rows[i - 1][k] : r[k]))]);
}

function drawChart(title, series, rows) {
  const lines = series === "hist" ? histogram(rows)
    : series.map(([key, label, scale]) => [key, label, rows.map((r) => (r[key] == null ? null : r[key] * (scale || 1)))]);
  const present = lines.filter(([, , ys]) => ys.some((y) => y != null));
  if (!present.length) return null;
  const W = 380, H = 160, P = 28;
  const steps = rows.map((r) => r.step);
  const all = present.flatMap(([, , ys]) => ys.filter((y) => y != null));
  let lo = Math.min(...all), hi = Math.max(...all);
  if (hi === lo) { const pad = Math.abs(hi) * 0.1 || 1; hi += pad; lo -= lo === 0 ? 0 : pad; }
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1);
  const X = (s) => P + ((s - x0) / (x1 - x0)) * (W - P - 6);
  const Y = (v) => H - 18 - ((v - lo) / (hi - lo)) * (H - 30);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-title": title });
  g.append(svg("line", { x1: P, y1: H - 18, x2: W, y2: H - 18, stroke: "#bbb" }));
  for (const [v, y] of [[hi, Y(hi)], [lo, Y(lo)]]) {
    const t = svg("text", { x: 2, y: y + 4, "font-size": 10, fill: "#666" });
    t.textContent = Number(v.toPrecision(3));
    g.append(t);
  }
  const tx = svg("text", { x: W - 40, y: H - 4, "font-size": 10, fill: "#666" });
  tx.textContent = "step " + x1;
  g.append(tx);
  const keys = el("div", { class: "keys" });
  present.forEach(([key, label, ys], i) => {
    const c = COLOURS[i % COLOURS.length];
    const pts = steps.map((s, j) => [s, ys[j]]).filter(([, y]) => y != null);
    g.append(svg("polyline", { points: pts.map(([s, y]) => `${X(s)},${Y(y)}`).join(" "), fill: "none", stroke: c }));
    for (const [s, y] of pts) {
      const dot = svg("circle", { cx: X(s), cy: Y(y), r: 2.5, fill: c, "data-step": s, "data-key": key });
      const tip = svg("title", {});
      tip.textContent = `step ${s}: ${label} ${Number(y.toPrecision(4))} (click: its samples)`;
      dot.append(tip);
      dot.addEventListener("click", () => openStep(s));
      g.append(dot);
    }
    keys.append(el("span", { style: `color:${c}` }, "● " + label));
  });
  g.setAttribute("data-points", String(Math.max(...present.map(([, , ys]) => ys.filter((y) => y != null).length))));
  return el("div", { class: "chart" }, el("h3", {}, title), keys, g);
}

function drawCharts() {
  const rows = withRates(state.rows);
  const box = document.getElementById("charts");
  box.replaceChildren(...CHARTS.map(([t, s]) => drawChart(t, s, rows)).filter(Boolean));
}

async function pollMetrics() {
  const rows = await api(`api/metrics?after=${state.lastStep}`);
  if (rows.length) {
    state.rows = state.rows.concat(rows).sort((a, b) => a.step - b.step);
    state.lastStep = state.rows[state.rows.length - 1].step;
    drawCharts();
    document.getElementById("charts").dataset.lastStep = String(state.lastStep);
  }
}

// -- the run -----------------------------------------------------------------------------------------
async function pollRun() {
  const run = await api("api/run");
  document.getElementById("run-dir").textContent = run.run_dir;
  const s = run.status;
  document.getElementById("run-state").textContent = s ? `${s.state} · step ${s.step}/${s.num_steps}` : "no status";
  const st = run.settings || {};
  document.getElementById("run-settings").textContent = [st.mode, st.mode === "fully_async" ? `max staleness ${st.max_staleness}` : "",
    st.estimator, st.lora_rank ? `LoRA r${st.lora_rank}` : "", st.agent_path ? `agent ${st.agent_path}` : "",
    st.multimodal ? "multimodal" : ""].filter(Boolean).join(" · ");
  document.getElementById("problems").replaceChildren(...(run.problems || []).map((p) => el("li", {}, p)));
  const steps = run.sample_steps || [];
  if (steps.length !== state.sampleSteps.length) {
    state.sampleSteps = steps;
    drawSteps();
  }
}

// -- samples -----------------------------------------------------------------------------------------
function drawSteps() {
  const box = document.getElementById("steps");
  box.replaceChildren(...state.sampleSteps.map((s) => {
    const b = el("button", { "data-step": s, class: s === state.step ? "on" : "" }, String(s));
    b.addEventListener("click", () => openStep(s));
    return b;
  }));
}

async function openStep(step) {
  showTab("samples");
  state.step = step;
  drawSteps();
  document.getElementById("sample-note").textContent = `loading step ${step} ...`;
  state.samples = await api(`api/samples/${step}`);
  drawSamples();
}

const KINDS = {  // relax_app/ui/data.py::token_kinds
  gen: "the model's text (trained on)", call: "a tool call by the model (trained on)",
  obs: "observation: the environment's or user's turn (not trained on)", tool: "a tool's result (not trained on)",
};

function versionColour(v, newest) {
  const lag = Math.max(0, newest - v);
  return `hsl(${(210 + 47 * lag) % 360}, 80%, ${lag ? 80 : 88}%)`;
}

function mismatchColour(d) {
  if (d == null) return "transparent";
  const a = Math.min(1, d / 0.5);
  return `rgba(220, 38, 38, ${0.08 + 0.8 * a})`;
}

function drawSample(s, newest) {
  const toks = el("div", { class: "tokens" });
  for (const t of s.tokens) {
    const kind = t.k || (t.m ? "gen" : "obs");
    const span = el("span", { class: `tok ${kind}` + (t.m ? "" : " env"), "data-version": t.v, "data-kind": kind });
    span.textContent = t.t;
    const bg = state.colour === "mismatch" ? mismatchColour(t.d) : versionColour(t.v, newest);
    if (t.m) span.style.background = bg;
    span.title = `${KINDS[kind] || kind} · policy version ${t.v}` + (t.d == null ? "" : `, |Δ log-prob| ${t.d.toFixed(4)}`);
    toks.append(span);
  }
  const media = el("div", { class: "media" });
  for (const m of s.media || []) {
    const src = `api/media/${encodeURIComponent(s.prompt_id)}/${m.n}` + (TOKEN ? `?token=${encodeURIComponent(TOKEN)}` : "");
    media.append(m.kind === "image" ? el("img", { src, alt: "sample image" }) : el(m.kind, { src, controls: "" }));
  }
  const adv = s.advantage == null ? "" : ` · advantage ${s.advantage.toFixed(3)}`;
  const meta = el("div", { class: "meta" }, `#${s.index} · reward ${s.reward}${adv} · ${s.finish_reason} · v${s.policy_version}`
    + (s.agent ? ` · agent ${s.agent}` : "") + (s.turns ? ` · ${s.turns} turns` : "") + (s.reward_failure ? ` · ${s.reward_failure}` : ""));
  return el("div", { class: "sample", "data-index": s.index }, meta, media, toks);
}

function drawSamples() {
  const data = state.samples;
  const box = document.getElementById("groups");
  document.getElementById("sample-note").textContent = data.problem || "";
  const newest = Math.max(0, ...data.groups.flatMap((g) => g.samples.flatMap((s) => s.tokens.map((t) => t.v || 0))));
  box.replaceChildren(...data.groups.map((g) => el("div", { class: "group", "data-group": g.group_id },
    el("div", { class: "meta" }, `group ${g.group_id}`), el("div", { class: "prompt" }, g.prompt),
    ...g.samples.map((s) => drawSample(s, newest)))));
}

// -- timeline ----------------------------------------------------------------------------------------
async function pollTimeline() {
  if (!document.getElementById("timeline").classList.contains("on")) return;
  const tl = await api("api/timeline");
  const roles = [...new Set(tl.spans.map((s) => s.role))];
  const W = 1200, lane = 22;
  const t0 = Math.min(...tl.spans.map((s) => s.ts)), t1 = Math.max(...tl.spans.map((s) => s.ts + s.dur), t0 + 1);
  const g = svg("svg", { viewBox: `0 0 ${W} ${lane * roles.length + 10}`, height: lane * roles.length + 10 });
  const names = [...new Set(tl.spans.map((s) => s.name))];
  roles.forEach((role, i) => {
    const t = svg("text", { x: 2, y: i * lane + 15, "font-size": 11 });
    t.textContent = role;
    g.append(t);
  });
  for (const s of tl.spans) {
    const r = svg("rect", { x: 110 + ((s.ts - t0) / (t1 - t0)) * (W - 115), y: roles.indexOf(s.role) * lane + 3,
      width: Math.max(0.5, (s.dur / (t1 - t0)) * (W - 115)), height: lane - 6,
      fill: COLOURS[names.indexOf(s.name) % COLOURS.length] });
    const tip = svg("title", {});
    const args = Object.entries(s.args || {}).map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`);
    tip.textContent = `${s.role}: ${s.name}, ${(s.dur / 1e6).toFixed(3)} s` + (args.length ? ` (${args.join(", ")})` : "");
    r.append(tip);
    g.append(r);
  }
  for (const ev of tl.events || []) {  // the health manager's failures and what it did, on their role's lane
    if (ev.ts == null) continue;
    const x = 110 + ((ev.ts - t0) / (t1 - t0)) * (W - 115), y = Math.max(0, roles.indexOf(ev.role)) * lane;
    const mark = svg("path", { d: `M${x},${y + 2} l5,8 l-10,0 z`, fill: "#111", class: "health-event" });
    const tip = svg("title", {});
    tip.textContent = `${ev.role}: ${ev.reason} → ${ev.action} (attempt ${ev.attempt})`;
    mark.append(tip);
    g.append(mark);
  }
  const legend = el("div", { class: "keys" }, ...names.map((n, i) => el("span", { style: `color:${COLOURS[i % COLOURS.length]}` }, "■ " + n)),
    el("span", {}, "▲ failure / restart"), el("span", {}, `${((t1 - t0) / 1e6).toFixed(1)} s shown`));
  document.getElementById("lanes").replaceChildren(legend, g);
  const evRows = (tl.events || []).map((ev) => el("tr", {}, el("td", {}, new Date(ev.at * 1000).toLocaleTimeString()),
    el("td", {}, ev.role), el("td", {}, ev.reason), el("td", {}, ev.action), el("td", {}, String(ev.attempt))));
  const rows = Object.entries(tl.roles || {}).map(([name, r]) =>
    el("tr", {}, el("td", {}, name), el("td", {}, r.state || ""), el("td", {}, String(r.version ?? "")), el("td", {}, String(r.restarts ?? 0))));
  document.getElementById("roles").replaceChildren(el("table", {},
    el("tr", {}, el("th", {}, "role"), el("th", {}, "state"), el("th", {}, "version"), el("th", {}, "restarts")), ...rows),
    ...(evRows.length ? [el("table", { id: "health-events" }, el("tr", {}, el("th", {}, "when"), el("th", {}, "role"),
      el("th", {}, "failure"), el("th", {}, "action"), el("th", {}, "attempt")), ...evRows)] : []));
  const bus = drawChart("bus depth (samples waiting)", [["live", "on the bus"]], tl.bus);
  document.getElementById("bus-chart").replaceChildren(...(bus ? [bus] : []));
}

// -- tabs and polling --------------------------------------------------------------------------------
function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("on", b.dataset.tab === name);
  for (const s of document.querySelectorAll(".tab")) s.classList.toggle("on", s.id === name);
  if (name === "timeline") pollTimeline();
}

for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => showTab(b.dataset.tab));
for (const r of document.querySelectorAll("input[name=colour]")) r.addEventListener("change", () => {
  state.colour = r.value;
  if (state.samples) drawSamples();
});

async function tick(fn, every) {
  try { await fn(); } catch (e) { console.warn("relax ui:", fn.name, e); }
  setTimeout(() => tick(fn, every), every);
}
tick(pollRun, 2000);
tick(pollMetrics, 1000);
tick(pollTimeline, 5000);
