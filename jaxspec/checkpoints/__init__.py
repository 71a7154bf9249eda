"""Reading and writing checkpoints: Hugging Face targets, the built-in SmolLM2 target, draft heads."""
