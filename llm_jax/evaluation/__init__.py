"""lm-evaluation-harness over llm_jax: `harness.LlmJaxLM`, registered as model "llm_jax".
CLI: `python -m llm_jax.eval` (lm_eval's own flags, with this model registered)."""
