// Boot: start the Python worker (static/python_worker.js: the self-hosted Pyodide and the
// project's wheel), open WebGPU there, load the model, wire the controls. Everything comes from
// this origin: the page works offline. Python does the work in the worker (chat/page.py, every
// call returns JSON); this thread only keeps the DOM, so it never waits on Python: chat_view.js
// (the chat and the comparison), overlay.js (timings), export.js, faults.js (errors, a lost
// device, long tasks), weights_cache.js, lab.js.
import { compare, fillLongDocument, finishReply, addMessage, missesText, newChat, send, setBusy, stopRunning, TextStream } from "./chat_view.js";
import { ClockWarm, HOLD_MS } from "./clock_warm.js";
import { exportSteps } from "./export.js";
import { keeper } from "./gguf_keeper.js";
import { deviceLost, errorText, fail, hideError, showError, watchLongTasks } from "./faults.js";
import { setUpLab } from "./lab.js";
import { DEFAULT_MAX_NEW_TOKENS, LAB_MAX_ITERS, MAX_TOP_K, SERVED_MODELS, SWITCH_AT } from "./page_api.js";
import { PythonWorker } from "./python.js";
import { $, definitionList, MiB, state, URL_RUN_OPTIONS } from "./ui.js";
import { cacheAvailable, cachedGgufs, cachedModels, clearCachedModels, GGUF_CHUNK_BYTES } from "./weights_cache.js";

window.demoUI = { finishReply, addMessage, missesText, TextStream };  // for the page tests
const params = new URLSearchParams(location.search);
// ?context=N asks for a KV cache of N tokens (the page shows what the model applied).
const REQUESTED_CONTEXT = Number(params.get("context") || 4096);
// ?model=tiny_chat loads random weights behind the same tokenizer (fast page tests on CPU WebGPU).
// ?model=synthetic:llama-3.1-8b (or llama-3.2-1b) runs that shape with random weights filled on the
// GPU, behind SmolLM2's tokenizer: the shape's real speed with nothing to download.
const MODEL = params.get("model") || "smollm2";
const SYNTHETIC_SHAPE = MODEL.startsWith("synthetic:") ? MODEL.slice("synthetic:".length) : null;
const MODEL_LABEL = SERVED_MODELS[MODEL] ? SERVED_MODELS[MODEL]
  : SYNTHETIC_SHAPE ? `${SYNTHETIC_SHAPE} shape (random weights filled on the GPU; the text is noise)`
  : MODEL;  // an artifact: its manifest says what it was made from (artifactLabel)
// The model's name in the header and the title, the status line and the exports: an artifact by its
// name (artifactLabel), a synthetic model by its shape, a GGUF by its file name and shape (openGguf).
const SYNTHETIC_NAME = `${SYNTHETIC_SHAPE} shape, random weights`;
// ?hooks=python (the tests and benchmarks, whose servers serve them): test hooks the worker loads.
const HOOKS = (params.get("hooks") || "").split(",").filter(Boolean);
// ?keepChunk=BYTES: the chunk an opened GGUF is hashed and stored by in the background (keepGguf).
const KEEP_CHUNK = Number(params.get("keepChunk")) || GGUF_CHUNK_BYTES;
// ?warm=off / ?warm=on: the clock warm while the user types (clock_warm.js; default on a GPU adapter).
const WARM = params.get("warm");
watchLongTasks();

// The runtime's numbers the page shows (chat/api.py, through page_api.js), never copied here.
function showConstants() {
  for (const el of document.querySelectorAll(".switch-at")) el.textContent = String(SWITCH_AT);
  $("long-document").title = `a built-in text of about 1,500 tokens: past the switch at ${SWITCH_AT}`;
  $("max-tokens").value = DEFAULT_MAX_NEW_TOKENS;
  $("top-k").max = MAX_TOP_K;
  $("lab-iters").max = LAB_MAX_ITERS;
}
showConstants();

// The served models as links (this page's URL with ?model=NAME); the one running is not a link.
function showServedModels() {
  const list = $("served-models");
  for (const [name, label] of Object.entries(SERVED_MODELS)) {
    if (list.childElementCount) list.append(" · ");
    const query = new URLSearchParams(location.search);
    query.set("model", name);
    const item = document.createElement(name === MODEL ? "strong" : "a");
    if (name !== MODEL) item.href = `?${query}`;
    item.textContent = label;
    list.append(item);
  }
}
showServedModels();
if (URL_RUN_OPTIONS.attention) $("attention").value = URL_RUN_OPTIONS.attention;  // ?attention=tiled

// The model this page runs, named everywhere the page says what it runs (state.model: the exports'
// too). `model`: {name, kind: "artifact" | "synthetic" | "gguf" | "none", shape, layers, ...}.
function nameModel(model) {
  state.model = model;
  $("model-name").textContent = model.name;  // a file's name is text, never HTML
  document.title = `${model.name} on WebGPU — sharded decode attention, Python in the browser`;
}

// What the URL asks for, named before the model loads (loadChat names what loaded).
nameModel(params.get("model") === "off" ? { name: "Kernels only (no model)", kind: "none" }
  : { name: SYNTHETIC_SHAPE ? SYNTHETIC_NAME : MODEL_LABEL, kind: SYNTHETIC_SHAPE ? "synthetic" : "artifact" });

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

function showAdapter(device, probe, warm) {
  definitionList($("adapter"), [
    ["name", device.adapter], ["backend", device.backend],
    ["shader-f16", device.shader_f16_note],
    ["timestamp-query", !device.timestamp_query ? "no (no attention timings)"
      : device.timestamps_inside_passes
        ? "yes, inside passes (attention timed in sampled steps, inside the step's pass)"
      : "yes, at pass boundaries (attention timed in sampled steps, a pass a layer)"],
    ["subgroups", device.subgroup_min_size
      ? `${device.subgroup_min_size}-${device.subgroup_max_size} invocations (subgroup attention kernels)`
      : "no (shards attention kernels)"],
    ["subgroup matrices", device.subgroup_matrix_configs.length
      ? `${device.subgroup_matrix_configs.join(", ")} (tensor-core prefill matmuls)` : "no (scalar prefill matmuls)"],
    ["clock warm", warm.on ? `${warm.reason}: while you type, a compute kernel keeps the clocks up until ` +
      `${HOLD_MS / 1000} s after the last key, so a reply starts at full clocks` : warm.reason],
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
async function openSession(python) {
  const kernelsUrl = new URL("./artifacts/kernels", location.href).href;
  return JSON.parse(await python.call("openSession", { kernelsUrl }));
}

// What an artifact was made from, as its manifest says: a GGUF (the served SmolLM2, or any file
// `python -m app convert --gguf` converted) or random weights (`convert --random`).
function artifactLabel(manifest) {
  if (SERVED_MODELS[MODEL]) return MODEL_LABEL;
  const source = manifest.source || {};
  return source.file ? `${MODEL} (converted from ${source.file})`
    : source.random_seed !== undefined ? `${MODEL} (random weights)` : MODEL;
}

// The worker fetches the weights (from the browser's cache when it holds this exact file) and
// checks their sha256, while this thread shows a progress bar; then Python checks every tensor and
// uploads it.
async function loadChat(python) {
  if (SYNTHETIC_SHAPE) {
    state.info = JSON.parse(await python.call("openSyntheticChat", {
      shape: SYNTHETIC_SHAPE, tokenizerBase: new URL("./artifacts/smollm2", location.href).href,
      options: JSON.stringify({ ...URL_RUN_OPTIONS, max_context: REQUESTED_CONTEXT }),
    }, { progress: (message) => step(`${MODEL_LABEL}: ${message}…`) }));
    nameModel({ name: SYNTHETIC_NAME, kind: "synthetic", shape: state.info.config, layers: state.info.layers });
    return;
  }
  const base = new URL(`./artifacts/${MODEL}`, location.href).href;
  const response = await fetch(`${base}/manifest.json`);
  if (!response.ok) {
    throw new Error(`cannot fetch ${base}/manifest.json (HTTP ${response.status}); run \`make setup\` on the server`);
  }
  const manifest = await response.json();
  if (!manifest.weights_sha256) {
    throw new Error(`the ${MODEL} artifact predates this page (no weights_sha256); run \`make setup\` on the server`);
  }
  const name = artifactLabel(manifest);
  step(`${name}: weights (${MiB(manifest.total_bytes)} MiB)…`);
  const bar = $("load-bar"), label = $("load-text");
  $("load-progress").hidden = false;
  const stages = { cache: "reading from the browser cache", download: "downloading", verify: "checking sha256" };
  const showWeights = ({ stage, received, total }) => {
    bar.max = total; bar.value = received;
    label.textContent = `${stages[stage]}: ${MiB(received)} / ${MiB(total)} MiB`;
  };
  const fetched = async (weights) => {  // before Python reads them
    $("load-progress").hidden = true;
    state.weights = weights;
    step(`${name}: weights ${weights.source === "cache" ? "from the browser cache" : "downloaded"}` +
         `${weights.dropped ? " (the cached copy did not match its sha256 and was replaced)" : ""}…`);
    await showCache();
  };
  state.info = JSON.parse(await python.call("openChat", {
    base, options: JSON.stringify({ ...URL_RUN_OPTIONS, max_context: REQUESTED_CONTEXT }),
    weights: { url: `${base}/${manifest.weights_file}`, sha256: manifest.weights_sha256, bytes: manifest.total_bytes },
  }, { weights: showWeights, fetched, progress: (message) => step(`${name}: ${message}…`) }));
  nameModel({ name, kind: "artifact", artifact: MODEL, shape: state.info.config, layers: state.info.layers });
}

// A button per GGUF the browser's cache keeps (keepGguf).
async function showCachedGgufs(app) {
  const list = $("cached-ggufs");
  list.replaceChildren();
  for (const cached of await cachedGgufs()) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "cached-gguf";
    button.textContent = `Open ${cached.name} (${MiB(cached.bytes)} MiB, cached)`;
    button.addEventListener("click", () => openGguf(app, null, cached));
    list.append(button);
  }
}

async function showCache() {
  if (state.app) await showCachedGgufs(state.app);
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
    await openSession(app.python);
    await loadChat(app.python);  // the worker carries the conversation over to the new chat
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

// "Open a GGUF…" or a dropped .gguf: the worker reads the File (it never leaves this machine) and
// Python repacks its tensors on the GPU. A file the runtime cannot run is refused with the reason,
// and the model already loaded stays.
// `cached` ({key, name, bytes}) opens a GGUF the browser's cache keeps instead of a File; a File
// that opens is then kept there for the next visit, in the background (keepGguf).
async function openGguf(app, file, cached = null) {
  if (state.busy || state.openingGguf) return;
  const name = cached ? cached.name : file.name, bytes = cached ? cached.bytes : file.size;
  state.openingGguf = true;
  setBusy(true);
  $("open-gguf").disabled = true;
  $("status-details").open = true;
  step(`Opening ${name} (${MiB(bytes)} MiB, ${cached ? "from the browser's cache" : "read in this browser"})…`);
  try {
    await stopRunning(app);
    const options = JSON.stringify({ ...URL_RUN_OPTIONS, max_context: REQUESTED_CONTEXT });
    const progress = { progress: (message) => step(`${name}: ${message}…`) };
    const info = JSON.parse(cached ? await app.python.call("openCachedGguf", { key: cached.key, options }, progress)
      : await app.python.call("openGgufChat", { file, options }, progress));
    state.info = info;
    nameModel({ name: ggufName(name, info), kind: "gguf", file: name, shape: info.config, layers: info.layers });
    const ready = readyText(info);
    step(`Ready: ${ready}.`);
    finishSteps(`ready: ${ready} (click for the loading steps)`);
    hideError();
    state.openingGguf = false;
    setBusy(false);
    if (!cached && cacheAvailable()) keepGguf(file);  // in the background: the chat is ready now
  } catch (err) {
    const message = `Cannot open ${name}: ${errorText(err)}`;
    step(message);
    finishSteps();
    showError(`${message} The model loaded before is still here.`, err);
  } finally {
    state.openingGguf = false;
    $("open-gguf").disabled = false;
    setBusy(false);
  }
}

// Keeps an opened GGUF in the browser's cache for the next visit (static/gguf_keeper.js): its own
// worker hashes and stores it a chunk at a time and waits while a reply runs; the line under the
// GGUF button shows how far it is. ?keepChunk=BYTES sets the chunk (the tests make it small).
async function keepGguf(file) {
  state.keptGguf = null;
  const line = $("keeping");
  keeper.onProgress = ({ stage, done, total, held }) => {
    Object.assign(state.keeping, { stage, done, total, held });
    line.textContent = `Keeping ${file.name} in this browser's cache: ${stage === "hash" ? "hashing" : "storing"} ` +
      `${MiB(done)} of ${MiB(total)} MiB${held ? " (waiting while the page works)" : ""}…`;
  };
  line.hidden = false;
  const keeping = keeper.keep(file, KEEP_CHUNK);
  state.keeping = { name: file.name, stage: "hash", done: 0, total: file.size, held: false, holds: keeper.holds };
  const kept = await keeping;
  if (kept.cancelled) return;  // a file opened later is kept instead
  line.hidden = true;
  state.keptGguf = kept;
  state.keeping.stage = "done";
  step(kept.error ? `${file.name} is not kept in the browser's cache (${kept.error}).`
    : `${file.name} is kept in the browser's cache (chunked sha256 ${kept.sha256.slice(0, 12)}…): the next visit offers it.`);
  finishSteps();
  await showCache();
}

// A GGUF by its file name and the shape it runs as.
function ggufName(file, info) {
  return `${file} (${info.config} shape, ${info.layers} ${info.layers === 1 ? "layer" : "layers"})`;
}

// The status line once a model is ready: its name, chat template, kernels, context and prefill.
function readyText(info) {
  return `${state.model.name}, ${info.chat_template} chat template, ${info.dtype === "float16" ? "f16" : "f32"} ` +
    `kernels, context up to ${info.options.max_context} tokens, prefill on ${info.prefill_matmuls}, ` +
    `weights ${info.weights}`;
}

// What an exported JSON belongs to: the model loaded now (each reply names its own: export.js).
function exportAbout() {
  const device = state.device;
  return { model: state.model, adapter: device.adapter, backend: device.backend, dtype: state.info.dtype,
    max_context: state.info.options.max_context, switch_at: SWITCH_AT };
}

async function boot() {
  if (!("gpu" in navigator)) {
    fail("This browser has no WebGPU (navigator.gpu is missing). Use a recent Chromium-based browser " +
         "with WebGPU enabled (on Linux: --enable-unsafe-webgpu).");
    return;
  }
  const python = new PythonWorker();
  const app = { python };
  python.on["device-lost"] = (message) => deviceLost(message, setBusy);
  const booted = await python.call("boot", { hooks: HOOKS }, { progress: step });
  // The test hooks' calls (app/hooks/), for the tests and benchmarks only: window.demo.python runs
  // Python in the worker with `page`, `session` and `chat` in scope, window.demo.bench a page benchmark
  // (app/page_bench). The page's own code never uses them.
  python.hooks = booted.hooks;
  window.demo = Object.fromEntries(booted.hooks.map((name) => [name, (arg, values) => python.call(name, { arg, values })]));
  step("Opening WebGPU and reading the kernel manifest…");
  const device = await openSession(python);
  step("Self-test: running a TVM-built kernel…");
  const probe = JSON.parse(await python.call("selfTest"));
  const warm = new ClockWarm(() => !state.busy && !state.deviceLost);
  if (params.get("model") !== "off") await warm.open(WARM, device.cpu);
  showAdapter(device, probe, warm.status);
  Object.assign(state, { device, probe, warm: warm.status });
  if (params.get("model") === "off") {
    await setUpLab(app);
    state.ready = true;  // with the lab's controls wired (tools click them as soon as this holds)
    step("Ready (model not loaded: ?model=off).");
    finishSteps("ready (kernels only)");
    return;
  }

  state.ready = true;  // the device and kernels: the model follows
  if (!/^([a-z0-9_]+|synthetic:[a-z0-9_.-]+)$/.test(MODEL)) { fail(`Unknown model "${MODEL}".`); return; }
  step(`Loading ${MODEL_LABEL}…`);
  await loadChat(python);
  await setUpLab(app);
  const ready = readyText(state.info);
  step(`Ready: ${ready}.`);
  finishSteps(`ready: ${ready} (click for the loading steps)`);
  $("chat-panel").hidden = false;
  // Typing keeps the GPU's clocks up; a turn stops that before it starts.
  const start = (turn) => { warm.stop(); turn(app); };
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); start(send); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); start(send); }
  });
  $("prompt").addEventListener("input", () => warm.nudge());
  $("stop").addEventListener("click", () => python.call("stop"));
  $("compare").addEventListener("click", () => start(compare));
  $("new-chat").addEventListener("click", () => newChat(app));
  $("reload-model").addEventListener("click", () => reloadModel(app));
  $("long-document").addEventListener("click", () => { fillLongDocument(); warm.nudge(); });
  $("export-csv").addEventListener("click", () => exportSteps("csv", exportAbout()));
  $("export-json").addEventListener("click", () => exportSteps("json", exportAbout()));
  $("open-gguf").hidden = false;
  state.app = app;
  await showCachedGgufs(app);
  $("open-gguf").addEventListener("click", () => $("gguf-file").click());
  $("gguf-file").addEventListener("change", () => {
    const file = $("gguf-file").files[0];
    $("gguf-file").value = "";
    if (file) openGguf(app, file);
  });
  document.addEventListener("dragover", (e) => e.preventDefault());
  document.addEventListener("drop", (e) => {
    const file = [...(e.dataTransfer?.files || [])].find((f) => f.name.endsWith(".gguf"));
    if (!file) return;
    e.preventDefault();
    openGguf(app, file);
  });
  $("clear-cache").addEventListener("click", async () => {
    await clearCachedModels();
    await showCache();
  });
  state.readyAt = performance.now();  // the tests check the main thread's long tasks up to here
  state.chatReady = true;
}

boot().catch((err) => fail(`Startup failed: ${errorText(err)}`, err));
