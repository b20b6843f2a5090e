"""Run-time side: the WebGPU seam, kernel dispatch from the manifest, and (later) the model.

Nothing in this package imports tvm or numpy: the same code runs in Pyodide and natively.
"""
