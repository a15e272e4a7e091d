"""Reading and writing model checkpoints: llm_jax, Hugging Face gpt-oss and OpenAI gpt-oss formats.

`load_pretrained(path)` detects the format of a directory and returns a `Transformer` with its
config attached (`model.cfg`):
- llm_jax: `config.json` ({"format": "llm_jax", "model": ModelConfig}) + `params.safetensors`
  holding the flattened param tree ("layers.attn.q_proj", ...; layer weights stacked on axis 0).
- Hugging Face: `config.json` (GptOssConfig) + `model.safetensors` or a sharded
  `model.safetensors.index.json`; MoE weights plain or MXFP4 (`*_blocks` / `*_scales`).
- OpenAI: `config.json` in the reference's naming (the same names as ModelConfig) + `*.safetensors`
  with `block.N.*` names, fused qkv, MoE weights (E, out, in), plain or MXFP4
  (`*.blocks` / `*.scales`).
  A directory holding only an `original/` subdirectory is read from there.
Layouts and names: docs/model.md, "Checkpoints". Only safetensors are read; pickles are
refused. Weights are filled into an abstract model (`nnx.eval_shape`), so nothing is randomly
initialised.

Hostile files (docs/reliability.md): every safetensors header is validated field by field before
any tensor is read (llm_jax.weights.safetensors_header), config.json fields are checked for type and
range by name, and the shapes the config implies are compared with the headers before anything
sized by the config is built or allocated. Every problem is a ValueError naming the file, the
tensor or field, and what was expected; the tensors themselves are read by `safetensors`.

Shapes: L layers, V vocab, D hidden, N q heads, K kv heads, H head_dim, E experts, F intermediate.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from llm_jax.config import RMS_NORM_EPS, SWIGLU_ALPHA, ModelConfig
from llm_jax.model import abstract_model
from llm_jax.weights.checkpointing import Checkpointer, find_training_checkpoint, restore_params
from llm_jax.weights.json_fields import Fields, read_json_object
from llm_jax.weights.safetensors_header import FLOAT_DTYPES, TensorInfo, read_header

LLM_JAX_CONFIG = "config.json"
LLM_JAX_PARAMS = "params.safetensors"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# The 16 architecture numbers: OpenAI's config.json uses exactly these names (docs/model.md).
ARCH_FIELDS = (
    "num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
    "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
    "sliding_window", "initial_context_length", "rope_theta", "rope_scaling_factor",
    "rope_ntk_alpha", "rope_ntk_beta", "swiglu_limit",
)
# Fields a caller may change at load time: they choose how the function is computed, not what.
OVERRIDABLE_FIELDS = ("dtype", "param_dtype", "moe_dispatch", "moe_capacity_factor", "remat",
                      "scan_layers", "attention_impl")

# OCP MX FP4 (E2M1) code points, low nibble first (docs/model.md, "MXFP4").
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
MXFP4_BLOCK = 32  # values per scale


# ====================================================================== safetensors
class TensorStore:
    """Read-only view of the tensors in one or more safetensors files, headers validated."""

    def __init__(self, files: Iterable[Path]):
        self.files = [Path(f) for f in files]
        self._info: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_header(f).items():
                if name in self._info:
                    raise ValueError(
                        f"tensor {name!r} appears in both {self._info[name].file} and {f}")
                self._info[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        return sorted(self._info)

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name].shape

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name` (read by `safetensors`); checks its shape when `shape` is given."""
        from safetensors import SafetensorError, safe_open

        if name not in self._info:
            where = ", ".join(str(f) for f in self.files)
            raise ValueError(f"checkpoint is missing tensor {name!r} (looked in {where})")
        info = self._info[name]
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} in {info.file} has shape {info.shape}, expected {tuple(shape)}"
            )
        try:
            with safe_open(str(info.file), framework="numpy") as f:
                return f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"tensor {name!r} in {info.file} does not read: {e}") from None


def _save_safetensors(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file  # handles bfloat16 through ml_dtypes
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


# ====================================================================== MXFP4
def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32,
                     rows_per_chunk: int = 1 << 16) -> np.ndarray:
    """MXFP4 -> dense: blocks uint8 (..., G, 16), scales uint8 (..., G) -> (..., G * 32).

    Byte j of a block holds values 2j (low nibble) and 2j+1 (high nibble); each block of 32 values
    shares the scale 2^(s - 127). Vectorised numpy, in chunks of blocks to bound the temporaries.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks shape {blocks.shape} does not match scales shape {scales.shape}: "
            f"expected blocks (..., G, {MXFP4_BLOCK // 2}) and scales (..., G)"
        )
    *lead, g, b = blocks.shape
    blocks_R16 = blocks.reshape(-1, b)
    exponents_R1 = scales.reshape(-1, 1).astype(np.int32) - 127
    out_R32 = np.empty((blocks_R16.shape[0], 2 * b), dtype)
    for r in range(0, blocks_R16.shape[0], rows_per_chunk):
        blk = blocks_R16[r:r + rows_per_chunk]
        pairs = np.stack([FP4_VALUES[blk & 0x0F], FP4_VALUES[blk >> 4]], axis=-1)  # low first
        out_R32[r:r + rows_per_chunk] = np.ldexp(pairs.reshape(len(blk), 2 * b),
                                                 exponents_R1[r:r + rows_per_chunk])
    return out_R32.reshape(*lead, g * 2 * b)


# ====================================================================== HF config
_HF_DEFAULTS = {  # GptOssConfig's defaults for the fields we check
    "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
    "tie_word_embeddings": False, "rope_theta": 150000.0,
}
_HF_DEFAULT_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}
_HF_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow",
                 "original_max_position_embeddings", "truncate", "attention_factor", "mscale",
                 "mscale_all_dim", "partial_rotary_factor"}


def _hf_unsupported(f: Fields, key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{f.where}: unsupported Hugging Face gpt-oss config: {key}={value!r} "
                      f"(llm_jax supports {expected})")


def hf_config_to_model_config(hf: Mapping[str, Any], source: str = "Hugging Face config"
                              ) -> ModelConfig:
    """A GptOssConfig dict (config.json) -> ModelConfig; refuses what llm_jax cannot compute,
    and any field of the wrong type or range, naming `source` and the field."""
    f = Fields(hf, source)
    if f.raw("model_type", "gpt_oss") != "gpt_oss":
        raise _hf_unsupported(f, "model_type", f.raw("model_type"), "'gpt_oss'")
    for key, want in {"rms_norm_eps": RMS_NORM_EPS, "swiglu_alpha": SWIGLU_ALPHA}.items():
        got = f.float(key, default=_HF_DEFAULTS[key])
        if not math.isclose(got, want, rel_tol=1e-9):
            raise _hf_unsupported(f, key, got, f"{want} only (fixed in gpt-oss)")
    if f.raw("attention_bias", True) is not True:
        raise _hf_unsupported(f, "attention_bias", f.raw("attention_bias"), "true only")
    if f.raw("tie_word_embeddings", False) is not False:
        raise _hf_unsupported(f, "tie_word_embeddings", f.raw("tie_word_embeddings"),
                              "false only")
    quant = f.obj("quantization_config")
    if quant is not None and quant.raw("quant_method") != "mxfp4":
        raise _hf_unsupported(f, "quantization_config.quant_method", quant.raw("quant_method"),
                              "'mxfp4' (dequantized on load) or none")

    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    layers = f.int("num_hidden_layers")
    window = f.int("sliding_window", default=0, low=0)

    rope_key = "rope_parameters" if f.raw("rope_parameters") else "rope_scaling"
    rope = f.obj(rope_key) if f.raw(rope_key) else Fields(dict(_HF_DEFAULT_ROPE), source)
    unknown = sorted(set(rope.d) - _HF_ROPE_KEYS)
    if unknown:
        raise _hf_unsupported(f, f"rope_parameters.{unknown[0]}", rope.d[unknown[0]], "no such key")
    rope_type = rope.raw("rope_type", rope.raw("type", "default"))
    theta = (rope.float("rope_theta", above=1.0) if "rope_theta" in rope
             else f.float("rope_theta", default=_HF_DEFAULTS["rope_theta"], above=1.0))
    if rope.raw("partial_rotary_factor", 1.0) != 1.0:
        raise _hf_unsupported(f, "rope_parameters.partial_rotary_factor",
                              rope.raw("partial_rotary_factor"), "1.0 only")
    arch: dict[str, Any] = {}
    if rope_type == "yarn":
        if "factor" not in rope:
            raise _hf_unsupported(f, "rope_parameters.factor", None, "a number >= 1")
        factor = rope.float("factor", at_least=1.0)
        if rope.raw("truncate", True) is not False:  # HF's YaRN truncates unless told not to
            raise _hf_unsupported(f, "rope_parameters.truncate", rope.raw("truncate", True),
                                  "false only (gpt-oss YaRN does not round the correction range)")
        for key in ("mscale", "mscale_all_dim"):
            if key in rope:
                raise _hf_unsupported(f, f"rope_parameters.{key}", rope.raw(key), "null only")
        conc = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        if "attention_factor" in rope and not math.isclose(
                rope.float("attention_factor"), conc, rel_tol=1e-6):
            raise _hf_unsupported(f, "rope_parameters.attention_factor",
                                  rope.raw("attention_factor"),
                                  f"null or 0.1 ln(factor) + 1 = {conc}")
        l0 = (rope.int("original_max_position_embeddings")
              if "original_max_position_embeddings" in rope else f.int("max_position_embeddings"))
        arch.update(rope_scaling_factor=factor,
                    rope_ntk_beta=rope.float("beta_fast", default=32.0, above=0.0),
                    rope_ntk_alpha=rope.float("beta_slow", default=1.0, above=0.0),
                    initial_context_length=l0)
    elif rope_type == "default":
        arch.update(rope_scaling_factor=1.0,
                    initial_context_length=f.int("max_position_embeddings", default=4096))
    else:
        raise _hf_unsupported(f, "rope_parameters.rope_type", rope_type, "'yarn' or 'default'")

    layer_types = f.str_list("layer_types")
    if layer_types is not None:  # compared by length first: `layers` comes from the file
        if "sliding_attention" not in layer_types:
            window = 0  # HF needs some sliding_window even when no layer slides; unused then
        expected = ["sliding_attention" if window > 0 and i % 2 == 0 else "full_attention"
                    for i in range(len(layer_types))]
        if len(layer_types) != layers or layer_types != expected:
            raise _hf_unsupported(f, "layer_types", layer_types,
                                  f"{layers} entries, {expected[:4]}... (even layers slide when "
                                  "sliding_window > 0)")

    arch.update(
        num_hidden_layers=layers,
        num_experts=f.int("num_local_experts", "num_experts"),
        experts_per_token=f.int("num_experts_per_tok"),
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        head_dim=f.int("head_dim", default=max(hidden // heads, 1)),
        num_attention_heads=heads,
        num_key_value_heads=f.int("num_key_value_heads", default=heads),
        sliding_window=window,
        rope_theta=theta,
        swiglu_limit=f.float("swiglu_limit", default=_HF_DEFAULTS["swiglu_limit"], above=0.0),
    )
    if f.raw("initializer_range"):
        arch["initializer_range"] = f.float("initializer_range", above=0.0)
    dtype = f.raw("dtype") or f.raw("torch_dtype")
    if dtype in ("float32", "bfloat16", "float16"):
        arch.update(dtype=dtype, param_dtype=dtype)
    try:
        return ModelConfig(**arch)
    except ValueError as e:  # a combination of fields, named by their ModelConfig names
        raise ValueError(f"{source}: {e} (Hugging Face names: num_local_experts = "
                         "num_experts, num_experts_per_tok = experts_per_token)") from None


def _check_exportable(cfg: ModelConfig) -> None:
    if cfg.norm_type != "rms" or cfg.prms_fraction > 0:
        raise ValueError(
            f"ModelConfig norm_type={cfg.norm_type!r}, prms_fraction={cfg.prms_fraction} cannot be "
            f"exported: gpt-oss checkpoints hold plain RMSNorm (norm_type='rms', prms_fraction=0)"
        )


def model_config_to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> a GptOssConfig dict that `transformers` loads as the same function."""
    _check_exportable(cfg)
    if cfg.rope_scaling_factor > 1:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor, "beta_fast": cfg.rope_ntk_beta,
                "beta_slow": cfg.rope_ntk_alpha,
                "original_max_position_embeddings": cfg.initial_context_length, "truncate": False}
    else:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    layers = cfg.num_hidden_layers
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": layers,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        # transformers builds a sliding mask even when no layer uses it, so it needs a number:
        # with no sliding layer, a window as long as the context (unused; equal to full anyway).
        "sliding_window": cfg.sliding_window or int(cfg.initial_context_length
                                                    * cfg.rope_scaling_factor),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in cfg.layer_windows],
        "rope_parameters": rope,
        "max_position_embeddings": int(cfg.initial_context_length * cfg.rope_scaling_factor),
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": SWIGLU_ALPHA,
        "rms_norm_eps": RMS_NORM_EPS,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": cfg.initializer_range,
        "dtype": cfg.param_dtype,
    }


def model_config_to_openai_config(cfg: ModelConfig) -> dict[str, Any]:
    _check_exportable(cfg)
    return {k: getattr(cfg, k) for k in ARCH_FIELDS}


# ====================================================================== name and layout tables
@dataclasses.dataclass(frozen=True)
class _Spec:
    """One llm_jax param from one checkpoint tensor: `src` (per layer: a template with {n}) of
    shape `src_shape`, `load` maps it to our (per-layer) layout and `save` back."""

    key: str
    src: str
    src_shape: tuple[int, ...]
    load: Callable[[np.ndarray], np.ndarray] = lambda w: w
    save: Callable[[np.ndarray], np.ndarray] = lambda w: w
    mxfp4: tuple[str, str] | None = None  # (blocks, scales) suffixes if it may be MXFP4-packed


def _t(w: np.ndarray) -> np.ndarray:
    return np.swapaxes(w, -1, -2)


def _hf_specs(cfg: ModelConfig) -> tuple[list[_Spec], list[_Spec]]:
    """(global specs, per-layer specs) for the Hugging Face layout."""
    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, f, v = cfg.num_experts, cfg.intermediate_size, cfg.vocab_size
    p = "model.layers.{n}."

    def proj(heads: int) -> dict[str, Any]:  # torch Linear (heads*H, D) <-> (D, heads, H)
        return dict(load=lambda w: w.T.reshape(d, heads, h), save=lambda w: w.reshape(d, -1).T)

    def bias(heads: int) -> dict[str, Any]:
        return dict(load=lambda b: b.reshape(heads, h), save=lambda b: b.reshape(-1))

    top = [
        _Spec("embedding", "model.embed_tokens.weight", (v, d)),
        _Spec("norm.scale", "model.norm.weight", (d,)),
        _Spec("unembedding", "lm_head.weight", (v, d)),
    ]
    layer = [
        _Spec("attn_norm.scale", p + "input_layernorm.weight", (d,)),
        _Spec("attn.q_proj", p + "self_attn.q_proj.weight", (n * h, d), **proj(n)),
        _Spec("attn.q_bias", p + "self_attn.q_proj.bias", (n * h,), **bias(n)),
        _Spec("attn.k_proj", p + "self_attn.k_proj.weight", (k * h, d), **proj(k)),
        _Spec("attn.k_bias", p + "self_attn.k_proj.bias", (k * h,), **bias(k)),
        _Spec("attn.v_proj", p + "self_attn.v_proj.weight", (k * h, d), **proj(k)),
        _Spec("attn.v_bias", p + "self_attn.v_proj.bias", (k * h,), **bias(k)),
        _Spec("attn.o_proj", p + "self_attn.o_proj.weight", (d, n * h),
              load=lambda w: w.T.reshape(n, h, d), save=lambda w: w.reshape(n * h, d).T),
        _Spec("attn.o_bias", p + "self_attn.o_proj.bias", (d,)),
        _Spec("attn.sinks", p + "self_attn.sinks", (n,)),
        _Spec("mlp_norm.scale", p + "post_attention_layernorm.weight", (d,)),
        _Spec("mlp.router", p + "mlp.router.weight", (e, d), load=_t, save=_t),
        _Spec("mlp.router_bias", p + "mlp.router.bias", (e,)),
        _Spec("mlp.gate_up_proj", p + "mlp.experts.gate_up_proj", (e, d, 2 * f),
              mxfp4=("_blocks", "_scales")),
        _Spec("mlp.gate_up_proj_bias", p + "mlp.experts.gate_up_proj_bias", (e, 2 * f)),
        _Spec("mlp.down_proj", p + "mlp.experts.down_proj", (e, f, d),
              mxfp4=("_blocks", "_scales")),
        _Spec("mlp.down_proj_bias", p + "mlp.experts.down_proj_bias", (e, d)),
    ]
    return top, layer


def _openai_specs(cfg: ModelConfig) -> tuple[list[_Spec], list[_Spec]]:
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
        _Spec("embedding", "embedding.weight", (v, d)),
        _Spec("norm.scale", "norm.scale", (d,)),
        _Spec("unembedding", "unembedding.weight", (v, d)),
    ]
    layer = [_Spec("attn_norm.scale", p + "attn.norm.scale", (d,))]
    for part in "qkv":
        layer.append(_Spec(f"attn.{part}_proj", p + "attn.qkv.weight", (qkv, d), load=qkv_w(part)))
        layer.append(_Spec(f"attn.{part}_bias", p + "attn.qkv.bias", (qkv,), load=qkv_b(part)))
    layer += [
        _Spec("attn.o_proj", p + "attn.out.weight", (d, n * h), load=lambda w: w.T.reshape(n, h, d),
              save=lambda w: w.reshape(n * h, d).T),
        _Spec("attn.o_bias", p + "attn.out.bias", (d,)),
        _Spec("attn.sinks", p + "attn.sinks", (n,)),
        _Spec("mlp_norm.scale", p + "mlp.norm.scale", (d,)),
        _Spec("mlp.router", p + "mlp.gate.weight", (e, d), load=_t, save=_t),
        _Spec("mlp.router_bias", p + "mlp.gate.bias", (e,)),
        _Spec("mlp.gate_up_proj", p + "mlp.mlp1_weight", (e, 2 * f, d), load=_t, save=_t,
              mxfp4=(".blocks", ".scales")),
        _Spec("mlp.gate_up_proj_bias", p + "mlp.mlp1_bias", (e, 2 * f)),
        _Spec("mlp.down_proj", p + "mlp.mlp2_weight", (e, d, f), load=_t, save=_t,
              mxfp4=(".blocks", ".scales")),
        _Spec("mlp.down_proj_bias", p + "mlp.mlp2_bias", (e, d)),
    ]
    return top, layer


def _packed_shapes(spec: _Spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of an MXFP4-packed MoE weight: (E, out, in/32, 16), (E, out, in/32)
    in both layouts. The dense tensor is (E, out, in) in OpenAI's (loaded with `_t`), (E, in, out)
    in Hugging Face's."""
    e, a, b = spec.src_shape
    d_out, d_in = (a, b) if spec.load is _t else (b, a)
    g = d_in // MXFP4_BLOCK if d_in % MXFP4_BLOCK == 0 else -1  # -1: cannot be MXFP4
    return (e, d_out, g, MXFP4_BLOCK // 2), (e, d_out, g)


def _fields_of(shape: tuple[int, ...], expected: tuple[int, ...], cfg: ModelConfig,
               names: Mapping[str, str]) -> str:
    """Which config fields the mismatching dims of `expected` come from, for the error."""
    out = []
    for axis, (got, want) in enumerate(itertools.zip_longest(shape, expected)):
        if got != want and want is not None:
            fields = [names.get(k, k) for k in ARCH_FIELDS if getattr(cfg, k) == want]
            out.append(f"axis {axis} = {' or '.join(fields) or 'a product of fields'} = {want}")
    return f" ({'; '.join(out)})" if out else ""


def _check_tensor(store: TensorStore, name: str, shape: tuple[int, ...], packed: bool,
                  source: Path, cfg: ModelConfig, names: Mapping[str, str]) -> None:
    """The header of tensor `name` against the shape `source` implies; dtype float, or uint8
    for MXFP4 blocks and scales (`packed`)."""
    info = store.info(name)
    if info.shape != shape:
        raise ValueError(f"tensor {name!r} in {info.file} has shape {info.shape}, expected "
                         f"{shape} from {source}{_fields_of(info.shape, shape, cfg, names)}: is "
                         "the config that of these weights?")
    if (info.dtype == np.uint8) if packed else (info.dtype in FLOAT_DTYPES):
        return
    raise ValueError(f"tensor {name!r} in {info.file} has dtype {info.dtype}, expected "
                     f"{'uint8 (MXFP4)' if packed else 'a floating-point dtype'}")


def _check_specs(store: TensorStore, specs: tuple[list[_Spec], list[_Spec]], cfg: ModelConfig,
                 source: Path, names: Mapping[str, str]) -> None:
    """Every tensor the config at `source` implies, by name, shape and dtype, against the
    headers, and none left over: before anything sized by the config is built or allocated.
    Layer by layer, so a layer count beyond the weights fails at the first missing layer."""
    top, layer = specs
    used: set[str] = set()

    def check(spec: _Spec, name: str, n: int | None) -> None:
        if name in store:
            _check_tensor(store, name, spec.src_shape, False, source, cfg, names)
            used.add(name)
        elif spec.mxfp4 is not None and name + spec.mxfp4[0] in store:
            for suffix, shape in zip(spec.mxfp4, _packed_shapes(spec)):
                if name + suffix not in store:
                    raise ValueError(f"checkpoint has {name + spec.mxfp4[0]!r} but not its "
                                     f"{name + suffix!r} (MXFP4 comes as blocks and scales)")
                _check_tensor(store, name + suffix, shape, True, source, cfg, names)
                used.add(name + suffix)
        else:
            layers = f" (layer {n} of num_hidden_layers={cfg.num_hidden_layers})" if n else ""
            where = ", ".join(str(f) for f in store.files)
            raise ValueError(f"checkpoint is missing tensor {name!r}, which {source} implies"
                             f"{layers} (looked in {where})")

    for spec in top:
        check(spec, spec.src, None)
    for n in range(cfg.num_hidden_layers):
        for spec in layer:
            check(spec, spec.src.format(n=n), n)
    unused = sorted(set(store.names()) - used)
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensor(s) that {source} does not "
                         f"imply, e.g. {unused[:5]} (is the config that of these weights?)")


def _read_spec(store: TensorStore, spec: _Spec, name: str, out: np.ndarray) -> None:
    """Fills `out` (our layout, target dtype) from checkpoint tensor `name` (checked by
    `_check_specs`), dequantizing MXFP4 one expert at a time to bound the float32 temporary."""
    if name in store:
        out[...] = spec.load(store.get(name)).astype(out.dtype)
        return
    blocks, scales = (store.get(name + s) for s in spec.mxfp4)
    for i in range(out.shape[0]):  # packed (E, out, in) -> ours (E, in, out)
        out[i] = dequantize_mxfp4(blocks[i], scales[i]).T.astype(out.dtype)


def _read_specs(store: TensorStore, specs: tuple[list[_Spec], list[_Spec]], cfg: ModelConfig,
                targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    """The params in our layout from tensors that `_check_specs` has passed."""
    top, layer = specs
    params: dict[str, np.ndarray] = {}
    for spec in top:
        t = targets[spec.key]
        params[spec.key] = np.empty(t.shape, t.dtype)
        _read_spec(store, spec, spec.src, params[spec.key])
    for spec in layer:
        t = targets[f"layers.{spec.key}"]
        out = params[f"layers.{spec.key}"] = np.empty(t.shape, t.dtype)
        for n in range(cfg.num_hidden_layers):
            _read_spec(store, spec, spec.src.format(n=n), out[n])
    return params


def _write_specs(flat: Mapping[str, np.ndarray], specs: tuple[list[_Spec], list[_Spec]],
                 cfg: ModelConfig) -> dict[str, np.ndarray]:
    top, layer = specs
    out = {s.src: s.save(flat[s.key]) for s in top}
    for s in layer:
        for n in range(cfg.num_hidden_layers):
            out[s.src.format(n=n)] = s.save(flat[f"layers.{s.key}"][n])
    return out


# ====================================================================== formats
def _is_llm_jax(root: Path) -> bool:
    cfg = root / LLM_JAX_CONFIG
    return cfg.is_file() and (root / LLM_JAX_PARAMS).is_file() and "model" in read_json_object(cfg)


def _is_hf(root: Path) -> bool:
    cfg = root / "config.json"
    if not cfg.is_file() or not ((root / HF_WEIGHTS).is_file() or (root / HF_INDEX).is_file()):
        return False
    d = read_json_object(cfg)  # any HF model type; hf_config_to_model_config refuses others
    return "model_type" in d or "num_local_experts" in d


def _is_openai(root: Path) -> bool:
    cfg = root / "config.json"
    if not cfg.is_file() or not any(root.glob("*.safetensors")):
        return False
    d = read_json_object(cfg)
    return "experts_per_token" in d and "num_experts" in d


def detect_format(path: str | Path) -> tuple[str, Path]:
    """(format, directory to read) for a checkpoint directory; ValueError if it holds none."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint path {root} is not a directory")
    if find_training_checkpoint(str(root)) is not None:  # a training workdir (Orbax)
        return "orbax", root
    for fmt, test in (("llm_jax", _is_llm_jax), ("hf", _is_hf), ("openai", _is_openai)):
        if test(root):
            return fmt, root
    if (root / "original").is_dir() and _is_openai(root / "original"):
        return "openai", root / "original"
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not any(root.glob("*.safetensors")):
        raise ValueError(
            f"{root} holds only pickled weights {pickles}; llm_jax never unpickles (it can run "
            f"code). Convert them to safetensors first "
            f"(e.g. save_pretrained(safe_serialization=True))"
        )
    raise ValueError(
        f"{root} is no checkpoint llm_jax can read; expected one of: "
        f"llm_jax ({LLM_JAX_CONFIG} with a 'model' key + {LLM_JAX_PARAMS}); "
        f"Hugging Face gpt-oss (config.json with model_type 'gpt_oss' + {HF_WEIGHTS} "
        f"or {HF_INDEX}); "
        f"OpenAI gpt-oss (config.json with num_experts/experts_per_token + *.safetensors, "
        f"possibly under original/). Found: {sorted(p.name for p in root.iterdir())}"
    )


def _shard_names(index: Path) -> dict[str, str]:
    """{tensor: shard file name} of a sharded Hugging Face checkpoint's index, checked."""
    weight_map = Fields(read_json_object(index), str(index)).obj("weight_map")
    if weight_map is None:
        raise ValueError(f"{index} has no 'weight_map' (expected an object: tensor -> shard)")
    for tensor, shard in weight_map.d.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors")
                and Path(shard).name == shard and not shard.startswith(".")):
            raise ValueError(f"{index}: weight_map[{tensor!r}] = {shard!r} is invalid: expected "
                             "the file name of a .safetensors shard in the same directory")
    return weight_map.d


def _hf_store(root: Path) -> TensorStore:
    if not (root / HF_INDEX).is_file():
        return TensorStore([root / HF_WEIGHTS])
    index = root / HF_INDEX
    weight_map = _shard_names(index)
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise ValueError(f"{index} names shard(s) {missing} that are not in {root}")
    store = TensorStore(root / f for f in files)
    for tensor in sorted(set(weight_map) | set(store.names())):
        actual = store.info(tensor).file.name if tensor in store else None
        if actual != weight_map.get(tensor):
            raise ValueError(f"{index} puts tensor {tensor!r} in {weight_map.get(tensor)}, but "
                             f"{actual or 'none of the shards it names'} holds it: the index "
                             "does not match the shards' headers")
    return store


@dataclasses.dataclass(frozen=True)
class _Format:
    """How to read one checkpoint format: its config; a check of the weight files' headers
    against it, before anything sized by the config is built; its tensors in our layout."""

    config: Callable[[Path], ModelConfig]
    check: Callable[[Path, ModelConfig], None]
    params: Callable[[Path, ModelConfig, Mapping[str, jax.ShapeDtypeStruct]], dict[str, np.ndarray]]


def _model_config(f: Fields, keys: Iterable[str]) -> ModelConfig:
    """ModelConfig from the fields `keys` of `f`, each number checked by name first."""
    types = {x.name: x.type for x in dataclasses.fields(ModelConfig)}
    d: dict[str, Any] = {}
    for k in keys:
        if types.get(k) == "int" and f.raw(k) is not None:
            d[k] = f.int(k, low=0 if k == "sliding_window" else 1)
        elif types.get(k) == "float" and f.raw(k) is not None:
            d[k] = f.float(k)
        else:
            d[k] = f.raw(k)
    try:
        return ModelConfig.from_dict(d)
    except (ValueError, TypeError) as e:  # TypeError: a missing field without default
        raise ValueError(f"{f.where}: {e}") from None


def _llm_jax_config(root: Path) -> ModelConfig:
    path = root / LLM_JAX_CONFIG
    model = Fields(read_json_object(path), str(path)).obj("model")
    if model is None:
        raise ValueError(f"{path} has no 'model' object (the ModelConfig)")
    return _model_config(model, model.d)


def _llm_jax_check(root: Path, cfg: ModelConfig) -> None:
    store = TensorStore([root / LLM_JAX_PARAMS])
    stacked = {store.shape(k)[0] for k in store.names() if k.startswith("layers.")
               and store.shape(k)}
    if stacked and cfg.num_hidden_layers not in stacked:  # the model is built from cfg next
        raise ValueError(f"{root / LLM_JAX_CONFIG}: num_hidden_layers={cfg.num_hidden_layers}, "
                         f"but the stacked layer tensors in {store.files[0]} hold "
                         f"{sorted(stacked)} layers")


def _llm_jax_params(root: Path, cfg: ModelConfig,
                    targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    store = TensorStore([root / LLM_JAX_PARAMS])
    unused = sorted(set(store.names()) - set(targets))
    if unused:
        raise ValueError(
            f"{root / LLM_JAX_PARAMS} has tensor(s) the model does not have: {unused[:5]}")
    missing = sorted(set(targets) - set(store.names()))
    if missing:
        raise ValueError(f"{root / LLM_JAX_PARAMS} is missing tensor(s) {missing[:5]}, which "
                         f"{root / LLM_JAX_CONFIG} implies")
    for k, t in targets.items():  # every shape before the first read
        _check_tensor(store, k, tuple(t.shape), False, root / LLM_JAX_CONFIG, cfg, {})
    return {k: np.asarray(store.get(k)).astype(t.dtype) for k, t in targets.items()}


def openai_config_to_model_config(d: Mapping[str, Any],
                                  source: str = "OpenAI gpt-oss config.json") -> ModelConfig:
    f = Fields(d, source)
    missing = [k for k in ARCH_FIELDS if k not in f.d]
    if missing:
        raise ValueError(f"{source} is missing {missing}")
    return _model_config(f, ARCH_FIELDS)


def _openai_config(root: Path) -> ModelConfig:
    path = root / "config.json"
    cfg = openai_config_to_model_config(read_json_object(path), str(path))
    store = _openai_store(root)
    if "embedding.weight" in store:  # OpenAI's config.json has no dtype; take the weights'
        dt = store.info("embedding.weight").dtype
        name = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                np.dtype(np.float16): "float16"}.get(dt)
        if name:
            cfg = cfg.replace(dtype=name, param_dtype=name)
    return cfg


def _orbax_config(root: Path) -> ModelConfig:
    workdir, step = find_training_checkpoint(str(root))
    ckpt = Checkpointer(workdir, create=False, async_save=False)
    try:
        return ModelConfig.from_dict(ckpt.restore_config(step)["model"])
    finally:
        ckpt.close()


def _orbax_params(root: Path, cfg: ModelConfig,
                  targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    workdir, step = find_training_checkpoint(str(root))
    _, params, _ = restore_params(workdir, step)
    flat = {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(params)}
    return {k: flat[k].astype(t.dtype) for k, t in targets.items() if k in flat}


_HF_NAMES = {"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"}


def _openai_store(root: Path) -> TensorStore:
    return TensorStore(sorted(root.glob("*.safetensors")))


FORMATS: dict[str, _Format] = {
    "orbax": _Format(_orbax_config, lambda root, cfg: None, _orbax_params),
    "llm_jax": _Format(_llm_jax_config, _llm_jax_check, _llm_jax_params),
    "hf": _Format(
        lambda root: hf_config_to_model_config(read_json_object(root / "config.json"),
                                               str(root / "config.json")),
        lambda root, cfg: _check_specs(_hf_store(root), _hf_specs(cfg), cfg,
                                       root / "config.json", _HF_NAMES),
        lambda root, cfg, t: _read_specs(_hf_store(root), _hf_specs(cfg), cfg, t)),
    "openai": _Format(
        _openai_config,
        lambda root, cfg: _check_specs(_openai_store(root), _openai_specs(cfg), cfg,
                                       root / "config.json", {}),
        lambda root, cfg, t: _read_specs(_openai_store(root), _openai_specs(cfg), cfg, t)),
}


# ====================================================================== model <-> flat params
def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's params as {"layers.attn.q_proj": numpy array, ...}."""
    return {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _abstract_targets(cfg: ModelConfig) -> tuple[nnx.Module, dict[str, jax.ShapeDtypeStruct]]:
    model = abstract_model(cfg)
    targets = {".".join(str(p) for p in path): v.get_value()
               for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return model, targets


def model_from_params(cfg: ModelConfig, params: Mapping[str, np.ndarray],
                      abstract: tuple[nnx.Module, dict[str, jax.ShapeDtypeStruct]] | None = None
                      ) -> nnx.Module:
    """A Transformer for `cfg` holding `params` (flat keys), built without random initialisation
    (`abstract`: `_abstract_targets(cfg)` if the caller has it already)."""
    model, targets = abstract or _abstract_targets(cfg)
    missing = sorted(set(targets) - set(params))
    if missing:
        raise ValueError(f"params are missing {missing}")
    for key, t in targets.items():
        if tuple(params[key].shape) != tuple(t.shape):
            raise ValueError(f"param {key!r} has shape {params[key].shape}, expected {t.shape}")
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    for key, t in targets.items():
        node = pure
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = jnp.asarray(params[key], t.dtype)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _apply_overrides(cfg: ModelConfig, dtype: str | None,
                     overrides: Mapping[str, Any]) -> ModelConfig:
    bad = sorted(set(overrides) - set(OVERRIDABLE_FIELDS))
    if bad:
        raise ValueError(f"load_pretrained cannot override {bad}: only {OVERRIDABLE_FIELDS} "
                         f"(the rest is fixed by the checkpoint)")
    if dtype is not None:
        name = jnp.dtype(dtype).name
        cfg = cfg.replace(dtype=name, param_dtype=name)
    return cfg.replace(**overrides)


def load_pretrained(path: str | Path, *, dtype: str | None = None, **overrides: Any) -> nnx.Module:
    """Loads an llm_jax, Hugging Face or OpenAI gpt-oss checkpoint directory as a Transformer.

    `dtype` sets both the weights' and the compute dtype (default: the checkpoint's); `overrides`
    may set the implementation fields OVERRIDABLE_FIELDS (e.g. moe_dispatch="dense").
    """
    fmt, root = detect_format(path)
    reader = FORMATS[fmt]
    cfg = _apply_overrides(reader.config(root), dtype, overrides)
    reader.check(root, cfg)  # the headers against the config, before a model is built from it
    abstract = _abstract_targets(cfg)
    return model_from_params(cfg, reader.params(root, cfg, abstract[1]), abstract)


# ====================================================================== writers
def save_llm_jax(model: nnx.Module, directory: str | Path) -> Path:
    """Writes `config.json` + `params.safetensors` (bitwise copy of the params)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _save_safetensors(flat_params(model), d / LLM_JAX_PARAMS)
    meta = {"format": "llm_jax", "version": 1, "model": model.cfg.to_dict()}
    (d / LLM_JAX_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return d


def save_hf(model: nnx.Module, directory: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes a Hugging Face gpt-oss checkpoint (`GptOssForCausalLM.from_pretrained` loads it);
    sharded with `model.safetensors.index.json` when larger than `max_shard_bytes`."""
    cfg = model.cfg
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = _write_specs(flat_params(model), _hf_specs(cfg), cfg)
    total = sum(t.nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        _save_safetensors(tensors, d / HF_WEIGHTS)
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
            _save_safetensors(shard, d / fname)
            weight_map.update(dict.fromkeys(shard, fname))
        (d / HF_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (d / "config.json").write_text(json.dumps(model_config_to_hf_config(cfg), indent=2))
    return d


def save_openai(model: nnx.Module, directory: str | Path) -> Path:
    """Writes an OpenAI-layout gpt-oss checkpoint (plain weights, no MXFP4)."""
    cfg = model.cfg
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    flat = flat_params(model)
    top, layer = _openai_specs(cfg)
    plain = [s for s in layer if not s.key.startswith(("attn.q_", "attn.k_", "attn.v_"))]
    tensors = _write_specs(flat, (top, plain), cfg)
    n, k, h, dm = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        w = [flat[f"layers.attn.{p}_proj"][i].reshape(dm, -1).T for p in "qkv"]
        b = [flat[f"layers.attn.{p}_bias"][i].reshape(-1) for p in "qkv"]
        tensors[f"block.{i}.attn.qkv.weight"] = np.concatenate(w, axis=0)
        tensors[f"block.{i}.attn.qkv.bias"] = np.concatenate(b, axis=0)
        assert tensors[f"block.{i}.attn.qkv.weight"].shape == ((n + 2 * k) * h, dm)
    _save_safetensors(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(model_config_to_openai_config(cfg), indent=2))
    return d
