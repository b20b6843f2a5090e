"""What files hold: GGUF (header, tensors, tokenizer metadata, upload and repack), the BPE
tokenizer and the chat templates."""
