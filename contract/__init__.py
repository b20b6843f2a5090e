"""The build/run contract: every fact the build (kernels/, convert/) and the runtime must agree on.

A top-level package that both sides import and that imports nothing but the standard library: the
page (Pyodide) and a GPU machine without TVM import it. Nothing here is computed from TVM: change a
fact here, rebuild (`make`), and both sides follow.

- `contract.model`: dtypes and the Llama-shaped configs the artifact has kernels for (the compiled
  shapes only; how long a context a run allows is a run option, model_glue.options).
- `contract.kernels`: the paged KV layout, the decode nests, the WebGPU limits kernels are built
  within, and the typed kernel specs (`MatmulSpec`, `AttentionSpec`, `KernelRole`) from which each
  kernel's artifact name and the exact buffers the runtime binds are derived.
- `contract.artifacts`: the artifacts' format versions and files, and the manifest entry of one
  kernel (`KernelSpec`), the schema both sides read and write.
"""
