// Boot: load the self-hosted Pyodide and the project's wheel, open WebGPU, load the model, wire
// the controls. Everything comes from this origin: the page works offline. Python does the work
// (chat/page.py: every call takes handles and plain values and returns JSON); the modules here
// keep the DOM: chat_view.js (the chat and the comparison), overlay.js (timings), export.js,
// faults.js (errors, a lost device, long tasks), weights_cache.js, replay.js (decode steps replayed).
import { loadPyodide } from "./pyodide/pyodide.mjs";
import { compare, fillLongDocument, finishReply, addMessage, newChat, send, setBusy, stopRunning } from "./chat_view.js";
import { exportSteps } from "./export.js";
import { deviceLost, errorText, fail, watchLongTasks } from "./faults.js";
import { setUpLab } from "./lab.js";
import { replayComputePasses } from "./replay.js";
import { $, definitionList, MiB, state } from "./ui.js";
import { cacheAvailable, cachedModels, clearCachedModels, loadWeights } from "./weights_cache.js";

globalThis.replayComputePasses = replayComputePasses;  // what Python's BrowserDevice replays decode steps with
window.demoUI = { finishReply, addMessage };  // for the page tests
const params = new URLSearchParams(location.search);
// ?context=N asks for a KV cache of N tokens (the page shows what the model applied).
const REQUESTED_CONTEXT = Number(params.get("context") || 4096);
// ?model=tiny_chat loads random weights behind the same tokenizer (fast page tests on CPU WebGPU).
const MODEL = params.get("model") || "smollm2";
const MODEL_LABEL = MODEL === "smollm2" ? "SmolLM2-135M" : `${MODEL} (random weights)`;
watchLongTasks();

// -- the status list ------------------------------------------------------------------------------
function step(text) {
  for (const li of $("progress").querySelectorAll("li.active")) li.className = "done";
  const li = document.createElement("li");
  li.className = "active";
  li.textContent = text;
  $("progress").append(li);
}

function finishSteps(summary) {
  for (const li of $("progress").querySelectorAll("li.active")) li.className = "done";
  if (summary) {  // folds the status list away once the model is ready
    $("status-summary").textContent = summary;
    $("status-details").open = false;
  }
}

function showAdapter(device, probe) {
  definitionList($("adapter"), [
    ["name", device.adapter], ["backend", device.backend],
    ["shader-f16", device.shader_f16_note],
    ["timestamp-query", device.timestamp_query ? "yes" : "no (no attention timings)"],
    ["subgroups", device.subgroup_min_size
      ? `${device.subgroup_min_size}-${device.subgroup_max_size} invocations (subgroup attention kernels)`
      : "no (shards attention kernels)"],
    ["features", device.features.join(", ")],
  ]);
  const verdict = $("probe-verdict");
  verdict.textContent = probe.ok
    ? `Self-test OK: a TVM-built reduction kernel matches Python's sums (max abs error ${probe.max_abs_error.toExponential(2)}).`
    : `Self-test FAILED: max abs error ${probe.max_abs_error}`;
  verdict.className = probe.ok ? "ok" : "error";
  $("adapter-panel").hidden = false;
}

// -- opening the device and the model ---------------------------------------------------------------
async function openSession(page) {
  const session = await page.open_session(new URL("./artifacts/kernels", location.href).href);
  return { session, device: JSON.parse(page.describe_device(session)) };
}

// Reports a lost device once (chat.page.watch_device runs until then).
function watchDevice(app) {
  app.page.watch_device(app.session, (message) => deviceLost(message, setBusy));
}

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
  state.weights = { source: weights.source, dropped: weights.dropped };
  step(`${MODEL_LABEL}: weights ${weights.source === "cache" ? "from the browser cache" : "downloaded"}` +
       `${weights.dropped ? " (the cached copy did not match its sha256 and was replaced)" : ""}…`);
  await showCache();
  const chat = await page.open_chat(session, base, (message) => step(`${MODEL_LABEL}: ${message}…`),
    JSON.stringify({ max_context: REQUESTED_CONTEXT }), weights.bytes, weights.verified);
  state.info = JSON.parse(page.chat_info(chat));
  return chat;
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
    await stopRunning(app);
    step("Reloading: opening WebGPU again…");
    const { session } = await openSession(app.page);
    const chat = await loadChat(app.page, session);
    app.page.carry_over(app.chat, chat);
    Object.assign(app, { session, chat });
    Object.assign(window.demo, { session, chat });
    watchDevice(app);
    state.deviceLost = null;
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

// What an exported JSON belongs to.
function exportAbout() {
  const device = state.device;
  return { model: MODEL_LABEL, adapter: device.adapter, backend: device.backend, dtype: state.info.dtype,
    max_context: state.info.options.max_context, switch_at: state.info.switch_at };
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
  const page = pyodide.pyimport("chat.page");
  const { session, device } = await openSession(page);
  step("Self-test: running a TVM-built kernel…");
  const probe = JSON.parse(await page.self_test(session));
  showAdapter(device, probe);
  // Handles for the tests and ../shared/tools/gpu-page (the page's own code goes through `page`).
  window.demo = { pyodide, page, session };
  Object.assign(state, { ready: true, device, probe });
  if (params.get("model") === "off") {
    setUpLab({ page, session, chat: null });
    step("Ready (model not loaded: ?model=off).");
    finishSteps("ready (kernels only)");
    return;
  }

  if (!/^[a-z0-9_]+$/.test(MODEL)) { fail(`Unknown model "${MODEL}".`); return; }
  step(`Loading ${MODEL_LABEL}…`);
  const chat = await loadChat(page, session);
  const app = { page, session, chat };
  window.demo.chat = chat;
  watchDevice(app);
  setUpLab(app);
  const ready = `${MODEL_LABEL}, ${state.info.dtype === "float16" ? "f16" : "f32"} kernels, context up to ` +
    `${state.info.options.max_context} tokens`;
  step(`Ready: ${ready}.`);
  finishSteps(`ready: ${ready} (click for the loading steps)`);
  $("chat-panel").hidden = false;
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(app); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(app); }
  });
  $("stop").addEventListener("click", () => app.page.stop_reply(app.chat));
  $("compare").addEventListener("click", () => compare(app));
  $("new-chat").addEventListener("click", () => newChat(app));
  $("reload-model").addEventListener("click", () => reloadModel(app));
  $("long-document").addEventListener("click", fillLongDocument);
  $("export-csv").addEventListener("click", () => exportSteps("csv", exportAbout()));
  $("export-json").addEventListener("click", () => exportSteps("json", exportAbout()));
  $("clear-cache").addEventListener("click", async () => {
    await clearCachedModels();
    await showCache();
  });
  state.chatReady = true;
}

boot().catch((err) => fail(`Startup failed: ${errorText(err)}`));
