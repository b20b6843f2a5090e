// The model's weights file, fetched once and kept in the browser's Cache API.
//
// The cache key is the file's URL plus the sha256 its manifest gives, so a re-converted model is a
// new entry and never a stale hit. Every byte is checked against that sha256 whether it came from
// the network or the cache: a cached copy that does not match is dropped and fetched again.
// The download is streamed so the page can show bytes as they arrive.

export const CACHE_NAME = "sharded-decode-demo-weights";
// Where a user's GGUF is kept in the same cache: gguf/<chunked sha256> under the page's folder.
export const GGUF_CACHE_BASE = new URL("./", import.meta.url).href;
export const ggufCacheKey = (sha256) => new URL(`gguf/${sha256}`, GGUF_CACHE_BASE).href;
// A kept GGUF is hashed and stored this many bytes at a time (static/gguf_keeper_worker.js).
export const GGUF_CHUNK_BYTES = 4 << 20;

export const cacheAvailable = () => typeof caches !== "undefined" && !!(crypto && crypto.subtle);

async function sha256Hex(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

// A file's "chunked sha256": the sha256 of its chunks' sha256 digests, concatenated in order (the
// chunks: chunkBytes each, the last one shorter). Only one chunk is in memory at a time, and native
// crypto.subtle hashes it. read(offset, end) returns the file's bytes [offset, end).
export async function chunkedSha256(size, chunkBytes, read) {
  const digests = new Uint8Array(32 * Math.ceil(size / chunkBytes));
  for (let offset = 0, i = 0; offset < size; offset += chunkBytes, i++) {
    const bytes = await read(offset, Math.min(size, offset + chunkBytes));
    digests.set(new Uint8Array(await crypto.subtle.digest("SHA-256", bytes)), 32 * i);
  }
  return sha256Hex(digests);
}

// A served artifact that is missing or damaged: the kind the page tells the user what to do about
// (chat.api.error_help's ArtifactError, the name the runtime's own such errors carry).
function artifactError(message) {
  return Object.assign(new Error(message), { type: "ArtifactError" });
}

// Streams `url` into one Uint8Array of `totalBytes`, calling onBytes(received) as chunks arrive.
async function download(url, totalBytes, onBytes) {
  const response = await fetch(url);
  if (!response.ok) {
    throw artifactError(`cannot fetch ${url} (HTTP ${response.status}); the server's artifact is incomplete: ` +
                    "run `make setup` there, then reload");
  }
  const bytes = new Uint8Array(totalBytes);
  const reader = response.body.getReader();
  let received = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (received + value.length > totalBytes) {
      throw artifactError(`${url} is larger than the ${totalBytes} bytes its manifest gives (re-convert the model)`);
    }
    bytes.set(value, received);
    received += value.length;
    onBytes(received);
  }
  if (received !== totalBytes) {
    throw artifactError(`${url}: got ${received} of ${totalBytes} bytes (the download was cut off)`);
  }
  return bytes;
}

// Returns {bytes, source: "cache" | "network", dropped: bool, verified} for the weights at `url`;
// `verified` is the sha256 the bytes were checked against (null where crypto.subtle is missing).
// onProgress({stage, received, total}) reports "cache", "download" and "verify" stages.
export async function loadWeights(url, sha256, totalBytes, onProgress) {
  const key = `${url}?sha256=${sha256}`;
  const cache = cacheAvailable() ? await caches.open(CACHE_NAME) : null;
  let dropped = false;
  if (cache) {
    const hit = await cache.match(key);
    if (hit) {
      onProgress({ stage: "cache", received: 0, total: totalBytes });
      const bytes = new Uint8Array(await hit.arrayBuffer());
      onProgress({ stage: "verify", received: bytes.length, total: totalBytes });
      if (bytes.length === totalBytes && (await sha256Hex(bytes)) === sha256) {
        return { bytes, source: "cache", dropped, verified: sha256 };
      }
      await cache.delete(key);  // corrupted or truncated: fetch it again
      dropped = true;
    }
  }
  const bytes = await download(url, totalBytes, (received) => onProgress({ stage: "download", received, total: totalBytes }));
  if (cacheAvailable()) {
    onProgress({ stage: "verify", received: totalBytes, total: totalBytes });
    const got = await sha256Hex(bytes);
    if (got !== sha256) {
      throw artifactError(`${url} does not match the sha256 in its manifest (${got.slice(0, 12)}… instead of ` +
                      `${sha256.slice(0, 12)}…): the served artifact is corrupted; run \`make setup\` on the server`);
    }
  }
  if (cache) {
    for (const old of await cache.keys()) {  // an older conversion of the same file
      if (old.url.startsWith(`${url}?`) && old.url !== key) await cache.delete(old);
    }
    try {
      await cache.put(key, new Response(bytes, { headers: {
        "Content-Type": "application/octet-stream", "X-Weights-Bytes": String(bytes.length) } }));
    } catch (err) {  // e.g. over the storage quota: the model still loads, just not cached
      console.warn(`could not cache ${url}: ${err}`);
    }
  }
  return { bytes, source: "network", dropped, verified: cacheAvailable() ? sha256 : null };
}

// Bytes held in this page's weights cache (entries and their sizes).
export async function cachedModels() {
  if (!cacheAvailable() || !(await caches.has(CACHE_NAME))) return [];
  const cache = await caches.open(CACHE_NAME);
  const entries = [];
  for (const request of await cache.keys()) {
    const response = await cache.match(request);
    entries.push({ url: request.url, bytes: Number(response.headers.get("X-Weights-Bytes")) });
  }
  return entries;
}

export async function clearCachedModels() {
  if (cacheAvailable()) await caches.delete(CACHE_NAME);
}

// The GGUFs this page keeps (static/gguf_keeper.js): [{key, name, bytes}], the latest first.
export async function cachedGgufs() {
  if (!cacheAvailable() || !(await caches.has(CACHE_NAME))) return [];
  const cache = await caches.open(CACHE_NAME);
  const found = [];
  for (const request of await cache.keys()) {
    if (!request.url.startsWith(`${GGUF_CACHE_BASE}gguf/`)) continue;
    const response = await cache.match(request);
    found.push({ key: request.url, name: response.headers.get("X-GGUF-Name") || "cached.gguf",
      bytes: Number(response.headers.get("X-Weights-Bytes")) });
  }
  return found.reverse();
}
