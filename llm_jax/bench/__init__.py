"""Benchmarks: `python -m llm_jax.bench SUBCOMMAND` (the list in `__main__.SUBCOMMANDS`; how to run
each and its current results: docs/benchmarks.md).

torch and transformers (the `bench` extra) are imported only by the subcommands that compare
against them, and only when they run.
"""
