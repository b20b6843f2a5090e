"""The model artifact's format: writing it (`write_artifact`), reading it back (`read_artifact_tensors`,
`load_artifact_weights`) and random weights of a contract config (`write_random_artifact`).

A GGUF reaches this format one way only, through the runtime: app.convert_gguf opens the file as
the page does (model_glue: the header, the tensor plan, the repack on the GPU) and hands the
repacked tensors to `write_artifact`. This module runs on the build machine only (it needs numpy);
nothing the browser loads imports it. The GPU kernels read the artifact's packing directly, so the format is a contract:

* `weights.bin` -- every tensor back to back, each starting at a 256-byte aligned offset (WebGPU
  storage-buffer offsets must be aligned, and 256 covers every adapter's limit), little-endian.
* a Q4 matrix `W[out, in]` -> `<name>.q4` uint32 `[out, in/8]` (element 8w+k in bits 4k..4k+3 of
  word w), `<name>.scale` float32 `[out, in/32]` (block d) and `<name>.min` float32
  `[out, in/32]` (block m); value = scale * code + min. The 4-bit codes are kept bit-exact.
* a Q8A matrix (a GGUF's 5- to 8-bit layer matrices) -> `<name>.q8a` uint32 `[out, in/4]` (signed bytes;
  weight c of each 16 at contract.model.q8a_code_position(c) of its 4 words), `<name>.scale` and
  `<name>.min` float32 `[out, in/16]`; value = scale * code + min.
* the Q8 embedding -> `embed.q8` uint32 `[vocab, dim/4]` (element 4w+k in byte k of word w, int8)
  and `embed.scale` float32 `[vocab, dim/32]`; it doubles as the LM head (tied embeddings; else `head.q8`, `head.scale`).
* Norm vectors as float32.
* Fused matrices so one dispatch serves several projections: `layers.{i}.qkv` (q, k, v rows),
  `layers.{i}.o`, `layers.{i}.gate_up` (gate rows then up rows), `layers.{i}.down`.
* `manifest.json` -- config name and values, source, every tensor's offset/nbytes/dtype/shape/sha256. It is
  written last by atomic rename, so a folder without it (or with a stale one whose hashes do not
  match) is detectably incomplete.

The GGUF's attn_q / attn_k rows are stored permuted for llama.cpp's adjacent-pair RoPE (rotate
(x[2i], x[2i+1]) by theta^(-2i/head_dim)); we keep that order, so the runtime must use
adjacent-pair RoPE too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from contract.artifacts import MANIFEST, MODEL_ARTIFACT_FORMAT, MODEL_ARTIFACT_KIND, WEIGHTS_FILE
from contract.model import (ALL_MODEL_CONFIGS, DEFAULT_CONTEXT_LENGTH, Q8A_BLOCK, LlamaConfig, matrix_format, norm_width,
                            q8a_weight_at)

ALIGN = 256
QBLOCK = 32  # elements per Q4 / Q8 block


class ConvertError(RuntimeError):
    """An artifact is missing, incomplete or corrupted."""


# ----------------------------------------------------------------------------------------------
# The word packing of Q4 and Q8 codes, and its dequantization (the tests' reference side).
# ----------------------------------------------------------------------------------------------

def pack_q4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes uint8 [rows, cols] -> uint32 [rows, cols/8], element 8w+k in bits 4k..4k+3 of word w.

    One u32 load then gives a shader eight consecutive weights of the row.
    """
    rows, cols = codes.shape
    nib = codes.reshape(rows, cols // 8, 8).astype(np.uint32)
    shifts = (np.arange(8, dtype=np.uint32) * 4).reshape(1, 1, 8)
    return np.bitwise_or.reduce(nib << shifts, axis=2).astype("<u4")


def unpack_q4(words: np.ndarray) -> np.ndarray:
    """Inverse of `pack_q4`: uint32 [rows, cols/8] -> uint8 codes [rows, cols]."""
    rows, nw = words.shape
    shifts = (np.arange(8, dtype=np.uint32) * 4).reshape(1, 1, 8)
    return ((words.astype(np.uint32)[:, :, None] >> shifts) & 0xF).astype(np.uint8).reshape(rows, nw * 8)


def pack_q8(codes: np.ndarray) -> np.ndarray:
    """int8 codes [rows, cols] -> uint32 [rows, cols/4] with element 4w+k in byte k (little-endian)."""
    rows, cols = codes.shape
    return np.ascontiguousarray(codes.astype(np.int8)).view("<u4").reshape(rows, cols // 4)


def unpack_q8(words: np.ndarray) -> np.ndarray:
    """Inverse of `pack_q8`: uint32 [rows, cols/4] -> int8 codes [rows, cols]."""
    rows, nw = words.shape
    return np.ascontiguousarray(words.astype("<u4")).view(np.int8).reshape(rows, nw * 4)


def q8a_word_order() -> np.ndarray:
    """The weight (of its block of Q8A_BLOCK) at each byte of a Q8A block's 4 words, in memory order."""
    return np.array([q8a_weight_at(word, byte) for word in range(Q8A_BLOCK // 4) for byte in range(4)])


def pack_q8a(codes: np.ndarray) -> np.ndarray:
    """int8 codes [rows, cols] -> uint32 [rows, cols/4] in the Q8A byte order."""
    rows, cols = codes.shape
    blocks = codes.astype(np.int8).reshape(rows, cols // Q8A_BLOCK, Q8A_BLOCK)[:, :, q8a_word_order()]
    return np.ascontiguousarray(blocks.reshape(rows, cols)).view("<u4").astype(np.uint32)


def unpack_q8a(words: np.ndarray) -> np.ndarray:
    """Inverse of `pack_q8a`: uint32 [rows, cols/4] -> int8 codes [rows, cols] in weight order."""
    stored = unpack_q8(words)
    rows, cols = stored.shape
    codes = np.empty_like(stored).reshape(rows, cols // Q8A_BLOCK, Q8A_BLOCK)
    codes[:, :, q8a_word_order()] = stored.reshape(rows, cols // Q8A_BLOCK, Q8A_BLOCK)
    return codes.reshape(rows, cols)


def dequant_q8a(words: np.ndarray, scale: np.ndarray, minv: np.ndarray) -> np.ndarray:
    """Our Q8A packing -> dense float32 [rows, cols]: code * scale + min per 16, in float32."""
    codes = unpack_q8a(words).astype(np.float32)
    rows, cols = codes.shape
    q = codes.reshape(rows, cols // Q8A_BLOCK, Q8A_BLOCK)
    return ((scale[:, :, None] * q) + minv[:, :, None]).reshape(rows, cols)


def dequant_q4(words: np.ndarray, scale: np.ndarray, minv: np.ndarray) -> np.ndarray:
    """Our Q4 packing -> dense float32 [rows, cols], computed as (d * q) + m in float32 like gguf does,
    so the result equals gguf's own dequantization bit for bit."""
    codes = unpack_q4(words).astype(np.float32)
    rows, cols = codes.shape
    q = codes.reshape(rows, cols // QBLOCK, QBLOCK)
    return ((scale[:, :, None] * q) + minv[:, :, None]).reshape(rows, cols)


def dequant_q8(words: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Our Q8 packing -> dense float32 [rows, cols] (code * d in float32, as gguf does)."""
    codes = unpack_q8(words).astype(np.float32)
    rows, cols = codes.shape
    return (codes.reshape(rows, cols // QBLOCK, QBLOCK) * scale[:, :, None]).reshape(rows, cols)


def q4_tensors(name: str, codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The three artifact tensors for one Q4 matrix."""
    return [(f"{name}.q4", pack_q4(codes)),
            (f"{name}.scale", np.ascontiguousarray(d, dtype="<f4")),
            (f"{name}.min", np.ascontiguousarray(m, dtype="<f4"))]


# ----------------------------------------------------------------------------------------------
# Artifact writer / reader.
# ----------------------------------------------------------------------------------------------

def _dtype_name(arr: np.ndarray) -> str:
    if arr.dtype == np.uint32:
        return "uint32"
    if arr.dtype == np.float32:
        return "float32"
    raise ConvertError(f"artifact tensors are uint32 or float32, got {arr.dtype}")


def write_artifact(out_dir, config_name: str, config: LlamaConfig, source: dict,
                   tensors: Iterable[tuple[str, np.ndarray]], log: Callable[[str], None] = lambda s: None,
                   context_length: int = DEFAULT_CONTEXT_LENGTH, tokenizer: str | None = None) -> dict:
    """Stream `tensors` into weights.bin (256-byte aligned) and then write manifest.json atomically.
    `tokenizer`: the tokenizer file the manifest names (contract.artifacts.GGUF_TOKENIZER_FILE), if
    not HF's tokenizer.json.

    Any existing manifest is removed first, so a crash mid-write never leaves a manifest that
    describes a half-written weights file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    tmp_weights = out / (WEIGHTS_FILE + ".tmp")
    entries: dict[str, dict] = {}
    offset = 0
    whole = hashlib.sha256()  # of the whole file: the page caches the weights under it
    with open(tmp_weights, "wb") as fh:
        for name, arr in tensors:
            if name in entries:
                raise ConvertError(f"duplicate tensor name {name!r}")
            arr = np.ascontiguousarray(arr)
            dtype = _dtype_name(arr)
            data = arr.astype("<u4" if dtype == "uint32" else "<f4", copy=False).tobytes()
            pad = (-offset) % ALIGN
            if pad:
                fh.write(b"\0" * pad)
                whole.update(b"\0" * pad)
                offset += pad
            fh.write(data)
            whole.update(data)
            entries[name] = {"offset": offset, "nbytes": len(data), "dtype": dtype,
                             "shape": [int(s) for s in arr.shape],
                             "sha256": hashlib.sha256(data).hexdigest()}
            offset += len(data)
    os.replace(tmp_weights, out / WEIGHTS_FILE)
    manifest = {"format": MODEL_ARTIFACT_FORMAT, "kind": MODEL_ARTIFACT_KIND, "config_name": config_name,
                "config": config.to_dict(), "context_length": context_length, "source": source,
                "tensors": entries, "weights_file": WEIGHTS_FILE, "total_bytes": offset,
                "weights_sha256": whole.hexdigest()}
    if tokenizer is not None:
        manifest["tokenizer"] = tokenizer
    tmp_manifest = out / (MANIFEST + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp_manifest, out / MANIFEST)
    log(f"wrote {len(entries)} tensors, {offset / 2**20:.1f} MiB to {out / WEIGHTS_FILE}")
    return manifest


def read_manifest(art_dir) -> dict:
    """Load and sanity-check manifest.json (format, kind, weights file size)."""
    root = Path(art_dir)
    path = root / MANIFEST
    if not path.exists():
        raise ConvertError(f"no {MANIFEST} in {root}: the artifact is missing or its write did not finish")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ConvertError(f"{path} is not valid JSON: {err}") from err
    if manifest.get("format") != MODEL_ARTIFACT_FORMAT or manifest.get("kind") != MODEL_ARTIFACT_KIND:
        raise ConvertError(f"{path}: format {manifest.get('format')!r} kind {manifest.get('kind')!r}, "
                           f"expected {MODEL_ARTIFACT_FORMAT} {MODEL_ARTIFACT_KIND!r}")
    weights = root / manifest["weights_file"]
    if not weights.exists() or weights.stat().st_size != manifest["total_bytes"]:
        size = weights.stat().st_size if weights.exists() else None
        raise ConvertError(f"{weights}: size {size}, manifest says {manifest['total_bytes']} bytes")
    return manifest


def read_artifact_tensors(art_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """All raw artifact tensors (packed, as stored), each checked against its manifest sha256."""
    root = Path(art_dir)
    manifest = read_manifest(root)
    blob = (root / manifest["weights_file"]).read_bytes()
    out: dict[str, np.ndarray] = {}
    for name, t in manifest["tensors"].items():
        data = blob[t["offset"]:t["offset"] + t["nbytes"]]
        if t["offset"] % ALIGN or len(data) != t["nbytes"]:
            raise ConvertError(f"tensor {name!r}: bad offset/size {t['offset']}/{t['nbytes']}")
        if hashlib.sha256(data).hexdigest() != t["sha256"]:
            raise ConvertError(f"tensor {name!r} is corrupted: sha256 of bytes {t['offset']}..."
                               f"{t['offset'] + t['nbytes']} of {manifest['weights_file']} does not match "
                               "the manifest (re-run the conversion)")
        dtype = {"uint32": "<u4", "float32": "<f4"}[t["dtype"]]
        out[name] = np.frombuffer(data, dtype=dtype).reshape(t["shape"])
    return manifest, out


def load_artifact_weights(art_dir, layers: Iterable[int] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Dequantize our packing back to dense float32 (qkv/o/gate_up/down [out, in], embed, norms).

    Every tensor's sha256 is verified (even for layers not requested) so corruption anywhere is
    reported; `layers` only limits which layers get dequantized, to keep tests fast.
    """
    manifest, raw = read_artifact_tensors(art_dir)
    config = manifest["config"]
    formats = LlamaConfig.from_dict(config)

    def matrix(name):  # in its format (contract.model.matrix_format)
        fmt = matrix_format(formats, name)
        codes, scale = raw[f"{name}.{fmt}"], raw[f"{name}.scale"]
        return dequant_q8(codes, scale) if fmt == "q8" else \
            {"q4": dequant_q4, "q8a": dequant_q8a}[fmt](codes, scale, raw[f"{name}.min"])

    wanted = range(config["n_layers"]) if layers is None else list(layers)
    dense = {"embed": matrix("embed"), "final_norm": raw["final_norm"].astype(np.float32)}
    for i in wanted:
        p = f"layers.{i}"
        for vector in formats.arch.layer_norms + ("qkv_bias",) * formats.arch.qkv_bias:
            dense[f"{p}.{vector}"] = raw[f"{p}.{vector}"].astype(np.float32)
        for mat in ("qkv", "o", "gate_up", "down"):
            dense[f"{p}.{mat}"] = matrix(f"{p}.{mat}")
    return config, dense


def _matrix_shapes(config: LlamaConfig) -> dict[str, list[tuple[int, int]]]:
    """(rows, cols) of the parts each fused matrix stacks, in row order (q, k, v; gate, up)."""
    d, hd, f = config.dim, config.head_dim, config.ffn_dim
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    return {"qkv": [(q, d), (kv, d), (kv, d)], "o": [(d, q)], "gate_up": [(f, d), (f, d)], "down": [(d, f)]}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Synthetic artifacts for tests and benchmarks.
# ----------------------------------------------------------------------------------------------

def _random_q4(rng: np.random.Generator, rows: int, cols: int):
    """Random codes with scales ~0.02 and mins ~ -8*scale (weights centred near zero, like real Q4_1).

    Scales/mins are rounded through float16 because real GGUF blocks store them as f16.
    """
    codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    d = (0.02 * rng.uniform(0.5, 1.5, size=(rows, cols // QBLOCK))).astype(np.float16).astype(np.float32)
    m = (-8.0 * d * rng.uniform(0.9, 1.1, size=d.shape)).astype(np.float16).astype(np.float32)
    return codes, d, m


def _iter_random_artifact(config: LlamaConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    d, vocab = config.dim, config.vocab_size
    codes = rng.integers(-127, 128, size=(vocab, d), dtype=np.int8)
    scale = (0.01 * rng.uniform(0.5, 1.5, size=(vocab, d // QBLOCK))).astype(np.float16).astype(np.float32)
    yield "embed.q8", pack_q8(codes)
    yield "embed.scale", scale
    shapes = _matrix_shapes(config)
    for i in range(config.n_layers):
        p = f"layers.{i}"
        for norm in config.arch.layer_norms:  # the family's norms (contract.family), in model_tensors' order
            yield f"{p}.{norm}", (1.0 + 0.1 * rng.standard_normal(norm_width(config, norm))).astype(np.float32)
        if config.arch.qkv_bias:
            yield f"{p}.qkv_bias", (0.5 * rng.standard_normal(config.qkv_dim)).astype(np.float32)
        for mat, parts in shapes.items():
            rows, cols = sum(r for r, _ in parts), parts[0][1]
            yield from q4_tensors(f"{p}.{mat}", *_random_q4(rng, rows, cols))
    yield "final_norm", (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    if not config.tied_embeddings:  # the head's own matrix, like the embedding's
        yield "head.q8", pack_q8(rng.integers(-127, 128, size=(vocab, d), dtype=np.int8))
        yield "head.scale", scale


def write_random_artifact(config_name: str, out_dir, seed: int = 0) -> dict:
    """Write random weights of a contract config (the format a converted GGUF has).

    Lets runtime/kernel tests run on a tiny model without the GGUF ("tiny_llama", "tiny_chat"),
    and benchmarks run on a SmolLM2-shaped model ("smollm2_135m").
    """
    config = ALL_MODEL_CONFIGS[config_name]
    source = {"file": None, "sha256": None, "random_seed": seed}
    return write_artifact(out_dir, config_name, config, source, _iter_random_artifact(config, seed))
