"""The Python the page runs under Pyodide: what the worker's calls run (chat/api.py declares them:
each call's function here, its arguments and the events it streams), and nothing else.

Every function here takes and returns plain values or JSON strings, so the JS side never reaches
into Python objects: it holds opaque handles (a Session, a ChatSession) and passes them back.
Everything goes through model_glue's WebGPU seam, so the same functions also run natively (the
tests call them both ways).
"""

from __future__ import annotations

import json
import random
import struct

from model_glue.gpu.artifact import KernelLibrary, http_readers
from model_glue.errors import ModelError
from model_glue.gpu.device import open_device
from model_glue.gpu.webgpu import DeviceLostError

PROBE_ROWS = 8
PROBE_WIDTH = 256
PROBE_SCALE = 0.5
LAB_MAX_ITERS = 200  # the kernel lab's most timed calls per row


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
        return {"got": list(got), "want": want, "max_abs_error": worst, "ok": worst < 1e-4}


# -- opening ----------------------------------------------------------------------------------------
async def open_session(base_url: str) -> Session:
    """Fetch the kernel artifact from the page's origin and open WebGPU."""
    return await Session.open(http_readers(base_url)[0])


# Chromium's Dawn blocklists shader-f16 on NVIDIA (crbug.com/42251215) although the driver supports
# it; this Dawn toggle lifts it (the f16 kernels then ran correctly on an H200, docs/benchmarks.md).
NVIDIA_F16_FLAG = "--enable-dawn-features=vulkan_enable_f16_on_nvidia"


def shader_f16_note(adapter_name: str, has_f16: bool) -> str:
    """What the page says about shader-f16: which kernels run, and on NVIDIA without it, why and the fix."""
    if has_f16:
        return "yes (f16 kernels)"
    if "nvidia" in adapter_name.lower():
        return ("no (f32 kernels): Chromium turns shader-f16 off on NVIDIA GPUs (crbug.com/42251215); start it "
                f"with {NVIDIA_F16_FLAG} to run the f16 kernels")
    return "no (f32 kernels)"


def describe_device(session: Session) -> str:
    """The adapter's name, backend and features, and what the page says about shader-f16 (JSON)."""
    device = session.device
    return json.dumps({**device.describe(), "shader_f16_note": shader_f16_note(device.adapter_name, device.has_f16)})


async def self_test(session: Session) -> str:
    """The probe kernel against Python's sums (JSON)."""
    return json.dumps(await session.run_probe())


async def watch_device(session: Session, on_lost) -> None:
    """Call on_lost(message) once, when the GPU device is lost (driver reset, another tab,
    device.destroy()). Runs until then; the page starts it as a task and does not await it."""
    info = await session.device.lost()
    on_lost(f"The GPU device was lost ({info}). The conversation is kept; reload the model to go on.")


async def open_chat(session: Session, base_url: str, progress, options: str, weights=None, weights_sha256=None):
    """Load the model artifact (weights + tokenizer) served under base_url into a ChatSession.

    `options` are RunOptions as JSON (the page's `?context=` gives max_context). `weights` is the
    weights file the page already fetched (a JS Uint8Array: it streams the download with a progress
    bar and keeps it in the browser's cache). `weights_sha256` is the whole file's sha256 the page
    checked it against: when the manifest gives the same one, the per-tensor hashes, which would
    check the same bytes a second time, are skipped.
    """
    from model_glue.sources import Artifact

    read_text, read_bytes = http_readers(base_url)
    if weights is not None:
        fetched = weights.to_bytes()  # one copy into Python's memory

        async def read_bytes(name: str) -> bytes:  # noqa: F811 (the page's copy replaces the fetch)
            return fetched

    return await _open_chat(session, Artifact((read_text, read_bytes), weights_sha256), options, progress)


async def open_synthetic_chat(session: Session, shape: str, tokenizer_base: str, options: str, progress):
    """A synthetic model of `shape` (e.g. "llama-3.1-8b": `?model=synthetic:llama-3.1-8b`), its random
    weights filled on the GPU, behind the tokenizer served under tokenizer_base: nothing to download."""
    from model_glue.sources import Synthetic

    return await _open_chat(session, Synthetic(shape, http_readers(tokenizer_base)), options, progress)


async def open_gguf_chat(session: Session, file, options: str, progress):
    """A user's GGUF from the page's file picker or a drop: `file` is the browser's File, read range by
    range here in the worker (model_glue.loading.load_gguf_model repacks each tensor on the GPU)."""
    from model_glue.sources import GGUFFile

    async def read(offset: int, nbytes: int) -> bytes:
        buffer = await file.slice(offset, offset + nbytes).arrayBuffer()
        data = buffer.to_bytes()
        if len(data) != nbytes:
            raise ModelError(f"{file.name} is truncated: {nbytes:,} bytes at {offset:,} are past its end")
        return data

    return await _open_chat(session, GGUFFile(read, int(file.size)), options, progress)


async def _open_chat(session: Session, source, options: str, progress):
    from chat.session import ChatSession
    from model_glue.options import RunOptions
    from model_glue.sources import open_model

    return ChatSession(await open_model(session.device, session.library, source,
                                        options=RunOptions.from_json(options), progress=progress))


def chat_info(chat) -> str:
    """What the page shows of a loaded model (JSON): the applied options (the context the KV cache
    really holds), the dtype and the prefill matmuls. The runtime's constants reach the page through chat/api.py."""
    model = chat.model
    return json.dumps({"dtype": model.dtype, "config": model.config_name, "options": model.options.to_json(),
                       "layers": model.config.n_layers, "chat_template": chat.template.family,
                       "prefill_matmuls": prefill_matmuls_note(model), "weights": weights_note(model)})


def weights_note(model) -> str:
    """The weight format of each matrix (contract.model: Q4, Q8, Q8A) and which were quantized at load."""
    from contract.model import layer_matrices, matrix_format

    formats: dict[str, list[str]] = {}
    for matrix in ("embed", *layer_matrices(model.config)):
        formats.setdefault(matrix_format(model.config, matrix).upper(), []).append(matrix)
    note = "; ".join(f"{fmt} {', '.join(names)}" for fmt, names in formats.items())
    if model.requantized:
        note += f" (quantized at load from the file's floats: {', '.join(model.requantized)})"
    return note


def prefill_matmuls_note(model) -> str:
    """Which prefill kernels the model runs, and why not the subgroup-matrix builds."""
    if model.runs_prefill_attention_matrix():
        return "subgroup matrices (tensor cores): matmuls and attention"
    if model.runs_prefill_matrix():
        why = ("prefill_attention_matrix is false" if model.run.prefill_attention_matrix is False
               else "the artifact has no subgroup-matrix build for this shape")
        return f"subgroup matrices (tensor cores): matmuls; scalar attention ({why})"
    if model.has_prefill_matrix:
        return "scalar matmuls (prefill_matrix or fold_norms is false)"
    return f"scalar matmuls: {model.prefill_matrix_why_not or 'the subgroup-matrix builds were not loaded'}"


# -- a chat turn ----------------------------------------------------------------------------------
def _failure(err: Exception) -> str | None:
    """A JSON error for the page if `err` is one a user can act on, else None (a bug: re-raised)."""
    if isinstance(err, DeviceLostError):
        return json.dumps({"error": f"{err}. The conversation is kept; reload the model to go on.",
                           "device_lost": True})
    if isinstance(err, ModelError):
        return json.dumps({"error": str(err)})
    return None


def parse_request(request: str) -> dict:
    """The page's request JSON ({"max_new_tokens", "options": RunOptions fields, "sampling":
    {"temperature", "top_k", "top_p", "seed"}}) as ChatSession.reply's keyword arguments."""
    from model_glue.model.generate import Sampling
    from model_glue.options import RunOptions

    try:
        values = json.loads(request or "{}")
    except ValueError as err:
        raise ModelError(f"bad request: {err}") from err
    try:
        sampling = values.get("sampling") or {}
        seed = sampling.get("seed")
        return {"max_new_tokens": int(values["max_new_tokens"]),
                "options": RunOptions.from_dict(values.get("options") or {}),
                "sampling": Sampling(temperature=float(sampling.get("temperature", 0)),
                                     top_k=int(sampling.get("top_k", 40)), top_p=float(sampling.get("top_p", 1)),
                                     seed=None if seed in (None, "") else int(seed))}
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(f"bad request setting: {err}") from err


async def _as_json(work) -> str:
    """`await work()` as JSON, or the JSON error of a failure a user can act on (a bug is re-raised)."""
    try:
        return json.dumps(await work())
    except Exception as err:
        failure = _failure(err)
        if failure is None:
            raise
        return failure


async def chat_reply(chat, text: str, request: str, on_text, on_step, on_prefill) -> str:
    """One chat turn; streams text pieces, per-step stats (JSON) and prefill progress to JS callbacks."""
    return await _as_json(lambda: chat.reply(text, **parse_request(request), on_text=on_text,
                                             on_step=lambda stats: on_step(json.dumps(stats)), on_prefill=on_prefill))


async def chat_compare(chat, text: str, request: str, on_progress) -> str:
    """The comparison mode: the same prompt, greedy, through each nest (JSON)."""
    async def compare():
        settings = parse_request(request)
        return await chat.compare(text, max_new_tokens=settings["max_new_tokens"], options=settings["options"],
                                  on_progress=on_progress)

    return await _as_json(compare)


def stop_reply(chat) -> None:
    if chat is not None:  # no model loaded (yet): nothing runs
        chat.request_stop()


def new_chat(chat) -> None:
    chat.reset()


def carry_over(old_chat, new_chat) -> None:
    """After the model is reloaded (e.g. the GPU device was lost), keep the conversation."""
    new_chat.messages = list(old_chat.messages)


# -- the kernel lab ------------------------------------------------------------------------------
def lab_defaults(session) -> str:
    """The lab's default contexts and iterations on this adapter, and why they are smaller on a CPU (JSON)."""
    from chat import lab

    cpu = session.device.is_cpu
    return json.dumps({"contexts": list(lab.CPU_LAB_CONTEXTS if cpu else lab.LAB_CONTEXTS),
                       "iters": lab.CPU_ITERS if cpu else lab.ITERS, "max_context": max(lab.LAB_CONTEXTS),
                       "note": ("a CPU rasterizer: small contexts and few iterations by default (each call takes "
                                "milliseconds to seconds)") if cpu else ""})


async def kernel_lab(session, chat, request: str, on_row) -> str:
    """Run the kernel lab (chat.lab) with the page's {"contexts": [...], "iters": n}; streams each
    row (JSON) to on_row; returns the whole result (JSON). `chat` (None: no model loaded) adds the
    loaded model's shape."""
    from chat import lab

    try:
        values = json.loads(request or "{}")
        contexts = [int(c) for c in values.get("contexts") or []]
        iters = int(values.get("iters") or 0) or None
    except (TypeError, ValueError) as err:
        return json.dumps({"error": f"bad lab setting: {err}"})
    if any(not 1 <= c <= max(lab.LAB_CONTEXTS) for c in contexts) or (iters is not None
                                                                     and not 1 <= iters <= LAB_MAX_ITERS):
        return json.dumps({"error": f"contexts must be 1..{max(lab.LAB_CONTEXTS)} tokens and iterations "
                                    f"1..{LAB_MAX_ITERS}"})
    # `chat` is the page's ChatSession, or JS null (Pyodide's JsNull) with ?model=off
    return await _as_json(lambda: lab.run_lab(session, model=getattr(chat, "model", None), contexts=contexts,
                                              iters=iters, on_row=lambda row: on_row(json.dumps(row))))
