"""`python -m llm_jax.describe`: what a config costs (llm_jax/model/costs.py)."""

if __name__ == "__main__":
    from llm_jax.model.costs import cli

    cli()
