"""Run side: the runtime the page (Pyodide) and the native CLI share.

- `gpu/`: the WebGPU seam (device, backends, kernel artifact and dispatch);
- `model/`: the model on the GPU (passes, forward pass, pipeline, KV cache, generation);
- `formats/`: what files hold (GGUF, tokenizer, chat template);
- `loading.open_model`: a model artifact, a GGUF or a synthetic shape, opened into what a chat needs;
- `options.RunOptions` (how a model runs) and `policy` (which variant runs on this adapter).

Every module here imports only the standard library (plus Pyodide's `js` or wgpu-py inside the
WebGPU seam): the same code runs in Pyodide and natively. The build side (kernels/, convert/)
imports the top-level `contract` package (which both sides share) and nothing from here.
"""
