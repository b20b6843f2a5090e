"""Run-time side: the WebGPU seam, kernel dispatch from the manifest, the model and its tokenizer.

The run path (webgpu, kernel, artifact, attention, model, tokenizer) imports neither tvm nor
numpy: the same code runs in Pyodide and natively. `convert` and `tokenizer_export` are the host's
build steps that make the model artifact (numpy, gguf, HF tokenizers); the browser never imports them.
"""
