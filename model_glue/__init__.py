"""Run side: the build/run contract, the WebGPU seam, kernel dispatch from the manifest, the model
and its tokenizer.

Every module here imports only the standard library (plus Pyodide's `js` or wgpu-py inside the
WebGPU seam): the same code runs in Pyodide and natively. The build side (kernels/, convert/)
imports `model_glue.contract` and nothing else from here.
"""
