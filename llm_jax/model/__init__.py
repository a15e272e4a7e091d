"""The gpt-oss network, one file per part (norm, rope, attention, moe, transformer)."""

from llm_jax.model.transformer import Block, Transformer, abstract_model, init_model

__all__ = ["Block", "Transformer", "abstract_model", "init_model"]
