"""The Python the page runs under Pyodide (the JS bootstrap only loads it and calls in here).

Everything goes through model_glue's WebGPU seam, so the same functions also run natively
(the tests call them both ways).
"""

from __future__ import annotations

import base64
import random
import struct

from model_glue.artifact import KernelLibrary
from model_glue.webgpu import open_device

PROBE_ROWS = 8
PROBE_WIDTH = 256
PROBE_SCALE = 0.5


class Session:
    """One page session: the device and the kernel library, opened once."""

    def __init__(self, device, library):
        self.device = device
        self.library = library

    @classmethod
    async def open(cls, read_text) -> "Session":
        device = await open_device()
        library = await KernelLibrary.load(device, read_text)
        return cls(device, library)

    async def run_probe(self, seed: int = 0) -> dict:
        """Row sums through the TVM-built probe kernel, checked against Python's own sums."""
        rng = random.Random(seed)
        rows = [[rng.uniform(-1, 1) for _ in range(PROBE_WIDTH)] for _ in range(PROBE_ROWS)]
        flat = struct.pack(f"<{PROBE_ROWS * PROBE_WIDTH}f", *(v for row in rows for v in row))
        x = self.device.storage_buffer(len(flat), flat)
        out = self.device.storage_buffer(PROBE_ROWS * 4)
        kernel = await self.library.kernel("row_sum_probe")
        bound = kernel.bind({"x": x, "out": out}, {"n": PROBE_ROWS, "scale": PROBE_SCALE})
        batch = self.device.batch()
        bound.dispatch(batch)
        batch.submit()
        got = struct.unpack(f"<{PROBE_ROWS}f", await self.device.read(out, PROBE_ROWS * 4))
        # f32 rounding of the inputs, then a sum in double: the GPU's tree order differs slightly.
        f32_rows = struct.unpack(f"<{PROBE_ROWS * PROBE_WIDTH}f", flat)
        want = [PROBE_SCALE * sum(f32_rows[r * PROBE_WIDTH:(r + 1) * PROBE_WIDTH]) for r in range(PROBE_ROWS)]
        worst = max(abs(g - w) for g, w in zip(got, want))
        return {"got": list(got), "want": want, "max_abs_error": worst, "ok": worst < 1e-4,
                "device": self.device.describe()}

    async def compile_kernels(self, names=None) -> dict:
        """Compile kernels with this device's shader compiler; returns {name: error} for failures.

        All compiles are started at once: the browser builds async pipelines on worker threads.
        """
        import asyncio

        wanted = [n for n in (names or list(self.library.specs))
                  if set(self.library.specs[n].features) <= self.device.features]
        results = await asyncio.gather(*(self.library.kernel(n) for n in wanted), return_exceptions=True)
        return {n: str(r) for n, r in zip(wanted, results) if isinstance(r, Exception)}

    async def run_kernel_b64(self, name: str, buffers: dict, values: dict, outputs: dict) -> dict:
        """Run one kernel on base64-encoded input buffers; returns the named outputs in base64.

        `outputs` maps buffer name -> byte size. The tests use this to check kernels inside
        the browser against the same f64 references as natively.
        """
        kernel = await self.library.kernel(name)
        gpu_buffers = {}
        for buffer_name, data in buffers.items():
            raw = base64.b64decode(data)
            gpu_buffers[buffer_name] = self.device.storage_buffer(len(raw), raw)
        for buffer_name, nbytes in outputs.items():
            gpu_buffers[buffer_name] = self.device.storage_buffer(nbytes)
        bound = kernel.bind(gpu_buffers, values)
        batch = self.device.batch()
        bound.dispatch(batch)
        batch.submit()
        return {n: base64.b64encode(await self.device.read(gpu_buffers[n], size)).decode() for n, size in outputs.items()}


async def open_chat(session: Session, base_url: str, progress, max_context: int = 4096, weights=None,
                    weights_sha256=None):
    """Load the model artifact (weights + tokenizer) served under base_url into a ChatSession.

    `weights` is the weights file the page already fetched (a JS Uint8Array: it streams the
    download with a progress bar and keeps it in the browser's cache). `weights_sha256` is the
    whole file's sha256 the page checked it against: when the manifest gives the same one, the
    per-tensor hashes, which would check the same bytes a second time, are skipped.
    """
    from app.chat import ChatSession
    from model_glue.artifact import http_readers

    read_text, read_bytes = http_readers(base_url)
    if weights is not None:
        fetched = weights.to_bytes()  # one copy into Python's memory

        async def read_bytes(name: str) -> bytes:  # noqa: F811 (the page's copy replaces the fetch)
            return fetched

    return await ChatSession.load(session.device, session.library, (read_text, read_bytes),
                                  max_context=max_context, progress=progress, verified_sha256=weights_sha256)


async def open_session(base_url: str) -> Session:
    """Called by the JS bootstrap: fetch the artifact from the page's origin and open WebGPU."""
    from model_glue.artifact import http_readers

    return await Session.open(http_readers(base_url)[0])


# -- thin JSON wrappers the JS bootstrap calls (no proxies to manage on the JS side) -------------
def _failure(err: Exception) -> str | None:
    """A JSON error for the page if `err` is one a user can act on, else None (a bug: re-raised)."""
    import json

    from model_glue.model import ModelError
    from model_glue.webgpu import DeviceLostError

    if isinstance(err, DeviceLostError):
        return json.dumps({"error": f"{err}. The conversation is kept; reload the model to go on.",
                           "device_lost": True})
    if isinstance(err, ModelError):
        return json.dumps({"error": str(err)})
    return None


def sampling_from_json(settings: str):
    """The page's sampling controls ({"temperature", "top_k", "top_p", "seed"}) as a Sampling."""
    import json

    from model_glue.model import ModelError, Sampling

    values = json.loads(settings or "{}")
    try:
        seed = values.get("seed")
        return Sampling(temperature=float(values.get("temperature", 0)), top_k=int(values.get("top_k", 40)),
                        top_p=float(values.get("top_p", 1)), seed=None if seed in (None, "") else int(seed))
    except (TypeError, ValueError) as err:
        raise ModelError(f"bad sampling setting: {err}") from err


async def chat_reply(chat, text: str, max_new_tokens: int, attention: str, sampling: str, on_text, on_step,
                     on_prefill) -> str:
    """One chat turn; streams text pieces, per-step stats (JSON) and prefill progress to JS callbacks."""
    import json

    try:
        result = await chat.reply(text, max_new_tokens=int(max_new_tokens), attention=attention,
                                  sampling=sampling_from_json(sampling), on_text=on_text,
                                  on_step=lambda stats: on_step(json.dumps(stats)), on_prefill=on_prefill)
    except Exception as err:
        failure = _failure(err)
        if failure is None:
            raise
        return failure
    return json.dumps(result)


async def chat_compare(chat, text: str, max_new_tokens: int, on_progress) -> str:
    import json

    try:
        return json.dumps(await chat.compare(text, max_new_tokens=int(max_new_tokens), on_progress=on_progress))
    except Exception as err:
        failure = _failure(err)
        if failure is None:
            raise
        return failure


def new_chat(chat) -> None:
    chat.reset()


def carry_over(old_chat, new_chat) -> None:
    """After the model is reloaded (e.g. the GPU device was lost), keep the conversation."""
    new_chat.messages = list(old_chat.messages)


async def decode_encode_benchmark(chat, steps: int, replay: bool) -> str:
    """`steps` greedy decode steps from a one-token prompt; per step the host's encode time (JSON).

    With `replay` false every pass is encoded in Python, the way the native path's first step is;
    with it true, decode steps replay the recorded passes in one call into JS (static/replay.js).
    The chat's KV cache is emptied (its next reply prefills the conversation again).
    """
    import json

    from model_glue.model import generate

    model = chat.model
    model.reset()
    model.replay_recorded = bool(replay)
    try:
        run = await generate(model, [chat.tokenizer.bos_id or 1], max_new_tokens=int(steps) + 1)
    finally:
        model.replay_recorded = True
        model.reset()
    decode = [s for s in run.stats if s.kind == "decode"]
    return json.dumps({"replay": bool(replay), "token_ids": run.token_ids,
                       "encode_ms": [s.encode_ms for s in decode], "step_ms": [s.step_ms for s in decode],
                       "gpu_ms": [s.gpu_ms for s in decode], "dispatches": [s.dispatches for s in decode],
                       "replayed_by": model.replayed_by if replay else None})
