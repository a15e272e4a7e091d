"""Where each llm_jax param lives in a Hugging Face or OpenAI gpt-oss checkpoint: tables of
`TensorSpec`s (name, shape, how the layout differs), read by readers.py and written by
writers.py. docs/model.md, "Checkpoints".

Shapes: L layers, V vocab, D hidden, N q heads, K kv heads, H head_dim, E experts, F intermediate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.model.mxfp4 import MXFP4_BLOCK
from llm_jax.weights.mxfp4 import to_checkpoint_layout

# File names of the formats.
LLM_JAX_CONFIG = "config.json"
LLM_JAX_PARAMS = "params.safetensors"
# 2: packed expert stacks in the model's layout; 1 held them as the HF checkpoint orders them.
LLM_JAX_VERSION = 2
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One llm_jax param from one checkpoint tensor: `src` (per layer: a template with {n}) of
    shape `src_shape`. `transposed`: the checkpoint holds the last two axes swapped (torch's
    (out, in)); then `load` maps the swapped tensor to our (per-layer) layout, `save` back."""

    key: str
    src: str
    src_shape: tuple[int, ...]
    load: Callable[[np.ndarray], np.ndarray] = lambda w: w
    save: Callable[[np.ndarray], np.ndarray] = lambda w: w
    mxfp4: tuple[str, str] | None = None  # (blocks, scales) suffixes if it may be MXFP4-packed
    transposed: bool = False

    def to_ours(self, w: np.ndarray) -> np.ndarray:
        return self.load(np.swapaxes(w, -1, -2) if self.transposed else w)

    def to_checkpoint(self, w: np.ndarray) -> np.ndarray:
        w = self.save(w)
        return np.swapaxes(w, -1, -2) if self.transposed else w


Layout = tuple[list[TensorSpec], list[TensorSpec]]  # (global specs, per-layer specs)


def hf_specs(cfg: ModelConfig) -> Layout:
    """(global specs, per-layer specs) for the Hugging Face layout."""
    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, f, v = cfg.num_experts, cfg.intermediate_size, cfg.vocab_size
    p = "model.layers.{n}."

    def proj(heads: int) -> dict[str, Any]:  # torch Linear (heads*H, D) <-> (D, heads, H)
        return dict(load=lambda w: w.T.reshape(d, heads, h), save=lambda w: w.reshape(d, -1).T)

    def bias(heads: int) -> dict[str, Any]:
        return dict(load=lambda b: b.reshape(heads, h), save=lambda b: b.reshape(-1))

    top = [
        TensorSpec("embedding", "model.embed_tokens.weight", (v, d)),
        TensorSpec("norm.scale", "model.norm.weight", (d,)),
        TensorSpec("unembedding", "lm_head.weight", (v, d)),
    ]
    layer = [
        TensorSpec("attn_norm.scale", p + "input_layernorm.weight", (d,)),
        TensorSpec("attn.q_proj", p + "self_attn.q_proj.weight", (n * h, d), **proj(n)),
        TensorSpec("attn.q_bias", p + "self_attn.q_proj.bias", (n * h,), **bias(n)),
        TensorSpec("attn.k_proj", p + "self_attn.k_proj.weight", (k * h, d), **proj(k)),
        TensorSpec("attn.k_bias", p + "self_attn.k_proj.bias", (k * h,), **bias(k)),
        TensorSpec("attn.v_proj", p + "self_attn.v_proj.weight", (k * h, d), **proj(k)),
        TensorSpec("attn.v_bias", p + "self_attn.v_proj.bias", (k * h,), **bias(k)),
        TensorSpec("attn.o_proj", p + "self_attn.o_proj.weight", (d, n * h),
              load=lambda w: w.T.reshape(n, h, d), save=lambda w: w.reshape(n * h, d).T),
        TensorSpec("attn.o_bias", p + "self_attn.o_proj.bias", (d,)),
        TensorSpec("attn.sinks", p + "self_attn.sinks", (n,)),
        TensorSpec("mlp_norm.scale", p + "post_attention_layernorm.weight", (d,)),
        TensorSpec("mlp.router", p + "mlp.router.weight", (e, d), transposed=True),
        TensorSpec("mlp.router_bias", p + "mlp.router.bias", (e,)),
        TensorSpec("mlp.gate_up_proj", p + "mlp.experts.gate_up_proj", (e, d, 2 * f),
                   mxfp4=("_blocks", "_scales")),
        TensorSpec("mlp.gate_up_proj_bias", p + "mlp.experts.gate_up_proj_bias", (e, 2 * f)),
        TensorSpec("mlp.down_proj", p + "mlp.experts.down_proj", (e, f, d),
                   mxfp4=("_blocks", "_scales")),
        TensorSpec("mlp.down_proj_bias", p + "mlp.experts.down_proj_bias", (e, d)),
    ]
    return top, layer


def openai_specs(cfg: ModelConfig) -> Layout:
    """(global specs, per-layer specs) for OpenAI's layout; q, k, v are rows of one fused qkv."""
    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, f, v = cfg.num_experts, cfg.intermediate_size, cfg.vocab_size
    p = "block.{n}."
    qkv = (n + 2 * k) * h
    rows = {"q": (0, n * h, n), "k": (n * h, (n + k) * h, k), "v": ((n + k) * h, qkv, k)}

    def qkv_w(part: str) -> Callable[[np.ndarray], np.ndarray]:
        a, b, heads = rows[part]
        return lambda w: w[a:b].T.reshape(d, heads, h)

    def qkv_b(part: str) -> Callable[[np.ndarray], np.ndarray]:
        a, b, heads = rows[part]
        return lambda w: w[a:b].reshape(heads, h)

    top = [
        TensorSpec("embedding", "embedding.weight", (v, d)),
        TensorSpec("norm.scale", "norm.scale", (d,)),
        TensorSpec("unembedding", "unembedding.weight", (v, d)),
    ]
    layer = [TensorSpec("attn_norm.scale", p + "attn.norm.scale", (d,))]
    for part in "qkv":
        layer.append(TensorSpec(f"attn.{part}_proj", p + "attn.qkv.weight", (qkv, d), load=qkv_w(part)))
        layer.append(TensorSpec(f"attn.{part}_bias", p + "attn.qkv.bias", (qkv,), load=qkv_b(part)))
    layer += [
        TensorSpec("attn.o_proj", p + "attn.out.weight", (d, n * h),
                   load=lambda w: w.T.reshape(n, h, d), save=lambda w: w.reshape(n * h, d).T),
        TensorSpec("attn.o_bias", p + "attn.out.bias", (d,)),
        TensorSpec("attn.sinks", p + "attn.sinks", (n,)),
        TensorSpec("mlp_norm.scale", p + "mlp.norm.scale", (d,)),
        TensorSpec("mlp.router", p + "mlp.gate.weight", (e, d), transposed=True),
        TensorSpec("mlp.router_bias", p + "mlp.gate.bias", (e,)),
        TensorSpec("mlp.gate_up_proj", p + "mlp.mlp1_weight", (e, 2 * f, d), transposed=True,
                   mxfp4=(".blocks", ".scales")),
        TensorSpec("mlp.gate_up_proj_bias", p + "mlp.mlp1_bias", (e, 2 * f)),
        TensorSpec("mlp.down_proj", p + "mlp.mlp2_weight", (e, d, f), transposed=True,
                   mxfp4=(".blocks", ".scales")),
        TensorSpec("mlp.down_proj_bias", p + "mlp.mlp2_bias", (e, d)),
    ]
    return top, layer


def packed_shapes(spec: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of an MXFP4-packed MoE weight: (E, out, in/32, 16), (E, out, in/32)
    in both layouts. The dense tensor is (E, out, in) in OpenAI's (`transposed`), (E, in, out)
    in Hugging Face's."""
    e, a, b = spec.src_shape
    d_out, d_in = (a, b) if spec.transposed else (b, a)
    g = d_in // MXFP4_BLOCK if d_in % MXFP4_BLOCK == 0 else -1  # -1: cannot be MXFP4
    return (e, d_out, g, MXFP4_BLOCK // 2), (e, d_out, g)


def write_specs(flat: Mapping[str, np.ndarray], specs: Layout,
                cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Checkpoint tensors from flat params. Packed expert stacks (`<key>_blocks` / `_scales`)
    are written as the checkpoint's bytes (bitwise what was read), dense ones as they are."""
    top, layer = specs
    out = {s.src: s.to_checkpoint(flat[s.key]) for s in top}
    for s in layer:
        key = f"layers.{s.key}"
        for n in range(cfg.num_hidden_layers):
            name = s.src.format(n=n)
            if s.mxfp4 is not None and key + "_blocks" in flat:
                out[name + s.mxfp4[0]], out[name + s.mxfp4[1]] = stored_layout(
                    flat[key + "_blocks"][n], flat[key + "_scales"][n])
            else:
                out[name] = s.to_checkpoint(flat[key][n])
    return out


def stored_layout(blocks_EG16O: np.ndarray, scales_EGO: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """One layer's packed stack from the model's layout back to the checkpoint's, (E, out, in /
    32, 16) and (E, out, in / 32), one expert at a time (bounded temporaries)."""
    e, g, _, o = blocks_EG16O.shape
    blocks = np.empty((e, o, g, MXFP4_BLOCK // 2), np.uint8)
    scales = np.empty((e, o, g), np.uint8)
    for i in range(e):
        blocks[i], scales[i] = to_checkpoint_layout(blocks_EG16O[i], scales_EGO[i])
    return blocks, scales
