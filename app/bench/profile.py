"""`python -m app bench decode --profile`: where a decode step's GPU time goes, per kernel role.

One greedy decode step after a C-token context is encoded with every dispatch in a timed compute
pass of its own (LlamaModel.profile_decode_step), `--profile-repeats` times, or with `--profile-in-pass`
(adapters that write timestamps inside passes) all in one pass, as a step runs, each bracketed by
timestamps there, so that a dispatch's figure holds no pass of its own. Each dispatch's median
is corrected by the cost of an empty timed span (measured in the same run, the same way) and summed per role
(embed, norm_qkv, rope_append, attention, merge, o_residual, norm_gate_up_swiglu, down_residual,
norm_lm_head, argmax). Beside each role: the bytes it reads (weights, or the K/V of the context), the
GB/s that makes, the time those bytes need at the streaming bandwidth measured in the same run, and
the one-dispatch floor (a timed pass holding one tiny dispatch) times the role's dispatches. The
profiled sum is checked against the GPU time of the same context's ordinary decode steps, whose
passes are fewer (each layer's attention is its own timed pass there).

Timing a dispatch alone adds its own cost (a pass, or timestamps that wait for the GPU to drain), so
each role also gets its cost inside the step ("in step"): the step as one pass, against the same pass
with that role's dispatches left out (LlamaModel.time_decode_step_leaving_out), run between two whole
steps in one submission (`in_step_costs`). It holds the role's barriers and tails, which is what
leaving the role out would save. The passes without a role compute on stale inputs, so the figure
assumes a kernel's speed does not depend on its data. On a CPU rasterizer a role much smaller than
the step is lost in the noise.
"""

from __future__ import annotations

import random
import statistics

from app.bench.attention import dispatch_floor, ramp_clocks, stream_bandwidth
from model_glue.gpu.webgpu import BufferSlice
from model_glue.model.generate import generate

EMPTY_PASS_CALLS = 64


async def empty_pass_seconds(device, calls: int = EMPTY_PASS_CALLS, in_pass: bool = False) -> float:
    """Median of a timed compute pass that holds no dispatch (`in_pass`: of two timestamps written
    with nothing between them inside a pass): what timing a dispatch alone adds."""
    stamps = device.timestamps(2 * calls)
    batch = device.batch()
    for i in range(calls):
        with batch.timed((stamps, 2 * i, 2 * i + 1), own_pass=not in_pass):
            pass
    batch.resolve(stamps)
    batch.submit()
    ticks = await stamps.read_ns()
    return statistics.median(ticks[2 * i + 1] - ticks[2 * i] for i in range(calls)) * 1e-9


def role_of(model, library, name: str) -> str:
    """The role a dispatched kernel plays in `model`'s step (model kernels are shared across shapes
    and roles, so the model's own map says, not the kernel's manifest entry)."""
    roles = sorted({role.removesuffix("_decode") for role, kernel in model.kernel_names.items() if kernel == name})
    if roles:
        return "/".join(roles)
    meta = library.specs[name].meta
    return {"decode_attention": "attention", "decode_attention_merge": "merge"}.get(meta.get("kind"), name)


def bytes_read(model, library, name: str, buffers: dict, context: int) -> int:
    """Bytes a dispatch must read: the weights it binds, and attention's K/V over the context
    (activations of one token are a few KiB)."""
    weights = {id(buffer) for buffer in model.weights.values()}
    bound = [(b.buffer, b.size) if isinstance(b, BufferSlice) else (b, b.size) for b in buffers.values()]
    total = sum(size for buffer, size in bound if id(buffer) in weights)  # a vocabulary slice's share (contract.slices)
    if role_of(model, library, name) == "embed":  # one row of the table (over a sliced vocabulary's dispatches)
        return total // model.config.vocab_size
    if library.specs[name].meta.get("kind") == "decode_attention":
        c = model.config
        total += context * c.n_kv_heads * c.head_dim * 2 * model.esize
    return total


async def profile_contexts(model, device, library, contexts, repeats: int, iters: int = 50,
                           in_pass: bool = False) -> dict:
    """The per-role profile of one decode step at each context (see the module docstring)."""
    await ramp_clocks(device, library)
    stream_gbps = await stream_bandwidth(device, library, iters, "timestamps")
    floor, _ = await dispatch_floor(device, library, iters, "timestamps")
    empty = await empty_pass_seconds(device, in_pass=in_pass)
    rng = random.Random(1)
    results = []
    for context in contexts:
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(context)]
        samples, stamps, ordinary = None, None, []
        for repeat in range(repeats):
            model.reset()
            run = await generate(model, prompt, max_new_tokens=4)
            decode = [s for s in run.stats if s.kind == "decode"]
            ordinary += [s.gpu_ms for s in decode if s.gpu_ms is not None]
            if stamps is None:
                stamps = device.timestamps(2 * decode[-1].dispatches)
            step_context = model.kv.length + 1  # the profiled step's own token attends too
            if repeat == repeats - 1:
                whole_ms, in_step = await in_step_costs(model, device, library, repeats)
            choice, dispatches = await model.profile_decode_step(stamps, in_pass)
            if samples is None:
                samples = [(name, buffers, []) for name, buffers, _ in dispatches]
            for (_, _, ns), (_, _, kept) in zip(dispatches, samples):
                kept.append(ns)
        roles: dict[str, dict] = {}
        for name, buffers, ns in samples:
            role = roles.setdefault(role_of(model, library, name), {"dispatches": 0, "us": 0.0, "bytes": 0})
            role["dispatches"] += 1
            role["us"] += max(statistics.median(ns) * 1e-9 - empty, 0.0) * 1e6
            role["bytes"] += bytes_read(model, library, name, buffers, step_context)
        for name, role in roles.items():
            role["in_step_us"] = in_step[name]
            role["gb_s"] = role["bytes"] / (role["us"] * 1e-6) / 1e9 if role["us"] else None
            role["stream_us"] = role["bytes"] / (stream_gbps * 1e9) * 1e6
            role["floor_us"] = role["dispatches"] * floor * 1e6
            # the bar a role is held to: within max(2x its bytes at streaming bandwidth, 1.5x its floor)
            role["target_us"] = max(2 * role["stream_us"], 1.5 * role["floor_us"])
        results.append({"context": context, "step_context": step_context, "attention": str(choice), "roles": roles,
                        "profiled_sum_ms": sum(r["us"] for r in roles.values()) / 1e3, "one_pass_step_ms": whole_ms,
                        "ordinary_step_gpu_ms": statistics.median(ordinary) if ordinary else None})
    return {"stream_gbps": stream_gbps, "one_dispatch_floor_us": floor * 1e6, "empty_pass_us": empty * 1e6,
            "repeats": repeats, "in_pass": in_pass, "contexts": results}


async def in_step_costs(model, device, library, rounds: int) -> tuple[float, dict[str, float]]:
    """The whole step's GPU ms as one pass, and each role's cost inside it in us (module docstring):
    `rounds` submissions, each a warm-up pass (a submission's first pass runs slower), then the whole
    step and the step without each role in turn, so that every pass without a role sits between two
    whole steps, whose mean it is held against; the medians over the rounds."""
    names, _ = await model.time_decode_step_leaving_out(device.timestamps(2), [frozenset()])
    kernels_of: dict[str, set[str]] = {}
    for name in names:
        kernels_of.setdefault(role_of(model, library, name), set()).add(name)
    leave_outs = [frozenset()]
    for kernels in kernels_of.values():
        leave_outs += [frozenset(), frozenset(kernels)]
    leave_outs.append(frozenset())
    stamps = device.timestamps(2 * len(leave_outs))
    wholes, costs = [], {role: [] for role in kernels_of}
    for _ in range(rounds):
        _, times = await model.time_decode_step_leaving_out(stamps, leave_outs)
        wholes += times[1::2]
        for j, role in enumerate(kernels_of):
            costs[role].append((times[1 + 2 * j] + times[3 + 2 * j]) / 2 - times[2 + 2 * j])
    return statistics.median(wholes) * 1e3, {role: statistics.median(c) * 1e6 for role, c in costs.items()}


def print_profile(profile: dict) -> None:
    timed = ("each dispatch timed inside the step's one pass; an empty timed span" if profile["in_pass"]
             else "each dispatch timed in a pass of its own; an empty timed pass")
    print(f"profile: streaming read {profile['stream_gbps']:.1f} GB/s; a timed pass with one tiny dispatch "
          f"{profile['one_dispatch_floor_us']:.2f} us; {timed} {profile['empty_pass_us']:.2f} us "
          f"(subtracted from each dispatch); median of {profile['repeats']} profiled steps", flush=True)
    for row in profile["contexts"]:
        print(f"context {row['context']} (step at {row['step_context']}, {row['attention']}): profiled sum {row['profiled_sum_ms']:.3f} ms, "
              f"ordinary step GPU {row['ordinary_step_gpu_ms'] or float('nan'):.3f} ms, the step as one pass "
              f"{row['one_pass_step_ms']:.3f} ms (in step: that pass without the role's dispatches, the difference)")
        print(f"  {'role':>20} {'n':>4} {'GPU us':>9} {'in step':>9} {'MB read':>9} {'GB/s':>8} {'stream us':>9} "
              f"{'floor us':>9} {'target us':>9}")
        for name, r in sorted(row["roles"].items(), key=lambda item: -item[1]["us"]):
            gbs = "-" if r["gb_s"] is None else f"{r['gb_s']:.1f}"
            print(f"  {name:>20} {r['dispatches']:>4} {r['us']:>9.1f} {r['in_step_us']:>9.1f} {r['bytes'] / 1e6:>9.3f} "
                  f"{gbs:>8} {r['stream_us']:>9.1f} {r['floor_us']:>9.1f} {r['target_us']:>9.1f}", flush=True)
