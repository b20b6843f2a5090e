"""The build/run wall, checked on the source and on the wheel the browser loads.

Run side (contract/, model_glue/, chat/): the standard library and each other, nothing else;
Pyodide's `js`/`pyodide` and wgpu-py only inside the modules that wrap them. Build side (kernels/,
convert/): of the run side only the contract, the one package both sides share. The native CLI
(app/) may import anything; nothing imports it. The wheel holds exactly the run side.
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_PACKAGES = ("contract", "model_glue", "chat")
RUN_SIDE = sorted(p for package in RUN_PACKAGES for p in (ROOT / package).rglob("*.py"))
# The seam's backends reach the browser's WebGPU or wgpu-py (model_glue/gpu/webgpu.py, the neutral part,
# neither); the artifact reader fetches over HTTP in the page.
BACKENDS = {"webgpu_browser.py": {"js", "pyodide"}, "webgpu_native.py": {"wgpu"}, "artifact.py": {"pyodide"}}
BUILD_SIDE = sorted((ROOT / "kernels").glob("*.py")) + sorted((ROOT / "convert").glob("*.py"))
WHEEL = ROOT / "static" / "pyodide" / "sharded_decode_demo-0.1.0-py3-none-any.whl"


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
    return modules


def in_packages(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("path", RUN_SIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_run_side_imports_only_the_standard_library_and_itself(path):
    allowed = set(sys.stdlib_module_names) | {"__future__"} | BACKENDS.get(path.name, set())
    foreign = {m for m in imported_modules(path) if not in_packages(m, RUN_PACKAGES) and m.split(".")[0] not in allowed}
    assert not foreign, f"{path.name} imports {sorted(foreign)}: the page (Pyodide) has none of them"


@pytest.mark.parametrize("path", sorted((ROOT / "contract").glob("*.py")), ids=lambda p: p.name)
def test_the_contract_imports_nothing_of_either_side(path):
    imported = {m for m in imported_modules(path) if in_packages(m, ("model_glue", "chat", "kernels", "convert", "app"))}
    assert not imported, f"contract/{path.name} imports {sorted(imported)}: both sides import the contract"


@pytest.mark.parametrize("path", BUILD_SIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_build_side_shares_only_the_contract(path):
    shared = {m for m in imported_modules(path) if in_packages(m, ("model_glue", "chat", "app"))}
    assert not shared, f"{path.name} imports {sorted(shared)} from the run side or the CLI (only `contract` is shared)"


def test_nothing_imports_the_cli():
    for path in RUN_SIDE + BUILD_SIDE:
        assert not {m for m in imported_modules(path) if in_packages(m, ("app",))}, path


def kernel_module_imports(path: Path, names: set[str]) -> set[str]:
    """The kernels/ modules (of `names`) that `path` imports anywhere, a function's body included;
    `from kernels import x` counts as importing kernels.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(m.split(".")[1] for m in modules if m.startswith("kernels.") and m.split(".")[1] in names)
    return found - {path.stem}


def test_kernels_import_no_cycle():
    """No kernels/ module reaches itself through imports (a deferred import too): a cycle made the
    kernel builders' import order matter (kernels.build imported the catalog, whose builders imported
    kernels.build)."""
    paths = {p.stem: p for p in (ROOT / "kernels").glob("*.py")}
    imports = {name: kernel_module_imports(path, set(paths)) for name, path in paths.items()}
    on_cycles = []
    for start in sorted(imports):
        reached, todo = set(), list(imports[start])
        while todo:
            module = todo.pop()
            if module not in reached:
                reached.add(module)
                todo.extend(imports[module])
        if start in reached:
            on_cycles.append(start)
    assert not on_cycles, f"kernels/ modules on an import cycle: {on_cycles} (imports: " \
        f"{ {m: sorted(imports[m]) for m in on_cycles} })"


def test_the_wheel_holds_only_the_run_side():
    """The browser downloads what runs there: the contract, the runtime and the chat, no build side,
    no CLI, no benchmarks, no tests (`make` builds the wheel from pyproject.toml's packages)."""
    if not WHEEL.exists():
        pytest.fail(f"{WHEEL.relative_to(ROOT)} is missing: run `make test`, which builds it")
    names = zipfile.ZipFile(WHEEL).namelist()
    code = sorted(n for n in names if ".dist-info/" not in n)
    assert code == sorted(p.relative_to(ROOT).as_posix() for p in RUN_SIDE), code


def test_the_contract_is_the_one_home_of_shared_constants():
    """PAGE_SIZE and the format versions are defined once, in the contract."""
    definition = re.compile(r"^\s*(PAGE_SIZE|\w*ARTIFACT_FORMAT|\w*_CONFIGS?|\w*ARTIFACT_KIND|MAX_CONTEXT)\s*[:=]", re.M)
    for path in RUN_SIDE + BUILD_SIDE + sorted((ROOT / "app").rglob("*.py")):
        if path.parent.name == "contract":
            continue
        found = definition.findall(path.read_text(encoding="utf-8"))
        assert not found, f"{path.relative_to(ROOT)} defines {found}: they belong in contract/"


def test_the_page_copies_no_python_constant():
    """static/*.js gets the runtime's constants (the 256-token switch, stop reasons, defaults) from
    static/page_api.js, which chat/api.py generates, and reaches into no Python object: only the page
    module's functions."""
    for path in sorted((ROOT / "static").glob("*.js")):
        if path.name in ("weights_cache.js", "page_api.js"):  # SHA-256, no Python; generated from chat/api.py
            continue
        text = path.read_text(encoding="utf-8")
        # state.model and the lab's result.model are the page's own JS record of the loaded model (main.js nameModel)
        assert not re.search(r"\b256\b|stopped during prefill|(?<!state)(?<!result)\.model\.|js_device|\.device\.",
                             text), path.name
        calls = set(re.findall(r"\bpage\.(\w+)\(", text))
        import chat.page
        assert calls <= set(dir(chat.page)), f"{path.name} calls {sorted(calls - set(dir(chat.page)))}"


def test_the_bench_hook_copies_every_module_of_the_page_benchmarks():
    """app/hooks/bench.js copies app.page_bench.FILES into the page's worker: every module of the package."""
    from app.page_bench import FILES

    assert sorted(FILES) == sorted(p.name for p in (ROOT / "app" / "page_bench").glob("*.py"))
