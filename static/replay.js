// Replays a decode step's recorded compute passes (model_glue.gpu.webgpu_browser.BrowserRecordedPasses) in one
// call from Python. Encoding ~180 dispatches through Pyodide's proxies costs three FFI crossings
// each; here the pipelines, bind groups and pass descriptors stay on the JS side.
//
// ops: [0, passDescriptor] begins a pass, [1, pipeline, bindGroup] dispatches (its grid is the
// next three entries of `grids`, which Python rewrites when a per-step kernel's grid changes),
// [2] ends the pass, [3, querySet, index] writes a timestamp inside it
// (chromium-experimental-timestamp-query-inside-passes).
export function replayComputePasses(encoder, ops, grids) {
  let pass = null;
  let g = 0;
  for (const op of ops) {
    if (op[0] === 1) {
      pass.setPipeline(op[1]);
      pass.setBindGroup(0, op[2]);
      pass.dispatchWorkgroups(grids[g], grids[g + 1], grids[g + 2]);
      g += 3;
    } else if (op[0] === 0) {
      pass = encoder.beginComputePass(op[1]);
    } else if (op[0] === 3) {
      pass.writeTimestamp(op[1], op[2]);
    } else {
      pass.end();
      pass = null;
    }
  }
}

// Asks for a readback buffer's map (GPUMapMode.READ) and handles a rejection here, in JS: the map
// of a pass that is abandoned is cancelled by unmap() and rejects unseen. Python awaits the
// promise it returns when it wants the bytes. (A .catch() attached from Python would go through
// Pyodide's futures: three more trips through the worker's event loop every decode step.)
export function mapForReading(buffer, size) {
  const mapped = buffer.mapAsync(GPUMapMode.READ, 0, size);
  mapped.catch(() => {});
  return mapped;
}

