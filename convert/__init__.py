"""Build side, host only: the model GGUF -> the WebGPU weight artifact (`weights`) and the tokenizer
files (`tokenizer`). Needs numpy, gguf and HF tokenizers; the browser never imports it."""
