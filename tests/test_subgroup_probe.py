"""The subgroup size the native host trusts (wgpu-native reports none) is measured the way the
subgroup-layout kernels run: in a workgroup of as many invocations, over all of them."""

import math
import re

import pytest

from model_glue.gpu.webgpu_native import subgroup_probe_wgsl


def subgroup_kernel_invocations(library) -> set[int]:
    """The invocations per workgroup of the artifact's subgroup-layout kernels (their manifest)."""
    specs = [s for s in library.specs.values()
             if s.meta.get("kind") == "decode_attention" and s.meta.get("layout") == "subgroup"]
    assert specs, "the test artifact has no subgroup-layout kernel"
    return {math.prod(spec.workgroup_size) for spec in specs}


def test_the_probe_runs_at_the_subgroup_kernels_workgroup_size(test_library):
    (invocations,) = subgroup_kernel_invocations(test_library)
    probed = re.search(r"@workgroup_size\((\d+)\)", subgroup_probe_wgsl())
    assert int(probed.group(1)) == invocations


def test_every_invocation_reports_a_size_within_the_adapters_bounds(gpu, test_library):
    if "subgroups" not in gpu.features:
        pytest.skip(f"{gpu.adapter_name} has no subgroups")
    (invocations,) = subgroup_kernel_invocations(test_library)
    sizes = gpu._subgroup_sizes(invocations)
    assert len(sizes) == invocations and 0 not in sizes, sizes  # every invocation wrote its size
    info = gpu._adapter.info  # wgpu-py 0.32 spells the keys "stackgroup_*"; WebGPU's bounds by default
    low = info.get("subgroup_min_size", info.get("stackgroup_min_size", 4))
    high = info.get("subgroup_max_size", info.get("stackgroup_max_size", 128))
    assert low <= min(sizes) <= max(sizes) <= high
    assert (gpu.subgroup_min_size, gpu.subgroup_max_size) == (min(sizes), max(sizes))
