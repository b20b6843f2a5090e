"""The GPU seam: a WebGPU device with two backends (the browser's, wgpu-py's), the kernel artifact
and the dispatch of its kernels by manifest name."""
