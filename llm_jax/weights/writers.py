"""Writing model checkpoints: llm_jax (`config.json` + `params.safetensors`, the params
bitwise), Hugging Face gpt-oss (sharded past a size) and OpenAI gpt-oss, from the layout tables
of layouts.py. Packed MXFP4 experts are written as the bytes the model holds (bitwise what was
read, for weights not trained). OpenAI's own loader (`gpt_oss.torch.weights.Checkpoint` on PyPI)
reads MoE weights only as MXFP4: `quantize_experts=True` writes dense experts as MXFP4 (lossy,
`mxfp4.quantize_experts`; the relative error of each stack is logged), which an export of a
model loaded packed never needs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from llm_jax.weights import mxfp4
from llm_jax.weights.configs import model_config_to_hf_config, model_config_to_openai_config
from llm_jax.weights.flat import flat_params
from llm_jax.weights.layouts import (
    HF_INDEX,
    HF_WEIGHTS,
    LLM_JAX_CONFIG,
    LLM_JAX_PARAMS,
    LLM_JAX_VERSION,
    hf_specs,
    openai_specs,
    write_specs,
)
from llm_jax.weights.tensor_store import save_safetensors


def save_llm_jax(model: nnx.Module, directory: str | Path) -> Path:
    """Writes `config.json` + `params.safetensors` (bitwise copy of the params). Version 2:
    packed expert stacks in the model's layout (`model.mxfp4.PackedExperts`); version 1 held
    them in the checkpoint's order, which the reader still converts."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(flat_params(model), d / LLM_JAX_PARAMS)
    meta = {"format": "llm_jax", "version": LLM_JAX_VERSION, "model": model.cfg.to_dict()}
    (d / LLM_JAX_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return d


def save_hf(model: nnx.Module, directory: str | Path, *, max_shard_bytes: int = 5 * 2**30,
            quantize_experts: bool = False) -> Path:
    """Writes a Hugging Face gpt-oss checkpoint (`GptOssForCausalLM.from_pretrained` loads it);
    sharded with `model.safetensors.index.json` when larger than `max_shard_bytes`. Packed
    experts are written as their MXFP4 bytes (with the `quantization_config` of the released
    gpt-oss), dense ones plain or, with `quantize_experts`, as MXFP4 (lossy)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if quantize_experts:
        model = _quantized(model, d)
    cfg = model.cfg
    tensors = write_specs(flat_params(model), hf_specs(cfg), cfg)
    total = sum(t.nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        save_safetensors(tensors, d / HF_WEIGHTS)
    else:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, t in tensors.items():
            if shards[-1] and size + t.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += t.nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors(shard, d / fname)
            weight_map.update(dict.fromkeys(shard, fname))
        (d / HF_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (d / "config.json").write_text(json.dumps(model_config_to_hf_config(cfg), indent=2))
    return d


def _quantized(model: nnx.Module, path: Path) -> nnx.Module:
    """`model` with MXFP4 experts (lossy if they were dense: the error is logged)."""
    model, errors = mxfp4.quantize_experts(model)
    mxfp4.log_quantization(errors, f"writing {path}")
    return model


def save_openai(model: nnx.Module, directory: str | Path, *,
                quantize_experts: bool = False) -> Path:
    """Writes an OpenAI-layout gpt-oss checkpoint: packed experts as their MXFP4 bytes, dense
    ones plain, or with `quantize_experts` as MXFP4 (what OpenAI's loader needs; lossy)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if quantize_experts:
        model = _quantized(model, d)
    cfg = model.cfg
    flat = flat_params(model)
    top, layer = openai_specs(cfg)
    plain = [s for s in layer if not s.key.startswith(("attn.q_", "attn.k_", "attn.v_"))]
    tensors = write_specs(flat, (top, plain), cfg)
    n, k, h, dm = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        w = [flat[f"layers.attn.{p}_proj"][i].reshape(dm, -1).T for p in "qkv"]
        b = [flat[f"layers.attn.{p}_bias"][i].reshape(-1) for p in "qkv"]
        tensors[f"block.{i}.attn.qkv.weight"] = np.concatenate(w, axis=0)
        tensors[f"block.{i}.attn.qkv.bias"] = np.concatenate(b, axis=0)
        assert tensors[f"block.{i}.attn.qkv.weight"].shape == ((n + 2 * k) * h, dm)
    save_safetensors(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(model_config_to_openai_config(cfg), indent=2))
    return d
