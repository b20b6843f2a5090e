// The page's side of static/python_worker.js: `python.call(name, args, on)` runs one of the
// worker's calls and resolves with its result; `on` maps event kinds ("text", "step", "progress",
// ...) to handlers for the events the call sends while it runs. Events sent outside any call (the
// device lost) go to `python.on`.

// A failure inside the worker, rebuilt here; `type` is the Python exception's class when Python
// raised it (faults.js's errorText then shows the traceback's last line).
class WorkerError extends Error {
  constructor({ message, type }) {
    super(message);
    this.type = type;
  }
}

export class PythonWorker {
  constructor() {
    this.worker = new Worker(new URL("./python_worker.js", import.meta.url), { type: "module" });
    this.calls = new Map();  // id -> {resolve, reject, on}
    this.nextId = 1;
    this.on = {};  // events outside a call: {"device-lost": (message) => ...}
    this.worker.onmessage = ({ data: { id, kind, value } }) => this.receive(id, kind, value);
    // A worker that cannot even start (a script error) fails every call still waiting.
    this.worker.onerror = (event) => {
      event.preventDefault();
      const err = new Error(`the Python worker failed: ${event.message || "it could not start"}`);
      for (const { reject } of this.calls.values()) reject(err);
      this.calls.clear();
    };
  }

  receive(id, kind, value) {
    if (id === 0) { if (this.on[kind]) this.on[kind](value); return; }
    const call = this.calls.get(id);
    if (!call) return;
    if (kind === "done" || kind === "error") {
      this.calls.delete(id);
      if (kind === "done") call.resolve(value); else call.reject(new WorkerError(value));
    } else if (call.on[kind]) {
      call.on[kind](value);
    }
  }

  // `transfer`: ArrayBuffers moved, not copied, to the worker (the weights).
  call(name, args = {}, on = {}, transfer = []) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.calls.set(id, { resolve, reject, on });
      this.worker.postMessage({ id, call: name, args }, transfer);
    });
  }
}
