"""Generation with a KV cache: sampling rules, the compiled decode loop, the `sample` API."""

from llm_jax.inference.sampler import sample

__all__ = ["sample"]
