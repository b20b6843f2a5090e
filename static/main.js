// Bootstrap: load the self-hosted Pyodide and the project's wheel, then hand over to Python
// (app/page.py, app/chat.py). Everything comes from this origin: the page works offline.
// Text from the model or the user is only ever set through textContent, never as HTML.
import { loadPyodide } from "./pyodide/pyodide.mjs";
import { COLORS, drawSteps } from "./charts.js";
import { download, stepsCsv, stepsJson } from "./export.js";
import { replayComputePasses } from "./replay.js";
import { cacheAvailable, cachedModels, clearCachedModels, loadWeights } from "./weights_cache.js";

const $ = (id) => document.getElementById(id);
globalThis.replayComputePasses = replayComputePasses;  // what Python's BrowserDevice replays decode steps with
const progress = $("progress");
const params = new URLSearchParams(location.search);
const MAX_CONTEXT = Number(params.get("context") || 4096);
// ?model=tiny_chat loads random weights behind the same tokenizer (fast page tests on CPU WebGPU).
const MODEL = params.get("model") || "smollm2";
const MODEL_LABEL = MODEL === "smollm2" ? "SmolLM2-135M" : `${MODEL} (random weights)`;
const SWITCH_AT = 256;  // the host's tiled -> sharded switch (model_glue.attention.TILED_MAX_CONTEXT)
const LONG_DOCUMENT_QUESTION = "\n\nSummarize the document above in three sentences.";

// steps: this conversation's live per-step stats (the overlay); replies: every finished reply or
// comparison run with its speed figures and complete step table (the export).
window.demoState = { ready: false, chatReady: false, busy: false, steps: [], replies: [], deviceLost: null,
  longTasks: [] };

// Main-thread tasks over 50 ms (the browser's definition), to check that a reply keeps the page usable.
try {
  new PerformanceObserver((list) => {
    for (const e of list.getEntries()) window.demoState.longTasks.push({ start: e.startTime, duration: e.duration });
  }).observe({ type: "longtask", buffered: true });
} catch { /* no Long Tasks API: nothing recorded */ }

// A Python exception reaches JS as a PythonError whose message is the whole traceback: show its
// last line, without the module path of the exception class.
function errorText(err) {
  const text = String((err && err.message) || err).trim();
  if (!err || err.type === undefined) return text;
  const last = text.split("\n").filter((line) => line.trim()).pop() || text;
  return last.replace(/^[\w.]*\.(\w+: )/, "$1");
}

function step(text) {
  for (const li of progress.querySelectorAll("li.active")) li.className = "done";
  const li = document.createElement("li");
  li.className = "active";
  li.textContent = text;
  progress.append(li);
}

function finishSteps(summary) {
  for (const li of progress.querySelectorAll("li.active")) li.className = "done";
  if (summary) {  // folds the status list away once the model is ready
    $("status-summary").textContent = summary;
    $("status-details").open = false;
  }
}

function fail(message) {
  for (const li of progress.querySelectorAll("li.active")) li.className = "";
  $("status-details").open = true;
  $("status-summary").textContent = "failed";
  $("error").textContent = message;
  $("error").hidden = false;
  window.demoState.error = message;
}

function showAdapter(device, probe) {
  const dl = $("adapter");
  const rows = [
    ["name", device.adapter], ["backend", device.backend],
    ["shader-f16", device.shader_f16 ? "yes (f16 kernels)" : "no (f32 kernels)"],
    ["timestamp-query", device.timestamp_query ? "yes" : "no (no attention timings)"],
    ["subgroups", device.subgroup_min_size
      ? `${device.subgroup_min_size}-${device.subgroup_max_size} invocations (subgroup attention kernels)`
      : "no (shards attention kernels)"],
    ["features", device.features.join(", ")],
  ];
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  }
  const verdict = $("probe-verdict");
  verdict.textContent = probe.ok
    ? `Self-test OK: a TVM-built reduction kernel matches Python's sums (max abs error ${probe.max_abs_error.toExponential(2)}).`
    : `Self-test FAILED: max abs error ${probe.max_abs_error}`;
  verdict.className = probe.ok ? "ok" : "error";
  $("adapter-panel").hidden = false;
}

// -- overlay and speed figures ---------------------------------------------------------------
const fmt = (value, digits = 1) => (value === null || value === undefined ? "–" : value.toFixed(digits));

function speedText(speed) {
  const ttft = speed.ttft_ms === null ? "–" : `${Math.round(speed.ttft_ms)} ms`;
  return `TTFT ${ttft} · prefill ${speed.prefill_tokens} tok (${speed.reused_tokens} reused) at ` +
    `${fmt(speed.prefill_tok_s)} tok/s · decode ${fmt(speed.decode_tok_s)} tok/s`;
}

function drawOverlayChart() {
  const points = window.demoState.steps.filter((s) => s.attention_ms !== null && s.kind === "decode")
    .map((s) => ({ x: s.context, y: s.attention_ms, nest: s.nest }));
  window.demoState.overlayChart = drawSteps($("overlay-chart"), [{ label: "this chat", color: "#777", points }],
    { switchAt: SWITCH_AT });
}

function updateOverlay(stats) {
  const steps = window.demoState.steps;
  steps.push(stats);
  const attn = stats.attention_ms === null ? "n/a" : `${stats.attention_ms.toFixed(3)} ms`;
  const gpu = stats.gpu_ms === null ? "n/a" : `${stats.gpu_ms.toFixed(2)} ms`;
  $("overlay-last").textContent =
    `${stats.kind} · ctx ${stats.context} · ${stats.variant} · attn ${attn} · GPU ${gpu} · ` +
    `encode ${stats.encode_ms.toFixed(2)} ms · step ${stats.step_ms.toFixed(1)} ms · ${stats.dispatches} dispatches`;
  $("overlay-note").textContent = stats.timing_note || "";
  drawOverlayChart();
  $("overlay").hidden = false;
}

// A finished reply (or comparison run): its speed and full step table go into the export.
function recordRun(label, result) {
  window.demoState.replies.push({ reply: label, speed: result.speed, seed: result.seed ?? null,
    stop_reason: result.stop_reason, stats: result.stats });
  $("export-csv").disabled = false; $("export-json").disabled = false;
}

function exportSteps(app, format) {
  const replies = window.demoState.replies;
  const stamp = new Date().toISOString().replace(/[:.]/g, "-");
  if (format === "csv") {
    download(`decode-steps-${stamp}.csv`, stepsCsv(replies), "text/csv");
  } else {
    const device = window.demoState.device;
    const about = { model: MODEL_LABEL, adapter: device.adapter, backend: device.backend,
      dtype: app.chat.model.dtype, max_context: MAX_CONTEXT, switch_at: SWITCH_AT };
    download(`decode-steps-${stamp}.json`, stepsJson(replies, about), "application/json");
  }
}

// -- chat -------------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  return div;
}

// The reply or comparison in flight (a promise), so New chat can stop it and wait for it.
let running = null;

function setBusy(busy) {
  window.demoState.busy = busy;
  const blocked = busy || window.demoState.deviceLost !== null;
  $("send").disabled = blocked; $("compare").disabled = blocked;
  $("stop").disabled = !busy;
}

// Ends a reply's bubble: its token ids when the text shows nothing, then count, stop reason, speed.
function finishReply(bubble, body, result) {
  if (!result.text.trim()) {  // nothing visible (e.g. only whitespace or special tokens): show the ids
    body.textContent = result.text;
    const ids = document.createElement("span");
    ids.className = "ids";
    ids.textContent = `(no visible text; token ids: ${result.token_ids.join(" ")})`;
    bubble.append(ids);
  }
  const meta = document.createElement("span");
  meta.className = "meta";
  const seed = result.seed === null ? "" : ` · seed ${result.seed}`;
  meta.textContent = `${result.token_ids.length} tokens · ${result.stop_reason}${seed} · ${speedText(result.speed)}`;
  bubble.append(meta);
}
window.demoUI = { finishReply, addMessage };  // for the page tests

function samplingSettings() {
  return JSON.stringify({ temperature: Number($("temperature").value) || 0, top_k: Number($("top-k").value),
    top_p: Number($("top-p").value), seed: $("seed").value === "" ? null : Number($("seed").value) });
}

function showPrefill(done, total) {
  window.demoState.prefill = { done, total };
  $("overlay-last").textContent = `prefill ${done}/${total} tokens`;
  $("overlay").hidden = false;
}

function chatError(message) {
  $("chat-error").textContent = message || "";
  $("chat-error").hidden = !message;
}

function send(app) {
  if (window.demoState.busy || window.demoState.deviceLost) return;
  running = reply(app).finally(() => { running = null; });
}

async function reply(app) {
  const text = $("prompt").value;
  if (!text.trim()) { chatError("The message is empty."); return; }
  chatError("");
  setBusy(true);
  window.demoState.prefill = null;
  const userDiv = addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const body = bubble.querySelector("span");
  // The box is free for the next message while this one runs; if the turn fails, the text comes
  // back (unless something new was typed meanwhile): nothing typed is lost.
  $("prompt").value = "";
  const giveBack = () => { if (!$("prompt").value) $("prompt").value = text; };
  try {
    const json = await app.page.chat_reply(app.chat, text, Number($("max-tokens").value) || 128,
      $("attention").value, samplingSettings(), (piece) => { body.textContent += piece; },
      (s) => updateOverlay(JSON.parse(s)), showPrefill);
    const result = JSON.parse(json);
    if (result.device_lost) {
      // Keep what was shown (the partial reply too) and the typed text; offer a reload.
      bubble.classList.add("interrupted");
      giveBack();
      deviceLost(app, result.error);
      return;
    }
    if (result.error) {
      userDiv.remove(); bubble.remove();
      giveBack();
      chatError(result.error);
      return;
    }
    if (result.stop_reason === "stopped during prefill") {
      userDiv.remove(); bubble.remove();
      giveBack();
      chatError("Stopped before the first token. Your message is back in the box.");
      window.demoState.lastReply = { text: "", stop_reason: result.stop_reason };
      return;
    }
    finishReply(bubble, body, result);
    $("overlay-speed").textContent = speedText(result.speed);
    recordRun(`chat ${window.demoState.replies.filter((r) => r.reply.startsWith("chat")).length + 1}`, result);
    window.demoState.lastReply = { text: result.text, stop_reason: result.stop_reason, speed: result.speed,
      seed: result.seed, token_ids: result.token_ids, prompt_tokens: result.prompt_tokens };
  } catch (err) {
    giveBack();
    if (window.demoState.deviceLost) {  // reported by the device's `lost` promise: keep what was shown
      bubble.classList.add("interrupted");
      return;
    }
    bubble.remove();
    chatError(`Generation failed: ${errorText(err)}`);
  } finally {
    setBusy(false);
  }
}

function compare(app) {
  if (window.demoState.busy || window.demoState.deviceLost) return;
  running = compareNests(app).finally(() => { running = null; });
}

async function compareNests(app) {
  const text = $("prompt").value;
  if (!text.trim()) { chatError("The message is empty."); return; }
  chatError("");
  setBusy(true);
  $("compare-panel").hidden = false;
  $("compare-verdict").textContent = "running…";
  $("compare-tiled").textContent = ""; $("compare-sharded").textContent = "";
  try {
    const result = JSON.parse(await app.page.chat_compare(app.chat, text, Number($("max-tokens").value) || 128,
      (nest) => { $("compare-verdict").textContent = `running the ${nest} nest…`; }));
    if (result.error) {
      $("compare-verdict").textContent = "";
      if (result.device_lost) deviceLost(app, result.error); else chatError(result.error);
      return;
    }
    const shown = (run) => (run.text.trim() ? run.text : `(no visible text; token ids: ${run.token_ids.join(" ")})`);
    $("compare-tiled").textContent = shown(result.runs.tiled);
    $("compare-sharded").textContent = shown(result.runs.sharded);
    $("compare-verdict").textContent = result.identical
      ? "Identical greedy text."
      : `Texts first differ at generated token ${result.first_divergence}.`;
    showCompareFigures(result);
    const series = Object.keys(result.runs).map((nest) => ({
      label: nest === "tiled" ? "tiled nest" : "sharded family", color: COLORS[nest],
      points: result.runs[nest].stats.filter((s) => s.kind === "decode" && s.attention_ms !== null)
        .map((s) => ({ x: s.context, y: s.attention_ms, nest })),
    }));
    window.demoState.compareChart = drawSteps($("compare-chart"), series, { switchAt: SWITCH_AT });
    const n = window.demoState.replies.filter((r) => r.reply.startsWith("compare")).length / 2 + 1;
    for (const nest of Object.keys(result.runs)) recordRun(`compare ${n} ${nest}`, result.runs[nest]);
    window.demoState.lastCompare = { identical: result.identical, first_divergence: result.first_divergence,
      teacher_forced: result.teacher_forced, past_switch: result.past_switch,
      prompt_tokens: result.runs.tiled.prompt_tokens };
  } catch (err) {
    chatError(`Comparison failed: ${errorText(err)}`);
  } finally {
    setBusy(false);
  }
}

function showCompareFigures(result) {
  const forced = result.teacher_forced, past = result.past_switch;
  const agreement = forced.steps
    ? `${(100 * forced.match_rate).toFixed(1)}% (${forced.matches} of ${forced.steps} steps: the sharded family ` +
      "fed the tiled run's tokens picks the same top-1)"
    : "no generated steps";
  const med = past.median_attention_ms;
  const speedup = past.speedup === null
    ? `no decode steps past ${SWITCH_AT} tokens of context (try Long document)` + (med.tiled === null && past.steps.tiled
      ? "; this adapter has no GPU timestamps" : "")
    : `tiled ${fmt(med.tiled, 3)} ms, sharded ${fmt(med.sharded, 3)} ms: ${past.speedup.toFixed(2)}x faster ` +
      `(median over ${past.steps.sharded} steps)`;
  const dl = $("compare-figures");
  dl.replaceChildren();
  for (const [k, v] of [["prompt", `${result.runs.tiled.prompt_tokens} tokens`], ["teacher-forced agreement", agreement],
                        [`attention past ${SWITCH_AT} tokens`, speedup]]) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  }
}

async function fillLongDocument() {
  try {
    const response = await fetch(new URL("./long_document.txt", location.href));
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    $("prompt").value = (await response.text()).trim() + LONG_DOCUMENT_QUESTION;
    chatError("");
  } catch (err) {
    chatError(`Cannot load the long document: ${errorText(err)}`);
  }
}

// The GPU device can be lost at any time (driver reset, another tab, device.destroy()). The page
// says so, keeps everything on screen and in the box, and offers to load the model again.
function deviceLost(app, message) {
  if (window.demoState.deviceLost) return;
  window.demoState.deviceLost = message;
  $("device-lost-text").textContent = message;
  $("device-lost").hidden = false;
  setBusy(window.demoState.busy);
}

function watchDevice(app, session) {
  session.device.js_device.lost.then((info) => {
    deviceLost(app, `The GPU device was lost (${info.reason}${info.message ? `: ${info.message}` : ""}). ` +
      "The conversation is kept; reload the model to go on.");
  });
}

async function openSession(page) {
  const session = await page.open_session(new URL("./artifacts/kernels", location.href).href);
  return { session, device: session.device.describe().toJs({ dict_converter: Object.fromEntries }) };
}

const MiB = (bytes) => (bytes / 2 ** 20).toFixed(1);

// Fetches the weights (from the browser's cache when it holds this exact file) with a progress
// bar, then hands them to Python, which checks every tensor and uploads it.
async function loadChat(page, session) {
  const base = new URL(`./artifacts/${MODEL}`, location.href).href;
  const response = await fetch(`${base}/manifest.json`);
  if (!response.ok) {
    throw new Error(`cannot fetch ${base}/manifest.json (HTTP ${response.status}); run \`make setup\` on the server`);
  }
  const manifest = await response.json();
  if (!manifest.weights_sha256) {
    throw new Error(`the ${MODEL} artifact predates this page (no weights_sha256); run \`make setup\` on the server`);
  }
  step(`${MODEL_LABEL}: weights (${MiB(manifest.total_bytes)} MiB)…`);
  const bar = $("load-bar"), label = $("load-text");
  $("load-progress").hidden = false;
  const stages = { cache: "reading from the browser cache", download: "downloading", verify: "checking sha256" };
  const weights = await loadWeights(`${base}/${manifest.weights_file}`, manifest.weights_sha256, manifest.total_bytes,
    ({ stage, received, total }) => {
      bar.max = total; bar.value = received;
      label.textContent = `${stages[stage]}: ${MiB(received)} / ${MiB(total)} MiB`;
    });
  $("load-progress").hidden = true;
  window.demoState.weights = { source: weights.source, dropped: weights.dropped };
  step(`${MODEL_LABEL}: weights ${weights.source === "cache" ? "from the browser cache" : "downloaded"}` +
       `${weights.dropped ? " (the cached copy did not match its sha256 and was replaced)" : ""}…`);
  await showCache();
  return page.open_chat(session, base, (message) => step(`${MODEL_LABEL}: ${message}…`), MAX_CONTEXT,
    weights.bytes, weights.verified);
}

async function showCache() {
  if (!cacheAvailable()) {
    $("cache-info").textContent = "This page cannot cache the model here (the Cache API needs https or localhost).";
    return;
  }
  const entries = await cachedModels();
  const bytes = entries.reduce((sum, e) => sum + e.bytes, 0);
  $("cache-info").textContent = entries.length
    ? `Browser cache: ${entries.length} model weights file(s), ${MiB(bytes)} MiB.`
    : "Browser cache: empty (the next load downloads the weights).";
  $("clear-cache").hidden = !entries.length;
}

async function reloadModel(app) {
  $("reload-model").disabled = true;
  try {
    if (running) { app.chat.request_stop(); await running; }
    step("Reloading: opening WebGPU again…");
    const { session } = await openSession(app.page);
    const chat = await loadChat(app.page, session);
    app.page.carry_over(app.chat, chat);
    Object.assign(app, { session, chat });
    Object.assign(window.demo, { session, chat });
    watchDevice(app, session);
    window.demoState.deviceLost = null;
    $("device-lost").hidden = true;
    step("Ready again: the model is reloaded and the conversation kept.");
    finishSteps("ready again");
    setBusy(false);
  } catch (err) {
    $("device-lost-text").textContent = `Reloading failed: ${errorText(err)}`;
  } finally {
    $("reload-model").disabled = false;
  }
}

async function newChat(app) {
  if (running) { app.chat.request_stop(); await running; }  // a reply in flight ends first
  app.page.new_chat(app.chat);
  $("messages").replaceChildren();
  window.demoState.steps = [];
  window.demoState.replies = [];
  $("export-csv").disabled = true; $("export-json").disabled = true;
  $("overlay-speed").textContent = "";
  drawOverlayChart();
  chatError("");
}

async function boot() {
  if (!("gpu" in navigator)) {
    fail("This browser has no WebGPU (navigator.gpu is missing). Use a recent Chromium-based browser " +
         "with WebGPU enabled (on Linux: --enable-unsafe-webgpu).");
    return;
  }
  step("Loading Python (Pyodide)…");
  const pyodide = await loadPyodide({ indexURL: new URL("./pyodide/", location.href).href });
  step("Loading the project's wheel…");
  await pyodide.loadPackage("sharded-decode-demo", { messageCallback: () => {} });
  step("Opening WebGPU and reading the kernel manifest…");
  const page = pyodide.pyimport("app.page");
  const { session, device } = await openSession(page);
  step("Self-test: running a TVM-built kernel…");
  const probe = (await session.run_probe()).toJs({ dict_converter: Object.fromEntries });
  showAdapter(device, probe);
  window.demo = { pyodide, page, session };
  window.demoState = { ...window.demoState, ready: true, device, probe };
  if (params.get("model") === "off") {
    step("Ready (model not loaded: ?model=off).");
    finishSteps("ready (kernels only)");
    return;
  }

  if (!/^[a-z0-9_]+$/.test(MODEL)) { fail(`Unknown model "${MODEL}".`); return; }
  step(`Loading ${MODEL_LABEL}…`);
  const chat = await loadChat(page, session);
  const app = { page, session, chat };
  window.demo.chat = chat;
  watchDevice(app, session);
  const ready = `${MODEL_LABEL}, ${device.shader_f16 ? "f16" : "f32"} kernels, context up to ${MAX_CONTEXT} tokens`;
  step(`Ready: ${ready}.`);
  finishSteps(`ready: ${ready} (click for the loading steps)`);
  $("chat-panel").hidden = false;
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(app); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(app); }
  });
  $("stop").addEventListener("click", () => app.chat.request_stop());
  $("compare").addEventListener("click", () => compare(app));
  $("new-chat").addEventListener("click", () => newChat(app));
  $("reload-model").addEventListener("click", () => reloadModel(app));
  $("long-document").addEventListener("click", fillLongDocument);
  $("export-csv").addEventListener("click", () => exportSteps(app, "csv"));
  $("export-json").addEventListener("click", () => exportSteps(app, "json"));
  $("clear-cache").addEventListener("click", async () => {
    await clearCachedModels();
    await showCache();
  });
  window.demoState.chatReady = true;
}

boot().catch((err) => fail(`Startup failed: ${errorText(err)}`));
