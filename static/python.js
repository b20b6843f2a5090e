// The page's side of static/python_worker.js: `python.call(name, args, on)` runs one of the
// worker's calls and resolves with its result; `on` maps event kinds ("text", "step", "progress",
// ...) to handlers for the events the call sends while it runs. Events sent outside any call (the
// device lost) go to `python.on`. Every call, argument and event kind is one chat/api.py declares
// (page_api.js): anything else is refused here, before it reaches the worker.
import { CALLS, GLOBAL_EVENTS } from "./page_api.js";

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
    this.on = {};  // events outside a call (GLOBAL_EVENTS): {"device-lost": (message) => ...}
    this.hooks = [];  // calls a test hook added in the worker (boot's result)
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
    if (id === 0) {
      if (!GLOBAL_EVENTS.includes(kind)) throw new Error(`an undeclared event ${kind} from the worker`);
      if (this.on[kind]) this.on[kind](value);
      return;
    }
    const call = this.calls.get(id);
    if (!call) return;
    if (kind === "done" || kind === "error") {
      this.calls.delete(id);
      if (kind === "done") call.resolve(value); else call.reject(new WorkerError(value));
    } else if (call.on[kind]) {
      call.on[kind](value);
    }
  }

  // Throws unless `name`, `args` and `on` are what chat/api.py declares for this call (or a test
  // hook's call, `hooks`: what the worker's boot said it added).
  check(name, args, on) {
    if (this.hooks.includes(name)) return;
    const call = CALLS[name];
    if (!call) throw new Error(`no such call: ${name} (chat/api.py declares the worker's calls)`);
    const names = (list) => list.slice().sort().join(", ");
    if (names(Object.keys(args)) !== names(call.args)) {
      throw new Error(`call ${name}: arguments {${names(Object.keys(args))}}, chat/api.py declares {${names(call.args)}}`);
    }
    const unknown = Object.keys(on).filter((kind) => !call.events.includes(kind));
    if (unknown.length) throw new Error(`call ${name}: no events ${unknown.join(", ")} (declared: ${call.events.join(", ")})`);
  }

  // `transfer`: ArrayBuffers moved, not copied, to the worker (the weights).
  call(name, args = {}, on = {}, transfer = []) {
    try { this.check(name, args, on); } catch (err) { return Promise.reject(err); }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.calls.set(id, { resolve, reject, on });
      this.worker.postMessage({ id, call: name, args }, transfer);
    });
  }
}
