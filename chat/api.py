"""The page-to-Python boundary, declared once: the worker's calls, the step fields, the constants.

static/python_worker.js runs a message {id, call, args} through `CALLS`: a call's `function` in
chat.page gets the worker's handles named in `handles`, then the page's `args` by name, then one
callback per kind in `events` (each posts an event {id, kind, value} to the page while the call
runs; one called with several values posts them as an array). A call marked `worker` does more in
the worker than that one function (fetching the weights, watching the device), so the worker gives
it a handler of its own. static/python.js refuses a call, an argument or an event handler the
declaration does not name.

STEP_FIELDS are StepStats' fields: the per-step dict the "step" events carry and the columns the
export writes (static/export.js, static/overlay.js). `constants()` are the runtime's numbers and
strings the page shows or checks against.

`page_api_js()` writes all of it as an ES module; `make` writes it to static/page_api.js (generated,
never committed) and `python -m app check` says when that file no longer matches this module.
tests/test_page_boundary.py checks chat.page's signatures and the page's JS against it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from chat.session import DEFAULT_MAX_NEW_TOKENS
from contract.kernels import MAX_TOP_K
from model_glue.options import option_kinds
from model_glue.policy import TILED_MAX_CONTEXT
from model_glue.model.generate import STOPPED_IN_PREFILL
from model_glue.model.step_stats import STEP_FIELDS

PAGE_API_FILE = "page_api.js"  # under static/


@dataclass(frozen=True)
class Call:
    """One call the page makes into the worker (`python.call(name, args, on)`)."""

    name: str  # what the page passes to python.call
    function: str | None  # the chat.page function it runs (None: the worker's own work, no Python)
    handles: tuple[str, ...] = ()  # the worker's handles ("session", "chat") passed first
    args: tuple[str, ...] = ()  # the page's arguments, passed next in this order
    events: tuple[str, ...] = ()  # event kinds streamed while it runs (chat.page: one `on_<kind>` callback each)
    worker: bool = False  # the worker does more than call `function`: a handler of its own in python_worker.js


CALLS = (
    # loads Pyodide, the project's wheel and the test hooks the page asks for (names: HOOKS_PATH)
    Call("boot", None, args=("hooks",), events=("progress",), worker=True),
    # opens WebGPU and the kernel artifact; also starts chat.page.watch_device and returns describe_device
    Call("openSession", "open_session", args=("kernelsUrl",), worker=True),
    Call("selfTest", "self_test", handles=("session",)),
    Call("labDefaults", "lab_defaults", handles=("session",)),
    # fetches the weights through the browser's cache first, then loads the model (the result: chat_info)
    Call("openChat", "open_chat", args=("base", "options", "weights"), events=("weights", "fetched", "progress"),
         worker=True),
    # a synthetic model of a contract shape, its weights filled on the GPU (the result: chat_info)
    Call("openSyntheticChat", "open_synthetic_chat", handles=("session",), args=("shape", "tokenizerBase", "options"),
         events=("progress",), worker=True),
    # a user's GGUF (a File, read in the worker: it never leaves the machine), its tensors repacked on the GPU
    Call("openGgufChat", "open_gguf_chat", handles=("session",), args=("file", "options"), events=("progress",),
         worker=True),
    # opens a GGUF the Cache API keeps (static/gguf_keeper.js keeps an opened one) like openGgufChat
    Call("openCachedGguf", "open_gguf_chat", handles=("session",), args=("key", "options"), events=("progress",),
         worker=True),
    Call("reply", "chat_reply", handles=("chat",), args=("text", "request"), events=("text", "step", "prefill")),
    Call("compare", "chat_compare", handles=("chat",), args=("text", "request"), events=("progress",)),
    Call("stop", "stop_reply", handles=("chat",)),  # answered while a reply awaits the GPU
    Call("newChat", "new_chat", handles=("chat",)),
    Call("lab", "kernel_lab", handles=("session", "chat"), args=("request",), events=("row",)),
)
HANDLES = ("session", "chat")
# Events outside any call (id 0), to python.on.
GLOBAL_EVENTS = ("device-lost",)
# Where the worker finds a test hook the page asks for (`?hooks=NAME`: HOOKS_PATH/NAME.js, relative to
# the worker). Only the tests' and the benchmarks' servers serve it (app/server.py, app/hooks/).
HOOKS_PATH = "hooks/"
# The model artifacts `make setup` serves that the page offers (?model=NAME -> its name in the page).
SERVED_MODELS = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}


def error_help() -> dict[str, str]:
    """The errors a user can act on, by the Python class the page receives (its `type`), and what to
    do about each: static/faults.js shows it under the error. tests/test_page_boundary.py checks that
    each names a class the runtime raises."""
    from chat.page import NVIDIA_F16_FLAG  # chat.page imports the WebGPU seam

    served = " or ".join(f"?model={name}" for name in SERVED_MODELS)  # each has float32 kernels too
    return {
        "NeedsShaderF16": "This adapter has no shader-f16 and this model runs in float16 only. Chromium on "
                          f"NVIDIA withholds it unless started with {NVIDIA_F16_FLAG}; or open {served} (float32 kernels).",
        "AdapterLimitError": f"This GPU's limits are below what this model needs: open a smaller one, {served}.",
        "WebGPUUnavailable": "Use a Chromium-based browser with WebGPU (on Linux: --enable-unsafe-webgpu).",
        "ArtifactError": "The model's files on this server are missing or damaged: run `make setup` again and "
                         "reload (a copy in this browser's cache that fails its check is dropped and fetched again).",
        "GGUFError": "The file is not a GGUF this page reads, or it is cut short; the model loaded before is kept.",
    }


def constants() -> dict:
    """What the page would otherwise copy from the runtime (name -> JSON value)."""
    from chat.page import LAB_MAX_ITERS  # chat.page imports the WebGPU seam

    # the URL may set every run option but max_context, which the page's ?context= sets
    run_options = [name for name in option_kinds() if name != "max_context"]
    return {"SWITCH_AT": TILED_MAX_CONTEXT, "STOPPED_IN_PREFILL": STOPPED_IN_PREFILL,
            "DEFAULT_MAX_NEW_TOKENS": DEFAULT_MAX_NEW_TOKENS, "MAX_TOP_K": MAX_TOP_K, "LAB_MAX_ITERS": LAB_MAX_ITERS,
            "RUN_OPTION_NAMES": run_options, "SERVED_MODELS": SERVED_MODELS, "ERROR_HELP": error_help()}


def page_api_js() -> str:
    """static/page_api.js: this module as an ES module."""
    calls = {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in CALLS}
    lines = ["// Generated by `python -m app page-api` from chat/api.py (make writes it; never edit, never commit).",
             "// The worker's calls, the step fields and the runtime's constants: the page-to-Python boundary.",
             "export const CALLS = Object.freeze({",
             *(f"  {json.dumps(name)}: {json.dumps(call)}," for name, call in calls.items()),
             "});",
             f"export const GLOBAL_EVENTS = Object.freeze({json.dumps(list(GLOBAL_EVENTS))});",
             f"export const STEP_FIELDS = Object.freeze({json.dumps(list(STEP_FIELDS))});",
             f"export const HOOKS_PATH = {json.dumps(HOOKS_PATH)};"]
    lines += [f"export const {name} = {json.dumps(value)};" for name, value in constants().items()]
    return "\n".join(lines) + "\n"
