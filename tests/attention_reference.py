"""Test inputs for paged decode attention, laid out the way TVM's PagedKVCache would, and the
self-check of the float64 reference (app.bench.reference) against TVM's CPU kernel
(`python tests/attention_reference.py`)."""

from __future__ import annotations

import math

import numpy as np

from app.bench.reference import (INIT_DENOM, INIT_MAX, LOG2E, decode_attention_reference,  # noqa: F401 (re-exported)
                                 relative_l2)


def _simulate_sliding_block(ctx_len, window, sink, page_size, chunks):
    """Replay TVM's PagedKVCache reserve/slide bookkeeping for one single-block sequence.

    Follows ``ReserveAppendLengthInSeq`` + ``SlideWindowForSequence`` +
    the append position map of ``paged_kv_cache.cc``: returns the logical page
    list (each a list of token ids per slot, -1 = empty), the stored length,
    ``sink_length`` and ``sliding_window_offset`` as the decode kernel sees them
    (the sliding-window decode path attends to the cache *before* appending the
    current token).
    """
    pages = []  # logical pages, slot -> token id
    L = sink_len = offset = 0
    seq_len = 0
    tok = 0
    for a in chunks:
        before = L
        tgt = -(-(L - sink_len + offset + a) // page_size)
        while len(pages) < tgt:
            pages.append([-1] * page_size)
        L += a
        seq_len += a
        if seq_len > window:  # slide
            to_slide = seq_len - window
            if sink > 0 and sink_len == 0:
                sink_len, offset = sink, sink
            n_sink_pages = -(-sink_len // page_size)
            pidx, pofs = divmod(offset + to_slide, page_size)
            while pidx > n_sink_pages:
                del pages[n_sink_pages]
                pidx -= 1
            assert pidx in (n_sink_pages - 1, n_sink_pages)
            seq_len = window
            L -= to_slide
            offset = pidx * page_size + pofs
            assert -(-(offset + L - sink_len) // page_size) == len(pages)
        for p in range(a):  # where each appended token is written
            pos_in_block = L - a + p
            if before + p < sink_len:
                slot = before + p
            elif pos_in_block < sink_len:
                slot = None  # slid out before it was written
            else:
                slot = pos_in_block - sink_len + offset
            if slot is not None:
                pages[slot // page_size][slot % page_size] = tok
            tok += 1
    assert tok == ctx_len
    return pages, L, sink_len, offset


def _sequence_layouts(rng, context_lens, page_size, sliding_window) -> list[tuple]:
    """Per sequence: (logical pages, each a list of token ids per slot (-1 = empty), stored length,
    sink_len, sliding_window_offset), without a window the tokens in order, with one replayed through
    TVM's reserve/slide bookkeeping (a prefill chunk, then single-token appends)."""
    layouts = []
    for n in context_lens:
        n = int(n)
        if sliding_window is None:
            np_ = -(-n // page_size)
            lp = [[t if t < n else -1 for t in range(i * page_size, (i + 1) * page_size)] for i in range(np_)]
            layouts.append((lp, n, 0, 0))
            continue
        W, S = int(sliding_window["window"]), int(sliding_window.get("sink", 0))
        if not 0 <= S < W:
            raise ValueError("need 0 <= sink < window")
        if n == 0:
            layouts.append(([], 0, 0, 0))
            continue
        first = sliding_window.get("prefill")
        first = int(rng.integers(1, n + 1)) if first is None else min(int(first), n)
        chunks = [first] + [1] * (n - first)
        layouts.append(_simulate_sliding_block(n, W, S, page_size, chunks))
    return layouts


def _attended_slots(kv_len, sink_len, offset):
    """The block slot of each attended row: the sink's rows, then the rest from the window's offset."""
    rows = np.arange(kv_len)
    return np.where(rows < sink_len, rows, rows - sink_len + offset)


def _page_table(layouts, phys, page_size) -> dict:
    """The page table over physical pages `phys` (taken in order), each sequence's last page length,
    window offset and sink, its stored length and the logical token of each attended row."""
    B, n_used = len(layouts), sum(len(lp) for lp, *_ in layouts)
    table = {"indptr": np.zeros(B + 1, dtype=np.int32), "values": np.zeros(n_used, dtype=np.int32),
             "last_len": np.zeros(B, dtype=np.int32), "offsets": np.zeros(B, dtype=np.int32),
             "sinks": np.zeros(B, dtype=np.int32), "kv_lens": [], "kept": []}
    pos = 0
    for b, (lp, L, sink_len, offset) in enumerate(layouts):
        table["values"][pos:pos + len(lp)] = phys[pos:pos + len(lp)]
        pos += len(lp)
        table["indptr"][b + 1] = pos
        # TVM: last_page_len = (L - sink + offset - 1) % page_size + 1, 0 for empty
        table["last_len"][b] = 0 if L == 0 else (L - sink_len + offset - 1) % page_size + 1
        table["offsets"][b], table["sinks"][b] = offset, sink_len
        table["kv_lens"].append(L)
        slots = _attended_slots(L, sink_len, offset)
        table["kept"].append(np.array([lp[s // page_size][s % page_size] for s in slots], dtype=np.int64))
    return table


def _fill_unused_slots(pages, layouts, table, page_size, fill) -> None:
    """Set every slot of `pages` that no sequence attends to `fill`, in place."""
    used = np.zeros((pages.shape[0], page_size), dtype=bool)
    for b, (_lp, L, sink_len, offset) in enumerate(layouts):
        slots = _attended_slots(L, sink_len, offset)
        used[table["values"][table["indptr"][b] + slots // page_size], slots % page_size] = True
    pages[np.broadcast_to(~used[:, None, None, :, None], pages.shape)] = fill


def make_paged_inputs(
    rng,
    context_lens,
    num_kv_heads,
    num_qo_heads,
    head_dim,
    dtype,
    page_size=16,
    shuffle=True,
    extra_pages=3,
    sliding_window=None,
    *,
    rope_offset_range=0,
    fill_unused=None,
):
    """Random paged decode inputs laid out the way TVM's PagedKVCache would.

    Without sliding window, ``context_lens[b]`` is the number of KV entries the
    kernel attends to (TVM appends the current token before the decode kernel,
    so it includes the query token itself; ``q_rope_position = len - 1``).

    With ``sliding_window={"window": W, "sink": S}`` (``0 <= S < W``; optional
    ``"prefill"``: size of the first append, default random in [1, len]), each
    sequence is replayed through TVM's reserve/slide bookkeeping: a prefill
    chunk followed by single-token appends totalling ``context_lens[b]`` tokens.
    The kernel then attends to ``min(len, W)`` entries (the first ``S`` tokens as
    sink + the most recent ``W - S``), with ``q_rope_position`` = that stored
    length (TVM's sliding path runs the paged kernel before appending).
    ``k_rope_pos_offset`` is 0 (one block per sequence) unless
    ``rope_offset_range > 0``, which adds a random per-sequence shift to both.

    Physical page ids are a random permutation (``shuffle``) with ``extra_pages``
    pages never referenced.  Slots not referenced are random noise, or
    ``fill_unused`` if given (e.g. a huge value to catch stray reads).
    q, k, v ~ N(0, 1) and ``sm_scale = 1/sqrt(D)``, so scores are ~N(0, 1).
    Returns a dict; ``kept_tokens[b]`` lists the logical token index of every
    attended row, in row order.
    """
    B = len(context_lens)
    if num_qo_heads % num_kv_heads:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    layouts = _sequence_layouts(rng, context_lens, page_size, sliding_window)
    num_pages = sum(len(lp) for lp, *_ in layouts) + int(extra_pages)
    phys = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    table = _page_table(layouts, phys, page_size)
    kv_lens = table["kv_lens"]

    D = head_dim
    q = rng.standard_normal((B, num_qo_heads, D)).astype(dtype)
    pages = rng.standard_normal((num_pages, 2, num_kv_heads, page_size, D)).astype(dtype)
    if fill_unused is not None:
        _fill_unused_slots(pages, layouts, table, page_size, fill_unused)

    koff = np.zeros(B, dtype=np.int32)
    if rope_offset_range:
        koff = rng.integers(0, int(rope_offset_range), size=B).astype(np.int32)
    if sliding_window is None:
        qpos = np.array([max(L - 1, 0) for L in kv_lens], dtype=np.int32) + koff
        length_info = table["last_len"]
    else:
        qpos = np.array(kv_lens, dtype=np.int32) + koff
        length_info = np.stack([table["last_len"], table["offsets"], table["sinks"]]).astype(np.int32)

    return {
        "q": q,
        "pages": pages,
        "page_table_indptr": table["indptr"],
        "page_table_values": table["values"],
        "length_info": length_info,
        "context_lens": [int(n) for n in context_lens],
        "kv_lens": kv_lens,
        "kept_tokens": table["kept"],
        "sliding_window": sliding_window is not None,
        "sm_scale": 1.0 / math.sqrt(D),
        "q_rope_position": qpos,
        "k_rope_pos_offset": koff,
        "page_size": page_size,
    }


def sub_batch(inputs: dict, keep: list[int]) -> dict:
    """Sequences `keep` of a batch from make_paged_inputs, on the same pages: the reference's rows
    `keep` are theirs."""
    indptr = inputs["page_table_indptr"]
    values = [inputs["page_table_values"][indptr[b]:indptr[b + 1]] for b in keep]
    return {**inputs, "q": inputs["q"][keep],
            "page_table_indptr": np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int32),
            "page_table_values": np.concatenate(values).astype(np.int32),
            "length_info": inputs["length_info"][..., keep],
            "context_lens": [inputs["context_lens"][b] for b in keep], "kv_lens": [inputs["kv_lens"][b] for b in keep],
            "kept_tokens": [inputs["kept_tokens"][b] for b in keep],
            "q_rope_position": inputs["q_rope_position"][keep], "k_rope_pos_offset": inputs["k_rope_pos_offset"][keep]}


if __name__ == "__main__":
    import time

    import tvm
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

    t0 = time.time()
    rng = np.random.default_rng(0)
    PS = 16

    # The simulated sliding layout keeps exactly the sink + most recent tokens.
    for W, S, n, pre in [(64, 4, 300, 1), (64, 4, 300, 200), (40, 0, 77, None), (48, 20, 49, 49), (33, 17, 500, 3)]:
        d = make_paged_inputs(rng, [n], 1, 1, 8, np.float32, page_size=PS,
                              sliding_window={"window": W, "sink": S, "prefill": pre})
        want = list(range(min(S, n))) + list(range(max(n - (W - S), S), n)) if n > W else list(range(n))
        assert d["kept_tokens"][0].tolist() == want, (W, S, n, pre, d["kept_tokens"][0].tolist())

    def run_tvm(fn, d, rotary_mode, rope_scale, rope_theta):
        dev = tvm.cpu()
        B, H, D = d["q"].shape
        t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
        out = t(np.zeros((B, H, D), np.float32))
        lse = t(np.zeros((B, H), np.float32))
        fn(t(d["q"]), t(d["pages"]), t(d["page_table_indptr"]), t(d["page_table_values"]),
           t(d["length_info"]), t(d["k_rope_pos_offset"]), t(d["q_rope_position"]), out, lse,
           rotary_mode, rope_scale, rope_theta, d["sm_scale"])
        return out.numpy(), lse.numpy()

    worst_o = worst_l = 0.0
    n_cases = 0
    for D in (64, 128):
        for h_kv, h_qo in ((4, 4), (2, 8)):
            for sw in (None, {"window": 64, "sink": 4}, {"window": 40, "sink": 0}):
                sliding = sw is not None
                f = _attention_decode_cpu(h_kv, h_qo, D, "float32", sliding, {}, PS)
                ex = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
                fn = ex["batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding else "")]
                for rotary_mode, rope_offset in ((0, 0), (1, 0), (1, 1000)):
                    d = make_paged_inputs(rng, [1, 17, 300, 0, 45], h_kv, h_qo, D, np.float32,
                                          page_size=PS, sliding_window=sw, rope_offset_range=rope_offset,
                                          fill_unused=1e4)
                    rs, rt = (1.0, 1e4) if rotary_mode == 0 or rope_offset == 0 else (0.5, 5e5)
                    o_t, l_t = run_tvm(fn, d, rotary_mode, rs, rt)
                    o_r, l_r = decode_attention_reference(
                        d["q"], d["pages"], d["page_table_indptr"], d["page_table_values"],
                        d["length_info"], d["sm_scale"], sliding_window=sliding,
                        rotary_mode=rotary_mode, rope_scale=rs, rope_theta=rt,
                        q_rope_position=d["q_rope_position"], k_rope_pos_offset=d["k_rope_pos_offset"])
                    ne = [b for b, n in enumerate(d["kv_lens"]) if n > 0]
                    e = [b for b, n in enumerate(d["kv_lens"]) if n == 0]
                    err_o = relative_l2(o_t[ne], o_r[ne])
                    err_l = relative_l2(l_t[ne], l_r[ne])
                    # empty context: output exactly 0 and lse exactly -5e4 in both
                    assert np.all(o_t[e] == 0) and np.all(o_r[e] == 0)
                    assert np.all(l_t[e] == INIT_MAX) and np.all(l_r[e] == INIT_MAX)
                    assert err_o < 1e-5 and err_l < 1e-5, (D, h_kv, h_qo, sw, rotary_mode, err_o, err_l)
                    worst_o, worst_l = max(worst_o, err_o), max(worst_l, err_l)
                    n_cases += 1
    print(f"{n_cases} cases vs TVM _attention_decode_cpu (float32): "
          f"max rel L2 output {worst_o:.3e}, lse {worst_l:.3e}; empty-context exact; "
          f"{time.time() - t0:.1f}s")


def wgsl_block(wgsl: str, header: str) -> str:
    """The `{ ... }` block of WGSL that follows the first `header` (e.g. a loop), braces included."""
    start = wgsl.index(header)
    depth, i = 0, wgsl.index("{", start)
    for j in range(i, len(wgsl)):
        depth += {"{": 1, "}": -1}.get(wgsl[j], 0)
        if depth == 0:
            return wgsl[i:j + 1]
    raise AssertionError("unbalanced braces")
