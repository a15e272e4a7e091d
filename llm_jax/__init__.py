"""llm_jax: a gpt-oss-style mixture-of-experts language model in JAX/Flax NNX.

Public entry points (imported lazily, so `import llm_jax` stays cheap): `ModelConfig` (what a
model is), `ExecutionConfig` (how it runs), `Transformer`, `init_model`, `load_pretrained`, and
`sample(model, prompt_ids, max_new_tokens=...)` for generation. The command lines are
`python -m llm_jax.train|generate|serve|chat|eval|convert|export|describe|compile|bench`.

Importing the package changes nothing in the process: no allocator tuning, no JAX flags or
global configuration. The command lines that compute (train, generate, serve, chat, eval, bench;
and `python -m llm_jax.run SCRIPT`) choose the host malloc themselves when they start
(`llm_jax.runtime.malloc`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "llm_jax.config",
    "ExecutionConfig": "llm_jax.execution",
    "Transformer": "llm_jax.model.transformer",
    "init_model": "llm_jax.model.transformer",
    "load_pretrained": "llm_jax.weights.readers",
    "sample": "llm_jax.inference.sampler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llm_jax' has no attribute {name!r}")
