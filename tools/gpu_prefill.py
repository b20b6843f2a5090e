#!/usr/bin/env python3
"""The page's prefill on a GPU machine, through ../shared/tools/gpu-page's driver (as tools/gpu_lab.py).

After gpu_page.py's `receive` (pieces 1-2; 3-4 too for smollm2) and `gl` steps, on the GPU machine:
  python3 tools/gpu_prefill.py [--models synthetic:llama-3.1-8b,...] [--set blog-f16] [--rounds 2]
For each model it opens the page (?model=M&hooks=python,bench) and, in the page's Python worker
(app/page_bench/prefill_check.py, copied into the worker by ?hooks=bench): checks every prefill kernel build the model runs (matmuls and attention)
against float64, times each at full size, runs the prefill benchmark with the subgroup-matrix builds and the scalar kernels in
turn (`--rounds` times each, alternating), and for real weights compares the two builds' greedy
replies to the long document. Writes $OUT/prefill-<model>.json and prints a table.
Standard library only, like gpu_page.py, which it imports from .cr/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / ".cr"))
import gpu_page  # noqa: E402 (the driver bundle.sh copies to .cr/)
from gpu_lab import start_server  # noqa: E402


def in_page(tab, code: str, timeout: float):
    """Python run in the page's worker (the test hook), its JSON result decoded."""
    return json.loads(tab.eval(f"window.demo.python({json.dumps(code)})", timeout=timeout))


def run(model: str, flag_set: str, rounds: int, tokens: str, timeout: float, agreement_tokens: int,
        context: int, diagnose_only: bool = False, diagnose: bool = True, short_tile_max: tuple[int, ...] = (),
        force_diagnosis: bool = False) -> dict:
    httpd, base = start_server()
    browser = gpu_page.Browser(gpu_page.flags_for(flag_set), gpu_page.OUT / "chromium-prefill.log",
                               gpu_page.chromium_env())
    out: dict = {"model": model, "flag_set": flag_set}
    try:
        tab = browser.new_tab()
        tab.goto(f"{base}/?model={model}&context={context}&hooks=python,bench")
        tab.wait("window.demoState && (window.demoState.chatReady || window.demoState.error)", timeout)
        if tab.eval("window.demoState.error || null"):
            raise RuntimeError(tab.eval("window.demoState.error"))
        out["load_s"] = round(time.time() - tab.t0, 2)
        out["device"] = tab.eval("window.demoState.device")
        out["adapter_panel"] = tab.eval("document.getElementById('adapter').innerText")
        setup = "import json, page_bench.prefill_check as pc; model = chat.model\n"
        out["loaded"] = in_page(tab, setup + "json.dumps({'dtype': model.dtype, 'matrix': model.has_prefill_matrix, "
                                "'why_not': model.prefill_matrix_why_not})", 60)
        print(f"{model}: {json.dumps(out['loaded'])}", flush=True)
        out["check"] = in_page(tab, "json.dumps(await pc.check_prefill_kernels(model))", timeout)
        for r in out["check"]:
            print(f"  check {r['kernel']:>44} n={r['tokens']:>4}: rel L2 {r['rel_l2']:.2e} {'ok' if r['ok'] else 'WRONG'}",
                  flush=True)
        attention_ok = [r["ok"] for r in out["check"] if r["role"] == "attention" and r["matrix"]]
        matrix_attention = bool(attention_ok) and all(attention_ok)
        passing = None
        if attention_ok and (not all(attention_ok) or force_diagnosis) and diagnose:
            out["diagnosis"], passing = diagnose_attention(tab, timeout)
            if diagnose_only:
                return out
        if passing is not None:
            label, text = passing  # the rest of the run times the variant that passed every case
            install_attention(tab, text, timeout)
            out["attention_variant"] = label
            matrix_attention = True
            print(f"  the timings and benchmarks below run the matrix attention's variant {label}", flush=True)
        out["timed"] = in_page(tab, "json.dumps(await pc.time_prefill_kernels(model))", timeout)
        for r in out["timed"]:
            print(f"  timed {r['kernel']:>44} {r['shape']:>22}: {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s", flush=True)
        out["bench"] = []
        paths = [(True, True)] * matrix_attention + [(True, False)] * out["loaded"]["matrix"] + [(False, False)]
        for i in range(rounds):
            for matrix, attention in paths:
                bench = in_page(tab, f"json.dumps(await pc.prefill_benchmark(model, tokens=({tokens},), "
                                     f"matrix={matrix}, attention_matrix={attention}))", timeout)
                bench["round"] = i
                out["bench"].append(bench)
                for r in bench["rows"]:
                    print(f"  bench round {i} matrix={matrix!s:5} attention={bench['prefill_attention']:>7} "
                          f"{r['turn']:>9} {r['tokens']:>5} tok: GPU "
                          f"{r['gpu_ms']:8.2f} ms (attention {r['attention_ms']:7.2f}) {r['tok_s_gpu'] or 0:9.0f} "
                          f"tok/s, TTFT {r['ttft_ms']:8.1f} ms  [{r['kernel']}]", flush=True)
        for most in short_tile_max:  # the follow-ups again, the short token tile run by passes of up to `most` tokens
            bench = in_page(tab, setup + "import model_glue.policy as ck\n"
                                 "saved = ck.SHORT_TILE_MAX_TOKENS, ck.MATRIX_SHORT_TILE_MAX_TOKENS\n"
                                 f"ck.SHORT_TILE_MAX_TOKENS = ck.MATRIX_SHORT_TILE_MAX_TOKENS = {most}\n"
                                 f"try:\n  out = await pc.prefill_benchmark(model, tokens=(), matrix=None, "
                                 f"attention_matrix={matrix_attention})\nfinally:\n"
                                 "  ck.SHORT_TILE_MAX_TOKENS, ck.MATRIX_SHORT_TILE_MAX_TOKENS = saved\n"
                                 "json.dumps(out)", timeout)
            bench["short_tile_max"] = most
            out["bench"].append(bench)
            for r in bench["rows"]:
                print(f"  bench short tile up to {most:>3} tokens {r['turn']:>26} {r['tokens']:>5} tok: GPU "
                      f"{r['gpu_ms']:8.2f} ms (attention {r['attention_ms']:7.2f})  [{r['kernel']}]", flush=True)
        if agreement_tokens and out["loaded"]["matrix"] and not model.startswith("synthetic"):
            text = (gpu_page.SITE / "static" / "long_document.txt").read_text()
            out["agreement"] = in_page(tab, f"json.dumps(await pc.matrix_agreement(chat, {json.dumps(text)}, "
                                            f"{agreement_tokens}, attention={matrix_attention}))", timeout)
            print(f"  agreement: {json.dumps({k: v for k, v in out['agreement'].items() if 'text' not in k})}",
                  flush=True)
            out["golden"] = in_page(tab, "json.dumps(await pc.matrix_agreement(chat, "
                                         f"'What is the capital of France?', 12, attention={matrix_attention}))",
                                    timeout)
            print(f"  golden: {json.dumps(out['golden'])}", flush=True)
        return out
    finally:
        browser.close()
        httpd.shutdown()


# (start, new tokens) cases that separate the matrix attention's stages: one key tile (no loop state),
# several tiles (K/V read ahead, Q held, P over K), a cached prefix; with K growing along the context
# (the lazy rescale of O runs) and without (it almost never does)
DIAGNOSIS_CASES = ((0, 8), (0, 64), (300, 20))


def partly_emulated(wgsl: str, emulate: str) -> str:
    """The matrix attention's WGSL with one of its two fragment chains emulated: "S" (Q's fragments,
    S = Q K^T and its store) or "PV" (O's fragments, P V, O's stores and loads); the other stays on
    the hardware's builtins. The chains meet only in workgroup memory, so each can be swapped alone."""
    from tests import matrix_emulation as em

    head, rest = wgsl.split("  var q0 = ", 1)
    q_decls, rest = rest.split("  var o0 = ", 1)
    o_decls, rest = rest.split("  var m = ", 1)
    loop_head, rest = rest.split("    // S = Q K^T", 1)
    s_part, rest = rest.split("    // this lane's half", 1)
    softmax, pv_part = rest.split("    if (workgroupUniformLoad(&rescale", 1)
    parts = {"S": ["  var q0 = " + q_decls, "    // S = Q K^T" + s_part],
             "PV": ["  var o0 = " + o_decls, "    if (workgroupUniformLoad(&rescale" + pv_part]}

    def swap(text: str) -> str:
        text = em._LEFT.sub(lambda m: f"load_left_{m[1]}({em.LANE}, ", text)
        text = em._RIGHT.sub("Right(", text)
        text = em._RESULT_LOAD.sub(lambda m: f"load_result_{m[1]}({em.LANE}, ", text)
        text = em._STORE.sub(lambda m: f"store_{m[1]}({em.LANE}, ", text)
        text = text.replace(f"subgroup_matrix_result<f32, {em.FRAG}, {em.FRAG}>()", "Accumulator()")
        return text.replace("subgroupMatrixMultiplyAccumulate(", f"multiply_accumulate({em.LANE}, ")

    parts[emulate] = [swap(p) for p in parts[emulate]]
    functions = em._functions(["kv_tile"], ["kv_tile"], ["scores"])
    head = head.replace("enable chromium_experimental_subgroup_matrix;\n",
                        "enable chromium_experimental_subgroup_matrix;\n" + functions)
    return (head + parts["S"][0] + parts["PV"][0] + "  var m = " + loop_head + parts["S"][1] + "    // this lane's half"
            + softmax + parts["PV"][1])


def diagnose_attention(tab, timeout: float) -> tuple[list[dict], tuple[str, str] | None]:
    """Where the matrix prefill attention goes wrong, on this GPU: the check per case, K growing and
    not, for the artifact's build with the hardware's builtins, with them emulated (tests/matrix_emulation:
    the kernel's own code on plain WGSL, so a fault in its logic or races shows apart from one in how
    the builtins behave here), with one fragment chain emulated at a time, and the variants
    tools/diag/make_variants.py wrote for this kernel (tools/diag/<variant>__<kernel>.wgsl)."""
    setup = ("import json, asyncio, page_bench.prefill_check as pc; from model_glue.gpu.kernel import Kernel\n"
             "model = chat.model\n"
             "name = model.attention.prefill_matrix\n")
    info = in_page(tab, setup + "json.dumps({'name': name, 'wgsl': model.library.specs[name].wgsl})", 60)
    wgsl = (gpu_page.SITE / "static" / "artifacts" / "kernels" / info["wgsl"]).read_text()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.matrix_emulation import emulated  # noqa: E402 (standard library only)

    builds = [("hardware", None), ("emulated", emulated(wgsl)), ("S emulated", partly_emulated(wgsl, "S")),
              ("PV emulated", partly_emulated(wgsl, "PV"))]
    builds += [(path.name.split("__")[0], path.read_text())
               for path in sorted((Path(__file__).resolve().parent / "diag").glob(f"*__{info['name']}.wgsl"))]
    rows, passing = [], None
    for label, text in builds:
        if text is not None:  # the library's compiled kernel replaced by this WGSL's
            try:
                install_attention(tab, text, timeout)
            except Exception as err:  # noqa: BLE001 (report, go on with the next build)
                print(f"  diagnose {label}: does not compile: {err}", flush=True)
                rows.append({"builtins": label, "error": str(err)})
                continue
        for growth in (128, 1e12):
            code = (setup + f"pc.ATTENTION_CASES = {DIAGNOSIS_CASES!r}; pc.KEY_GROWTH = {growth!r}\n"
                    "json.dumps(await pc.check_prefill_attention(model))")
            for r in in_page(tab, code, timeout):
                if not r["matrix"] and label != "hardware":
                    continue
                r.update(key_growth=growth, builtins=label)
                rows.append(r)
                print(f"  diagnose {label:>12} growth={growth:g} {'matrix' if r['matrix'] else 'scalar':>6} "
                      f"start={r['start']:>3} n={r['tokens']:>3}: rel L2 {r['rel_l2']:.2e} "
                      f"{'ok' if r['ok'] else 'WRONG'}", flush=True)
        mine = [r["ok"] for r in rows if r.get("builtins") == label and r.get("matrix")]
        if passing is None and label not in ("hardware", "emulated") and mine and all(mine) and "emulated" not in label:
            passing = (label, text)
    # the artifact's build again, and no pass plan bound to a variant's kernel
    in_page(tab, setup + "import importlib; importlib.reload(pc); model.library._compiled.pop(name, None)\n"
            "model._attention_compiled.pop(name, None); await model._compile_attention_kernels([name])\n"
            "model._drop_plans()\njson.dumps(0)", 60)
    return rows, passing


def install_attention(tab, wgsl: str, timeout: float) -> None:
    """The page's model runs `wgsl` as its matrix prefill attention (same ABI) from now on."""
    in_page(tab, "import json, asyncio; from model_glue.gpu.kernel import Kernel\nmodel = chat.model\n"
            "name = model.attention.prefill_matrix\nspec = model.library.specs[name]\n"
            f"kernel = await Kernel.compile(model.device, spec, {json.dumps(wgsl)})\n"
            "done = asyncio.get_event_loop().create_future(); done.set_result(kernel)\n"
            "model.library._compiled[name] = done\nmodel._attention_compiled.pop(name, None)\njson.dumps(name)", timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="synthetic:llama-3.1-8b,synthetic:llama-3.2-1b")
    parser.add_argument("--set", default="blog-f16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", default="512,1536,3060,8000")
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--diagnose-only", action="store_true",
                        help="where the matrix attention fails its check: the diagnosis, then the next model")
    parser.add_argument("--no-diagnosis", action="store_true",
                        help="where the matrix attention fails its check, go on to the benchmarks without diagnosing it")
    parser.add_argument("--force-diagnosis", action="store_true",
                        help="the diagnosis also where the matrix attention passes (its variants as controls)")
    parser.add_argument("--context", type=int, default=8192, help="the page's ?context= (the KV cache's tokens)")
    parser.add_argument("--short-tile-max", default="",
                        help="comma-separated: the follow-up turns again with the matmuls' short token tile run by "
                             "passes of up to this many tokens (model_glue.policy.SHORT_TILE_MAX_TOKENS and its matrix twin)")
    args = parser.parse_args()
    gpu_page.OUT.mkdir(parents=True, exist_ok=True)
    gpu_page.ensure_wrapper()
    status = 0
    for model in args.models.split(","):
        try:
            out = run(model, args.set, args.rounds, args.tokens, args.timeout, args.agreement_tokens, args.context,
                      args.diagnose_only, not args.no_diagnosis,
                      tuple(int(v) for v in args.short_tile_max.split(",") if v), args.force_diagnosis)
        except Exception as err:  # noqa: BLE001 (report, go on with the next model)
            print(f"{model}: FAILED {type(err).__name__}: {err}", flush=True)
            out, status = {"model": model, "error": f"{type(err).__name__}: {err}"}, 1
        name = model.replace(":", "-")
        (gpu_page.OUT / f"prefill-{name}.json").write_text(json.dumps(out, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
