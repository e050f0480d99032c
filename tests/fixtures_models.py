"""Model fixtures: tiny randomly initialised Llama-style models and a tokenizer, built offline."""
