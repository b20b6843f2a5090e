"""Rebuild only some kernels of an existing artifact, in place: the recipes of the served artifact
(kernels.catalog.all_recipes) or the tests' (tests/kernel_grid.grid_recipes) whose names match a regular
expression and that the artifact already holds; their WGSL files and manifest entries are replaced,
every other kernel is left as it is. For a change to a few kernels' ABI without a whole `make`.

    .venv/bin/python tools/rebuild_kernels.py --set served --match '^embed_' static/artifacts/kernels
    .venv/bin/python tools/rebuild_kernels.py --set tests --match '^embed_' build/test-kernels
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # kernel_grid

from contract.artifacts import MANIFEST  # noqa: E402
from kernels.build import _build_recipe  # noqa: E402


def recipes_of(which: str) -> list:
    if which == "served":
        from kernels.catalog import all_recipes

        return all_recipes()
    from kernel_grid import grid_recipes

    return grid_recipes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="the artifact folder (its manifest.json is updated)")
    parser.add_argument("--set", choices=("served", "tests"), required=True, help="whose recipes")
    parser.add_argument("--match", action="append", required=True, help="a regular expression on kernel names (repeatable)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="list the kernels, build nothing")
    args = parser.parse_args()

    manifest_path = args.artifact / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    patterns = [re.compile(p) for p in args.match]
    wanted = lambda name: any(p.search(name) for p in patterns)  # noqa: E731
    recipes = {r.name: r for r in recipes_of(args.set) if wanted(r.name)}
    held = {name for name in manifest["kernels"] if wanted(name)}
    build = [recipes[name] for name in sorted(held & recipes.keys())]
    print(f"{len(build)} kernels to rebuild in {args.artifact}")
    for name in sorted(held - recipes.keys()):
        print(f"  kept as it is (no recipe of that name now): {name}")
    for name in sorted(recipes.keys() - held):
        print(f"  not built (the artifact does not hold it): {name}")
    if args.dry_run or not build:
        for recipe in build:
            print("  ", recipe.name)
        return
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        built = list(pool.map(_build_recipe, build, chunksize=2))
    for kernel in built:
        (args.artifact / kernel.spec.wgsl).write_text(kernel.wgsl)
        manifest["kernels"][kernel.spec.name] = kernel.spec.to_json()
        print("  rebuilt", kernel.spec.name)
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path)
    print(f"rebuilt {len(built)} kernels in {time.perf_counter() - started:.1f} s -> {manifest_path}")


if __name__ == "__main__":
    main()
