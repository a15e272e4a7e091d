"""Benchmarks: `python -m llm_jax.bench {peak,train,decode,moe,norm,attention}` (docs/benchmarks.md).

torch and transformers (the `bench` extra) are imported only by the subcommands that compare
against them, and only when they run.
"""
