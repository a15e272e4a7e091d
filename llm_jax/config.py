"""ModelConfig: what a gpt-oss model is, as one frozen, hashable, validated dataclass.

The 16 architecture numbers carry the names of the gpt-oss reference (docs/model.md); beside
them, the dtypes, the experts' storage format, the norm variant and the initialiser. This is what
a checkpoint stores and what identifies a model; how it runs (MoE dispatch, attention kernel,
tiles, loss chunks, remat, scan) is `llm_jax.execution.ExecutionConfig`. Each field's
documentation is its `doc` metadata (`field_doc`), which `describe` prints and docs/config.md
lists. The config is a pytree with no leaves, so it can be a static jit argument and pass
through `jax.tree.map`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

DTYPES = ("float32", "bfloat16", "float16")
# How the MoE expert stacks are held: dense in param_dtype, or packed MXFP4 as gpt-oss ships
# them (model/mxfp4.py; frozen, unpacked inside each dispatch).
EXPERT_FORMATS = ("dense", "mxfp4")
NORM_TYPES = ("rms", "layer")
# The model section of checkpoints written before the execution settings had a config of their
# own also held these; `from_saved` reads past them (they never identified a model).
LEGACY_EXECUTION_FIELDS = (
    "mxfp4_unpack_mib", "gmm_tile_m", "gmm_tile_k", "gmm_tile_n", "moe_dispatch",
    "attention_impl", "moe_capacity_factor", "remat", "scan_layers", "loss_chunk_tokens",
    "loss_group_chunks",
)

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


def doc_field(default: Any, doc: str) -> Any:
    """A config field with its documentation (`field_doc` reads it; describe and docs/config.md
    print it)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def field_doc(cls: type, name: str) -> str:
    """What field `name` of the dataclass `cls` controls (its `doc` metadata)."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}[name]


class FrozenConfig:
    """Dict and JSON round trips and `replace` for the frozen config dataclasses (ModelConfig,
    execution.ExecutionConfig)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        """Builds a config from a mapping; unknown keys are refused by name."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known fields are "
                             f"{sorted(known)}")
        for f in dataclasses.fields(cls):  # JSON has no int/float distinction for floats
            if f.name in d and f.type == "float" and isinstance(d[f.name], int) \
                    and not isinstance(d[f.name], bool):
                d[f.name] = float(d[f.name])
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> Any:
        return cls.from_dict(json.loads(s))

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig(FrozenConfig):
    """The gpt-oss network's design decisions. Defaults are the book's tiny model."""

    num_hidden_layers: int = doc_field(4, "depth: levels of abstraction, one attend-then-think "
                                       "round each; params and FLOPs grow linearly")
    num_experts: int = doc_field(16, "experts per MoE layer: stored knowledge; params grow with E, "
                                 "FLOPs per token do not")
    experts_per_token: int = doc_field(2, "top-k experts each token uses: active compute; FLOPs "
                                       "grow with k")
    vocab_size: int = doc_field(8000, "granularity of the tokenizer: larger = fewer tokens per "
                                "text, but two V x D tables and a V-wide softmax")
    hidden_size: int = doc_field(256, "resolution of the residual stream: the width every layer "
                                 "reads and writes")
    intermediate_size: int = doc_field(256, "scratch paper: width of each expert's SwiGLU hidden "
                                       "layer")
    head_dim: int = doc_field(64, "width of one attention head's query-key comparison (RoPE "
                              "rotates its pairs)")
    num_attention_heads: int = doc_field(4, "query heads: how many things a token looks for at "
                                         "once")
    num_key_value_heads: int = doc_field(2, "kv heads shared by groups of query heads (GQA): sets "
                                         "the KV-cache size")
    sliding_window: int = doc_field(0, "keys an even layer sees (0 = every layer full): caps that "
                                    "layer's attention cost and cache at W")
    initial_context_length: int = doc_field(4096, "context of pre-training (L0): the view, and "
                                            "YaRN's reference length")
    rope_theta: float = doc_field(10000.0, "RoPE base: the slowest rotation, how far apart "
                                  "positions stay distinguishable")
    rope_scaling_factor: float = doc_field(32.0, "YaRN extension: usable context = L0 x factor "
                                           "(1 = plain RoPE); the KV memory bill grows with it")
    rope_ntk_alpha: float = doc_field(1.0, "YaRN beta_slow: dimensions turning fewer times than "
                                      "this over L0 are fully interpolated")
    rope_ntk_beta: float = doc_field(32.0, "YaRN beta_fast: dimensions turning more times than "
                                     "this over L0 are left as they are")
    swiglu_limit: float = doc_field(7.0, "clamp on the experts' SwiGLU inputs: keeps activations "
                                    "bounded")
    dtype: str = doc_field("float32", "compute dtype of matmuls and activations: sets activation "
                           "and KV-cache bytes")
    param_dtype: str = doc_field("float32", "storage dtype of weights (norms, sinks, router stay "
                                 "float32): sets params and grads bytes")
    expert_format: str = doc_field("dense", "how the expert stacks are held: dense (param_dtype) "
                                   "or mxfp4 (packed as gpt-oss ships them, 4.25 bits a value, "
                                   "frozen: QLoRA; unpacked inside each dispatch)")
    norm_type: str = doc_field("rms", "rms (gpt-oss) or layer (LayerNorm, only to compare against)")
    prms_fraction: float = doc_field(0.0, "pRMSNorm: estimate the RMS from this fraction of "
                                     "features (0 = full RMSNorm)")
    initializer_range: float = doc_field(0.02, "std of the normal initialiser (output projections "
                                         "/ sqrt(2L))")

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
            "initial_context_length",
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
        for name in ("rope_theta", "rope_ntk_alpha", "rope_ntk_beta", "swiglu_limit"):
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

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a mapping; unknown keys are refused by name (an execution
        setting with the place it belongs)."""
        moved = sorted(set(d) & set(LEGACY_EXECUTION_FIELDS))
        if moved:
            raise ValueError(
                f"ModelConfig: {moved} say how the model runs, not what it is: they are fields "
                f"of ExecutionConfig (llm_jax.execution; config.execution.{moved[0]} in a run "
                "config)")
        return super().from_dict(d)

    @classmethod
    def from_saved(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """The model section a checkpoint stored (training workdir, llm_jax saved model, an
        adapter's base): `from_dict`, past the LEGACY_EXECUTION_FIELDS that checkpoints written
        before ExecutionConfig also stored there."""
        return cls.from_dict({k: v for k, v in d.items() if k not in LEGACY_EXECUTION_FIELDS})
