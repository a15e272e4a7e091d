"""LoRA out of the model and back in: the adapters alone on disk and loaded again onto a base
(dense or packed MXFP4) for generation without merging, or merged into the base weights, dense
or re-quantized to MXFP4.

The adapters file is `adapters.safetensors` (flat names as in the model, e.g.
"layers.attn.q_proj_lora_a", float32, leading layers axis) + `adapters.json` (rank, alpha,
targets and the base model's config), so they can be re-attached to the same base: one whose
architecture equals `base_model` (its LOAD_CONVERSIONS, expert_format among them, may differ:
adapters trained over packed experts load onto the dequantized base and back).

Merging works one layer at a time in float32: w (a packed stack unpacked exactly) + (alpha/r) A B,
then cast to the output dtype, or quantized again to MXFP4 (round to nearest; the relative RMS
error of each re-quantized stack is returned, since the merged weights are no longer MXFP4
values).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from llm_jax.config import ModelConfig
from llm_jax.model.lora import TARGETS, LoRAParam, add_lora, lora_delta
from llm_jax.weights.configs import LOAD_CONVERSIONS
from llm_jax.weights.flat import abstract_targets, flat_params, model_from_params
from llm_jax.weights.json_fields import read_json_object
from llm_jax.weights.mxfp4 import QuantizationError, dequantize_stack, quantize_experts_into

ADAPTERS_WEIGHTS = "adapters.safetensors"
ADAPTERS_CONFIG = "adapters.json"
ADAPTERS_FORMAT = "llm_jax_lora"
LORA_SUFFIXES = ("_lora_a", "_lora_b")
PACKED_SUFFIXES = ("_blocks", "_scales")


def _split(flat: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    lora = {k: v for k, v in flat.items() if k.endswith(LORA_SUFFIXES)}
    return {k: v for k, v in flat.items() if k not in lora}, lora


def adapter_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's LoRA adapters as flat params {"layers.attn.q_proj_lora_a": array, ...}."""
    return {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}


def _lora_scale(model: nnx.Module) -> float:
    for part in ("attn", "mlp"):
        if hasattr(getattr(model.layers, part), "lora_scale"):
            return getattr(model.layers, part).lora_scale
    return 1.0


def _layer_weight(base: Mapping[str, np.ndarray], lora: Mapping[str, np.ndarray], key: str,
                  n: int, scale: float) -> np.ndarray:
    """Layer n of the weight `key` ("layers.mlp.down_proj") in float32: a packed stack unpacked
    (exact), its adapter added."""
    if key + "_blocks" in base:
        blocks, scales = base[key + "_blocks"][n], base[key + "_scales"][n]  # [E, G, 16, O]
        w = np.stack([dequantize_stack(b, s) for b, s in zip(blocks, scales)])  # [E, I, O]
    else:
        w = base[key][n].astype(np.float32)
    if key + "_lora_a" in lora:
        name = key.rsplit(".", 1)[1]
        w = w + np.asarray(lora_delta(name, lora[key + "_lora_a"][n],
                                      lora[key + "_lora_b"][n], scale))
    return w


def _changed(base: Mapping[str, np.ndarray], lora: Mapping[str, np.ndarray]) -> list[str]:
    """The weights a merge rewrites: the adapted ones and the packed ones."""
    return sorted({k[:-len("_lora_a")] for k in lora if k.endswith("_lora_a")}
                  | {k[:-len("_blocks")] for k in base if k.endswith("_blocks")})


def merge_lora(model: nnx.Module, *, dtype: str | None = None) -> nnx.Module:
    """A plain dense Transformer whose weights are `w + (alpha/r) A B`, in `dtype` (default: the
    base's param_dtype); packed MXFP4 experts are unpacked (exactly) before their adapter is
    added, so the result has dense experts."""
    cfg = model.cfg.replace(expert_format="dense", param_dtype=dtype or model.cfg.param_dtype)
    if cfg == model.cfg and not adapter_params(model):
        return model  # nothing to merge, unpack or cast
    abstract = abstract_targets(cfg)
    targets = abstract[1]
    base, lora = _split(flat_params(model))
    scale = _lora_scale(model)
    for key in _changed(base, lora):
        out = np.empty(targets[key].shape, targets[key].dtype)
        for n in range(cfg.num_hidden_layers):
            out[n] = _layer_weight(base, lora, key, n, scale)
        for suffix in PACKED_SUFFIXES:
            base.pop(key + suffix, None)
        base[key] = out
    return _running_as(model_from_params(cfg, base, abstract), model)


def merge_lora_mxfp4(model: nnx.Module, *, dtype: str | None = None
                     ) -> tuple[nnx.Module, dict[str, float]]:
    """(a Transformer with packed MXFP4 experts holding `w + (alpha/r) A B` re-quantized, the
    relative RMS error ||q(w') - w'|| / ||w'|| of each re-quantized stack over all layers).

    The other weights are merged in `dtype` (default: the base's param_dtype), as `merge_lora`;
    a packed stack without adapter keeps its bytes (error 0, not listed)."""
    cfg = model.cfg.replace(expert_format="mxfp4", param_dtype=dtype or model.cfg.param_dtype)
    abstract = abstract_targets(cfg)
    targets = abstract[1]
    base, lora = _split(flat_params(model))
    scale = _lora_scale(model)
    errors: dict[str, float] = {}
    for key in _changed(base, lora):
        if key + "_blocks" not in targets:  # not an expert stack: merged as merge_lora does
            out = np.empty(targets[key].shape, targets[key].dtype)
            for n in range(cfg.num_hidden_layers):
                out[n] = _layer_weight(base, lora, key, n, scale)
            base[key] = out
            continue
        if key + "_lora_a" not in lora and key + "_blocks" in base:
            continue  # packed, not adapted: the checkpoint's bytes as they are
        blocks = np.empty(targets[key + "_blocks"].shape, np.uint8)
        scales = np.empty(targets[key + "_scales"].shape, np.uint8)
        error = QuantizationError()
        for n in range(cfg.num_hidden_layers):
            w = _layer_weight(base, lora, key, n, scale)  # [E, I, O]
            error.add(*quantize_experts_into(w, blocks[n], scales[n]))
        base.pop(key, None)
        base[key + "_blocks"], base[key + "_scales"] = blocks, scales
        errors[key.rsplit(".", 1)[1]] = error.relative_rms
    return _running_as(model_from_params(cfg, base, abstract), model), errors


def _running_as(merged: nnx.Module, model: nnx.Module) -> nnx.Module:
    merged.execution = model.execution  # how it runs is the caller's, whatever the weights
    return merged


def save_adapters(model: nnx.Module, directory: str | Path, *, rank: int, alpha: float) -> Path:
    """Writes the adapters alone, without the base weights: adapters.safetensors (float32; an
    A and B per expert and layer for the expert targets) and adapters.json (rank, alpha,
    targets and the base model's config)."""
    lora = adapter_params(model)
    if not lora:
        raise ValueError("the model has no LoRA adapters to save")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in lora.items()},
              str(d / ADAPTERS_WEIGHTS))
    targets = sorted({k.rsplit(".", 1)[1][:-len("_lora_a")] for k in lora if k.endswith("_a")})
    meta = {"format": ADAPTERS_FORMAT, "version": 1, "rank": rank, "alpha": alpha,
            "targets": targets, "base_model": model.cfg.to_dict()}
    (d / ADAPTERS_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return d


def attach_adapters(model: nnx.Module, adapters: Mapping[str, np.ndarray], *, rank: int,
                    alpha: float, source: str = "adapters") -> nnx.Module:
    """Adds LoRA adapters holding `adapters` (flat names as `adapter_params` gives them) to
    `model` in place; names and shapes must be exactly those `add_lora` makes."""
    if adapter_params(model):
        raise ValueError(f"{source}: the model already has LoRA adapters")
    targets = tuple(sorted({k.rsplit(".", 1)[-1][:-len("_lora_a")] for k in adapters
                            if k.endswith("_lora_a")}))
    add_lora(model, rank=rank, alpha=alpha, targets=targets, seed=0)
    expected = {".".join(str(p) for p in path): v
                for path, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    missing, unexpected = sorted(set(expected) - set(adapters)), sorted(set(adapters) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: adapter tensors do not match targets {list(targets)}: "
                         f"missing {missing}, unexpected {unexpected}")
    for key, v in expected.items():
        if tuple(adapters[key].shape) != tuple(v.shape):
            raise ValueError(f"{source}: adapter {key!r} has shape {tuple(adapters[key].shape)}, "
                             f"expected {tuple(v.shape)} (rank {rank} on this base)")
        v.set_value(jnp.asarray(adapters[key], jnp.float32))
    return model


def _check_base(meta: Mapping, cfg: ModelConfig, where: Path) -> None:
    try:
        trained_on = ModelConfig.from_saved(meta["base_model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: base_model is not a model config: {e}") from None
    diff = [f"{k}={v!r} (this model: {getattr(cfg, k)!r})"
            for k, v in trained_on.to_dict().items()
            if k not in LOAD_CONVERSIONS and v != getattr(cfg, k)]
    if diff:
        raise ValueError(f"{where}: the adapters were trained on another base model: "
                         f"{', '.join(diff)}")


def load_adapters(model: nnx.Module, directory: str | Path) -> nnx.Module:
    """Attaches the adapters `save_adapters` wrote in `directory` to `model` (in place), which
    then computes the fine-tuned function with its base weights untouched: packed MXFP4 experts
    stay packed (QLoRA for generation, nothing merged). The base must have the architecture the
    adapters were trained on (adapters.json `base_model`); errors name the file and field."""
    d = Path(directory)
    meta_path, weights_path = d / ADAPTERS_CONFIG, d / ADAPTERS_WEIGHTS
    for p in (meta_path, weights_path):
        if not p.is_file():
            raise ValueError(f"{d} holds no {p.name}: expected a directory written by "
                             "`python -m llm_jax.export --adapters` (save_adapters)")
    meta = read_json_object(meta_path)
    if meta.get("format") != ADAPTERS_FORMAT or meta.get("version") != 1:
        raise ValueError(f"{meta_path}: format={meta.get('format')!r} version="
                         f"{meta.get('version')!r}: expected {ADAPTERS_FORMAT!r} version 1")
    rank, alpha = meta.get("rank"), meta.get("alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{meta_path}: rank={rank!r}: expected an integer >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not np.isfinite(alpha):
        raise ValueError(f"{meta_path}: alpha={alpha!r}: expected a finite number")
    targets = meta.get("targets")
    if not isinstance(targets, list) or not targets or not set(targets) <= set(TARGETS):
        raise ValueError(f"{meta_path}: targets={targets!r}: expected a non-empty subset of "
                         f"{sorted(TARGETS)}")
    _check_base(meta, model.cfg, meta_path)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} does not read: {e}") from None
    named = sorted({k.rsplit(".", 1)[-1][:-len("_lora_a")] for k in tensors
                    if k.endswith("_lora_a")})
    if named != sorted(targets):
        raise ValueError(f"{weights_path} holds adapters for {named}, {meta_path} says "
                         f"targets={sorted(targets)}")
    return attach_adapters(model, tensors, rank=rank, alpha=float(alpha), source=str(d))
