// The page's Python, in a dedicated worker: loading Pyodide, checking and uploading the weights,
// compiling pipelines and encoding every pass happen here, so none of it can freeze the page.
// WebGPU, fetch and the Cache API all work in a worker. The DOM stays in main.js, which talks to
// this worker through static/python.js: a message {id, call, args} runs one of the calls chat/api.py
// declares (static/page_api.js, generated): its chat.page function gets the handles it names, its
// arguments and one callback per event kind. It answers {id, kind: "done" | "error", value} and,
// meanwhile, events {id, kind, value} (a text piece, a step's stats, a progress line). The Python
// handles (the Session, the ChatSession) stay here; the page only ever sees JSON.
import { loadPyodide } from "./pyodide/pyodide.mjs";
import { CALLS, HOOKS_PATH } from "./page_api.js";
import { mapForReading, replayComputePasses } from "./replay.js";
import { CACHE_NAME as WEIGHTS_CACHE, loadWeights } from "./weights_cache.js";

globalThis.replayComputePasses = replayComputePasses;  // what Python's BrowserDevice replays passes with
globalThis.mapForReading = mapForReading;  // and asks for its readbacks' maps with

let pyodide = null;
let page = null;  // the chat.page module: every call goes through it
const handles = { session: null, chat: null };
const hookCalls = {};  // calls a test hook adds (boot's `hooks`); never in the served tree

const post = (id, kind, value) => self.postMessage({ id, kind, value });

// A declared call: its chat.page function with the handles, the arguments and the event callbacks
// chat/api.py names, in that order (a handle not opened yet is Python's None). An event callback
// Python calls with several values (on_prefill(done, total)) posts them as an array.
function runDeclared(id, call, args) {
  const events = call.events.map((kind) => (...values) => post(id, kind, values.length === 1 ? values[0] : values));
  return page[call.function](...call.handles.map((h) => handles[h] ?? undefined), ...call.args.map((a) => args[a]),
    ...events);
}

// The calls chat/api.py marks `worker`: more than one chat.page function.
const own = {
  // Loads Pyodide and the project's wheel; then the test hooks the page asks for (`hooks`: names of
  // modules under HOOKS_PATH, which only the tests' and the benchmarks' servers serve).
  async boot(id, { hooks }) {
    post(id, "progress", "Loading Python (Pyodide)…");
    pyodide = await loadPyodide({ indexURL: new URL("./pyodide/", import.meta.url).href });
    post(id, "progress", "Loading the project's wheel…");
    await pyodide.loadPackage("sharded-decode-demo", { messageCallback: () => {} });
    page = pyodide.pyimport("chat.page");
    for (const name of hooks || []) {
      if (!/^[a-z_]+$/.test(name)) throw new Error(`bad hook name ${JSON.stringify(name)}`);
      let hook;
      try {
        hook = await import(new URL(`./${HOOKS_PATH}${name}.js`, import.meta.url).href);
      } catch (err) {
        throw new Error(`the page asked for the test hook "${name}", which this server does not serve ` +
          `(python -m app serve never does): ${err.message || err}`);
      }
      Object.assign(hookCalls, await hook.install({ pyodide, page, handles }));
    }
    return { hooks: Object.keys(hookCalls) };
  },

  // Opens WebGPU and the kernel artifact (again after a lost device); reports the loss once.
  async openSession(id, { kernelsUrl }) {
    handles.session = await page.open_session(kernelsUrl);
    page.watch_device(handles.session, (message) => post(0, "device-lost", message));
    return page.describe_device(handles.session);
  },

  // Loads the model: the weights file (weights: {url, sha256, bytes}) through the browser's cache,
  // its progress as "weights" events (about one per percent), then Python. After a reload the
  // conversation carries over from the chat it replaces.
  async openChat(id, { base, options, weights }) {
    let shown = -1;
    const loaded = await loadWeights(weights.url, weights.sha256, weights.bytes, (progress) => {
      const percent = Math.floor((100 * progress.received) / progress.total);
      if (percent !== shown || progress.stage !== "download") post(id, "weights", progress);
      shown = percent;
    });
    post(id, "fetched", { source: loaded.source, dropped: loaded.dropped });
    const chat = await page.open_chat(handles.session, base, (message) => post(id, "progress", message), options,
      loaded.bytes, loaded.verified);
    if (handles.chat) page.carry_over(handles.chat, chat);
    handles.chat = chat;
    return page.chat_info(chat);
  },

  // A synthetic model of a contract shape: its weights are filled on the GPU (nothing to fetch or
  // cache); the tokenizer comes from tokenizerBase.
  async openSyntheticChat(id, { shape, tokenizerBase, options }) {
    const chat = await page.open_synthetic_chat(handles.session, shape, tokenizerBase, options,
      (message) => post(id, "progress", message));
    if (handles.chat) page.carry_over(handles.chat, chat);
    handles.chat = chat;
    return page.chat_info(chat);
  },

  // A user's GGUF: the File stays in this worker, read a range at a time by Python.
  async openGgufChat(id, { file, options }) {
    const chat = await page.open_gguf_chat(handles.session, file, options, (message) => post(id, "progress", message));
    if (handles.chat) page.carry_over(handles.chat, chat);
    handles.chat = chat;
    return page.chat_info(chat);
  },

  // A GGUF the Cache API keeps: its bytes (a Blob backed by the cache) go through openGgufChat's path.
  async openCachedGguf(id, { key, options }) {
    const hit = await (await caches.open(WEIGHTS_CACHE)).match(key);
    if (!hit) throw new Error("that GGUF is no longer in the browser's cache");
    const file = new File([await hit.blob()], hit.headers.get("X-GGUF-Name") || "cached.gguf");
    return own.openGgufChat(id, { file, options });
  },
};

// The declaration and this file agree, or the worker refuses to start (every call then fails).
for (const [name, call] of Object.entries(CALLS)) {
  if (call.worker !== (name in own)) throw new Error(`chat/api.py and python_worker.js disagree on the call ${name}`);
}
for (const name of Object.keys(own)) if (!(name in CALLS)) throw new Error(`python_worker.js: ${name} is not declared`);

function run(id, name, args) {
  if (name in hookCalls) return hookCalls[name](id, args);
  const call = CALLS[name];
  if (!call) throw new Error(`no such call: ${name}`);
  return call.worker ? own[name](id, args) : runDeclared(id, call, args);
}

self.onmessage = async ({ data: { id, call, args } }) => {
  try {
    post(id, "done", await run(id, call, args || {}));
  } catch (err) {
    // A Python exception arrives as a PythonError (type: the exception's class); faults.js shows
    // its last line.
    post(id, "error", { message: String((err && err.message) || err), type: err && err.type });
  }
};
