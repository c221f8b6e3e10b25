// posttrain view: the page's whole script (no libraries, nothing fetched but this server's /api).
// Data: /api/tail gives appended files (metrics.jsonl, the dumps' index.jsonl) from an offset, polled every
// POLL_MS; /api/step gives one step's samples. Charts are inline SVG; tokens are spans coloured per mode.
"use strict";

const POLL_MS = 2000;
const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781"];
const CHARTS = [
  ["reward (training)", [/^critic\/score\/mean$/, /^reward\/acc\/mean$/]],
  ["held-out accuracy", [/^val-core\/.*\/mean@/, /^val-aux\/.*\/acc\/mean@/]],
  ["KL", [/^actor\/kl_loss$/, /^actor\/ppo_kl$/, /^actor\/reward_kl_penalty$/, /^rollout_corr\/kl$/]],
  ["entropy", [/^actor\/entropy$/, /^actor\/entropy_rollout$/]],
  ["response length (tokens)", [/^response_length\/mean$/, /^response_length\/max$/]],
  ["step time (s)", [/^timing_s\/step$/, /^timing_s\/gen$/, /^timing_s\/update_actor$/, /^timing_s\/testing$/]],
  ["memory (GB)", [/^memory\/tree_peak_gb$/, /^memory\/peak_resident_gb$/]],
  ["policy loss and gradient norm", [/^actor\/pg_loss$/, /^actor\/grad_norm$/]],
  ["tool calls (multi-turn)", [/^multi_turn\/tool_calls\/mean$/, /^multi_turn\/tool_errors\/mean$/]],
];
const COLOURS = {
  logprob: "log-prob (actor, else rollout)",
  entropy: "entropy",
  ratio: "rollout/actor ratio",
  advantage: "advantage",
  none: "none",
};
const SHOW = {all: "all groups", right: "groups all right", wrong: "groups all wrong", mixed: "mixed groups",
              same: "groups scored alike", tools: "failed tool calls"};
const ROLE_LINE = /^(assistant|user|system|<\|[^|]*\|>)$/i;  // a chat template's role words, decoded
const STEP_FILTERS = {all: "all steps", right: "with groups all right", tools: "with failed tool calls",
                      missing: "not written"};

const S = {runs: [], a: 0, b: null, tab: "curves", data: {}, open: {train: null, val: null},
           colour: "logprob", show: "all", stepFilter: {train: "all", val: "all"}, extra: [], lastNew: 0};
window.__view = {ready: {}, times: {}};  // read by the tests and benchmarks/bench_view.py

// ------------------------------------------------------------------ small helpers
const $ = (sel, el = document) => el.querySelector(sel);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const fmt = (v, d = 4) => v == null || Number.isNaN(v) ? "-" : (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0)
  ? Number(v).toExponential(2) : String(+Number(v).toFixed(d)));
const signed = (v) => v == null ? "-" : (v > 0 ? "+" : "") + fmt(v, 3);
function el(tag, attrs = {}, html = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  if (html) e.innerHTML = html;
  return e;
}
function painted() {  // resolves once the browser has laid out and painted what the script just built
  return new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
}
function showError(msg) {
  const box = $("#error");
  box.hidden = !msg;
  box.textContent = msg || "";
}
async function getJSON(url) {
  const r = await fetch(url);
  const body = await r.json().catch(() => ({error: `${url}: the server's answer is not JSON`}));
  if (!r.ok || body.error) throw new Error(body.error || `${url}: HTTP ${r.status}`);
  return body;
}
function shown() { return S.b == null ? [S.a] : [S.a, S.b]; }

// ------------------------------------------------------------------ data: appended files, polled
function runData(i) {
  if (!S.data[i]) {
    S.data[i] = {metrics: {offset: 0, steps: new Map(), keys: new Set()}, train: {offset: 0, steps: new Map()},
                 val: {offset: 0, steps: new Map()}};
  }
  return S.data[i];
}
async function tail(i, what) {
  const d = runData(i)[what];
  const r = await fetch(`/api/tail?run=${i}&what=${what}&offset=${d.offset}`);
  if (!r.ok) throw new Error((await r.json().catch(() => ({}))).error || `HTTP ${r.status}`);
  if (r.headers.get("X-Reset") === "1") {  // written anew: start over
    d.steps = new Map();
    if (d.keys) d.keys = new Set();
  }
  d.offset = +r.headers.get("X-Offset");
  const text = await r.text();
  let added = 0;
  for (const line of text.split("\n")) {
    if (!line) continue;
    let row;
    try { row = JSON.parse(line); } catch (e) { continue; }
    if (typeof row.step !== "number") continue;
    if (what === "metrics") {
      const old = d.steps.get(row.step);
      d.steps.set(row.step, old ? Object.assign(old, row) : row);  // a step's records merge, later ones win
      for (const k in row) d.keys.add(k);
    } else {
      d.steps.set(row.step, row);  // a step written again (a resumed run): the last line counts
    }
    added++;
  }
  return added;
}
async function poll(first) {
  let added = 0;
  try {
    for (const i of shown()) {
      const run = S.runs[i];
      if (run.metrics || first) added += await tail(i, "metrics");
      added += await tail(i, "train");
      added += await tail(i, "val");
    }
    showError("");
  } catch (e) {
    showError(e.message.includes("fetch") ? "the server is not answering (did posttrain view stop?)" : e.message);
    return;
  }
  if (added) {
    S.lastNew = Date.now();
    refresh();
  }
  const live = $("#live");
  const quiet = (Date.now() - S.lastNew) / 1000;
  live.className = quiet < 60 ? "on" : "";
  live.textContent = S.lastNew ? (quiet < 60 ? "live: new lines " + Math.round(quiet) + " s ago"
                                              : "no new lines for " + Math.round(quiet / 60) + " min") : "";
}
function refresh() {
  if (S.tab === "curves") drawCurves();
  if (S.tab === "train" || S.tab === "val") {
    drawStepList(S.tab);
    const open = S.open[S.tab];
    if (open == null) { const last = lastStep(S.tab); if (last != null) openStep(S.tab, last); }
  }
  fillMetricPicker();
}
function lastStep(kind) {
  const steps = [...runData(S.a)[kind].steps.values()].filter((e) => e.file);
  return steps.length ? steps[steps.length - 1].step : null;
}

// ------------------------------------------------------------------ curves (inline SVG)
function seriesFor(patterns) {
  const out = [];
  shown().forEach((run, r) => {
    const m = runData(run).metrics;
    const keys = [...m.keys].filter((k) => patterns.some((p) => (p instanceof RegExp ? p.test(k) : p === k))).sort();
    for (const key of keys) {
      const pts = [];
      for (const [step, row] of m.steps) {
        const v = row[key];
        if (typeof v === "number" && Number.isFinite(v)) pts.push([step, v]);
      }
      pts.sort((p, q) => p[0] - q[0]);
      if (pts.length) out.push({key, run: r, name: S.runs[run].name, pts});
    }
  });
  const keys = [...new Set(out.map((s) => s.key))];
  for (const s of out) s.colour = PALETTE[keys.indexOf(s.key) % PALETTE.length];
  return out;
}
function ticks(lo, hi, n) {
  // round values about n apart, and the decimals that tell them apart
  if (hi === lo) return {values: [lo], decimals: 3};
  const step0 = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const values = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) values.push(+v.toPrecision(12));
  return {values, decimals: Math.max(0, -Math.floor(Math.log10(step) + 1e-9))};
}
function tickLabel(v, decimals) {
  return Math.abs(v) >= 1e5 || (decimals > 6 && v !== 0) ? v.toExponential(2) : v.toFixed(decimals);
}
function drawCurves() {
  const box = $("#charts");
  const specs = CHARTS.concat(S.extra.map((k) => [k, [k], true]));
  const frag = document.createDocumentFragment();
  for (const [title, patterns, removable] of specs) {
    const series = seriesFor(patterns);
    if (!series.length) continue;
    frag.appendChild(chart(title, series, removable));
  }
  box.replaceChildren(frag);
  if (!box.children.length) {
    box.innerHTML = `<p class="muted">no metrics yet: ${esc(S.runs[S.a].path)}/metrics.jsonl is written by the ` +
      "<code>file</code> logger (trainer.logger=[console,file]); this page polls it</p>";
  } else if (!window.__view.ready.curves) {
    painted().then(() => { window.__view.ready.curves = performance.now(); });
  }
}
function chart(title, series, removable) {
  const W = 430, H = 210, L = 46, R = 8, T = 8, B = 22;
  const xs = series.flatMap((s) => s.pts.map((p) => p[0])), ys = series.flatMap((s) => s.pts.map((p) => p[1]));
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  const X = (v) => L + (v - x0) / (x1 - x0) * (W - L - R), Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  let svg = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">`;
  const yt = ticks(y0, y1, 4);
  for (const v of yt.values) {
    svg += `<line class="grid" x1="${L}" x2="${W - R}" y1="${Y(v)}" y2="${Y(v)}"/><text x="${L - 4}" y="${Y(v) + 3}" text-anchor="end">${tickLabel(v, yt.decimals)}</text>`;
  }
  for (const v of ticks(x0, x1, 6).values) {
    if (v >= x0 && v <= x1 && Number.isInteger(v)) svg += `<text x="${X(v)}" y="${H - 6}" text-anchor="middle">${v}</text>`;
  }
  svg += `<line class="axis" x1="${L}" x2="${L}" y1="${T}" y2="${H - B}"/><line class="axis" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`;
  for (const s of series) {
    const d = s.pts.map((p, k) => `${k ? "L" : "M"}${X(p[0]).toFixed(1)} ${Y(p[1]).toFixed(1)}`).join("");
    const dash = s.run ? ` stroke-dasharray="5 3"` : "";
    svg += `<path d="${d}" fill="none" stroke="${s.colour}" stroke-width="1.6"${dash}/>`;
    if (s.pts.length <= 40) {
      for (const p of s.pts) svg += `<circle cx="${X(p[0])}" cy="${Y(p[1])}" r="2.2" fill="${s.colour}"/>`;
    }
  }
  svg += `<line class="cursor" x1="0" x2="0" y1="${T}" y2="${H - B}" visibility="hidden"/>` +
         `<rect x="${L}" y="${T}" width="${W - L - R}" height="${H - T - B}" fill="transparent"/></svg>`;
  const two = shown().length > 1;
  const legend = series.map((s) => `<span><i class="${s.run ? "dash" : ""}" style="background:${s.colour};color:${s.colour}"></i>` +
    `${esc(s.key)}${two ? " (" + esc(s.name) + ")" : ""}</span>`).join("");
  const box = el("div", {class: "chart", "data-title": title},
    `<h3><span>${esc(title)}</span>${removable ? "<button>remove</button>" : ""}</h3>${svg}<div class="legend">${legend}</div>`);
  if (removable) $("button", box).onclick = () => { S.extra = S.extra.filter((k) => k !== title); drawCurves(); };
  const svgEl = $("svg", box), cursor = $(".cursor", box);
  svgEl.addEventListener("mousemove", (ev) => {
    const rect = svgEl.getBoundingClientRect();
    const x = (ev.clientX - rect.left) / rect.width * W;
    const step = x0 + (x - L) / (W - L - R) * (x1 - x0);
    const rows = series.map((s) => {
      let best = s.pts[0];
      for (const p of s.pts) if (Math.abs(p[0] - step) < Math.abs(best[0] - step)) best = p;
      return [s, best];
    });
    const at = rows.reduce((b, r) => (Math.abs(r[1][0] - step) < Math.abs(b - step) ? r[1][0] : b), rows[0][1][0]);
    cursor.setAttribute("x1", X(at)); cursor.setAttribute("x2", X(at)); cursor.setAttribute("visibility", "visible");
    const lines = [`step ${at}`].concat(rows.filter((r) => r[1][0] === at)
      .map(([s, p]) => `${s.key}${two ? " (" + s.name + ")" : ""}: ${fmt(p[1], 5)}`));
    tip(ev, lines.join("\n"));
  });
  svgEl.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip(null); });
  return box;
}
function fillMetricPicker() {
  const pick = $("#addMetric");
  const keys = new Set();
  for (const i of shown()) for (const k of runData(i).metrics.keys) if (k !== "step") keys.add(k);
  if (pick.options.length - 1 === keys.size) return;
  pick.replaceChildren(el("option", {value: ""}, "(any metric)"));
  for (const k of [...keys].sort()) pick.appendChild(el("option", {value: k}, esc(k)));
}

// ------------------------------------------------------------------ tooltip, modal
function tip(ev, text) {
  const t = $("#tip");
  if (!ev) { t.hidden = true; return; }
  t.textContent = text;
  t.hidden = false;
  const x = Math.min(ev.clientX + 14, window.innerWidth - t.offsetWidth - 8);
  const y = ev.clientY + 16 + t.offsetHeight > window.innerHeight ? ev.clientY - t.offsetHeight - 10 : ev.clientY + 16;
  t.style.left = x + "px";
  t.style.top = y + "px";
}
function openModal(node) {
  $("#modalBody").replaceChildren(node);
  $("#modal").hidden = false;
}
function closeModal() { $("#modal").hidden = true; $("#modalBody").replaceChildren(); }

// ------------------------------------------------------------------ step browser
function correct(rec) {
  if (typeof rec.acc === "number" || typeof rec.acc === "boolean") return !!rec.acc;
  return rec.score == null ? null : rec.score > 0;
}
function failedCalls(rec) {
  let n = 0;
  for (const t of rec.turns || []) for (const c of t.calls || []) if (c.status !== "ok") n++;
  return Math.max(n, (rec.multi_turn || {}).tool_errors || 0);
}
function groupKind(recs) {
  const right = recs.map(correct);
  if (recs.length > 1 && right.every((x) => x === true)) return "right";
  if (recs.length > 1 && right.every((x) => x === false)) return "wrong";
  return "mixed";
}
function browser(kind) {
  const sec = $("#" + kind);
  if (sec.dataset.built) return sec;
  sec.dataset.built = "1";
  const filters = Object.entries(STEP_FILTERS).map(([k, v]) => `<option value="${k}">${v}</option>`).join("");
  const colours = Object.entries(COLOURS).map(([k, v]) => `<option value="${k}">${v}</option>`).join("");
  const shows = Object.entries(SHOW).map(([k, v]) => `<option value="${k}">${v}</option>`).join("");
  sec.innerHTML = `<div class="browser"><aside class="steplist"><div class="filters"><select class="stepfilter">${filters}</select></div>
    <div class="steps"></div></aside><div><div class="stepbar">
    <label>colour tokens by <select class="colour">${colours}</select></label><span class="scale"></span>
    <label>show <select class="show">${shows}</select></label>
    <button class="lowest">lowest-probability token</button><span class="summary muted"></span></div>
    <div class="panes"></div></div></div>`;
  $(".stepfilter", sec).onchange = (e) => { S.stepFilter[kind] = e.target.value; drawStepList(kind); };
  $(".colour", sec).onchange = (e) => { S.colour = e.target.value; rerenderPanes(kind); };
  $(".show", sec).onchange = (e) => { S.show = e.target.value; rerenderPanes(kind); };  // both: window.__view.rendering
  $(".lowest", sec).onclick = () => jumpToLowest(sec);
  return sec;
}
function drawStepList(kind) {
  const sec = browser(kind);
  const list = $(".steps", sec);
  const entries = [...runData(S.a)[kind].steps.values()].sort((p, q) => p.step - q.step);
  const f = S.stepFilter[kind];
  const keep = entries.filter((e) => f === "all" || (f === "right" && e.all_right_groups > 0) ||
    (f === "tools" && e.tool_errors > 0) || (f === "missing" && !e.file));
  const html = keep.map((e) => {
    const b = [];
    if (e.score_mean != null) b.push(`<span class="badge">${fmt(e.score_mean, 2)}</span>`);
    if (e.all_right_groups) b.push(`<span class="badge ok" title="groups whose responses were all right">&#10003;${e.all_right_groups}</span>`);
    if (e.tool_errors) b.push(`<span class="badge bad" title="failed tool calls">tool &#10007;${e.tool_errors}</span>`);
    if (!e.file) b.push(`<span class="badge warn" title="${esc(e.skipped || "")}">not written</span>`);
    return `<button class="step${S.open[kind] === e.step ? " on" : ""}" data-step="${e.step}"><span>step ${e.step}</span><span class="b">${b.join(" ")}</span></button>`;
  }).join("");
  list.innerHTML = html || `<p class="muted" style="padding:6px">${entries.length ? "no step matches" :
    kind === "train" ? "no training samples yet (trainer.rollout_data_dir)" : "no validation samples yet (trainer.validation_data_dir)"}</p>`;
  for (const b of list.querySelectorAll("button.step")) b.onclick = () => openStep(kind, +b.dataset.step);
}
async function openStep(kind, step) {
  // times[kind + "Step"]: click to the first screen of groups painted; ...StepAll: to every group painted
  const t0 = performance.now();
  S.open[kind] = step;
  const sec = browser(kind);
  for (const b of sec.querySelectorAll("button.step")) b.classList.toggle("on", +b.dataset.step === step);
  const panes = $(".panes", sec);
  panes.classList.toggle("two", shown().length > 1);
  const nodes = await Promise.all(shown().map(async (run) => {
    const pane = el("div", {class: "pane", "data-run": run});
    pane.addEventListener("click", paneClick);
    try {
      const r = await fetch(`/api/step?run=${run}&kind=${kind}&step=${step}`);
      const text = await r.text();
      if (!r.ok) throw new Error(JSON.parse(text).error);
      pane._recs = text.split("\n").filter((l) => l).map((l) => JSON.parse(l));
    } catch (e) {
      pane._error = e.message;
    }
    return pane;
  }));
  if (S.open[kind] !== step) return;  // another step was opened meanwhile
  panes.replaceChildren(...nodes);
  const shownNow = rerenderPanes(kind);
  await shownNow.first;
  window.__view.times[kind + "Step"] = performance.now() - t0;
  await shownNow.done;
  window.__view.times[kind + "StepAll"] = performance.now() - t0;
  window.__view.ready[kind + "Step"] = step;
}
function rerenderPanes(kind) {
  // each pane's first screen of groups now, the rest a chunk a frame; window.__view.rendering counts those going
  const sec = browser(kind);
  const available = new Set(["none"]);
  const firsts = [], dones = [];
  for (const pane of sec.querySelectorAll(".pane")) {
    const r = renderPane(pane, kind);
    firsts.push(r.first);
    dones.push(r.done);
    for (const m of pane._modes || []) available.add(m);
  }
  for (const o of $(".colour", sec).options) {
    o.disabled = !available.has(o.value);
    o.textContent = COLOURS[o.value] + (o.disabled ? " (not recorded)" : "");
  }
  $(".colour", sec).value = S.colour;
  $(".scale", sec).innerHTML = scaleHtml(S.colour);
  window.__view.rendering = (window.__view.rendering || 0) + 1;
  const done = Promise.all(dones).then(painted).finally(() => { window.__view.rendering--; });
  return {first: Promise.all(firsts), done};
}
const CHUNK_TOKENS = 2500;  // tokens rendered between two frames
function renderPane(pane, kind) {
  const gen = (pane._gen = (pane._gen || 0) + 1);
  const run = S.runs[+pane.dataset.run];
  const title = `<h2>${esc(run.name)} &middot; ${kind === "val" ? "validation at " : ""}step ${S.open[kind]}</h2>`;
  if (pane._error) {
    pane.innerHTML = title + `<div class="err">${esc(pane._error)}</div>`;
    return {first: painted(), done: Promise.resolve()};
  }
  const recs = pane._recs;
  const groups = new Map();
  recs.forEach((r, i) => { r._i = i; if (!groups.has(r.uid)) groups.set(r.uid, []); groups.get(r.uid).push(r); });
  const scale = pane._scale = paneScale(recs);
  pane._modes = modesOf(recs);
  const todo = [];
  let right = 0;
  for (const [uid, g] of groups) {
    const gk = groupKind(g);
    if (gk === "right") right++;
    const same = g.length > 1 && new Set(g.map((r) => r.score)).size === 1;
    const fails = g.reduce((n, r) => n + failedCalls(r), 0);
    if (S.show === "all" || S.show === gk || (S.show === "same" && same) || (S.show === "tools" && fails > 0)) {
      todo.push([uid, g, gk, same, fails]);
    }
  }
  const scores = recs.filter((r) => r.score != null).map((r) => r.score);
  const mean = scores.length ? scores.reduce((a, b) => a + b, 0) / scores.length : null;
  pane.innerHTML = title + `<div class="muted">${recs.length} responses in ${groups.size} groups &middot; mean score ${fmt(mean, 3)}` +
    ` &middot; ${right} group${right === 1 ? "" : "s"} all right</div>` +
    (todo.length ? "" : `<p class="muted">no group is ${esc(SHOW[S.show])} in this step</p>`);
  const chunk = () => {  // the next groups, about CHUNK_TOKENS tokens of them
    let html = "", tokens = 0;
    while (todo.length && (!html || tokens < CHUNK_TOKENS)) {
      const [uid, g, gk, same, fails] = todo.shift();
      html += groupHtml(uid, g, gk, same, fails, scale);
      tokens += g.reduce((n, r) => n + (r.tokens ? r.tokens.length : 0), 0);
    }
    pane.insertAdjacentHTML("beforeend", html);
  };
  chunk();
  const first = painted();
  const done = (async () => {
    while (todo.length) {
      await painted();
      if (pane._gen !== gen) return;  // re-rendered meanwhile (another colour, filter or step)
      chunk();
    }
  })();
  return {first, done};
}
function paneClick(e) {
  const pane = e.currentTarget;
  const low = e.target.closest("a.low");
  if (low) flash(low.closest(".card"), +low.dataset.k);
  const traj = e.target.closest("button.traj");
  if (traj) {
    const card = traj.closest(".card").cloneNode(true);
    card._pane = pane;
    $("button.traj", card)?.remove();
    openModal(card);
  }
}
function modesOf(recs) {
  const m = new Set();
  for (const r of recs) {
    const lp = r.logprobs || {};
    if (lp.actor || lp.rollout) m.add("logprob");
    if (r.entropy) m.add("entropy");
    if (lp.actor && lp.rollout) m.add("ratio");
    if (r.tokens && (r.advantages || r.advantage != null)) m.add("advantage");
  }
  return m;
}
function paneScale(recs) {
  let ent = 1e-6, ratio = 1e-4, adv = 1e-6;
  for (const r of recs) {
    if (r.entropy) for (const e of r.entropy) if (e != null && e > ent) ent = e;
    const lp = r.logprobs || {};
    if (lp.actor && lp.rollout) lp.actor.forEach((a, k) => { const d = Math.abs(a - lp.rollout[k]); if (a != null && lp.rollout[k] != null && d > ratio) ratio = d; });
    if (r.advantages) for (const a of r.advantages) if (a != null && Math.abs(a) > adv) adv = Math.abs(a);
    if (r.advantage != null && Math.abs(r.advantage) > adv) adv = Math.abs(r.advantage);
  }
  return {ent, ratio, adv};
}
function tokenValues(r, k) {
  const lp = r.logprobs || {};
  const pick = (a) => (a ? a[k] : null);
  const actor = pick(lp.actor), rollout = pick(lp.rollout);
  return {actor, rollout, ref: pick(lp.ref), lp: actor ?? rollout, entropy: pick(r.entropy), value: pick(r.values),
          adv: r.advantages ? r.advantages[k] : (r.mask && !r.mask[k] ? null : r.advantage),
          logRatio: actor != null && rollout != null ? rollout - actor : null};
}
function tokenColour(v, scale) {
  switch (S.colour) {
    case "logprob": return v.lp == null ? "" : `rgba(239,68,68,${(0.85 * (1 - Math.exp(v.lp))).toFixed(3)})`;
    case "entropy": return v.entropy == null ? "" : `rgba(59,130,246,${(0.85 * Math.min(1, v.entropy / scale.ent)).toFixed(3)})`;
    case "ratio": {
      if (v.logRatio == null) return "";
      const a = (0.85 * Math.min(1, Math.abs(v.logRatio) / scale.ratio)).toFixed(3);
      return v.logRatio > 0 ? `rgba(239,68,68,${a})` : `rgba(59,130,246,${a})`;
    }
    case "advantage": {
      if (v.adv == null) return "";
      const a = (0.75 * Math.min(1, Math.abs(v.adv) / scale.adv)).toFixed(3);
      return v.adv >= 0 ? `rgba(34,160,80,${a})` : `rgba(239,68,68,${a})`;
    }
    default: return "";
  }
}
function scaleHtml(mode) {
  const ramps = {logprob: ["p = 1", "p = 0", "#fff", "rgba(239,68,68,.85)"], entropy: ["0", "the step's max", "#fff", "rgba(59,130,246,.85)"],
                 ratio: ["rollout < actor", "rollout > actor", "rgba(59,130,246,.85)", "rgba(239,68,68,.85)"],
                 advantage: ["negative", "positive", "rgba(239,68,68,.75)", "rgba(34,160,80,.75)"]};
  const r = ramps[mode];
  if (!r) return "";
  const mid = mode === "ratio" || mode === "advantage" ? ",#fff" : "";
  return `${r[0]}<span class="ramp" style="background:linear-gradient(90deg,${r[2]}${mid},${r[3]})"></span>${r[1]}`;
}
function tokensHtml(r, from, to, scale) {
  let s = "";
  for (let k = from; k < to; k++) {
    const text = r.tokens[k];
    const tool = r.mask && !r.mask[k];
    const bg = tool ? "" : tokenColour(tokenValues(r, k), scale);
    const shownText = text === "\n" ? "\u21b5\n" : text === "" ? "\u2205" : text;
    s += `<span class="t${tool ? " tool" : ""}" data-k="${k}"${bg ? ` style="background:${bg}"` : ""}>${esc(shownText)}</span>`;
  }
  return s;
}
function lowestToken(r) {
  const lp = r.logprobs || {};
  const row = lp.actor || lp.rollout;
  if (!row) return null;
  let best = null;
  row.forEach((v, k) => { if (v != null && (best == null || v < row[best])) best = k; });
  return best;
}
function groupHtml(uid, g, gk, same, fails, scale) {
  const first = g[0];
  const badges = [];
  if (gk === "right") badges.push(`<span class="badge ok">all right</span>`);
  if (gk === "wrong") badges.push(`<span class="badge bad">all wrong</span>`);
  if (same) badges.push(`<span class="badge warn" title="every response scored the same: a zero advantage for GRPO">scored alike</span>`);
  if (fails) badges.push(`<span class="badge bad">${fails} failed tool call${fails > 1 ? "s" : ""}</span>`);
  const lines = String(first.input || "").trim().split("\n").filter((l) => l.trim() && !ROLE_LINE.test(l.trim()));
  const lastLine = lines.length ? lines[lines.length - 1] : "";
  const gts = first.gts != null ? ` &middot; answer <b>${esc(typeof first.gts === "object" ? JSON.stringify(first.gts) : first.gts)}</b>` : "";
  return `<div class="group" data-uid="${esc(uid)}" data-kind="${gk}"><div class="ghead">${badges.join(" ")}<span class="muted">${esc(uid)}` +
    `${first.data_source ? " &middot; " + esc(first.data_source) : ""}</span>${gts}</div>` +
    `<details><summary>prompt: ${esc(lastLine.slice(0, 160))}</summary><pre>${esc(first.input)}</pre></details>` +
    `<div class="cards">${g.map((r) => cardHtml(r, scale)).join("")}</div></div>`;
}
function cardHtml(r, scale) {
  const ok = correct(r);
  const head = [`<b>#${r.sample}</b>`, `score <b>${fmt(r.score, 3)}</b>`];
  if (r.reward != null && r.reward !== r.score) head.push(`reward ${fmt(r.reward, 3)}`);
  if (r.advantage != null) head.push(`adv <b>${signed(r.advantage)}</b>`);
  head.push(`${r.response_length} tokens`);
  if (ok != null) head.push(ok ? `<span style="color:var(--ok)">&#10003; right</span>` : `<span style="color:var(--bad)">&#10007; wrong</span>`);
  let body;
  if (!r.tokens) {
    body = `<div class="plain">${esc(r.output)}</div><div class="cfoot muted">no per-token values: beyond the first responses of the step (the dump's bound)</div>`;
  } else if (r.turns) {
    body = r.turns.map((t) => turnHtml(r, t, scale)).join("");
  } else {
    body = `<div class="toks">${tokensHtml(r, 0, r.tokens.length, scale)}</div>`;
  }
  const foot = [];
  const low = r.tokens ? lowestToken(r) : null;
  if (low != null) {
    const v = tokenValues(r, low);
    foot.push(`lowest p: <a class="low" data-k="${low}" title="show it">${esc(JSON.stringify(r.tokens[low]))} ${fmt(v.lp, 3)}</a>`);
  }
  const mt = r.multi_turn;
  if (mt) foot.push(`${mt.turns || 0} turns &middot; ${mt.tool_calls || 0} tool calls` + (failedCalls(r) ? ` &middot; <b style="color:var(--bad)">${failedCalls(r)} failed</b>` : ""));
  if (r.turns) foot.push(`<button class="traj">open trajectory</button>`);
  return `<div class="card${ok === true ? " right" : ok === false ? " wrong" : ""}" data-i="${r._i}"><div class="chead">${head.join(" ")}</div>` +
    body + (foot.length ? `<div class="cfoot">${foot.join(" ")}</div>` : "") + "</div>";
}
function turnHtml(r, t, scale) {
  if (t.role !== "assistant") {
    return `<div class="turn ${t.role}"><div class="role">${t.role}</div><div class="toks">${tokensHtml(r, t.start, t.end, scale)}</div></div>`;
  }
  const calls = (t.calls || []).map((c) => {
    const args = typeof c.arguments === "string" ? c.arguments : JSON.stringify(c.arguments);
    const label = c.status === "ok" ? "ok" : c.status === "error" ? "failed" : "invalid call";
    const what = c.status === "invalid" ? esc(args) : `${esc(c.name)}(${esc(args)})`;  // an invalid call: as written
    return `<div class="call ${c.status}"><span class="st">${esc(label)}</span> ${what}` +
      (c.output != null ? `<pre>${esc(c.output)}</pre>` : "") + "</div>";
  }).join("");
  return `<div class="turn assistant"><div class="role">assistant</div><div class="toks">${tokensHtml(r, t.start, t.end, scale)}</div>${calls}</div>`;
}
function tokenTip(ev, span) {
  const card = span.closest(".card");
  const pane = card._pane || card.closest(".pane");
  const r = pane && pane._recs ? pane._recs[+card.dataset.i] : null;
  if (!r) return;
  const k = +span.dataset.k;
  const v = tokenValues(r, k);
  const lines = [`${JSON.stringify(r.tokens[k])}  id ${r.ids ? r.ids[k] : "?"}  position ${k}`];
  if (r.mask && !r.mask[k]) lines.push("tool/user token (not trained on)");
  if (v.actor != null) lines.push(`log-prob actor   ${fmt(v.actor)}  (p ${fmt(Math.exp(v.actor), 4)})`);
  if (v.rollout != null) lines.push(`log-prob rollout ${fmt(v.rollout)}  (p ${fmt(Math.exp(v.rollout), 4)})`);
  if (v.ref != null) lines.push(`log-prob ref     ${fmt(v.ref)}`);
  if (v.logRatio != null) lines.push(`rollout/actor    ${fmt(Math.exp(v.logRatio), 5)}`);
  if (v.entropy != null) lines.push(`entropy          ${fmt(v.entropy)}`);
  if (v.adv != null) lines.push(`advantage        ${signed(v.adv)}`);
  if (v.value != null) lines.push(`value            ${fmt(v.value)}`);
  tip(ev, lines.join("\n"));
}
function flash(card, k) {
  const span = card && card.querySelector(`.t[data-k="${k}"]`);
  if (!span) return;
  span.scrollIntoView({block: "center", inline: "nearest"});
  for (const s of document.querySelectorAll(".t.flash")) s.classList.remove("flash");
  span.classList.add("flash");
}
function jumpToLowest(sec) {
  let best = null;
  for (const pane of sec.querySelectorAll(".pane")) {
    for (const card of pane.querySelectorAll(".card")) {
      const r = pane._recs[+card.dataset.i];
      const k = r.tokens ? lowestToken(r) : null;
      if (k == null) continue;
      const lp = tokenValues(r, k).lp;
      if (best == null || lp < best[2]) best = [card, k, lp];
    }
  }
  if (best) flash(best[0], best[1]);
}

// ------------------------------------------------------------------ eval cards
function flatten(obj, prefix, out) {
  for (const [k, v] of Object.entries(obj)) {
    const key = prefix ? prefix + "." + k : k;
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, key, out);
    else out.push([key, Array.isArray(v) || (v && typeof v === "object") ? JSON.stringify(v) : String(v)]);
  }
  return out;
}
async function drawCards() {
  const sec = $("#cards");
  const panes = await Promise.all(shown().map(async (run) => {
    const pane = el("div", {class: "pane"}, `<h2>${esc(S.runs[run].name)}</h2>`);
    try {
      const {files} = await getJSON(`/api/cards?run=${run}`);
      if (!files.length) {
        pane.insertAdjacentHTML("beforeend", `<p class="muted">no eval card in this run's folder (a <code>*card*.json</code> ` +
          "file, or JSON files in an <code>eval_cards/</code> folder)</p>");
        return pane;
      }
      const pick = el("select", {class: "cardfile"}, files.map((f) => `<option>${esc(f)}</option>`).join(""));
      pick.value = files[files.length - 1];  // the latest
      const table = el("div");
      pick.onchange = () => showCard(run, pick.value, table);
      pane.append(el("label", {}, "card "), pick, table);
      await showCard(run, pick.value, table);
    } catch (e) {
      pane.insertAdjacentHTML("beforeend", `<div class="err">${esc(e.message)}</div>`);
    }
    return pane;
  }));
  sec.replaceChildren(el("div", {class: "panes" + (panes.length > 1 ? " two" : "")}));
  sec.firstChild.append(...panes);
}
async function showCard(run, file, box) {
  try {
    const {data} = await getJSON(`/api/card?run=${run}&file=${encodeURIComponent(file)}`);
    const rows = flatten(data && typeof data === "object" ? data : {value: data}, "", []);
    box.innerHTML = `<table class="kv">${rows.map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join("")}</table>`;
  } catch (e) {
    box.innerHTML = `<div class="err">${esc(e.message)}</div>`;
  }
}

// ------------------------------------------------------------------ tabs, runs, start
function setTab(tab) {
  S.tab = tab;
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("on", b.dataset.tab === tab);
  for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== tab;
  if (tab === "cards") drawCards(); else refresh();
  if ((tab === "train" || tab === "val") && S.open[tab] != null) openStep(tab, S.open[tab]);
}
function selectRuns(a, b) {
  S.a = a;
  S.b = b === a ? null : b;
  S.open = {train: null, val: null};
  for (const id of ["train", "val"]) $("#" + id).querySelector(".panes")?.replaceChildren();
  window.__view.ready.curves = 0;
  poll(true).then(() => setTab(S.tab));
}
async function start() {
  let body;
  try { body = await getJSON("/api/runs"); } catch (e) { showError(e.message); return; }
  S.runs = body.runs;
  document.title = "posttrain view: " + body.title;
  const a = $("#runA"), b = $("#runB");
  S.runs.forEach((r, i) => {
    a.appendChild(el("option", {value: i}, esc(r.name)));
    b.appendChild(el("option", {value: i}, esc(r.name)));
  });
  const params = new URLSearchParams(location.hash.slice(1));
  // #b=N shows run N beside the first, #b= none; by default the server's choice (two runs named, a compare folder)
  let second = params.has("b") ? (params.get("b") === "" ? null : +params.get("b")) : body.beside;
  if (second === 0 || second >= S.runs.length) second = null;
  a.value = 0;
  b.value = second == null ? "" : second;
  a.onchange = () => selectRuns(+a.value, b.value === "" ? null : +b.value);
  b.onchange = () => selectRuns(+a.value, b.value === "" ? null : +b.value);
  for (const btn of document.querySelectorAll("#tabs button")) btn.onclick = () => setTab(btn.dataset.tab);
  $("#addMetric").onchange = (e) => { if (e.target.value && !S.extra.includes(e.target.value)) S.extra.push(e.target.value); e.target.value = ""; drawCurves(); };
  $("#modalClose").onclick = closeModal;
  $("#modal").onclick = (e) => { if (e.target.id === "modal") closeModal(); };
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeModal(); });
  document.addEventListener("mouseover", (e) => {
    const span = e.target.closest && e.target.closest(".t");
    if (span) tokenTip(e, span);
  });
  document.addEventListener("mouseout", (e) => { if (e.target.closest && e.target.closest(".t")) tip(null); });
  S.a = 0;
  S.b = second;
  await poll(true);
  const tab = params.get("tab") || "curves";
  if (params.has("step")) S.open[tab] = +params.get("step");
  setTab(tab);
  setInterval(() => poll(false), POLL_MS);
}
start();
