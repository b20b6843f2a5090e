"""The loaded model's prefill kernels in the page: checked against float64, timed per kernel, and the
prefill itself timed at several prompt lengths (`python -m app bench page --prefill`, and on a GPU
machine tools/gpu_prefill.py).

Each matmul build the model runs (the scalar tiled kernels and, where the model loaded them, the
subgroup-matrix builds; 128- and 32-token tiles) is run on random q4 weights of the model's row
widths and CHECK_ROWS rows (a part-full last tile of every build), for a pass that leaves its last
token tile part-full, and its outputs at SAMPLES places, every tile's corners among them, are
compared with a float64 dot product computed here (standard library only: the page has no numpy).
Each prefill attention build is run on random q and paged K/V, for a first turn and a follow-up
after a cached prefix, with keys that grow along the context (so later tiles move a row's max and
the subgroup-matrix build's lazy rescale runs), and compared at sampled (token, head) rows. Then
each build is timed (GPU timestamps) at full size: the matmuls on the model's own layer-0 weights,
attention on its KV cache's first layer.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from dataclasses import replace

from chat.lab import _gpu_seconds, random_values
from contract.attention import MATRIX_PREFILL, AttentionChoice
from contract.kernels import PAGE_SIZE, Matmul, folded_matmuls, layer_matmuls, llama_kernels, matmul_role
from contract.model import DTYPE_BYTES, Q8A_BLOCK, codes_tensor
from model_glue.policy import DECODE_BATCH_MAX_TOKENS, short_token_tile

CHECK_TOKENS = (200, 20)  # a long pass (two 128-token tiles, the second part-full) and a short one
CHECK_ROWS = 320  # W rows: 2.5 matrix tiles of 128, 5 scalar tiles of 64 (SwiGLU: 160 columns)
SAMPLES = 96
TOLERANCE = {"float16": 2e-3, "float32": 1e-4}  # relative L2 over the samples (f16: y's and f16 W's rounding)
TIMED_TOKENS = (1536, 8000)
TIMED_ITERS, TIMED_ROUNDS = 5, 2
# prefill attention: (tokens cached before the pass, its tokens) of the checked calls, (token, head)
# rows compared in each, and how fast K grows along the context (1 + position / KEY_GROWTH)
ATTENTION_CASES = ((0, 150), (300, 20))
ATTENTION_SAMPLES = 24
KEY_GROWTH = 128


def _tolerance(dtype: str, matrix: bool) -> float:
    """A build's bound: the matrix builds multiply f16 fragments whatever the model's dtype."""
    return TOLERANCE["float16" if matrix else dtype]


def _builds(model) -> list[tuple[Matmul, bool]]:
    """(matmul, matrix) of each prefill matmul build the model runs (its family's; the matrix builds are
    the folded matmuls', which GPUs run)."""
    return [(m, matrix) for m in folded_matmuls(model.config.arch, model.run.fold_norms)
            for matrix in ((False, True) if model.has_prefill_matrix else (False,))]


def _spec(model, role: str):
    return llama_kernels(model.config, model.dtype, prefill_matrix=model.has_prefill_matrix)[role]


def _activation(glu: str, gate: float) -> float:
    """The gate's activation (contract.family.ACTIVATIONS) in float64: SiLU, or GELU's tanh form."""
    if glu == "silu":
        return gate / (1 + math.exp(-gate))
    return 0.5 * gate * (1 + math.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))


class CheckInputs:
    """Random inputs of one matmul width (x, W in the build's q4 or q8a, its scales and mins, the norm's
    weight, the residual) and the float64 reference of its outputs at sampled places."""

    def __init__(self, spec, n: int, dtype: str, rng: random.Random):
        self.spec, self.n, self.dtype = spec, n, dtype
        k, rows = spec.in_features, CHECK_ROWS
        self.columns = rows if spec.glu is None else rows // 2
        self.x = random_values(n * k, dtype, rng)
        self.q8a = spec.weights == "q8a"
        self.block = Q8A_BLOCK if self.q8a else 32  # weights a scale and a min
        self.words = rng.randbytes(rows * k if self.q8a else rows * k // 2)  # a byte or a nibble a weight
        # q8a's signed codes span 16x q4's 0..15 (around 0): its scale and min keep W in a like range
        self.scale = array("f", [rng.uniform(0.005, 0.03) / (16 if self.q8a else 1) for _ in range(rows * k // self.block)])
        self.wmin = array("f", [(-0.1 if self.q8a else -8) * s * rng.uniform(0.8, 1.2) for s in self.scale])
        self.norm = array("f", [rng.uniform(0.6, 1.4) for _ in range(k)])
        self.resid = random_values(n * self.columns, dtype, rng)
        tiles = [(t, c) for t in {0, n - 1, min(n - 1, 127), min(n - 1, 128), min(n - 1, 31)}
                 for c in {0, self.columns - 1, min(self.columns - 1, 63), min(self.columns - 1, 64)}]
        self.places = sorted(set(tiles + [(rng.randrange(n), rng.randrange(self.columns))
                                          for _ in range(SAMPLES - len(tiles))]))
        self.want = [self._reference(t, c) for t, c in self.places]

    def values(self, data) -> memoryview:
        return memoryview(data).cast("e" if self.dtype == "float16" else "f")

    def _code(self, r: int, i: int) -> int:
        """Weight i of row r's code: a q4 nibble (element 8w + j in bits 4j of word w, little-endian), or a
        q8a signed byte (weight q8a_weight_at(u, b) of a block is byte b of its word u)."""
        k = self.spec.in_features
        if not self.q8a:
            return (self.words[(r * k + i) // 2] >> (4 * (i % 2))) & 15
        j = i % Q8A_BLOCK
        word, byte = 2 * (j // 8) + j % 2, (j % 8) // 2  # q8a_weight_at's inverse
        code = self.words[r * k + i - j + 4 * word + byte]
        return code - 256 if code >= 128 else code

    def _row(self, r: int) -> list[float]:
        k, block = self.spec.in_features, self.block
        return [self._code(r, i) * self.scale[(r * k + i) // block] + self.wmin[(r * k + i) // block] for i in range(k)]

    def _reference(self, t: int, c: int) -> float:
        spec, k = self.spec, self.spec.in_features
        x = self.values(self.x)[t * k:(t + 1) * k].tolist()
        if spec.norm_eps is not None:
            inv_rms = 1 / math.sqrt(math.fsum(v * v for v in x) / k + spec.norm_eps)
            x = [v * inv_rms * g for v, g in zip(x, self.norm)]

        def dot(r):
            return math.fsum(a * b for a, b in zip(x, self._row(r)))
        if spec.glu is not None:
            gate, up = dot(c), dot(self.columns + c)
            return _activation(spec.glu, gate) * up
        y = dot(c)
        return y + self.values(self.resid)[t * self.columns + c] if spec.residual else y

    def relative_error(self, output: bytes) -> float:
        got = self.values(output)
        num = math.fsum((got[t * self.columns + c] - w) ** 2 for (t, c), w in zip(self.places, self.want))
        den = math.fsum(w * w for w in self.want)
        return math.sqrt(num / den) if den else math.inf


def _bind(kernel, spec, n: int, buffers: dict):
    return kernel.bind({name: buffers[name] for name in kernel.buffer_names}, {"n": n, **spec.values})


async def check_prefill_matmuls(model, seed: int = 0, on_row=lambda row: None) -> list[dict]:
    """Every prefill matmul build the model runs against float64 (one row a build and pass length)."""
    device, rng = model.device, random.Random(seed)
    rows = []
    for matmul, matrix in _builds(model):
        for n in CHECK_TOKENS:
            role = matmul_role(matmul, prefill=True, short=short_token_tile(n, matrix), matrix=matrix)
            spec = replace(_spec(model, role), out_features=CHECK_ROWS)
            inputs = CheckInputs(spec, n, model.dtype, rng)
            esize = DTYPE_BYTES[model.dtype]
            buffers = {"x": inputs.x, "w": inputs.words, "scale": inputs.scale.tobytes(),
                       "wmin": inputs.wmin.tobytes(), "norm": inputs.norm.tobytes(), "resid": inputs.resid}
            uploaded = {name: device.storage_buffer(len(data), data) for name, data in buffers.items()}
            uploaded["y"] = device.storage_buffer(n * inputs.columns * esize)
            kernel = model.kernels[role]
            bound = _bind(kernel, spec, n, uploaded)
            try:
                batch = device.batch()
                bound.dispatch(batch)
                batch.submit()
                error = inputs.relative_error(await device.read(uploaded["y"], n * inputs.columns * esize))
            finally:
                bound.release()
                for buffer in uploaded.values():
                    device.destroy(buffer)
            row = {"role": matmul, "kernel": kernel.name, "matrix": matrix, "tokens": n,
                   "tile": "short" if short_token_tile(n, matrix) else "long", "in_features": spec.in_features,
                   "rows": CHECK_ROWS, "samples": len(inputs.places), "rel_l2": error,
                   "ok": error <= _tolerance(model.dtype, matrix)}
            rows.append(row)
            on_row(row)
    return rows


async def time_prefill_matmuls(model, tokens=TIMED_TOKENS, iters: int = TIMED_ITERS, on_row=lambda row: None) -> list[dict]:
    """GPU time and TFLOP/s of each prefill matmul build at the model's full sizes, on its layer-0
    weights and random x (one row a build and pass length)."""
    device = model.device
    if not device.has_timestamps:
        return []
    c, esize, rng = model.config, DTYPE_BYTES[model.dtype], random.Random(1)
    rows = []
    for n in tokens:
        widest = max(c.dim, c.ffn_dim, c.n_heads * c.head_dim)
        x = device.storage_buffer(n * widest * esize, random_values(n * widest, model.dtype, rng))
        y = device.storage_buffer(n * max(c.qkv_dim, c.ffn_dim, c.dim) * esize)
        resid = device.storage_buffer(n * c.dim * esize)
        try:
            for matmul, matrix in _builds(model):
                role = matmul_role(matmul, prefill=True, short=short_token_tile(n, matrix), matrix=matrix)
                spec, kernel = _spec(model, role), model.kernels[role]
                weight = f"layers.0.{layer_matmuls(c.arch)[matmul]}"
                buffers = {"x": x, "y": y, "resid": resid, "w": model.weights[codes_tensor(c, weight)],
                           "scale": model.weights[f"{weight}.scale"], "wmin": model.weights[f"{weight}.min"],
                           "norm": model.weights["layers.0.attn_norm" if "qkv" in matmul else "layers.0.ffn_norm"]}
                bound = _bind(kernel, spec, n, buffers)
                try:
                    if not rows:  # the GPU's clocks rise while the first build runs: that timing is thrown away
                        await _gpu_seconds(device, [bound], iters, TIMED_ROUNDS)
                    seconds = await _gpu_seconds(device, [bound], iters, TIMED_ROUNDS)
                finally:
                    bound.release()
                flops = 2 * n * spec.out_features * spec.in_features
                row = {"role": matmul, "kernel": kernel.name, "matrix": matrix, "tokens": n,
                       "shape": f"{n} x {spec.out_features} x {spec.in_features}", "us": seconds * 1e6,
                       "tflops": flops / seconds / 1e12, "timing": "gpu-timestamps"}
                rows.append(row)
                on_row(row)
        finally:
            for buffer in (x, y, resid):
                device.destroy(buffer)
    return rows


def _attention_builds(model) -> list[AttentionChoice]:
    """The prefill attention builds the model runs: the scalar kernel and, beside the matmuls'
    subgroup-matrix builds, its own."""
    builds = [AttentionChoice("prefill")] if model.attention.prefill else []
    if model.has_prefill_matrix and model.attention.prefill_matrix:
        builds.append(AttentionChoice("prefill", MATRIX_PREFILL))
    return builds


class AttentionInputs:
    """One prefill attention call: `n` new tokens after `start` cached ones, on shuffled pages, K
    growing along the context, and the float64 reference at sampled (token, head) rows."""

    def __init__(self, shape, start: int, n: int, dtype: str, rng: random.Random):
        self.shape, self.start, self.n, self.dtype = shape, start, n, dtype
        self.used = (start + n + PAGE_SIZE - 1) // PAGE_SIZE
        self.num_pages = self.used + 1  # a page the sequence does not own
        self.page_ids = rng.sample(range(self.num_pages), self.used)
        self.q = random_values(n * shape.num_qo_heads * shape.head_dim, dtype, rng)
        pages = bytearray(random_values(self.num_pages * 2 * shape.num_kv_heads * PAGE_SIZE * shape.head_dim,
                                        dtype, rng))
        values = memoryview(pages).cast("e" if dtype == "float16" else "f")
        for position in range(start + n):
            for kv_head in range(shape.num_kv_heads):
                at = self._at(position, 0, kv_head)
                for i in range(at, at + shape.head_dim):
                    values[i] *= 1 + position / KEY_GROWTH
        self.pages = bytes(pages)
        corners = {(0, 0), (n - 1, shape.num_qo_heads - 1), (min(n - 1, 15), shape.group - 1)}
        self.rows = sorted(corners | {(rng.randrange(n), rng.randrange(shape.num_qo_heads))
                                      for _ in range(ATTENTION_SAMPLES - len(corners))})
        self.want = [self._reference(t, h) for t, h in self.rows]

    def _at(self, position: int, kv: int, kv_head: int) -> int:
        s = self.shape
        page = self.page_ids[position // PAGE_SIZE]
        return (((page * 2 + kv) * s.num_kv_heads + kv_head) * PAGE_SIZE + position % PAGE_SIZE) * s.head_dim

    def _reference(self, token: int, head: int) -> list[float]:
        s, D = self.shape, self.shape.head_dim
        q = self.values(self.q)[(token * s.num_qo_heads + head) * D:(token * s.num_qo_heads + head + 1) * D].tolist()
        pages, kv_head = self.values(self.pages), head // s.group
        positions = range(self.start + token + 1)  # causal: the cached prefix and the pass up to the token
        scores = [D ** -0.5 * math.fsum(a * b for a, b in zip(q, pages[self._at(p, 0, kv_head):][:D].tolist()))
                  for p in positions]
        top = max(scores)
        weights = [math.exp(x - top) for x in scores]
        out = [0.0] * D
        for p, w in zip(positions, weights):
            at = self._at(p, 1, kv_head)
            for d, v in enumerate(pages[at:at + D].tolist()):
                out[d] += w * v
        total = math.fsum(weights)
        return [x / total for x in out]

    def values(self, data) -> memoryview:
        return memoryview(data).cast("e" if self.dtype == "float16" else "f")

    def relative_error(self, output: bytes) -> float:
        got, s = self.values(output), self.shape
        num = den = 0.0
        for (t, h), want in zip(self.rows, self.want):
            at = (t * s.num_qo_heads + h) * s.head_dim
            num += math.fsum((a - b) ** 2 for a, b in zip(got[at:at + s.head_dim].tolist(), want))
            den += math.fsum(b * b for b in want)
        return math.sqrt(num / den) if den else math.inf


def _attention_values(shape, n: int, start: int, num_pages: int, used: int) -> dict:
    """The call's values: the whole causal prefix (window 0), as AttentionInputs' reference sees it."""
    return {"n": n, "num_pages": num_pages, "used_pages": used, "start": start, "sm_scale": shape.head_dim ** -0.5,
            "window": 0}


async def check_prefill_attention(model, seed: int = 0, on_row=lambda row: None) -> list[dict]:
    """Every prefill attention build the model runs against float64 (one row a build and case)."""
    device, rng, shape = model.device, random.Random(seed), model.config.attention_shape
    cases = [AttentionInputs(shape, start, n, model.dtype, rng) for start, n in ATTENTION_CASES]
    rows = []
    for choice in _attention_builds(model):
        kernel = await model.library.kernel(model.attention.kernel_names(choice)[0])
        for inputs in cases:
            out_bytes = len(inputs.q)
            uploaded = {"q": device.storage_buffer(len(inputs.q), inputs.q),
                        "pages": device.storage_buffer(len(inputs.pages), inputs.pages),
                        "page_ids": device.storage_buffer(4 * inputs.used, array("i", inputs.page_ids).tobytes()),
                        "output": device.storage_buffer(out_bytes)}
            bound = kernel.bind(uploaded, _attention_values(shape, inputs.n, inputs.start, inputs.num_pages,
                                                            inputs.used))
            try:
                batch = device.batch()
                bound.dispatch(batch)
                batch.submit()
                error = inputs.relative_error(await device.read(uploaded["output"], out_bytes))
            finally:
                bound.release()
                for buffer in uploaded.values():
                    device.destroy(buffer)
            row = {"role": "attention", "kernel": kernel.name, "matrix": choice.layout == MATRIX_PREFILL,
                   "tokens": inputs.n, "start": inputs.start, "samples": len(inputs.rows), "rel_l2": error,
                   "ok": error <= _tolerance(model.dtype, choice.layout == MATRIX_PREFILL)}
            rows.append(row)
            on_row(row)
    return rows


async def time_prefill_attention(model, tokens=TIMED_TOKENS, iters: int = TIMED_ITERS,
                                 on_row=lambda row: None) -> list[dict]:
    """GPU time and TFLOP/s of each prefill attention build for a first turn of each length that
    fits the model's KV cache (on its first layer's pages: what they hold does not change the work)."""
    device, shape, esize = model.device, model.config.attention_shape, DTYPE_BYTES[model.dtype]
    if not device.has_timestamps:
        return []
    rng, rows = random.Random(2), []
    for n in [n for n in tokens if n <= model.kv.capacity]:
        used = (n + PAGE_SIZE - 1) // PAGE_SIZE
        width = shape.num_qo_heads * shape.head_dim
        buffers = {"q": device.storage_buffer(n * width * esize, random_values(n * width, model.dtype, rng)),
                   "page_ids": device.storage_buffer(4 * used, array("i", range(used)).tobytes()),
                   "output": device.storage_buffer(n * width * esize)}
        try:
            for choice in _attention_builds(model):
                kernel = await model.library.kernel(model.attention.kernel_names(choice)[0])
                bound = kernel.bind({**buffers, "pages": model.kv.layers[0]},
                                    _attention_values(shape, n, 0, model.kv.num_pages, used))
                try:
                    seconds = await _gpu_seconds(device, [bound], iters, TIMED_ROUNDS)
                finally:
                    bound.release()
                flops = 4 * shape.num_qo_heads * shape.head_dim * n * (n + 1) // 2  # q.k and p.v of each causal pair
                row = {"role": "attention", "kernel": kernel.name, "matrix": choice.layout == MATRIX_PREFILL,
                       "tokens": n, "shape": f"{n} causal, {shape.num_qo_heads} heads x {shape.head_dim}",
                       "us": seconds * 1e6, "tflops": flops / seconds / 1e12, "timing": "gpu-timestamps"}
                rows.append(row)
                on_row(row)
        finally:
            for buffer in buffers.values():
                device.destroy(buffer)
    return rows


async def check_prefill_kernels(model, seed: int = 0) -> list[dict]:
    """check_prefill_matmuls, then check_prefill_attention."""
    return await check_prefill_matmuls(model, seed) + await check_prefill_attention(model, seed)


async def time_prefill_kernels(model, tokens=TIMED_TOKENS) -> list[dict]:
    """time_prefill_matmuls, then time_prefill_attention."""
    return await time_prefill_matmuls(model, tokens) + await time_prefill_attention(model, tokens)


async def prefill_benchmark(model, tokens=(512, 1536, 3060, 8000), short_turns=(8, 37, 64), matrix=None,
                            attention_matrix: bool | None = None, seed: int = 0) -> dict:
    """The prefill as a chat turn meets it, with the model's options (`matrix`: RunOptions.prefill_matrix
    for this run, `attention_matrix`: RunOptions.prefill_attention_matrix; None: the model's): for each prompt length a first turn of random ids (in the model's chunks), its GPU
    ms (summed over its passes, attention apart) and tokens per GPU second, and the wall time to its
    first token; then, after a 1,536-token first turn, a follow-up turn of each short length, its
    attention run by the causal prefill kernel and as a decode batch (RunOptions.short_prefill_decode_attention)."""
    from model_glue.model.generate import generate

    options = None if matrix is None and attention_matrix is None else \
        replace(model.options, prefill_matrix=model.options.prefill_matrix if matrix is None else matrix,
                prefill_attention_matrix=attention_matrix)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, model.config.vocab_size) for _ in range(n)]

    async def turn(prompt: list[int], label: str, options=options) -> dict:
        started = time.perf_counter()
        run = await generate(model, prompt, max_new_tokens=1, options=options, reuse_cache=True)
        wall = time.perf_counter() - started
        passes = [s for s in run.stats if s.kind == "prefill"]
        gpu = sum(s.gpu_ms or 0 for s in passes)
        attention = sum(s.attention_ms or 0 for s in passes)
        return {"turn": label, "tokens": run.prefill_tokens, "passes": len(passes),
                "kernel": passes[-1].kernel if passes else None, "gpu_ms": gpu, "attention_ms": attention,
                "rest_ms": gpu - attention, "tok_s_gpu": run.prefill_tokens / gpu * 1e3 if gpu else None,
                "ttft_ms": wall * 1e3}

    rows = []
    for n in tokens:
        if n + 2 <= model.kv.capacity:
            model.reset()
            rows.append(await turn(ids(n), "first"))
    for n in short_turns:
        first, more = ids(min(1536, model.kv.capacity - n - 4)), ids(n)
        for decode_attention in (False, True):
            model.reset()
            await turn(first, "first")
            rows.append(await turn(first + more, "follow-up" if decode_attention else "follow-up, prefill kernel",
                                   replace(options or model.options, short_prefill_decode_attention=decode_attention)))
    model.reset()
    return {"model": model.config_name, "dtype": model.dtype, "adapter": model.device.adapter_name,
            "prefill_matrix": model.runs_prefill_matrix(),
            "prefill_attention": model.prefill_attention(DECODE_BATCH_MAX_TOKENS + 1, 0).layout or "scalar",  # a long pass's
            "timing": "gpu-timestamps" if model.device.has_timestamps else "wall", "rows": rows}


async def matrix_agreement(chat, text: str, tokens: int = 64, attention: bool = False) -> dict:
    """A chat's reply to `text`, greedy, once with the scalar prefill matmuls and once with the
    subgroup-matrix builds (`attention`: the prefill attention's too; the decode steps are the same
    kernels): identical ids, or the first divergence and how many of the scalar run's tokens the
    matrix run predicts when fed them."""
    from model_glue.model.generate import generate

    model = chat.model
    if not model.has_prefill_matrix:
        return {"error": f"the model runs no subgroup-matrix prefill: {model.prefill_matrix_why_not}"}
    ids = chat.prompt_ids([{"role": "user", "content": text}])
    runs = {}
    for matrix in (False, True):
        model.reset()
        run = await generate(model, ids, max_new_tokens=tokens,
                             options=replace(model.options, prefill_matrix=matrix,
                                             prefill_attention_matrix=matrix and attention))
        runs[matrix] = run.token_ids
    model.reset()
    forced = await generate(model, ids, max_new_tokens=tokens, forced_ids=runs[False],
                            options=replace(model.options, prefill_matrix=True, prefill_attention_matrix=attention))
    model.reset()
    first = next((i for i, (a, b) in enumerate(zip(runs[False], runs[True])) if a != b), None)
    return {"prompt_tokens": len(ids), "tokens": len(runs[False]), "identical": runs[False] == runs[True],
            "first_divergence": first, "teacher_forced": sum(a == b for a, b in zip(forced.token_ids, runs[False])),
            "scalar_text": chat.tokenizer.decode(runs[False]), "matrix_text": chat.tokenizer.decode(runs[True])}
