"""Native benchmarks (numpy, wgpu-py): `python -m app bench attention | decode`. They need no TVM:
a GPU machine runs them from a copied artifact."""
