"""llm_jax: a gpt-oss-style mixture-of-experts language model in JAX/Flax NNX.

Public entry points (imported lazily, so `import llm_jax` stays cheap):
`ModelConfig`, `Transformer`, `load_pretrained`, `generate` (callable:
`llm_jax.generate(model, prompt_ids, max_new_tokens=...)`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "llm_jax.config",
    "Transformer": "llm_jax.model.transformer",
    "load_pretrained": "llm_jax.checkpoint_io",
}
__all__ = sorted(_EXPORTS) + ["generate"]


def __getattr__(name: str) -> Any:
    if name == "generate":  # the module is callable; importing it sets the attribute
        return importlib.import_module("llm_jax.generate")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llm_jax' has no attribute {name!r}")
