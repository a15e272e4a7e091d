"""LoRA out of the model: merged into the base weights, or the adapters alone on disk.

The adapters file is `adapters.safetensors` (flat names as in the model, e.g.
"layers.attn.q_proj_lora_a", float32, leading layers axis) + `adapters.json` (rank, alpha,
targets and the base model's config), so they can be re-attached to the same base.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from llm_jax.model.lora import TARGETS, lora_delta
from llm_jax.weights.flat import flat_params, model_from_params

ADAPTERS_WEIGHTS = "adapters.safetensors"
ADAPTERS_CONFIG = "adapters.json"


def _split(flat: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    lora = {k: v for k, v in flat.items() if k.endswith(("_lora_a", "_lora_b"))}
    return {k: v for k, v in flat.items() if k not in lora}, lora


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A plain Transformer whose weights are `w + (alpha/r) A B` (in the base's dtype)."""
    base, lora = _split(flat_params(model))
    for key in [k for k in lora if k.endswith("_lora_a")]:
        path, name = key[:-len("_lora_a")].rsplit(".", 1)
        module = model.layers.attn if TARGETS[name][0] == "attn" else model.layers.mlp
        w = base[f"{path}.{name}"]
        delta = np.asarray(lora_delta(name, lora[key], lora[f"{path}.{name}_lora_b"],
                                      module.lora_scale))
        base[f"{path}.{name}"] = (w.astype(np.float32) + delta).astype(w.dtype)
    return model_from_params(model.cfg, base)


def save_adapters(model: nnx.Module, directory: str | Path, *, rank: int, alpha: float) -> Path:
    """Writes the adapters alone (a few MB where the model is GBs)."""
    _, lora = _split(flat_params(model))
    if not lora:
        raise ValueError("the model has no LoRA adapters to save")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in lora.items()},
              str(d / ADAPTERS_WEIGHTS))
    targets = sorted({k.rsplit(".", 1)[1][:-len("_lora_a")] for k in lora if k.endswith("_a")})
    meta = {"format": "llm_jax_lora", "version": 1, "rank": rank, "alpha": alpha,
            "targets": targets, "base_model": model.cfg.to_dict()}
    (d / ADAPTERS_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return d
