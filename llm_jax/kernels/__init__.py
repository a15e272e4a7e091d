"""Accelerator kernels behind the model's attention and MoE interfaces (one file per kernel);
`llm_jax.model.select` holds the one table of which implementation each backend runs."""
