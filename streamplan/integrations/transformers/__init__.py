"""transformers: its decoder models' forwards, the Llama family's parts, and what its layers need on the captured
path (the attention backend, the cache)."""
