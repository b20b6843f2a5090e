"""Native benchmarks (numpy, wgpu-py): `python -m app bench attention | decode | chat`. They need no TVM:
a GPU machine runs them from a copied artifact."""
