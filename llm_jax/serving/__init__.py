"""The OpenAI-compatible HTTP server over the continuous-batching engine: `protocol` (request
bodies, their checks, response objects), `app` (the ASGI routes). CLI: `python -m llm_jax.serve`."""
