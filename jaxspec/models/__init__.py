"""Models: the Llama-family target (and, later, the EAGLE-3 head) with their shared layers and KV cache."""
