"""The build/run wall, checked on the source: what each side may import.

Run side (model_glue/, app/page.py, app/chat.py): the standard library and each other, nothing
else; Pyodide's `js`/`pyodide` and wgpu-py only inside the modules that wrap them. Build side
(kernels/, convert/): of the run side only the contract. The contract is the one place the two
sides share facts (model_glue/contract.py).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_SIDE = sorted((ROOT / "model_glue").glob("*.py")) + [ROOT / "app" / "page.py", ROOT / "app" / "chat.py"]
RUN_PACKAGES = {"model_glue", "app.page", "app.chat"}
# The seam reaches the browser's WebGPU or wgpu-py; the artifact reader fetches over HTTP in the page.
BACKENDS = {"webgpu.py": {"js", "pyodide", "wgpu"}, "artifact.py": {"pyodide"}}
BUILD_SIDE = sorted((ROOT / "kernels").glob("*.py")) + sorted((ROOT / "convert").glob("*.py"))


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
    return modules


def is_run_side(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in RUN_PACKAGES)


@pytest.mark.parametrize("path", RUN_SIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_run_side_imports_only_the_standard_library_and_itself(path):
    allowed = set(sys.stdlib_module_names) | {"__future__"} | BACKENDS.get(path.name, set())
    foreign = {m for m in imported_modules(path) if not is_run_side(m) and m.split(".")[0] not in allowed}
    assert not foreign, f"{path.name} imports {sorted(foreign)}: the page (Pyodide) has none of them"


@pytest.mark.parametrize("path", BUILD_SIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_build_side_shares_only_the_contract(path):
    shared = {m for m in imported_modules(path) if is_run_side(m)}
    assert shared <= {"model_glue.contract"}, f"{path.name} imports {sorted(shared)} from the run side"


def test_the_contract_is_the_one_home_of_shared_constants():
    """PAGE_SIZE and the format versions are defined once, in the contract."""
    definition = re.compile(r"^\s*(PAGE_SIZE|\w*ARTIFACT_FORMAT|\w*_CONFIGS?|\w*ARTIFACT_KIND|MAX_CONTEXT)\s*[:=]", re.M)
    for path in RUN_SIDE + BUILD_SIDE + sorted((ROOT / "app").rglob("*.py")):
        if path.name == "contract.py":
            continue
        found = definition.findall(path.read_text(encoding="utf-8"))
        assert not found, f"{path.relative_to(ROOT)} defines {found}: they belong in model_glue/contract.py"
