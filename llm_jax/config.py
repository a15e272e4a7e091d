"""ModelConfig: the gpt-oss design decisions as one frozen, hashable, validated dataclass.

The 16 architecture numbers carry the names of the gpt-oss reference (docs/model.md); the
rest are implementation choices (dtypes, MoE dispatch, the pRMSNorm fraction). The config is a
pytree with no leaves, so it can be a static jit argument and pass through `jax.tree.map`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

# model/moe_dispatch.py's table; "auto" picks a dropless one by shape and backend.
MOE_DISPATCHES = ("auto", "dense", "ragged", "gather", "blocked", "gmm", "capacity",
                  "expert_parallel", "expert_parallel_gmm")
# model/select.py's table; "auto" picks by backend and shape.
ATTENTION_IMPLS = ("auto", "direct", "blockwise", "splash", "flash")
DTYPES = ("float32", "bfloat16", "float16")
# How the MoE expert stacks are held: dense in param_dtype, or packed MXFP4 as gpt-oss ships
# them (model/mxfp4.py; frozen, unpacked inside each dispatch).
EXPERT_FORMATS = ("dense", "mxfp4")
NORM_TYPES = ("rms", "layer")
# How the same function is executed: changing them never changes a result, so a run may resume
# with other values.
EXECUTION_FIELDS = ("remat", "scan_layers", "attention_impl", "loss_chunk_tokens",
                    "loss_group_chunks", "gmm_tile_m", "gmm_tile_k", "gmm_tile_n")

# Fixed by the gpt-oss reference, not design decisions (docs/model.md).
RMS_NORM_EPS = 1e-5
SWIGLU_ALPHA = 1.702


def yarn_correction_range(cfg: "ModelConfig") -> tuple[float, float]:
    """YaRN's (low, high) dimension bounds of the interpolation ramp (YaRN paper, eq. 17)."""
    half = cfg.head_dim / 2
    base = math.log(cfg.rope_theta)
    l0 = cfg.initial_context_length
    low = half * math.log(l0 / (cfg.rope_ntk_beta * 2 * math.pi)) / base
    high = half * math.log(l0 / (cfg.rope_ntk_alpha * 2 * math.pi)) / base
    return low, high


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The gpt-oss network's design decisions. Defaults are the book's tiny model."""

    num_hidden_layers: int = 4
    num_experts: int = 16
    experts_per_token: int = 2
    vocab_size: int = 8000
    hidden_size: int = 256
    intermediate_size: int = 256
    head_dim: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    sliding_window: int = 0
    initial_context_length: int = 4096
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 32.0
    rope_ntk_alpha: float = 1.0
    rope_ntk_beta: float = 32.0
    swiglu_limit: float = 7.0
    # Implementation choices.
    dtype: str = "float32"  # compute dtype of matmuls and activations
    param_dtype: str = "float32"  # storage dtype of weights (norm scales always float32)
    expert_format: str = "dense"  # one of EXPERT_FORMATS; mxfp4 experts are frozen
    # The grouped-matmul dispatches (gmm, expert_parallel_gmm) unpack mxfp4 experts a group at a
    # time, each group's unpacked stack at most this many MiB (at least one expert); 0 = a
    # layer's whole stack at once.
    mxfp4_unpack_mib: int = 256
    # megablox's tiles (TPU grouped matmuls: gmm, expert_parallel_gmm): rows, contracted lanes
    # and output lanes of one block, multiples of 128 (kernels/grouped_matmul.py: each row tile
    # re-reads its expert's weights, each output tile the rows). The GPU kernel picks its own.
    gmm_tile_m: int = 512
    gmm_tile_k: int = 1024
    gmm_tile_n: int = 1024
    # One of MOE_DISPATCHES. The dropping ones (capacity, expert_parallel*) apply only to
    # training calls (`train=True`); every other call computes the exact function.
    moe_dispatch: str = "auto"
    # One of ATTENTION_IMPLS: how self-attention is computed (the same function; splash is a
    # TPU kernel and falls back to the shape rule where it cannot apply).
    attention_impl: str = "auto"
    moe_capacity_factor: float = 1.25  # dropping dispatches: slots per expert = factor * T * k / E
    prms_fraction: float = 0.0  # pRMSNorm: estimate the RMS from the first p of features; 0 = off
    norm_type: str = "rms"  # rms (gpt-oss) | layer (LayerNorm, for the norm benchmark)
    remat: bool = False  # recompute each layer's activations in the backward pass
    scan_layers: bool = True  # one lax.scan over the stacked layers; False unrolls the loop
    # Tokens per batch shard (per device) in one chunk of the fused unembedding + cross-entropy
    # (model/unembed_loss.py): each chunk holds [tokens, vocab] float32 logits and re-reads the
    # unembedding and its float32 gradient, so larger chunks read those fewer times.
    loss_chunk_tokens: int = 256
    # Chunks of the loss whose logits' gradients go into dh and dW in one product: each product
    # reduces a [vocab, hidden] float32 gradient (across the batch shards, on a mesh), so k chunks
    # a group do that k times less often for k - 1 more chunks of gradient held at once. Unused
    # where the loss splits by vocabulary (unembed_loss.vocab_split: dW stays on its device).
    loss_group_chunks: int = 1
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raises ValueError naming the first bad field, its value and what is allowed."""

        def bad(field: str, allowed: str) -> None:
            raise ValueError(
                f"ModelConfig.{field}={getattr(self, field)!r} is invalid: expected {allowed}"
            )

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "str": str, "bool": bool}[f.type]
            if isinstance(v, bool) and f.type != "bool" or not isinstance(v, want):
                bad(f.name, f"a value of type {f.type}")
        positive_ints = (
            "num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
            "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
            "initial_context_length", "loss_chunk_tokens", "loss_group_chunks",
        )
        for name in positive_ints:
            if getattr(self, name) <= 0:
                bad(name, "a positive integer")
        if self.head_dim % 2:
            bad("head_dim", "an even number (RoPE rotates pairs of features)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is invalid: expected a "
                f"multiple of num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"ModelConfig.experts_per_token={self.experts_per_token} is invalid: expected at "
                f"most num_experts={self.num_experts}"
            )
        if self.sliding_window < 0:
            bad("sliding_window", "0 (off) or a positive window length")
        for name in ("gmm_tile_m", "gmm_tile_k", "gmm_tile_n"):
            if getattr(self, name) <= 0 or getattr(self, name) % 128:
                bad(name, "a positive multiple of 128 (TPU lanes)")
        if self.mxfp4_unpack_mib < 0:
            bad("mxfp4_unpack_mib", "0 (a whole layer at once) or a positive size in MiB")
        for name in ("rope_theta", "rope_ntk_alpha", "rope_ntk_beta", "swiglu_limit",
                     "moe_capacity_factor"):
            if not getattr(self, name) > 0:
                bad(name, "a positive number")
        if self.rope_theta <= 1:
            bad("rope_theta", "a number > 1")
        if self.rope_scaling_factor < 1:
            bad("rope_scaling_factor", "a number >= 1 (1 = plain RoPE, > 1 = YaRN)")
        if self.rope_scaling_factor > 1:
            low, high = yarn_correction_range(self)
            if not 0 < low < high < self.head_dim / 2 - 1:
                raise ValueError(
                    f"ModelConfig YaRN range low={low:.3f}, high={high:.3f} (from rope_theta="
                    f"{self.rope_theta}, head_dim={self.head_dim}, initial_context_length="
                    f"{self.initial_context_length}, rope_ntk_alpha={self.rope_ntk_alpha}, "
                    f"rope_ntk_beta={self.rope_ntk_beta}) is invalid: expected "
                    f"0 < low < high < head_dim/2 - 1 = {self.head_dim / 2 - 1}"
                )
        if self.dtype not in DTYPES:
            bad("dtype", f"one of {DTYPES}")
        if self.param_dtype not in DTYPES:
            bad("param_dtype", f"one of {DTYPES}")
        if self.expert_format not in EXPERT_FORMATS:
            bad("expert_format", f"one of {EXPERT_FORMATS}")
        if self.expert_format == "mxfp4":
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % 32:
                    bad(name, "a multiple of 32 with expert_format='mxfp4' (MXFP4 blocks "
                              "hold 32 values along each expert matmul's input)")
        if self.moe_dispatch not in MOE_DISPATCHES:
            bad("moe_dispatch", f"one of {MOE_DISPATCHES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            bad("attention_impl", f"one of {ATTENTION_IMPLS}")
        if self.norm_type not in NORM_TYPES:
            bad("norm_type", f"one of {NORM_TYPES}")
        if not 0.0 <= self.prms_fraction <= 1.0:
            bad("prms_fraction", "a fraction in [0, 1] (0 = plain RMSNorm)")
        if self.prms_fraction > 0 and int(self.prms_fraction * self.hidden_size) < 1:
            bad("prms_fraction", f"a fraction that keeps >= 1 of hidden_size={self.hidden_size}")
        if not self.initializer_range > 0:
            bad("initializer_range", "a positive number")

    # ------------------------------------------------------------------ derived values
    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_window(self, layer: int) -> int:
        """Sliding window of layer `layer` (0 = full attention): even layers slide (gpt-oss)."""
        return self.sliding_window if self.sliding_window > 0 and layer % 2 == 0 else 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    @property
    def scan_unroll(self) -> int | bool:
        """`unroll` for every `lax.scan` over the layers (training, prefill, decode)."""
        return 1 if self.scan_layers else True

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a mapping; unknown keys are refused by name."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"ModelConfig: unknown field(s) {unknown}; known fields are {sorted(known)}"
            )
        for f in dataclasses.fields(cls):  # JSON has no int/float distinction for floats
            if f.name in d and f.type == "float" and isinstance(d[f.name], int) \
                    and not isinstance(d[f.name], bool):
                d[f.name] = float(d[f.name])
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "ModelConfig":
        return cls.from_dict(json.loads(s))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
