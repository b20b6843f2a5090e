"""The walking skeleton's probe: a TVM-built reduction kernel, natively and in the browser."""

import numpy as np
import pytest

from chat.page import PROBE_SCALE, Session


def test_probe_manifest_abi(library):
    spec = library.specs["row_sum_probe"]
    assert [b.name for b in spec.buffers] == ["out", "x"]  # TVM orders bindings by name
    assert [b.access for b in spec.buffers] == ["read_write", "read"]
    assert [(p["name"], p["type"]) for p in spec.pod] == [("n", "i32"), ("scale", "f32")]
    assert spec.workgroup_size == [256, 1, 1]
    assert spec.grid == ["n", 1]
    assert spec.workgroup_storage_bytes == 256 * 4
    assert spec.barriers >= 8  # one per tree level at least


def test_probe_matches_numpy_natively(loop, gpu, library):
    rng = np.random.default_rng(1)
    rows = 37
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    xb = gpu.storage_buffer(x.nbytes, x.tobytes())
    out = gpu.storage_buffer(rows * 4)
    kernel = loop.run_until_complete(library.kernel("row_sum_probe"))
    bound = kernel.bind({"x": xb, "out": out}, {"n": rows, "scale": PROBE_SCALE})
    batch = gpu.batch()
    bound.dispatch(batch)
    batch.submit()
    got = np.frombuffer(loop.run_until_complete(gpu.read(out, rows * 4)), np.float32)
    want = PROBE_SCALE * x.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_page_probe_natively(loop, gpu, library):
    """The exact code the page runs (chat.page.Session), here on wgpu."""
    result = loop.run_until_complete(Session(gpu, library).run_probe(seed=3))
    assert result["ok"], result


def test_missing_value_is_a_clear_error(loop, gpu, library):
    kernel = loop.run_until_complete(library.kernel("row_sum_probe"))
    buffers = {"x": gpu.storage_buffer(1024), "out": gpu.storage_buffer(4)}
    with pytest.raises(KeyError, match="'scale'"):
        kernel.bind(buffers, {"n": 1})


def test_the_clock_warmer_is_bounded_and_keeps_its_buffers(loop, gpu, library):
    """app.bench.clock_warmer: a warm stops after its time (plus the batch in flight), dispatches the
    stream kernel at least once, and a second warm reuses its buffers (no new GPU buffers)."""
    from app.bench.clock_warmer import ClockWarmer

    warmer = ClockWarmer(gpu, library, words=1 << 16)
    first = loop.run_until_complete(warmer.warm(0.05))
    live = gpu.live_buffers
    second = loop.run_until_complete(warmer.warm(0.05))
    assert first["dispatches"] >= 1 and second["dispatches"] >= 1
    assert first["seconds"] >= 0.05 and second["seconds"] < 30  # bounded: a batch doubles from one dispatch
    assert gpu.live_buffers == live
    warmer.release()
    assert gpu.live_buffers == live - 3  # its two buffers and its binding's uniform


def test_a_warm_stops_when_cancelled(loop, gpu, library):
    """cancel() ends a running warm after its batch in flight (a benchmark stops it before it times)."""
    import asyncio

    from app.bench.clock_warmer import ClockWarmer

    warmer = ClockWarmer(gpu, library, words=1 << 16, max_batch=4)

    async def warm_then_cancel():
        task = asyncio.ensure_future(warmer.warm(60))
        await asyncio.sleep(0.2)
        warmer.cancel()
        return await task

    result = loop.run_until_complete(warm_then_cancel())
    warmer.release()
    assert result["cancelled"] and result["dispatches"] >= 1 and result["seconds"] < 30, result
