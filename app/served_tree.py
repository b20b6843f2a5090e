"""`python -m app check`: is the served tree complete? The last step of `make setup`.

Make decides what to rebuild from file times, which can tie on a fast disk; this check looks at
the tree itself (files present, the project's wheel registered in the lockfile the page reads, the
artifacts' manifests readable) and names whatever is missing, with the command that makes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from chat.api import SERVED_MODELS
from contract.artifacts import MODEL_ARTIFACT_FORMAT

PROJECT_PACKAGE = "sharded-decode-demo"  # the name the page passes to pyodide.loadPackage
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip")
PAGE_FILES = ("index.html", "main.js", "charts.js", "weights_cache.js", "export.js", "replay.js", "style.css",
              "favicon.svg", "long_document.txt")
PAGE_API = "page_api.js"  # generated from chat/api.py (`python -m app page-api`, a make rule)
MODELS = (*SERVED_MODELS, "tiny_chat")  # tiny_chat: random weights for the page tests
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json")  # HF's; an artifact converted from a GGUF names its own


def _read_json(path: Path, problems: list[str], fix: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        problems.append(f"{path} is missing ({fix})")
    except ValueError as err:
        problems.append(f"{path} is not valid JSON: {err} ({fix})")
    return None


def _check_lockfile(pyodide: Path, problems: list[str]) -> None:
    fix = "run `make setup`; it builds the wheel and registers it"
    lock = _read_json(pyodide / "pyodide-lock.json", problems, fix)
    if lock is None:
        return
    entry = lock.get("packages", {}).get(PROJECT_PACKAGE)
    if entry is None:
        problems.append(f"{pyodide / 'pyodide-lock.json'} does not register {PROJECT_PACKAGE!r} ({fix})")
        return
    wheel = pyodide / entry["file_name"]
    if not wheel.exists():
        problems.append(f"{wheel} is registered in the lockfile but missing ({fix})")
    elif hashlib.sha256(wheel.read_bytes()).hexdigest() != entry.get("sha256"):
        problems.append(f"{wheel} does not match the sha256 in the lockfile ({fix})")


def _check_kernels(folder: Path, problems: list[str]) -> None:
    manifest = _read_json(folder / "manifest.json", problems, "run `python -m app build`")
    if manifest is None:
        return
    missing = [k["wgsl"] for k in manifest.get("kernels", {}).values() if not (folder / k["wgsl"]).exists()]
    if missing:
        problems.append(f"{folder}: {len(missing)} WGSL files listed in the manifest are missing, "
                        f"e.g. {missing[0]} (run `python -m app build`)")


def _check_model(folder: Path, problems: list[str]) -> None:
    manifest = _read_json(folder / "manifest.json", problems, "run `make setup` (python -m app convert)")
    if manifest is None:
        return
    if manifest.get("format") != MODEL_ARTIFACT_FORMAT:
        problems.append(f"{folder}: model artifact format {manifest.get('format')}, the runtime reads "
                        f"{MODEL_ARTIFACT_FORMAT} (run `make setup` (python -m app convert))")
    weights = folder / manifest.get("weights_file", "weights.bin")
    if not weights.exists() or weights.stat().st_size != manifest.get("total_bytes"):
        problems.append(f"{weights} is missing or not {manifest.get('total_bytes')} bytes "
                        "(run `make setup` (python -m app convert))")
    tokenizer = (manifest["tokenizer"],) if manifest.get("tokenizer") else MODEL_FILES
    problems.extend(f"{folder / name} is missing (run `make setup`)" for name in tokenizer
                    if not (folder / name).exists())


def write_page_api(path: Path) -> None:
    """chat/api.py as the page's ES module, written to a temporary name and renamed (never half a file)."""
    from chat.api import page_api_js

    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(page_api_js(), encoding="utf-8")
    partial.replace(path)


def _check_page_api(static: Path, problems: list[str]) -> None:
    from chat.api import page_api_js

    path = static / PAGE_API
    fix = "run `python -m app page-api`; `make setup` does"
    if not path.exists():
        problems.append(f"{path} is missing ({fix})")
    elif path.read_text(encoding="utf-8") != page_api_js():
        problems.append(f"{path} does not match chat/api.py ({fix})")


def check_served_tree(static: Path) -> list[str]:
    """Every problem found in the served tree, as a sentence naming the file and the fix."""
    static = Path(static)
    problems = [f"{static / name} is missing" for name in PAGE_FILES if not (static / name).exists()]
    _check_page_api(static, problems)
    pyodide = static / "pyodide"
    problems += [f"{pyodide / name} is missing (run `make setup`; Pyodide comes from npm)"
                 for name in PYODIDE_FILES if not (pyodide / name).exists()]
    _check_lockfile(pyodide, problems)
    _check_kernels(static / "artifacts" / "kernels", problems)
    for model in MODELS:
        _check_model(static / "artifacts" / model, problems)
    return problems
