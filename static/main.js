// Bootstrap: load the self-hosted Pyodide and the project's wheel, then hand over to Python
// (app/page.py, app/chat.py). Everything comes from this origin: the page works offline.
// Text from the model or the user is only ever set through textContent, never as HTML.
import { loadPyodide } from "./pyodide/pyodide.mjs";

const $ = (id) => document.getElementById(id);
const progress = $("progress");
const params = new URLSearchParams(location.search);
const MAX_CONTEXT = Number(params.get("context") || 4096);
// ?model=tiny_chat loads random weights behind the same tokenizer (fast page tests on CPU WebGPU).
const MODEL = params.get("model") || "smollm2";
const MODEL_LABEL = MODEL === "smollm2" ? "SmolLM2-135M" : `${MODEL} (random weights)`;
const COLORS = { tiled: "#5aa2ff", sharded: "#ffa04d" };

window.demoState = { ready: false, chatReady: false, busy: false, steps: [], deviceLost: null };

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

function finishSteps() {
  for (const li of progress.querySelectorAll("li.active")) li.className = "done";
}

function fail(message) {
  for (const li of progress.querySelectorAll("li.active")) li.className = "";
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

// -- charts -----------------------------------------------------------------------------------
function drawSteps(canvas, series) {
  // series: [{nest, points: [{x, y}]}]; one polyline per series, points coloured by nest.
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 24;
  ctx.clearRect(0, 0, w, h);
  const all = series.flatMap((s) => s.points);
  if (!all.length) return;
  const minX = Math.min(...all.map((p) => p.x)), maxX = Math.max(...all.map((p) => p.x), minX + 1);
  const maxY = Math.max(...all.map((p) => p.y), 1e-3);
  ctx.strokeStyle = "#888"; ctx.fillStyle = "#aaa"; ctx.font = "10px monospace";
  ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, h - pad); ctx.lineTo(w - 4, h - pad); ctx.stroke();
  ctx.fillText(`${maxY.toFixed(2)} ms`, pad + 2, 12);
  ctx.fillText(`context ${minX}`, pad + 2, h - 8);
  ctx.fillText(`${maxX}`, w - 40, h - 8);
  for (const s of series) {
    ctx.beginPath();
    s.points.forEach((p, i) => {
      const X = pad + ((p.x - minX) / (maxX - minX)) * (w - pad - 6), Y = h - pad - (p.y / maxY) * (h - pad - 8);
      ctx.fillStyle = COLORS[p.nest] || "#ccc";
      ctx.fillRect(X - 1.5, Y - 1.5, 3, 3);
      i ? ctx.lineTo(X, Y) : ctx.moveTo(X, Y);
    });
    ctx.strokeStyle = s.stroke || "#999";
    ctx.stroke();
  }
}

function updateOverlay(stats) {
  const steps = window.demoState.steps;
  steps.push(stats);
  const attn = stats.attention_ms === null ? "n/a" : `${stats.attention_ms.toFixed(3)} ms`;
  $("overlay-last").textContent =
    `${stats.kind} · ctx ${stats.context} · ${stats.variant} · attn ${attn} · step ${stats.step_ms.toFixed(1)} ms`;
  $("overlay-note").textContent = stats.timing_note || "";
  const points = steps.filter((s) => s.attention_ms !== null && s.kind === "decode")
    .map((s) => ({ x: s.context, y: s.attention_ms, nest: s.nest }));
  drawSteps($("overlay-chart"), [{ points, stroke: "#666" }]);
  $("overlay").hidden = false;
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
      $("attention").value, (piece) => { body.textContent += piece; }, (s) => updateOverlay(JSON.parse(s)),
      showPrefill);
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
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = `${result.token_ids.length} tokens · ${result.stop_reason}`;
    bubble.append(meta);
    window.demoState.lastReply = { text: result.text, stop_reason: result.stop_reason };
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
    $("compare-tiled").textContent = result.runs.tiled.text;
    $("compare-sharded").textContent = result.runs.sharded.text;
    $("compare-verdict").textContent = result.identical
      ? "Identical greedy text."
      : `Texts first differ at generated token ${result.first_divergence}.`;
    const series = Object.keys(result.runs).map((nest) => ({
      stroke: COLORS[nest],
      points: result.runs[nest].stats.filter((s) => s.kind === "decode" && s.attention_ms !== null)
        .map((s) => ({ x: s.context, y: s.attention_ms, nest })),
    }));
    drawSteps($("compare-chart"), series);
    window.demoState.lastCompare = { identical: result.identical, first_divergence: result.first_divergence };
  } catch (err) {
    chatError(`Comparison failed: ${errorText(err)}`);
  } finally {
    setBusy(false);
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

async function loadChat(page, session) {
  return page.open_chat(session, new URL(`./artifacts/${MODEL}`, location.href).href,
    (message) => step(`${MODEL_LABEL}: ${message}…`), MAX_CONTEXT);
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
    finishSteps();
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
  if (params.get("model") === "off") { step("Ready (model not loaded: ?model=off)."); finishSteps(); return; }

  if (!/^[a-z0-9_]+$/.test(MODEL)) { fail(`Unknown model "${MODEL}".`); return; }
  step(`Loading ${MODEL_LABEL}…`);
  const chat = await loadChat(page, session);
  const app = { page, session, chat };
  window.demo.chat = chat;
  watchDevice(app, session);
  step(`Ready: ${MODEL_LABEL}, ${device.shader_f16 ? "f16" : "f32"} kernels, context up to ${MAX_CONTEXT} tokens.`);
  finishSteps();
  $("chat-panel").hidden = false;
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(app); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(app); }
  });
  $("stop").addEventListener("click", () => app.chat.request_stop());
  $("compare").addEventListener("click", () => compare(app));
  $("new-chat").addEventListener("click", () => newChat(app));
  $("reload-model").addEventListener("click", () => reloadModel(app));
  window.demoState.chatReady = true;
}

boot().catch((err) => fail(`Startup failed: ${errorText(err)}`));
