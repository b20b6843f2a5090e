"""The model on the GPU: LlamaModel (its passes, the pass plan, the forward pass), the decode
pipeline, scratch buffers, the paged KV cache, the attention choice, step statistics, generation."""
