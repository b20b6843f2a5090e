// Keeps a user's GGUF in the browser's Cache API, in a worker of its own: the Python worker that
// encodes the decode steps never reads, hashes or stores the file (static/gguf_keeper.js starts it).
// One chunk of the file is in memory at a time, and no chunk starts while the page holds the work
// (a reply, a comparison, the kernel lab, opening a model): a reply runs as fast as with nothing
// in the background.
//
// Messages in: {type: "keep", file, chunkBytes}, {type: "hold"}, {type: "release"}.
// Messages out: {type: "progress", stage: "hash" | "store", done, total, held} (about one per
// percent, and at each hold and release) and, once, {type: "done", sha256, key, reused} or
// {type: "done", error}.
import { CACHE_NAME, chunkedSha256, ggufCacheKey } from "./weights_cache.js";

let held = false;
let wake = null;  // resolves the wait of the chunk that found the work held
let status = { stage: "hash", done: 0, total: 0 };

function report(force = false) {
  const step = Math.max(1, Math.floor(status.total / 100));
  if (force || status.done === status.total || Math.floor(status.done / step) !== Math.floor(status.last / step)) {
    self.postMessage({ type: "progress", ...status, held });
  }
  status.last = status.done;
}

// Resolves when the work is not held (at once, unless the page holds it).
async function whenReleased() {
  while (held) await new Promise((resolve) => { wake = resolve; });
}

// The file's bytes [offset, end) once the work is not held.
async function readChunk(file, offset, end) {
  await whenReleased();
  return new Uint8Array(await file.slice(offset, end).arrayBuffer());
}

async function keep(file, chunkBytes) {
  const size = file.size;
  status = { stage: "hash", done: 0, total: size, last: 0 };
  const sha256 = await chunkedSha256(size, chunkBytes, async (offset, end) => {
    const bytes = await readChunk(file, offset, end);
    status.done = end;
    report();
    return bytes;
  });
  const key = ggufCacheKey(sha256);
  const cache = await caches.open(CACHE_NAME);
  if (await cache.match(key)) return { sha256, key, reused: true };  // kept by an earlier visit
  status = { stage: "store", done: 0, total: size, last: 0 };
  report(true);
  // The body is pulled a chunk at a time (highWaterMark 0: nothing read ahead of the cache's writes).
  let offset = 0;
  const body = new ReadableStream({
    async pull(controller) {
      if (offset >= size) { controller.close(); return; }
      const end = Math.min(size, offset + chunkBytes);
      controller.enqueue(await readChunk(file, offset, end));
      offset = status.done = end;
      report();
    },
  }, { highWaterMark: 0 });
  try {
    await cache.put(key, new Response(body, { headers: {
      "Content-Type": "application/octet-stream", "X-Weights-Bytes": String(size), "X-GGUF-Name": file.name } }));
  } catch (err) {  // over the storage quota: the model runs, it is just not kept
    return { sha256, error: String(err) };
  }
  return { sha256, key, reused: false };
}

self.onmessage = ({ data }) => {
  if (data.type === "hold" || data.type === "release") {
    held = data.type === "hold";
    if (!held && wake) { wake(); wake = null; }
    report(true);
  } else if (data.type === "keep") {
    keep(data.file, data.chunkBytes).then((result) => self.postMessage({ type: "done", ...result }),
      (err) => self.postMessage({ type: "done", error: String((err && err.message) || err) }));
  }
};
