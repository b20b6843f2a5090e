// The page's side of static/gguf_keeper_worker.js: keeps the GGUF a user opened in the browser's
// cache for the next visit, in the background, off the Python worker. `hold(reason, on)` pauses the
// work while any reason holds it (a reply, a comparison, the lab, opening a model); the worker then
// starts no chunk until every reason is released.
import { GGUF_CHUNK_BYTES } from "./weights_cache.js";

class GgufKeeper {
  constructor() {
    this.onProgress = () => {};  // ({stage, done, total, held}) as the worker reports it (main.js sets it)
    this.reasons = new Set();
    this.worker = null;
    // Each hold as the worker saw it: {stage, heldAt, releasedAt} (bytes done in that stage).
    this.holds = [];
  }

  // Keeps `file`; resolves with {sha256, key, reused}, {sha256?, error}, or {cancelled: true} when
  // a later keep replaced it (the Cache API commits an entry only when its body is complete).
  keep(file, chunkBytes = GGUF_CHUNK_BYTES) {
    this.cancel();
    this.holds = [];
    const worker = this.worker = new Worker(new URL("./gguf_keeper_worker.js", import.meta.url), { type: "module" });
    return new Promise((resolve) => {
      this.settle = (result) => { this.finish(worker); resolve(result); };
      worker.onmessage = ({ data }) => {
        if (data.type === "progress") {
          this.noteHold(data);
          this.onProgress(data);
        } else {
          this.settle(data);
        }
      };
      worker.onerror = (event) => {
        event.preventDefault();
        this.settle({ error: `the caching worker failed: ${event.message || "it could not start"}` });
      };
      worker.postMessage({ type: "keep", file, chunkBytes });
      if (this.reasons.size) worker.postMessage({ type: "hold" });
    });
  }

  hold(reason, on) {
    const wasHeld = this.reasons.size > 0;
    if (on) this.reasons.add(reason); else this.reasons.delete(reason);
    const held = this.reasons.size > 0;
    if (this.worker && held !== wasHeld) this.worker.postMessage({ type: held ? "hold" : "release" });
  }

  cancel() {
    if (this.worker) this.settle({ cancelled: true });
  }

  finish(worker) {
    worker.terminate();
    if (this.worker === worker) this.worker = null;
  }

  noteHold({ stage, done, held }) {
    const last = this.holds.at(-1);
    if (held && (!last || last.releasedAt !== null || last.stage !== stage)) {
      this.holds.push({ stage, heldAt: done, releasedAt: null });
    } else if (!held && last && last.releasedAt === null && last.stage === stage) {
      last.releasedAt = done;
    }
  }
}

// The page's one keeper: chat_view.js holds it while the page is busy, lab.js while the lab runs.
export const keeper = new GgufKeeper();
