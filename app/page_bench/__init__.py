"""The page's benchmarks and diagnostics, which run in the page's Python worker only when asked and
are never in the page's wheel: the test hook app/hooks/bench.js (?hooks=bench, served only by the
tests' and the benchmarks' server) copies this package into the worker as `page_bench`; natively it
is `app.page_bench` (`python -m app bench prefill`, the tests).

`CALLS` is what the hook's `bench(name, args)` runs (`window.demo.bench` in the page): each an async
function of the page's chat and keyword arguments, whose result goes back as JSON. `FILES` are the
package's modules, which the hook copies (imports inside it are relative: its name differs there).
"""

from __future__ import annotations

import json

from . import decode, prefill_check

FILES = ["__init__.py", "decode.py", "prefill_check.py"]  # JSON as written: the hook reads this line


async def _builds(chat) -> dict:
    return {"dtype": chat.model.dtype, "matrix": chat.model.has_prefill_matrix}


async def _check_prefill_kernels(chat, seed: int = 0) -> list[dict]:
    return await prefill_check.check_prefill_kernels(chat.model, seed)


async def _time_prefill_kernels(chat) -> list[dict]:
    return await prefill_check.time_prefill_kernels(chat.model)


async def _prefill_benchmark(chat, tokens: list[int], matrix: bool) -> dict:
    return await prefill_check.prefill_benchmark(chat.model, tokens=tuple(tokens), matrix=matrix)


CALLS = {
    "prefill_builds": _builds,  # the loaded model's dtype and whether it has the subgroup-matrix builds
    "check_prefill_kernels": _check_prefill_kernels,
    "time_prefill_kernels": _time_prefill_kernels,
    "prefill_benchmark": _prefill_benchmark,
    "matrix_agreement": prefill_check.matrix_agreement,
    "decode_encode_benchmark": decode.decode_encode_benchmark,
}


async def call(name: str, chat, args_json: str) -> str:
    """Run CALLS[name] on the page's chat with the JSON-encoded keyword arguments; its result as JSON."""
    if name not in CALLS:
        raise ValueError(f"no page benchmark {name!r} (app/page_bench: {', '.join(CALLS)})")
    return json.dumps(await CALLS[name](chat, **json.loads(args_json or "{}")))
