"""Kernel definitions (TVMScript) and their build to WGSL + a JSON ABI manifest.

Build-time only: nothing here is imported on the run path (browser or native runtime).
"""
