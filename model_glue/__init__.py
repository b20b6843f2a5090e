"""Run side: the WebGPU seam, kernel dispatch from the manifest, the model
and its tokenizer.

Every module here imports only the standard library (plus Pyodide's `js` or wgpu-py inside the
WebGPU seam): the same code runs in Pyodide and natively. The build side (kernels/, convert/)
imports the top-level `contract` package (which both sides share) and nothing from here.
"""
