"""The kernel lab: the seed's experiment on the visitor's own GPU, in the page.

For each benchmark shape (and the loaded model's) and each context, one decode step's attention for
one layer (batch 1) through TVM's tiled nest, the sharded family as the host picks it for this
adapter (layout and splits), and the host's automatic choice: GPU time per call (median of
`iters` timestamped calls, the fastest of ROUNDS rounds), per decode step for the model's layers,
KV bytes read per second, and the tiled/sharded ratio next to the seed's. Each row is checked once,
before it is timed, against a float64 reference computed here in Python for REFERENCE_HEADS query
heads: a wrong row is reported wrong and not timed.

Standard library only (the page has no numpy): random K/V come from random bytes whose exponent
bits are set so every value is +-[0.5, 2), which keeps q.k moderate; decoding rows for the
reference uses memoryview casts.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from array import array

from contract.attention import MAX_SPLITS, AttentionChoice
from contract.kernels import PAGE_SIZE, SPLIT_WORKSPACE
from contract.model import BENCH_SHAPES, DTYPE_BYTES, AttentionShape
from model_glue.model.attention import attention_call, attention_dispatches, resolve_attention_kernels, split_workspace_bytes
from model_glue.policy import choose_decode_attention

LAB_CONTEXTS = (256, 1024, 3060, 8192)
CPU_LAB_CONTEXTS = (64, 300)  # a CPU rasterizer takes seconds per call beyond these
ITERS, CPU_ITERS = 20, 3
ROUNDS, CPU_ROUNDS = 3, 1
WARMUP_CALLS, CPU_WARMUP_CALLS = 4, 1
REFERENCE_HEADS = 2  # the first and the last query head (the last is where a GQA mapping goes wrong)
TOLERANCE = {"float16": 5e-3, "float32": 1e-4}  # relative L2 vs the f64 reference (f16: output rounding)
LAYERS = 32  # the benchmark shapes are timed per decode step of a 32-layer model (Llama-3.1-8B has 32)
# The seed's tiled / sharded ratios at 3,060 tokens (Apple M4 Max in Chrome), by head_dim.
SEED_RATIOS = {64: 2.9, 128: 4.0, 256: 3.4}
SEED_CONTEXT = 3060
NESTS = ("tiled", "sharded", "auto")


def random_values(count: int, dtype: str, rng: random.Random) -> bytes:
    """`count` little-endian f16/f32 values, each +-[0.5, 2): random bits with the exponent forced."""
    raw = bytearray(rng.randbytes(count * DTYPE_BYTES[dtype]))
    if dtype == "float16":  # sign, exponent 01110 or 01111: high byte 0b s011 10mm / s011 11mm
        raw[1::2] = raw[1::2].translate(bytes((b & 0x87) | 0x38 for b in range(256)))
    else:  # sign, exponent 0111 1110 or 0111 1111: high byte s0111111, next byte's top bit free
        raw[3::4] = raw[3::4].translate(bytes((b & 0x80) | 0x3F for b in range(256)))
    return bytes(raw)


class LabInputs:
    """One sequence of `context` tokens on shuffled pages, its query, and the f64 reference output
    of REFERENCE_HEADS query heads."""

    def __init__(self, shape: AttentionShape, context: int, dtype: str, seed: int):
        rng = random.Random(seed)
        self.shape, self.context, self.dtype = shape, context, dtype
        self.num_pages = (context + PAGE_SIZE - 1) // PAGE_SIZE
        self.page_ids = list(range(self.num_pages))
        rng.shuffle(self.page_ids)  # logical page i lives at physical page page_ids[i]
        self.q = random_values(shape.num_qo_heads * shape.head_dim, dtype, rng)
        self.pages = random_values(self.num_pages * 2 * shape.num_kv_heads * PAGE_SIZE * shape.head_dim, dtype, rng)
        self.sm_scale = shape.head_dim ** -0.5
        last = shape.num_qo_heads - 1
        self.heads = sorted({0, last})[:REFERENCE_HEADS]
        self.reference = {h: self._reference_head(h) for h in self.heads}

    def _values(self, data: bytes):
        return memoryview(data).cast("e" if self.dtype == "float16" else "f")

    def _row(self, pages, token: int, kv: int, kv_head: int) -> list[float]:
        """K (kv=0) or V (kv=1) of one token and KV head, from the paged layout."""
        s = self.shape
        page = self.page_ids[token // PAGE_SIZE]
        start = (((page * 2 + kv) * s.num_kv_heads + kv_head) * PAGE_SIZE + token % PAGE_SIZE) * s.head_dim
        return pages[start:start + s.head_dim].tolist()

    def _reference_head(self, head: int) -> list[float]:
        s = self.shape
        kv_head = head // s.group
        q = self._values(self.q)[head * s.head_dim:(head + 1) * s.head_dim].tolist()
        pages = self._values(self.pages)
        scores = [self.sm_scale * math.fsum(a * b for a, b in zip(q, self._row(pages, t, 0, kv_head)))
                  for t in range(self.context)]
        top = max(scores)
        weights = [math.exp(x - top) for x in scores]
        total = math.fsum(weights)
        out = [0.0] * s.head_dim
        for t, w in enumerate(weights):
            for d, v in enumerate(self._row(pages, t, 1, kv_head)):
                out[d] += w * v
        return [x / total for x in out]

    def relative_error(self, output: bytes) -> float:
        """Relative L2 of the kernel's output over the reference heads."""
        s, got = self.shape, self._values(output)
        num = den = 0.0
        for h, want in self.reference.items():
            row = got[h * s.head_dim:(h + 1) * s.head_dim].tolist()
            num += sum((a - b) ** 2 for a, b in zip(row, want))
            den += sum(b * b for b in want)
        return math.sqrt(num / den) if den else math.inf

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one call reads at least once: every KV head over the context."""
        return self.context * self.shape.num_kv_heads * self.shape.head_dim * 2 * DTYPE_BYTES[self.dtype]


async def _kernels_of(session, shape: AttentionShape, dtype: str, context: int, nest: str) -> tuple[list, AttentionChoice]:
    """The kernels of one call of `nest` ("tiled", "sharded", or "auto": the host's own choice) as
    this adapter runs it (model_glue.model.attention), and the choice they make (str: e.g. "subgroup S=4").
    A LookupError or ValueError says why the nest does not run this shape here."""
    device, library = session.device, session.library
    kernels = resolve_attention_kernels(library, shape, dtype, device)
    choice = choose_decode_attention([context], kernels, is_cpu=device.is_cpu, attention=nest)
    return [await library.kernel(name) for name in kernels.kernel_names(choice)], choice


async def _gpu_seconds(device, bound: list, iters: int, rounds: int) -> float:
    """Seconds per call: the fastest of `rounds` medians of `iters` timestamped calls, each round
    queued behind WARMUP_CALLS untimed ones so the GPU never idles between them."""
    medians = []
    stamps = device.timestamps(2 * iters)  # reused by every round: each reads its ticks before the next
    for _ in range(rounds):
        warm = device.batch()
        for _ in range(CPU_WARMUP_CALLS if device.is_cpu else WARMUP_CALLS):
            for b in bound:
                b.dispatch(warm)
        warm.submit()
        batch = device.batch()
        for i in range(iters):
            with batch.timed((stamps, 2 * i, 2 * i + 1)):  # a split's kernel and merge timed together
                for b in bound:
                    b.dispatch(batch)
        batch.resolve(stamps)
        batch.submit()
        ticks = await stamps.read_ns()
        medians.append(statistics.median(ticks[2 * i + 1] - ticks[2 * i] for i in range(iters)))
    return min(medians) * 1e-9


async def lab_rows(session, shape: AttentionShape, layers: int, context: int, dtype: str, *, iters: int,
                   rounds: int, seed: int = 0, check=None) -> list[dict]:
    """The rows of one (shape, context): one per nest, checked, then timed. `check(inputs, output)`
    gives the relative error (default: against the f64 reference; the tests pass a wrong one)."""
    device = session.device
    inputs = LabInputs(shape, context, dtype, seed)
    check = check or (lambda inputs, output: inputs.relative_error(output))
    s = shape
    out_bytes = s.num_qo_heads * s.head_dim * DTYPE_BYTES[dtype]
    uploads = {"q": device.storage_buffer(len(inputs.q), inputs.q),
               "pages": device.storage_buffer(len(inputs.pages), inputs.pages),
               "indptr": device.storage_buffer(8, array("i", [0, inputs.num_pages]).tobytes()),
               "page_ids": device.storage_buffer(4 * inputs.num_pages, array("i", inputs.page_ids).tobytes()),
               "last": device.storage_buffer(4, array("i", [context - (inputs.num_pages - 1) * PAGE_SIZE]).tobytes()),
               "zero": device.storage_buffer(4), "output": device.storage_buffer(out_bytes),
               "lse": device.storage_buffer(4 * s.num_qo_heads),
               **{name: device.storage_buffer(n) for name, n in split_workspace_bytes(MAX_SPLITS, shape).items()}}
    rows = []
    try:
        for nest in NESTS:
            row = {"head_dim": s.head_dim, "num_kv_heads": s.num_kv_heads, "num_qo_heads": s.num_qo_heads,
                   "context": context, "nest": nest, "dtype": dtype, "layers": layers}
            try:
                kernels, choice = await _kernels_of(session, shape, dtype, context, nest)
            except (LookupError, ValueError) as err:
                rows.append({**row, "ran": None, "ok": False, "error": f"not run: {err}"})
                continue
            buffers, values = attention_call(
                q=uploads["q"], pages=uploads["pages"], page_table_indptr=uploads["indptr"],
                page_table_values=uploads["page_ids"], length_info=uploads["last"], k_rope_pos_offset=uploads["zero"],
                q_rope_position=uploads["zero"], output=uploads["output"], lse=uploads["lse"], batch=1,
                nnz_pages=inputs.num_pages, max_num_pages=inputs.num_pages, sm_scale=inputs.sm_scale,
                workspace={n: uploads[n] for n in SPLIT_WORKSPACE}, num_splits=choice.num_splits)
            bound = [k.bind(b, v) for k, b, v in attention_dispatches(kernels, buffers, values)]
            try:
                batch = device.batch()
                for b in bound:
                    b.dispatch(batch)
                batch.submit()
                error = check(inputs, await device.read(uploads["output"], out_bytes))
                row.update(ran=str(choice), rel_l2=error, ok=error <= TOLERANCE[dtype])
                if not row["ok"]:
                    row["error"] = f"output differs from the f64 reference (relative L2 {error:.2e}): not timed"
                elif device.has_timestamps:
                    seconds = await _gpu_seconds(device, bound, iters, rounds)
                    row.update(us=seconds * 1e6, step_ms=seconds * 1e3 * layers,
                               kv_gb_s=inputs.kv_bytes / seconds / 1e9, timing="gpu-timestamps")
                else:
                    row["error"] = "this adapter has no timestamp-query: not timed"
            finally:
                for b in bound:
                    b.release()
            rows.append(row)
    finally:
        for buffer in uploads.values():
            device.destroy(buffer)
    tiled, sharded = (next((r.get("us") for r in rows if r["nest"] == n), None) for n in ("tiled", "sharded"))
    for r in rows:
        r["tiled_over_sharded"] = tiled / sharded if tiled and sharded else None
        r["seed_ratio"] = SEED_RATIOS.get(s.head_dim) if context == SEED_CONTEXT else None
    return rows


def lab_shapes(model=None) -> list[tuple[str, AttentionShape, int]]:
    """(label, shape, layers): the benchmark shapes, and the loaded model's own."""
    shapes = [(f"D={s.head_dim} {s.num_kv_heads}/{s.num_qo_heads}", s, LAYERS) for s in BENCH_SHAPES]
    if model is not None:
        c = model.config
        shapes.append((f"{model.config_name} (D={c.head_dim} {c.n_kv_heads}/{c.n_heads})", c.attention_shape,
                       c.n_layers))
    return shapes


async def run_lab(session, *, model=None, contexts=None, iters=None, on_row=lambda row: None,
                  dtype: str | None = None) -> dict:
    """Every row of the lab (default contexts and iterations for this adapter); `on_row` sees each."""
    device = session.device
    dtype = dtype or ("float16" if device.has_f16 else "float32")
    contexts = list(contexts or (CPU_LAB_CONTEXTS if device.is_cpu else LAB_CONTEXTS))
    iters = iters or (CPU_ITERS if device.is_cpu else ITERS)
    rounds = CPU_ROUNDS if device.is_cpu else ROUNDS
    started = time.perf_counter()
    rows = []
    for label, shape, layers in lab_shapes(model):
        for context in contexts:
            for row in await lab_rows(session, shape, layers, context, dtype, iters=iters, rounds=rounds):
                row["shape"] = label
                rows.append(row)
                on_row(row)
    return {"adapter": device.adapter_name, "backend": device.backend, "dtype": dtype, "cpu_adapter": device.is_cpu,
            "contexts": contexts, "iters": iters, "rounds": rounds, "reference_heads": REFERENCE_HEADS,
            "seed": {"ratios": SEED_RATIOS, "context": SEED_CONTEXT, "gpu": "Apple M4 Max, Chrome"},
            "seconds": time.perf_counter() - started, "rows": rows}
