"""MPT: a Hugging Face compatible config and causal LM, and its Composer wrapper."""
