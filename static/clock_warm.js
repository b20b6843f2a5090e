// Keeps the GPU's clocks up while the user types, so that a reply starts at full clocks.
// An idle GPU lowers its clocks, and needs longer sustained work to raise them again than a small
// model's short reply gives it (docs/benchmarks.md). While input
// arrives (and HOLD_MS after the last of it), a compute-bound kernel runs back to back on a device
// of its own, one dispatch in flight, so a reply sent meanwhile waits behind one dispatch at most.
// Light work does not hold the clocks, and streaming reads slowed the next reply (docs/benchmarks.md).
// It never runs while the page is busy. On by default on a GPU adapter, off with ?warm=off; off by
// default on a CPU adapter (no clocks to hold), where ?warm=on runs it a little (the tests).

const SPIN_SHADER = `
struct Spin { iterations: u32 }
@group(0) @binding(0) var<uniform> spin: Spin;
@group(0) @binding(1) var<storage, read_write> sink: array<f32>;

// A dependent chain of multiply-adds: the kernel's time is the SM clock's, not memory's.
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3u) {
  var x = f32(id.x);
  for (var i = 0u; i < spin.iterations; i++) { x = x * 0.9999 + 1.0; }
  sink[id.x] = x;
}`;

const WORKGROUP_SIZE = 64;
const GPU_SPIN = { workgroups: 128, iterations: 400_000 };  // a short dispatch: a turn waits behind one
const CPU_SPIN = { workgroups: 1, iterations: 1_000 };
export const HOLD_MS = 2000;  // how long after the last input the clocks are kept up

export class ClockWarm {
  // `idle()`: whether the page may run the warm now (false while a reply or a load runs).
  constructor(idle) {
    this.idle = idle;
    this.gpu = null;
    this.until = 0;
    this.status = { on: false, reason: "not opened", running: false, dispatches: 0, bursts: 0 };
  }

  // `mode`: the URL's ?warm ("on", "off" or null); `cpu`: whether the model's adapter is a CPU.
  async open(mode, cpu) {
    if (mode === "off") return this.off("off (?warm=off; without it the clocks are kept up while you type)");
    if (cpu && mode !== "on") return this.off("off on a CPU adapter (?warm=on runs it anyway)");
    try {
      const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
      if (!adapter) return this.off("off (no adapter for it)");
      this.gpu = await adapter.requestDevice();
    } catch (err) {  // the chat does not need it
      return this.off(`off (${err.message || err})`);
    }
    this.gpu.lost.then(() => { this.gpu = null; this.off("off (its device was lost)"); });
    const { workgroups, iterations } = cpu ? CPU_SPIN : GPU_SPIN;
    const pipeline = this.gpu.createComputePipeline({
      layout: "auto", compute: { module: this.gpu.createShaderModule({ code: SPIN_SHADER }), entryPoint: "main" },
    });
    const uniform = this.gpu.createBuffer({ size: 16, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
    this.gpu.queue.writeBuffer(uniform, 0, new Uint32Array([iterations, 0, 0, 0]));
    const sink = this.gpu.createBuffer({ size: workgroups * WORKGROUP_SIZE * 4, usage: GPUBufferUsage.STORAGE });
    this.spin = { pipeline, workgroups, bindings: this.gpu.createBindGroup({ layout: pipeline.getBindGroupLayout(0),
      entries: [{ binding: 0, resource: { buffer: uniform } }, { binding: 1, resource: { buffer: sink } }] }) };
    Object.assign(this.status, { on: true, reason: mode === "on" ? "on (?warm=on)" : "on (?warm=off turns it off)",
      iterations, workgroups });
  }

  off(reason) {
    Object.assign(this.status, { on: false, reason });
  }

  // Input arrived: keep the clocks up until HOLD_MS from now.
  nudge() {
    if (!this.gpu || !this.idle()) return;
    this.until = performance.now() + HOLD_MS;
    if (!this.status.running) this.run();
  }

  // The page is about to work (a reply): no dispatch after the one in flight.
  stop() {
    this.until = 0;
  }

  async run() {
    this.status.running = true;
    this.status.bursts += 1;
    try {
      while (this.gpu && performance.now() < this.until && this.idle()) {
        const encoder = this.gpu.createCommandEncoder();
        const pass = encoder.beginComputePass();
        pass.setPipeline(this.spin.pipeline);
        pass.setBindGroup(0, this.spin.bindings);
        pass.dispatchWorkgroups(this.spin.workgroups);
        pass.end();
        this.gpu.queue.submit([encoder.finish()]);
        await this.gpu.queue.onSubmittedWorkDone();
        this.status.dispatches += 1;
      }
    } finally {
      this.status.running = false;
    }
  }
}
