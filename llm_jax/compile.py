"""`python -m llm_jax.compile`: the train step compiled ahead of time for a TPU slice or a
simulated CPU mesh, with its per-chip memory (llm_jax/parallel/aot.py)."""

if __name__ == "__main__":
    from llm_jax.parallel.aot import cli

    cli()
