"""Weights in and out: llm_jax directories, Hugging Face safetensors, OpenAI `original/` (MXFP4)."""
