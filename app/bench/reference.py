"""Float64 numpy reference for TVM's paged single-token decode attention.

This mirrors the semantics of ``_attention_decode`` / ``_attention_decode_cpu`` in
``tvm/relax/frontend/nn/llm/_decode_kernels.py`` (apache-tvm 0.27) so that a
replacement kernel can be checked against an exact (f64) answer instead of
against another low-precision kernel.  Nothing here imports tvm; only the
``__main__`` self-check does, to prove the reference matches TVM's CPU kernel.

Semantics pinned down from the TVM source
-----------------------------------------
* ``pages``: ``[num_pages, 2, H_kv, page_size, D]``; index 0 of axis 1 is K, 1 is V.
* Sequence ``b`` owns logical pages ``page_table_values[indptr[b]:indptr[b+1]]``
  (physical page ids).  Slot ``s`` of the sequence is page ``s // page_size``,
  in-page offset ``s % page_size``.
* ``length_info`` without sliding window: ``[B]`` = number of used slots in the
  last page (``last_page_len``).  With sliding window: ``[3, B]`` where row 0 is
  ``last_page_len``, row 1 the sliding-window start offset (in slots), row 2 the
  attention-sink length.
* kv length (``kv_chunk_len``) = 0 if the sequence has no pages, else
  ``(npages - 1) * page_size + last_page_len`` and, with sliding window,
  ``- sliding_window_offset + sink_size`` on top.
* Row ``i`` of the attended KV (0 <= i < kv_len) lives at slot ``i`` without
  sliding window; with sliding window at ``i if i < sink else i - sink + offset``.
* GQA: query head ``h`` reads kv head ``h // (H_qo // H_kv)``.
* Scores are ``(q . k) * sm_scale * log2(e)``; softmax is done with ``exp2`` and
  ``lse`` is returned in the log2 domain: ``lse = m + log2(d)``.
* The online softmax starts from ``m = -5e4, d = 1.0, O = 0``.  That phantom
  entry is numerically invisible for real contexts (it adds ``2**(-5e4 - m)``),
  but it defines the empty-context result: ``output = 0`` and ``lse = -5e4``.
* ``rotary_mode == 1`` applies RoPE inline to Q at position ``q_rope_position[b]``
  and to K row ``i`` at ``k_rope_pos_offset[b] + i`` (``i`` is the row index in
  the attended sequence, *not* the slot, so sinks + window get contiguous
  positions).  With ``rope_scaling={}`` TVM uses ``rope_freq_default``: the angle
  for dim ``d`` is ``(pos * rope_scale) / rope_theta ** ((2 * d % D) / D)`` and
  pairs are half-rotation (NeoX style): dim ``d < D/2`` pairs with ``d + D/2``:
  ``out[d] = x[d] cos - x[d + D/2] sin``, ``out[d + D/2] = x[d + D/2] cos + x[d] sin``.
  Note ``rope_scale`` *multiplies* the position.  V is never rotated.
"""

from __future__ import annotations

import math

import numpy as np

LOG2E = math.log2(math.e)
INIT_MAX = -5e4  # the kernels' initial running max
INIT_DENOM = 1.0  # the kernels' initial running denominator


def relative_l2(a, b):
    """||a - b|| / ||b|| in float64 (``b`` is the reference); 0 when both are zero."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = float(np.linalg.norm((a - b).ravel()))
    den = float(np.linalg.norm(b.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _rope_f64(x, pos, rope_scale, rope_theta):
    """Half-rotation RoPE exactly as TVM's default freq function, in f64.

    ``x``: ``[..., D]``; ``pos``: broadcastable to ``x.shape[:-1]``.
    """
    D = x.shape[-1]
    half = D // 2
    d = np.arange(D)
    inv = np.power(float(rope_theta), -((2 * d) % D) / D)  # dims d and d+D/2 share a freq
    ang = (np.asarray(pos, dtype=np.float64) * float(rope_scale))[..., None] * inv
    cos, sin = np.cos(ang), np.sin(ang)
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def _kv_len_and_slots(b, indptr, length_info, page_size, sliding_window):
    """kv_chunk_len and the slot of every attended row for sequence ``b``."""
    npages = int(indptr[b + 1]) - int(indptr[b])
    if npages == 0:
        return 0, np.zeros(0, dtype=np.int64)
    if sliding_window:
        last, offset, sink = (int(length_info[r, b]) for r in range(3))
        n = (npages - 1) * page_size + last - offset + sink
    else:
        last = int(length_info[b])
        n = (npages - 1) * page_size + last
    n = max(n, 0)  # the kernels' row loops simply do not run for n <= 0
    rows = np.arange(n, dtype=np.int64)
    if sliding_window:
        slots = np.where(rows < sink, rows, rows - sink + offset)
    else:
        slots = rows
    if n and (slots.min() < 0 or slots.max() >= npages * page_size):
        raise ValueError(f"seq {b}: rows map outside its {npages} pages (slots {slots.min()}..{slots.max()})")
    return n, slots


def decode_attention_reference(
    q,
    pages,
    page_table_indptr,
    page_table_values,
    length_info,
    sm_scale,
    *,
    sliding_window=False,
    rotary_mode=0,
    rope_scale=1.0,
    rope_theta=1e4,
    q_rope_position=None,
    k_rope_pos_offset=None,
):
    """f64 paged decode attention; returns ``(output[B, H_qo, D], lse[B, H_qo])``.

    ``lse`` is log2-domain, including the kernels' phantom initial entry
    (``m=-5e4, d=1``), so an empty sequence yields ``output=0, lse=-5e4`` like
    TVM's CPU kernel.  With ``rotary_mode=1`` the RoPE'd Q/K are kept in f64
    (TVM rounds them to the qkv dtype, which matters only for f16 tolerances).
    ``q_rope_position`` defaults to ``kv_len - 1`` and ``k_rope_pos_offset`` to 0.
    """
    q = np.asarray(q).astype(np.float64)
    pages = np.asarray(pages)
    indptr = np.asarray(page_table_indptr).astype(np.int64)
    values = np.asarray(page_table_values).astype(np.int64)
    length_info = np.asarray(length_info).astype(np.int64)
    B, H_qo, D = q.shape
    num_pages, two, H_kv, page_size, D_kv = pages.shape
    if two != 2 or D_kv != D or H_qo % H_kv:
        raise ValueError(f"bad shapes q={q.shape} pages={pages.shape}")
    if indptr.shape != (B + 1,):
        raise ValueError("page_table_indptr must have shape [B+1]")
    if length_info.shape != ((3, B) if sliding_window else (B,)):
        raise ValueError(f"length_info shape {length_info.shape} does not match sliding_window={sliding_window}")
    group = H_qo // H_kv
    kv_head = np.arange(H_qo) // group
    scale = float(sm_scale) * LOG2E

    out = np.zeros((B, H_qo, D), dtype=np.float64)
    lse = np.zeros((B, H_qo), dtype=np.float64)
    for b in range(B):
        n, slots = _kv_len_and_slots(b, indptr, length_info, page_size, sliding_window)
        phys = values[indptr[b] + slots // page_size] if n else np.zeros(0, np.int64)
        if n and (phys.min() < 0 or phys.max() >= num_pages):
            raise ValueError(f"seq {b}: page id out of range")
        k = pages[phys, 0, :, slots % page_size, :].astype(np.float64)  # [n, H_kv, D]
        v = pages[phys, 1, :, slots % page_size, :].astype(np.float64)
        qb = q[b]
        if rotary_mode == 1:
            qpos = (n - 1 if q_rope_position is None else int(q_rope_position[b]))
            koff = 0 if k_rope_pos_offset is None else int(k_rope_pos_offset[b])
            qb = _rope_f64(qb, np.float64(qpos), rope_scale, rope_theta)
            k = _rope_f64(k, (koff + np.arange(n, dtype=np.float64))[:, None], rope_scale, rope_theta)
        elif rotary_mode != 0:
            raise ValueError("rotary_mode must be 0 or 1")
        # s[h, i] = q[h] . k[i, kv_head(h)] * sm_scale * log2(e)
        s = np.einsum("hd,ihd->hi", qb, k[:, kv_head, :]) * scale
        m = s.max(axis=1, initial=INIT_MAX)  # [H_qo], includes the phantom -5e4 entry
        p = np.exp2(s - m[:, None])
        d = INIT_DENOM * np.exp2(INIT_MAX - m) + p.sum(axis=1)
        out[b] = np.einsum("hi,ihd->hd", p, v[:, kv_head, :]) / d[:, None]
        lse[b] = m + np.log2(d)
    return out, lse


def decode_attention_f64(inputs, **rope):
    """The reference for a dict of inputs as `random_paged_inputs` (app.bench.harness) makes them."""
    return decode_attention_reference(
        inputs["q"], inputs["pages"], inputs["page_table_indptr"], inputs["page_table_values"],
        inputs["length_info"], inputs["sm_scale"], sliding_window=np.asarray(inputs["length_info"]).ndim == 2,
        q_rope_position=inputs.get("q_rope_position"), k_rope_pos_offset=inputs.get("k_rope_pos_offset"), **rope)
