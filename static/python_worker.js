// The page's Python, in a dedicated worker: loading Pyodide, checking and uploading the weights,
// compiling pipelines and encoding every pass happen here, so none of it can freeze the page.
// WebGPU, fetch and the Cache API all work in a worker. The DOM stays in main.js, which talks to
// this worker through static/python.js: a message {id, call, args} runs one of `calls` below; it
// answers {id, kind: "done" | "error", value} and, meanwhile, events {id, kind, value} (a text
// piece, a step's stats, a progress line). The Python handles (the Session, the ChatSession) stay
// here; the page only ever sees JSON.
import { loadPyodide } from "./pyodide/pyodide.mjs";
import { replayComputePasses } from "./replay.js";
import { loadWeights } from "./weights_cache.js";

globalThis.replayComputePasses = replayComputePasses;  // what Python's BrowserDevice replays passes with

let pyodide = null;
let page = null;  // the chat.page module: every call below goes through it
const handles = { session: null, chat: null };
let pythonNamespace = null;  // the namespace of `python` calls (the tests' and tools' window.demo.python)

const post = (id, kind, value) => self.postMessage({ id, kind, value });

const calls = {
  async boot(id) {
    post(id, "progress", "Loading Python (Pyodide)…");
    pyodide = await loadPyodide({ indexURL: new URL("./pyodide/", import.meta.url).href });
    post(id, "progress", "Loading the project's wheel…");
    await pyodide.loadPackage("sharded-decode-demo", { messageCallback: () => {} });
    page = pyodide.pyimport("chat.page");
    return true;
  },

  // Opens WebGPU and the kernel artifact (again after a lost device); reports the loss once.
  async openSession(id, { kernelsUrl }) {
    handles.session = await page.open_session(kernelsUrl);
    page.watch_device(handles.session, (message) => post(0, "device-lost", message));
    return page.describe_device(handles.session);
  },

  selfTest: () => page.self_test(handles.session),
  labDefaults: () => page.lab_defaults(handles.session),

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

  reply: (id, { text, request }) => page.chat_reply(handles.chat, text, request,
    (piece) => post(id, "text", piece), (stats) => post(id, "step", stats),
    (done, total) => post(id, "prefill", [done, total])),

  compare: (id, { text, request }) => page.chat_compare(handles.chat, text, request,
    (nest) => post(id, "progress", nest)),

  // Handled while a reply awaits the GPU: the reply stops after its current token or chunk.
  stop: () => { if (handles.chat) page.stop_reply(handles.chat); },
  newChat: () => page.new_chat(handles.chat),

  lab: (id, { request }) => page.kernel_lab(handles.session, handles.chat || undefined, request,
    (row) => post(id, "row", row)),

  // Python source run with `page`, `session` and `chat` in scope (and `values`, converted), in one
  // namespace kept between calls; the result comes back as plain JS. For the tests and the GPU
  // tools, which used to reach into the page's Pyodide directly.
  async python(id, { code, values }) {
    pythonNamespace = pythonNamespace || pyodide.globals.get("dict")();
    pythonNamespace.set("page", page);
    pythonNamespace.set("session", handles.session);
    pythonNamespace.set("chat", handles.chat);
    pythonNamespace.set("values", pyodide.toPy(values || {}));
    const result = await pyodide.runPythonAsync(code, { globals: pythonNamespace });
    return result && typeof result.toJs === "function"
      ? result.toJs({ dict_converter: Object.fromEntries, create_pyproxies: false }) : result;
  },
};

self.onmessage = async ({ data: { id, call, args } }) => {
  try {
    if (!(call in calls)) throw new Error(`no such call: ${call}`);
    post(id, "done", await calls[call](id, args || {}));
  } catch (err) {
    // A Python exception arrives as a PythonError (type: the exception's class); faults.js shows
    // its last line.
    post(id, "error", { message: String((err && err.message) || err), type: err && err.type });
  }
};
