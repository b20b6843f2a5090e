"""Setup must not depend on timestamp luck: the Makefile with every mtime equal, and the tree check.

A fresh clone once served a page that could not find the project's wheel: Pyodide's copy step
wrote the lockfile in the same clock tick as its prerequisite, so make skipped registering the
wheel. These tests rebuild that situation in a scratch tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from app.served_tree import PROJECT_PACKAGE, check_served_tree

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"


def _set_all_mtimes(folder: Path, ns: int) -> None:
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, ns=(ns, ns), follow_symlinks=False)


def _scratch_project(tmp_path: Path) -> Path:
    """The real Makefile over stand-ins for npm's Pyodide, the venv and the sources."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "package.json").write_text("{}")
    for package in ("app", "kernels", "model_glue"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    npm = tmp_path / "node_modules" / "pyodide"
    npm.mkdir(parents=True)
    for name in ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip"):
        (npm / name).write_text(name)
    (npm / "pyodide-lock.json").write_text(json.dumps({"packages": {}}))
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").write_text("")
    return tmp_path


def _make(project: Path, *args: str) -> str:
    done = subprocess.run(["make", "--no-print-directory", *args], cwd=project, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_wheel_is_registered_even_when_every_mtime_is_equal(tmp_path):
    project = _scratch_project(tmp_path)
    tick = 1_700_000_000 * 10**9
    _set_all_mtimes(project, tick)
    _make(project, "static/pyodide/pyodide.mjs")  # the copy step, for real
    # A coarse clock: everything the copy wrote lands in the same tick as its prerequisites.
    _set_all_mtimes(project, tick)
    plan = _make(project, "-n", "static/pyodide/pyodide-lock.json")
    assert "pip wheel" in plan and "lockfile add-wheels" in plan, \
        f"make would skip building and registering the wheel:\n{plan}"


def test_an_unregistered_lockfile_from_an_old_setup_is_rebuilt(tmp_path):
    project = _scratch_project(tmp_path)
    tick = 1_700_000_000 * 10**9
    served = project / "static" / "pyodide"
    served.mkdir(parents=True)
    for name in ("pyodide.mjs", "pyodide-lock.json"):  # what the old copy step left
        shutil.copy(project / "node_modules" / "pyodide" / name, served / name)
    _set_all_mtimes(project, tick)
    plan = _make(project, "-n", "static/pyodide/pyodide-lock.json")
    assert "lockfile add-wheels" in plan


def test_the_served_tree_is_complete():
    assert check_served_tree(STATIC) == []


def _copy_tree(tmp_path: Path) -> Path:
    """The served tree's small files copied, the big ones linked (the check only reads them)."""
    copy = tmp_path / "static"
    for path in STATIC.rglob("*"):
        target = copy / path.relative_to(STATIC)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.stat().st_size > 1 << 20:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    return copy


def test_the_check_names_what_is_missing(tmp_path):
    copy = _copy_tree(tmp_path)
    lock = copy / "pyodide" / "pyodide-lock.json"
    data = json.loads(lock.read_text())
    del data["packages"][PROJECT_PACKAGE]
    lock.write_text(json.dumps(data))
    (copy / "artifacts" / "tiny_chat" / "manifest.json").unlink()
    kernels = json.loads((copy / "artifacts" / "kernels" / "manifest.json").read_text())
    (copy / "artifacts" / "kernels" / next(iter(kernels["kernels"].values()))["wgsl"]).unlink()
    (copy / "artifacts" / "smollm2" / "tokenizer.json").unlink()
    problems = "\n".join(check_served_tree(copy))
    assert f"does not register '{PROJECT_PACKAGE}'" in problems
    assert "tiny_chat/manifest.json is missing" in problems
    assert "1 WGSL files listed in the manifest are missing" in problems
    assert "smollm2/tokenizer.json is missing" in problems
