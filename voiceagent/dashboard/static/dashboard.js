// Latency dashboard: does speculative decoding pay for this traffic? Reads the turn store through
// the /api/* JSON endpoints and redraws on the server's /api/events stream (no reload).
// Plain script, no build step; plotly is served by this server at /static/vendor/plotly.min.js.
"use strict";

const PAGE = 50; // calls per page of the calls list
const MAX_CALLS = 500; // the most /api/calls returns at once
const REFRESH_MIN_MS = 1000; // live events redraw at most once a second
const SLIDE_MS = 60_000; // redraw this often without events too, so "last 1 h" slides
const RECONNECT_MS = 5000; // after the event stream was refused (e.g. the server restarted)
const CARD_RETRY_MS = 5000; // the pair card is there once the server's models have loaded
const BACKEND_MS = 15_000; // a remote LLM server's speculation counters are read this often
const TURNS_LIMIT = 5000; // turns plotted over time, the newest
const MAX_STEPS = 5000; // points of the drafting vs verification scatter, the newest
const K_TURNS = 20; // turns whose K history is drawn, the newest

const METHOD_ORDER = ["off", "ngram", "draft", "eagle"];
const METHOD_COLOURS = { off: "#6e7781", ngram: "#0969da", draft: "#d1570b", eagle: "#1a7f37" };
const OTHER_COLOUR = "#8250df"; // a method this page does not know yet

// The waterfall's segments, in the order a turn's time passes.
const SEGMENTS = [
  ["user_speech_ms", "user speech", "#c8d1dc"],
  ["vad_hangover_ms", "VAD hangover", "#8c959f"],
  ["asr_final_ms", "ASR final", "#54aeff"],
  ["transcript_to_request_ms", "transcript → request", "#b392f0"],
  ["tool_call_ms", "LLM → tool call", "#6639ba"],
  ["tools_ms", "tools", "#1b7c83"],
  ["first_token_ms", "first token", "#d1570b"],
  ["first_clause_ms", "first clause", "#f0b72f"],
  ["tts_first_chunk_ms", "TTS first chunk", "#2da44e"],
  ["chunk_to_audio_ms", "to audio", "#116329"],
];

// Overview cards: title, [data-metric path, label, format], and the path of the card's sample
// size (how many turns its figures are over), if it has one.
const OVERVIEW = [
  ["Traffic", [["calls", "calls", "count"], ["turns", "turns", "count"],
    ["interrupted_share", "interrupted", "pct"]]],
  ["Turn end → first audio", [["turn_end_to_first_audio_ms.p50", "p50", "ms"],
    ["turn_end_to_first_audio_ms.p95", "p95", "ms"],
    ["turn_end_to_first_audio_ms.p99", "p99", "ms"]], "samples.turn_end_to_first_audio_ms"],
  ["Request → first token", [["request_to_first_token_ms.p50", "p50", "ms"],
    ["request_to_first_token_ms.p95", "p95", "ms"]], "samples.request_to_first_token_ms"],
  ["Inter-token latency", [["itl_ms.mean", "mean", "ms"], ["itl_ms.p50", "p50", "ms"],
    ["itl_ms.p95", "p95", "ms"], ["itl_ms.p99", "p99", "ms"]], "samples.itl_turns"],
  ["Speculation", [["accepted_per_step", "accepted tokens / step", "x2"],
    ["accepted_per_step_by_turn.p50", "per-turn p50", "x2"],
    ["samples.speculative_steps", "speculative steps", "count"]],
    "samples.accepted_per_step_turns"],
  ["Barge-in → bot silent", [["barge_in_to_silence_ms.p50", "p50", "ms"],
    ["barge_in_detection_ms.p50", "detection p50", "ms"],
    ["interruption_to_silence_ms.p50", "stopping p50", "ms"],
    ["barge_in_to_silence_ms.max", "max", "ms"]], "samples.barge_in_to_silence_ms"],
  ["Early preparation", [["preparation.committed", "committed", "count"],
    ["preparation.discarded", "discarded", "count"],
    ["preparation.wasted_tokens_share", "wasted tokens", "pct"],
    ["preparation.wasted_audio_share", "wasted audio", "pct"]]],
];

// The A/B table's cells after the method name, as in the page's header.
const BY_METHOD = [
  ["calls", "count"], ["turns", "count"],
  ["turn_end_to_first_audio_ms.p50", "ms"], ["turn_end_to_first_audio_ms.p95", "ms"],
  ["turn_end_to_first_audio_ms.p99", "ms"],
  ["request_to_first_token_ms.p50", "ms"], ["request_to_first_token_ms.p95", "ms"],
  ["itl_ms.mean", "ms"], ["itl_ms.p50", "ms"], ["itl_ms.p95", "ms"], ["itl_ms.p99", "ms"],
  ["itl_speedup.value", "speedup"], ["accepted_per_step", "x2"], ["interrupted_share", "pct"],
];

const UNITS = { ms: "ms", count: "", pct: "", x2: "", speedup: "" };

const $ = (id) => document.getElementById(id);
let signingIn = null; // the sign-in form's promise while it is shown

// ---- small helpers ----------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

function get(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function isNum(v) {
  return typeof v === "number" && isFinite(v);
}

function fmt(v, kind) {
  if (!isNum(v)) return "–";
  if (kind === "ms") return String(Math.round(v));
  if (kind === "pct") return `${Math.round(v * 100)}%`;
  if (kind === "x2") return v.toFixed(2);
  if (kind === "speedup") return `${v.toFixed(2)}×`;
  return String(v);
}

// A number cell: its text is the formatted number, data-value the exact one (JSON; null if none).
function metric(tag, path, v, kind) {
  return el(tag, {
    "data-metric": path,
    "data-value": JSON.stringify(isNum(v) ? v : null),
    class: "num",
    text: fmt(v, kind),
  });
}

function fmtTime(seconds) {
  if (!isNum(seconds)) return "–";
  const d = new Date(seconds * 1000);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
    `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

function fmtDuration(call) {
  if (!isNum(call.ended_at)) return "–"; // still on, or its end was not recorded
  const s = Math.round(call.ended_at - call.started_at);
  return s < 60 ? `${s} s` : `${Math.floor(s / 60)} min ${s % 60} s`;
}

function methodOrder(methods) {
  const rank = (m) => (METHOD_ORDER.includes(m) ? METHOD_ORDER.indexOf(m) : METHOD_ORDER.length);
  return [...methods].sort((a, b) => rank(a) - rank(b) || String(a).localeCompare(String(b)));
}

function methodColour(m) {
  return METHOD_COLOURS[m] || OTHER_COLOUR;
}

function swatch(m) {
  return el("span", { class: "swatch", style: `background:${methodColour(m)}` });
}

// Items grouped by speculation method, methods in display order.
function groupByMethod(items, methodOf) {
  const groups = new Map();
  for (const it of items) {
    const m = methodOf(it) || "unknown";
    if (!groups.has(m)) groups.set(m, []);
    groups.get(m).push(it);
  }
  return methodOrder(groups.keys()).map((m) => [m, groups.get(m)]);
}

// ---- API access -------------------------------------------------------------------------------

class Unauthorized extends Error {}

async function api(path, params = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) if (v != null) url.searchParams.set(k, v);
  const res = await fetch(url); // same origin: the session cookie goes with it
  if (res.ok) return res.json();
  if (res.status === 401) throw new Unauthorized();
  let detail = "";
  try {
    const d = (await res.json()).detail;
    detail = d == null ? "" : typeof d === "string" ? d : JSON.stringify(d);
  } catch {
    // no JSON body: the status code is all we have
  }
  const err = new Error(`${path}: HTTP ${res.status}${detail ? `: ${detail}` : ""}`);
  err.status = res.status;
  throw err;
}

function showError(err) {
  const box = $("error");
  if (err instanceof Unauthorized) {
    // The form has its own box: other errors shown meanwhile never replace it.
    if (!signingIn) {
      signingIn = askForToken($("signin-box"), "This server needs its token.").then(() => {
        signingIn = null;
        run(() => Promise.all([refreshAll(), refreshPairCard(), refreshBackend()]));
        connectEvents();
      });
    }
    return;
  } else {
    box.textContent = `error: ${err.message || err}`;
  }
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

// Run an async step; its failure is shown, not thrown.
async function run(step) {
  try {
    await step();
    clearError();
  } catch (err) {
    console.error(err);
    showError(err);
  }
}

// Run `step` at most once per REFRESH_MIN_MS however often this is called. A call while it runs
// runs it once more afterwards: the running one may have read the store before the news.
function throttled(step) {
  let last = 0;
  let timer = null;
  let running = false;
  let again = false;
  const fire = async () => {
    timer = null;
    running = true;
    last = Date.now();
    await run(step);
    running = false;
    if (again) {
      again = false;
      schedule();
    }
  };
  const schedule = () => {
    if (running) again = true;
    else if (!timer) timer = setTimeout(fire, Math.max(0, last + REFRESH_MIN_MS - Date.now()));
  };
  return schedule;
}

// ---- window -----------------------------------------------------------------------------------

function since() {
  const v = $("window").value;
  return v === "all" ? null : Date.now() / 1000 - Number(v);
}

// ---- filters: by speculation method and by config hash ----------------------------------------

// The API's filter parameters as chosen (null: all).
function filters() {
  return {
    method: $("filter-method").value || null,
    config_hash: $("filter-config").value || null,
  };
}

// A select's options from the window's choices; a chosen value stays, with none left in it.
function fillSelect(select, choices) {
  const chosen = select.value;
  const options = [el("option", { value: "", text: "all" })];
  for (const [value, label] of choices) options.push(el("option", { value, text: label }));
  if (chosen && !choices.some(([value]) => value === chosen)) {
    options.push(el("option", { value: chosen, text: `${chosen} (none in this window)` }));
  }
  select.replaceChildren(...options);
  select.value = chosen;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function renderFilters(f) {
  fillSelect($("filter-method"), (f.methods || []).map((m) =>
    [m.method, `${m.method} (${plural(m.turns, "turn")})`]));
  fillSelect($("filter-config"), (f.config_hashes || []).map((h) =>
    [h.config_hash, `${shortHash(h.config_hash)} (${plural(h.calls, "call")}, ` +
      `${plural(h.turns, "turn")})`]));
}

function shortHash(h) {
  return h && h.length > 12 ? h.slice(0, 12) : h || "–";
}

// ---- charts -----------------------------------------------------------------------------------

const PLOT_CONFIG = {
  displaylogo: false,
  responsive: true,
  modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d"],
};

function layout(title, xTitle, yTitle, extra = {}) {
  return {
    title: { text: title, x: 0.01, xanchor: "left", font: { size: 14 } },
    font: { family: "system-ui, sans-serif", size: 12, color: "#1d1d1f" },
    margin: { l: 60, r: 16, t: 40, b: 48 },
    height: 300,
    paper_bgcolor: "#fff",
    plot_bgcolor: "#fff",
    xaxis: { title: { text: xTitle }, gridcolor: "#eee", zeroline: false },
    yaxis: { title: { text: yTitle }, gridcolor: "#eee", rangemode: "tozero" },
    // At the chart's bottom edge, under the axis whatever its ticks take.
    legend: { orientation: "h", x: 0, xanchor: "left", yref: "container", y: 0, yanchor: "bottom" },
    hovermode: "closest",
    ...extra,
  };
}

function plot(id, traces, lay, empty = "no data in this window") {
  if (typeof Plotly === "undefined") {
    throw new Error("the charting library /static/vendor/plotly.min.js did not load");
  }
  const points = traces.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
  if (points === 0) {
    lay.annotations = [{
      text: empty, showarrow: false, xref: "paper", yref: "paper",
      x: 0.5, y: 0.5, font: { size: 13, color: "#888" },
    }];
    lay.xaxis = { ...lay.xaxis, showticklabels: false, showgrid: false };
    lay.yaxis = { ...lay.yaxis, showticklabels: false, showgrid: false };
  }
  return Plotly.react($(id), traces, lay, PLOT_CONFIG);
}

function turnLabel(t) {
  return `call ${t.call_id} turn ${t.turn}${t.interrupted ? " (interrupted)" : ""}`;
}

function renderClocks(turns) {
  const clocks = [
    ["chart-clock1", "Clock 1: request → first token", (t) => t.clocks.request_to_first_token_ms],
    ["chart-clock2", "Clock 2: inter-token latency (mean per turn)",
      (t) => get(t, "clocks.itl_ms.mean")],
    ["chart-clock3", "Clock 3: turn end → first audio",
      (t) => t.clocks.turn_end_to_first_audio_ms],
  ];
  const groups = groupByMethod(turns, (t) => t.engine && t.engine.method);
  for (const [id, title, value] of clocks) {
    const traces = groups.map(([m, ts]) => {
      const shown = ts.filter((t) => isNum(value(t)));
      return {
        type: "scatter",
        mode: "markers",
        name: m,
        x: shown.map((t) => new Date(t.started_at * 1000)),
        y: shown.map(value),
        customdata: shown.map((t) => t.call_id),
        hovertext: shown.map(turnLabel),
        hovertemplate: "%{y:.0f} ms<br>%{hovertext}<extra>%{fullData.name}</extra>",
        marker: { color: methodColour(m), size: 7, opacity: 0.8 },
      };
    });
    // The legend even for one method: it says which method the points are.
    plot(id, traces, layout(title, "", "ms", {
      margin: { l: 60, r: 16, t: 40, b: 72 },
      showlegend: true,
      // Few, level date ticks: rotated ones run into the legend in a narrow chart.
      xaxis: { type: "date", gridcolor: "#eee", tickangle: 0, nticks: 4 },
    }));
    const div = $(id);
    if (!div.dataset.clickable) {
      div.on("plotly_click", onChartClick); // a turn's point opens its call
      div.dataset.clickable = "1";
    }
  }
}

// Counts on the y axis: whole ticks, also when there are only a few.
function countAxis(hist, title) {
  return { title: { text: title }, gridcolor: "#eee", rangemode: "tozero",
    dtick: Math.max(0, ...hist) <= 5 ? 1 : null };
}

function renderSpeculation(spec) {
  const bars = (hist) => ({ x: hist.map((_, i) => i), y: hist });
  const accepted = spec.accepted_per_step_hist || [];
  plot("chart-accepted", accepted.length ? [{
    type: "bar", ...bars(accepted), marker: { color: METHOD_COLOURS.ngram },
    hovertemplate: "%{y} steps accepted %{x} tokens<extra></extra>",
  }] : [], layout("Accepted tokens per speculative step", "", "", {
    xaxis: { title: { text: "tokens accepted" }, dtick: 1 }, yaxis: countAxis(accepted, "steps"),
  }));

  const rejected = spec.rejection_position_hist || [];
  plot("chart-rejection", rejected.length ? [{
    type: "bar", ...bars(rejected), marker: { color: "#b42318" },
    hovertemplate: "%{y} steps rejected at position %{x}<extra></extra>",
  }] : [], layout("Rejection position", "", "", {
    xaxis: { title: { text: "first rejected draft position" }, dtick: 1 },
    yaxis: countAxis(rejected, "steps"),
  }));

  const steps = (spec.steps || []).slice(-MAX_STEPS);
  plot("chart-draft-verify", groupByMethod(steps, (s) => s.method).map(([m, ss]) => ({
    type: "scatter",
    mode: "markers",
    name: m,
    x: ss.map((s) => s.draft_ms),
    y: ss.map((s) => s.verify_ms),
    text: ss.map((s) => `${s.accepted} accepted`),
    hovertemplate: "draft %{x:.2f} ms, verify %{y:.1f} ms<br>%{text}" +
      "<extra>%{fullData.name}</extra>",
    marker: { color: methodColour(m), size: 5, opacity: 0.6 },
  })), layout("Drafting vs verification time per step", "draft ms", "verify ms",
    { margin: { l: 60, r: 16, t: 40, b: 84 } }));

  renderK((spec.k_history || []).filter((h) => h.k && h.k.length).slice(-K_TURNS));
}

// Line styles telling apart the turns of one method (which share its colour).
const K_DASHES = ["solid", "dot", "dash", "longdash", "dashdot", "longdashdot"];

// Each turn's K per decode step: a line per turn in its method's colour, the legend grouped by
// method with a line per turn (click one to hide it).
function renderK(ks) {
  const groups = groupByMethod(ks, (h) => h.method);
  const traces = groups.flatMap(([m, hs]) => hs.map((h, i) => ({
    type: "scatter",
    mode: "lines",
    line: { shape: "hv", width: 1.5, color: methodColour(m), dash: K_DASHES[i % K_DASHES.length] },
    name: `call ${shortHash(h.call_id)} turn ${h.turn}`,
    legendgroup: m,
    legendgrouptitle: { text: m },
    x: h.k.map((_, i) => i + 1),
    y: h.k,
    hovertemplate: `step %{x}: K = %{y}<extra>%{fullData.name} · ${m}</extra>`,
  })));
  const lay = layout(`K per step (last ${K_TURNS} turns)`, "decode step of the turn's reply",
    "K asked for (0: a plain step)", {
      height: 360,
      showlegend: true,
      legend: { orientation: "v", x: 1.02, xanchor: "left", y: 1, yanchor: "top",
        font: { size: 11 }, groupclick: "toggleitem", tracegroupgap: 8 },
    });
  lay.yaxis.dtick = Math.max(0, ...ks.flatMap((h) => h.k)) <= 8 ? 1 : null; // whole Ks
  plot("chart-k", traces, lay);
}

// A turn's tool calls (records from before tools have none).
function toolCalls(t) {
  return t.tool_calls || [];
}

// One tool call as the page shows it: name, duration, result size, and how it ended.
function fmtTool(c) {
  const ms = isNum(c.duration_ms) ? `${Math.round(c.duration_ms)} ms` : "– ms";
  const size = isNum(c.result_chars) ? `${c.result_chars} chars` : "no result";
  const how = c.ok ? "" : c.cancelled ? " (cancelled)" : " (error)";
  return `${c.name} ${ms} · ${size}${how}`;
}

// What a segment's hover says beyond its own milliseconds.
function segmentDetail(key, t) {
  if (key === "first_token_ms") {
    const prefill = get(t, "breakdown.prefill_ms");
    return `<br>prefill inside it: ${isNum(prefill) ? `${Math.round(prefill)} ms` : "–"}`;
  }
  if (key === "tools_ms") {
    const filler = get(t, "breakdown.filler_audio_ms");
    return toolCalls(t).map((c) => `<br>${fmtTool(c)}`).join("") +
      (isNum(filler) ? `<br>filler heard ${Math.round(filler)} ms after the turn end` : "");
  }
  return "";
}

function renderWaterfall(turns) {
  const labels = turns.map((t) => `turn ${t.turn}${t.interrupted ? " ✂" : ""}`);
  const traces = SEGMENTS.map(([key, name, colour]) => {
    const values = turns.map((t) => get(t, `breakdown.${key}`));
    const trace = {
      type: "bar",
      orientation: "h",
      name,
      y: labels,
      x: values.map((v) => (isNum(v) ? v : 0)), // a segment not measured counts as 0
      customdata: turns.map((t) => t.turn), // a click plays the turn from the recording
      marker: { color: colour },
      hovertext: turns.map((t, i) => {
        const v = values[i];
        const text = `${name}: ${isNum(v) ? `${Math.round(v)} ms` : "not measured"}`;
        return text + segmentDetail(key, t);
      }),
      hovertemplate: "%{y}<br>%{hovertext}<extra></extra>",
    };
    if (key === "tools_ms") {
      // The calls' names on their segment; the hover and the table below have the rest.
      trace.text = turns.map((t) => toolCalls(t).map((c) => c.name).join(", "));
      trace.textposition = "inside";
      trace.insidetextanchor = "middle";
      trace.textfont = { color: "#fff" };
    }
    return trace;
  });
  const lay = layout("", "ms from the caller starting to speak", "", {
    barmode: "stack",
    height: Math.max(220, 110 + 34 * turns.length),
    margin: { l: 90, r: 16, t: 56, b: 48 },
    // Stacked bars list their legend bottom-up by default; keep the order time passes in.
    legend: { orientation: "h", x: 0, xanchor: "left", y: 1.0, yanchor: "bottom",
      traceorder: "normal" },
  });
  lay.yaxis = { autorange: "reversed", type: "category", gridcolor: "#eee" };
  plot("chart-waterfall", turns.length ? traces : [], lay, "no turns in this call");
  const div = $("chart-waterfall");
  if (!div.dataset.clickable) {
    div.on("plotly_click", onChartClick);
    div.dataset.clickable = "1";
  }
}

// ---- overview and the A/B table ---------------------------------------------------------------

// "n = 12": how many turns a figure is over; data-metric `path` for the number alone.
function sampleSize(path, v) {
  return el("span", { class: "n", title: "turns this figure is over" }, "n = ",
    metric("span", path, v, "count"));
}

function renderOverview(ov, windowSince, chosen) {
  const box = $("overview");
  box.dataset.since = JSON.stringify(windowSince);
  box.dataset.filters = JSON.stringify(chosen);
  box.replaceChildren(...OVERVIEW.map(([title, items, samples]) => el("div", { class: "card" },
    el("h3", {}, title, samples ? " " : null,
      samples ? sampleSize(samples, get(ov, samples)) : null),
    el("dl", {}, ...items.flatMap(([path, label, kind]) => [
      el("dt", { text: label }),
      el("dd", {}, metric("span", path, get(ov, path), kind),
        UNITS[kind] ? el("span", { class: "unit", text: ` ${UNITS[kind]}` }) : null),
    ])),
  )));
}

function renderByMethod(byMethod, abOffShare) {
  const body = $("by-method").querySelector("tbody");
  const methods = methodOrder(Object.keys(byMethod || {}));
  if (!methods.length) {
    body.replaceChildren(el("tr", {}, el("td", {
      colspan: BY_METHOD.length + 1, class: "empty", text: "no turns in this window",
    })));
    return;
  }
  body.replaceChildren(...methods.map((m) => {
    const row = byMethod[m];
    return el("tr", { "data-method": m },
      el("th", { scope: "row" }, swatch(m), m),
      ...BY_METHOD.map(([path, kind]) => {
        if (path === "itl_speedup.value") return speedupCell(m, row.itl_speedup || {});
        if (path === "accepted_per_step") {
          return el("td", { class: "num" }, metric("span", path, get(row, path), kind),
            el("br"), el("span", { class: "n", title: "speculative steps it pools" }, "steps = ",
              metric("span", "samples.speculative_steps",
                get(row, "samples.speculative_steps"), "count")));
        }
        return metric("td", path, get(row, path), kind);
      }));
  }));
  renderBaseline(byMethod, abOffShare);
}

// The speed-up (stats.itl_speedup, computed by the server), and beside it the turns it is over:
// this method's and off's.
function speedupCell(m, sp) {
  const cell = el("td", {
    class: "num",
    title: `mean ITL over ${sp.turns ?? 0} turns (${sp.gaps ?? 0} gaps) of ${m}` +
      (sp.off_turns ? `, against ${sp.off_turns} turns (${sp.off_gaps} gaps) of off`
        : ", no turns of off to compare"),
  }, metric("span", "itl_speedup.value", sp.value, "speedup"), el("br"));
  const n = el("span", { class: "n" }, "(",
    metric("span", "itl_speedup.turns", sp.turns, "count"));
  if (m !== "off") {
    n.append(" vs ", el("span", {
      "data-metric": "itl_speedup.off_turns",
      "data-value": JSON.stringify(sp.off_turns ?? null),
      text: sp.off_turns ? String(sp.off_turns) : "no off",
    }));
  }
  n.append(" turns)");
  cell.append(n);
  return cell;
}

// Where the speed-up's baseline comes from, or in one line how to get one.
function renderBaseline(byMethod, share) {
  const pct = isNum(share) ? `${Math.round(share * 100)}%` : "–";
  const note = $("baseline");
  note.dataset.offTurns = JSON.stringify(get(byMethod, "off.samples.itl_turns") ?? 0);
  if (get(byMethod, "off.samples.itl_turns")) {
    note.textContent = `Baseline: the turns with speculation off, from the calls the server ` +
      `holds out (server.ab_off_share = ${pct} of calls, spread evenly) and any calls run with ` +
      `method off.`;
  } else {
    note.textContent = `No turns with speculation off in this window, so no speed-up: serve ` +
      `holds out server.ab_off_share of calls with speculation off (now ${pct}); set it above ` +
      `0 (e.g. --set server.ab_off_share=0.1), or run voiceagent bench call --modes off,ngram.`;
  }
}

// ---- calls list and one call's turns ----------------------------------------------------------

const calls = { rows: [], nextBefore: null, selected: null };

function renderCalls() {
  const body = $("calls").querySelector("tbody");
  if (!calls.rows.length) {
    body.replaceChildren(el("tr", {}, el("td", {
      colspan: 9, class: "empty", text: "no calls in this window",
    })));
  } else {
    body.replaceChildren(...calls.rows.map((c) => {
      const cls = c.call_id === calls.selected ? "selected" : null;
      return el("tr", { "data-call-id": c.call_id, tabindex: 0, class: cls },
        el("td", { text: fmtTime(c.started_at) }),
        el("td", {}, el("code", { text: c.call_id })),
        el("td", { text: c.kind || "–" }),
        el("td", { class: "call-sid" }, c.call_sid ? el("code", { text: c.call_sid }) : "–"),
        el("td", {}, swatch(c.method), c.method || "–"),
        el("td", { title: c.config_hash || "no config hash recorded" },
          el("code", { text: shortHash(c.config_hash) })),
        el("td", { class: "num", text: String(c.turns ?? "–") }),
        el("td", { class: "num", text: String(c.interrupted_turns ?? "–") }),
        el("td", { class: "num", text: fmtDuration(c) }));
    }));
  }
  $("calls-more").hidden = calls.nextBefore == null;
}

// The newest calls, as many as are shown: a live refresh must not undo "Older calls".
function fetchCalls(s) {
  const limit = Math.min(MAX_CALLS, Math.max(PAGE, calls.rows.length));
  return api("/api/calls", { since: s, limit, ...filters() });
}

function applyCalls(page) {
  calls.rows = page.calls;
  calls.nextBefore = page.next_before;
  renderCalls();
}

async function refreshCalls() {
  applyCalls(await fetchCalls(since()));
}

async function olderCalls() {
  const r = await api("/api/calls", {
    since: since(), before: calls.nextBefore, limit: PAGE, ...filters(),
  });
  const seen = new Set(calls.rows.map((c) => c.call_id));
  calls.rows.push(...r.calls.filter((c) => !seen.has(c.call_id)));
  calls.nextBefore = r.next_before;
  renderCalls();
}

function transcriptCell(text, stored) {
  if (!stored) return el("td", { class: "text missing", text: "(transcripts not stored)" });
  return el("td", { class: text ? "text" : "text missing", text: text || "–" });
}

function toolsCell(t) {
  const calls = toolCalls(t);
  if (!calls.length) return el("td", { class: "tools missing", text: "–" });
  return el("td", { class: "tools" }, ...calls.map((c) => el("div", {
    class: c.ok ? "tool" : "tool failed",
    "data-tool": c.name,
    "data-duration-ms": JSON.stringify(isNum(c.duration_ms) ? c.duration_ms : null),
    "data-result-chars": JSON.stringify(isNum(c.result_chars) ? c.result_chars : null),
    text: fmtTool(c),
  })));
}

function renderCallTurns(turns) {
  const body = $("call-turns").querySelector("tbody");
  if (!turns.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "empty", text: "no turns" })));
    return;
  }
  body.replaceChildren(...turns.map((t) => {
    // With `store.transcripts: false` the store keeps the texts as empty strings.
    const stored = Boolean(t.user_text || t.bot_text || t.llm_text);
    const c = t.clocks || {};
    return el("tr", { "data-turn": t.turn, class: t.interrupted ? "interrupted" : null },
      el("th", { scope: "row", class: "num" }, String(t.turn),
        t.interrupted ? el("span", { class: "badge", text: "interrupted" }) : null,
        t.continues ? el("span", { class: "badge", text: "goes on",
                                   title: "the caller went on with the turn before as its reply began: one message to the model" }) : null,
        t.early_ends ? el("span", { class: "badge", text: "ended early",
                                    title: "the turn ended at a pause the caller went on from; the reply begun there was withdrawn before any of it was heard" }) : null),
      transcriptCell(t.user_text, stored),
      transcriptCell(t.bot_text, stored),
      toolsCell(t),
      metric("td", "request_to_first_token_ms", c.request_to_first_token_ms, "ms"),
      metric("td", "itl_ms.mean", get(c, "itl_ms.mean"), "ms"),
      metric("td", "turn_end_to_first_audio_ms", c.turn_end_to_first_audio_ms, "ms"),
      bargeInCell(t));
  }));
}

// A barge-in: the caller's first voiced frame -> the bot silent, and its two parts.
function bargeInCell(t) {
  if (!isNum(t.barge_in_to_silence_ms)) return el("td", { class: "num", text: "–" });
  return el("td", { class: "num" },
    metric("span", "barge_in_to_silence_ms", t.barge_in_to_silence_ms, "ms"),
    el("span", { class: "n" }, " (",
      metric("span", "barge_in_detection_ms", t.barge_in_detection_ms, "ms"), " + ",
      metric("span", "interruption_to_silence_ms", t.interruption_to_silence_ms, "ms"), ")"));
}

// Each turn's speculation as the API computed it (stats.turn_speculation): the page only shows it.
function renderCallSpeculation(rows) {
  const body = $("call-speculation").querySelector("tbody");
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 7, class: "empty", text: "no turns" })));
    return;
  }
  body.replaceChildren(...rows.map((s) => el("tr", { "data-turn": s.turn },
    el("th", { scope: "row", class: "num" }, String(s.turn)),
    el("td", { class: "method" }, swatch(s.method), s.method),
    el("td", { class: "num" }, metric("span", "speculative_steps", s.speculative_steps, "count"),
      " / ", metric("span", "steps", s.steps, "count")),
    metric("td", "accepted_per_step", s.accepted_per_step, "x2"),
    el("td", { class: "num" }, metric("span", "acceptance_rate", s.acceptance_rate, "pct"),
      s.drafted ? el("span", { class: "n" }, " (", metric("span", "accepted", s.accepted, "count"),
        " of ", metric("span", "drafted", s.drafted, "count"), ")") : null),
    kRange(s),
    metric("td", "k_mean", s.k_mean, "x2"))));
}

// "2–6", or "4" when every step asked for the same K.
function kRange(s) {
  const cell = el("td", { class: "num" }, metric("span", "k_min", s.k_min, "count"));
  if (isNum(s.k_max) && s.k_max !== s.k_min) {
    cell.append("–", metric("span", "k_max", s.k_max, "count"));
  }
  return cell;
}

async function showCall(callId) {
  calls.selected = callId;
  for (const tr of $("calls").querySelectorAll("tr[data-call-id]")) {
    tr.classList.toggle("selected", tr.dataset.callId === callId);
  }
  const detail = $("call-detail");
  detail.hidden = false;
  detail.dataset.callId = callId;
  let r;
  try {
    r = await api(`/api/calls/${encodeURIComponent(callId)}`);
  } catch (err) {
    if (err.status !== 404) throw err;
    $("call-title").textContent = `Call ${callId}: not in the store`;
    renderCallTurns([]);
    renderCallSpeculation([]);
    renderWaterfall([]);
    await showRecording(callId, null);
    return;
  }
  if (calls.selected !== callId) return; // another call was clicked meanwhile
  const c = r.call;
  $("call-title").replaceChildren(`Call ${c.call_id} · ${c.kind || "?"} · speculation ` +
    `${c.method || "?"} · ${fmtTime(c.started_at)} · ${r.turns.length} turn(s)`,
  ...(c.call_sid ? [" · Twilio CallSid ", el("code", { id: "call-sid", text: c.call_sid })] : []));
  renderCallTurns(r.turns);
  renderCallSpeculation(r.speculation || []);
  renderWaterfall(r.turns);
  await showRecording(callId, r.recording);
}

// ---- pair card --------------------------------------------------------------------------------

async function refreshPairCard() {
  let card;
  try {
    card = await api("/api/pair-card");
  } catch (err) {
    if (err.status !== 404 && err.status !== 503) throw err;
    $("card-hash").textContent = "–";
    $("card-json").textContent = err.status === 503
      ? "(the server is still loading its models)"
      : "(no pair card: the LLM runs on a remote server)";
    if (err.status === 503) setTimeout(() => run(refreshPairCard), CARD_RETRY_MS);
    return;
  }
  $("card-hash").textContent = card.card_hash || "–";
  $("card-json").textContent = JSON.stringify(card, null, 2);
}

// ---- the LLM: in process, or a remote server (whose speculation counters are server-wide) ------

async function refreshBackend() {
  let b;
  try {
    b = await api("/api/backend");
  } catch (err) {
    if (err.status !== 503) throw err;
    $("backend").textContent = "LLM: (the server is still loading its models)";
    setTimeout(() => run(refreshBackend), CARD_RETRY_MS);
    return;
  }
  if (b.backend === "engine") {
    $("backend").textContent = `LLM: the in-process engine · ${b.model} · speculation ${b.name}`;
    return;
  }
  const s = b.speculation;
  const spec = s
    ? `its speculation, all requests since it started: ${fmt(s.acceptance_rate, "pct")} of ` +
      `${s.draft_tokens} drafted tokens accepted, ${fmt(s.mean_accepted_per_draft, "x2")} ` +
      `per draft`
    : "it shows no speculation counters";
  $("backend").textContent = `LLM: the server at ${b.base_url} · ${b.model} · its turns ` +
    `show as method ${b.name} · ${spec}`;
  setTimeout(() => run(refreshBackend), BACKEND_MS);
}

// ---- refresh and live updates -----------------------------------------------------------------

let generation = 0; // bumped by each full refresh: a slower, older one must not draw last

async function refreshAll() {
  const mine = ++generation;
  const s = since();
  const chosen = filters();
  const [ov, turns, spec, page, choices] = await Promise.all([
    api("/api/overview", { since: s, ...chosen }),
    api("/api/turns", { since: s, limit: TURNS_LIMIT, ...chosen }),
    api("/api/speculation", { since: s, ...chosen }),
    fetchCalls(s),
    api("/api/filters", { since: s }),
  ]);
  if (mine !== generation) return;
  renderFilters(choices);
  renderOverview(ov, s, chosen); // the tables first: they need no charting library
  renderByMethod(ov.by_method, ov.ab_off_share);
  applyCalls(page);
  renderClocks(turns.turns);
  renderSpeculation(spec);
  $("updated").textContent = `updated ${fmtTime(Date.now() / 1000).slice(11)}`;
}

const refreshSoon = throttled(refreshAll);
const callsSoon = throttled(refreshCalls);
const callSoon = throttled(() => (calls.selected ? showCall(calls.selected) : null));

function setLive(state) {
  const live = $("live");
  live.className = state;
  live.textContent = { on: "live", reconnecting: "reconnecting…", off: "offline" }[state];
}

let events = null; // the open EventSource, one at a time

function connectEvents() {
  if (events && events.readyState !== EventSource.CLOSED) return;
  const es = new EventSource("/api/events");
  events = es;
  let opened = false;
  es.onopen = () => {
    setLive("on");
    if (opened) {
      // Back after a gap: events may have been missed, and a restarted server may run another pair.
      refreshSoon();
      run(refreshPairCard);
    }
    opened = true;
  };
  es.onerror = () => {
    if (es.readyState !== EventSource.CLOSED) {
      setLive("reconnecting"); // the browser retries by itself
      return;
    }
    // Refused (an HTTP error): the browser gives up, we don't.
    setLive("off");
    es.close();
    setTimeout(connectEvents, RECONNECT_MS);
  };
  es.addEventListener("turn", (e) => {
    refreshSoon();
    try {
      if (JSON.parse(e.data).call_id === calls.selected) callSoon();
    } catch {
      // not JSON: the full refresh is all it gets
    }
  });
  es.addEventListener("call", callsSoon);
}

function onCallsClick(e) {
  const tr = e.target.closest("tr[data-call-id]");
  if (tr) run(() => showCall(tr.dataset.callId));
}

function onChartClick(data) {
  // A point's customdata: a call id (the clocks' charts open the call) or a turn number (the
  // waterfall plays the turn).
  const key = data.points && data.points[0] && data.points[0].customdata;
  if (typeof key === "string") run(() => showCall(key));
  if (typeof key === "number") playTurn(key);
}

function onTurnClick(e) {
  const tr = e.target.closest("tr[data-turn]");
  if (tr) playTurn(Number(tr.dataset.turn));
}

function start() {
  for (const id of ["window", "filter-method", "filter-config"]) {
    $(id).addEventListener("change", () => {
      calls.rows = [];
      calls.nextBefore = null;
      run(refreshAll);
    });
  }
  $("calls").addEventListener("click", onCallsClick);
  $("calls").addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      onCallsClick(e);
    }
  });
  $("calls-more").addEventListener("click", () => run(olderCalls));
  $("call-turns").addEventListener("click", onTurnClick);
  run(() => Promise.all([refreshAll(), refreshPairCard(), refreshBackend()]));
  connectEvents();
  setInterval(refreshSoon, SLIDE_MS);
}

sessionFromFragment().finally(start);
