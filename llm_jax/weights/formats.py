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
Layouts and names: docs/model.md, "Checkpoint layouts". Only safetensors are read (by a small
reader of the format, because `safetensors.numpy` cannot read bfloat16); pickles are refused.
Weights are filled into an abstract model (`nnx.eval_shape`), so nothing is randomly initialised.

Shapes: L layers, V vocab, D hidden, N q heads, K kv heads, H head_dim, E experts, F intermediate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from llm_jax.training.checkpointing import Checkpointer, find_training_checkpoint, restore_params
from llm_jax.config import RMS_NORM_EPS, SWIGLU_ALPHA, ModelConfig

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
                      "scan_layers")

# OCP MX FP4 (E2M1) code points, low nibble first (docs/model.md, "MXFP4").
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
MXFP4_BLOCK = 32  # values per scale


# ====================================================================== safetensors
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


class TensorStore:
    """Lazy, read-only view of the tensors in one or more safetensors files (memory-mapped)."""

    def __init__(self, files: Iterable[Path]):
        self.files = [Path(f) for f in files]
        self._info: dict[str, _TensorInfo] = {}
        for f in self.files:
            for name, info in _read_header(f).items():
                if name in self._info:
                    raise ValueError(
                        f"tensor {name!r} appears in both {self._info[name].file} and {f}")
                self._info[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        return sorted(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name].shape

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name` (a read-only memory map); checks its shape when `shape` is given."""
        if name not in self._info:
            where = ", ".join(str(f) for f in self.files)
            raise ValueError(f"checkpoint is missing tensor {name!r} (looked in {where})")
        info = self._info[name]
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} in {info.file} has shape {info.shape}, expected {tuple(shape)}"
            )
        count = math.prod(info.shape)
        if count == 0:
            return np.zeros(info.shape, info.dtype)
        return np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset,
                         shape=(count,)).reshape(info.shape)


def _read_header(path: Path) -> dict[str, _TensorInfo]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(
                f"{path} is not a safetensors file (header size {n} > file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(
                f"{path} is not a safetensors file (header is not JSON: {e})") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} in {path} has unsupported dtype {entry['dtype']!r}")
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        start, end = entry["data_offsets"]
        shape = tuple(int(s) for s in entry["shape"])
        if end - start != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
            raise ValueError(
                f"tensor {name!r} in {path} has inconsistent data offsets {start, end}")
        out[name] = _TensorInfo(path, dtype, shape, 8 + n + start)
    return out


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


def _hf_unsupported(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(
        f"unsupported Hugging Face gpt-oss config: {key}={value!r} (llm_jax supports {expected})")


def hf_config_to_model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """A GptOssConfig dict (config.json) -> ModelConfig; refuses what llm_jax cannot compute."""
    hf = dict(hf)
    if hf.get("model_type", "gpt_oss") != "gpt_oss":
        raise _hf_unsupported("model_type", hf["model_type"], "'gpt_oss'")

    def need(key: str, *aliases: str) -> Any:
        for k in (key, *aliases):
            if hf.get(k) is not None:
                return hf[k]
        raise ValueError(f"Hugging Face config is missing {key!r}")

    fixed = {"rms_norm_eps": RMS_NORM_EPS, "swiglu_alpha": SWIGLU_ALPHA}
    for key, want in fixed.items():
        got = hf.get(key, _HF_DEFAULTS[key])
        if not math.isclose(got, want, rel_tol=1e-9):
            raise _hf_unsupported(key, got, f"{want} only (fixed in gpt-oss)")
    if hf.get("attention_bias", True) is not True:
        raise _hf_unsupported("attention_bias", hf["attention_bias"], "true only")
    if hf.get("tie_word_embeddings", False) is not False:
        raise _hf_unsupported("tie_word_embeddings", hf["tie_word_embeddings"], "false only")
    quant = hf.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise _hf_unsupported("quantization_config.quant_method", quant.get("quant_method"),
                              "'mxfp4' (dequantized on load) or none")

    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    layers = int(need("num_hidden_layers"))
    window = int(hf.get("sliding_window") or 0)

    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    rope = dict(_HF_DEFAULT_ROPE if rope is None else rope)
    unknown = sorted(set(rope) - _HF_ROPE_KEYS)
    if unknown:
        raise _hf_unsupported(f"rope_parameters.{unknown[0]}", rope[unknown[0]], "no such key")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or _HF_DEFAULTS["rope_theta"])
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _hf_unsupported("rope_parameters.partial_rotary_factor",
                              rope["partial_rotary_factor"], "1.0 only")
    arch: dict[str, Any] = {}
    if rope_type == "yarn":
        factor = float(rope["factor"]) if rope.get("factor") is not None else None
        if factor is None:
            raise _hf_unsupported("rope_parameters.factor", None, "a number >= 1")
        if rope.get("truncate", True) is not False:  # HF's YaRN truncates unless told not to
            raise _hf_unsupported("rope_parameters.truncate", rope.get("truncate", True),
                                  "false only (gpt-oss YaRN does not round the correction range)")
        for key in ("mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                raise _hf_unsupported(f"rope_parameters.{key}", rope[key], "null only")
        conc = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        if rope.get("attention_factor") is not None and not math.isclose(
                rope["attention_factor"], conc, rel_tol=1e-6):
            raise _hf_unsupported("rope_parameters.attention_factor", rope["attention_factor"],
                                  f"null or 0.1 ln(factor) + 1 = {conc}")
        l0 = rope.get("original_max_position_embeddings") or need("max_position_embeddings")
        arch.update(rope_scaling_factor=factor, rope_ntk_beta=float(rope.get("beta_fast") or 32.0),
                    rope_ntk_alpha=float(rope.get("beta_slow") or 1.0),
                    initial_context_length=int(l0))
    elif rope_type == "default":
        arch.update(rope_scaling_factor=1.0,
                    initial_context_length=int(hf.get("max_position_embeddings") or 4096))
    else:
        raise _hf_unsupported("rope_parameters.rope_type", rope_type, "'yarn' or 'default'")

    layer_types = hf.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = 0  # HF needs some sliding_window even when no layer slides; it is unused then
    expected_types = ["sliding_attention" if window > 0 and i % 2 == 0 else "full_attention"
                      for i in range(layers)]
    if layer_types is not None and list(layer_types) != expected_types:
        raise _hf_unsupported("layer_types", layer_types,
                              f"{expected_types} (even layers slide when sliding_window > 0)")

    arch.update(
        num_hidden_layers=layers,
        num_experts=int(need("num_local_experts", "num_experts")),
        experts_per_token=int(need("num_experts_per_tok")),
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        sliding_window=window,
        rope_theta=theta,
        swiglu_limit=float(hf.get("swiglu_limit", _HF_DEFAULTS["swiglu_limit"])),
    )
    if hf.get("initializer_range"):
        arch["initializer_range"] = float(hf["initializer_range"])
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    if dtype in ("float32", "bfloat16", "float16"):
        arch.update(dtype=dtype, param_dtype=dtype)
    return ModelConfig(**arch)


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


def openai_config_to_model_config(d: Mapping[str, Any]) -> ModelConfig:
    missing = [k for k in ARCH_FIELDS if k not in d]
    if missing:
        raise ValueError(f"OpenAI gpt-oss config.json is missing {missing}")
    return ModelConfig.from_dict({k: d[k] for k in ARCH_FIELDS})


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


def _read_spec(store: TensorStore, spec: _Spec, name: str, out: np.ndarray) -> None:
    """Fills `out` (our layout, target dtype) from checkpoint tensor `name`, dequantizing MXFP4."""
    if name not in store and spec.mxfp4 is not None and name + spec.mxfp4[0] in store:
        # Packed MoE weights are (E, out, in) in both layouts, blocked along `in`;
        # ours are (E, in, out).
        blocks_name, scales_name = (name + s for s in spec.mxfp4)
        e, d_in, d_out = out.shape
        want = (e, d_out, d_in // MXFP4_BLOCK)
        scales = store.get(scales_name)
        if scales.shape != want or d_in % MXFP4_BLOCK:
            raise ValueError(f"tensor {scales_name!r} has shape {scales.shape}, expected {want} "
                             f"(MXFP4 scales of an {(e, d_out, d_in)} weight)")
        blocks = store.get(blocks_name, (*want, MXFP4_BLOCK // 2))
        for i in range(e):  # one expert at a time bounds the float32 temporary
            out[i] = dequantize_mxfp4(blocks[i], scales[i]).T.astype(out.dtype)
        return
    out[...] = spec.load(store.get(name, spec.src_shape)).astype(out.dtype)


def _read_specs(store: TensorStore, specs: tuple[list[_Spec], list[_Spec]], cfg: ModelConfig,
                targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    top, layer = specs
    params: dict[str, np.ndarray] = {}
    used: set[str] = set()

    def fill(spec: _Spec, name: str, out: np.ndarray) -> None:
        _read_spec(store, spec, name, out)
        used.update({name} if name in store else {name + s for s in spec.mxfp4 or ()})

    for spec in top:
        t = targets[spec.key]
        params[spec.key] = np.empty(t.shape, t.dtype)
        fill(spec, spec.src, params[spec.key])
    for spec in layer:
        t = targets[f"layers.{spec.key}"]
        out = params[f"layers.{spec.key}"] = np.empty(t.shape, t.dtype)
        for n in range(cfg.num_hidden_layers):
            fill(spec, spec.src.format(n=n), out[n])
    unused = sorted(set(store.names()) - used)
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensor(s) the config does not use, "
                         f"e.g. {unused[:5]} (is the config.json that of these weights?)")
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
def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _is_llm_jax(root: Path) -> bool:
    cfg = root / LLM_JAX_CONFIG
    return cfg.is_file() and (root / LLM_JAX_PARAMS).is_file() and "model" in _read_json(cfg)


def _is_hf(root: Path) -> bool:
    cfg = root / "config.json"
    if not cfg.is_file() or not ((root / HF_WEIGHTS).is_file() or (root / HF_INDEX).is_file()):
        return False
    d = _read_json(cfg)  # any HF model type; hf_config_to_model_config refuses non-gpt-oss ones
    return "model_type" in d or "num_local_experts" in d


def _is_openai(root: Path) -> bool:
    cfg = root / "config.json"
    if not cfg.is_file() or not any(root.glob("*.safetensors")):
        return False
    d = _read_json(cfg)
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


def _hf_store(root: Path) -> TensorStore:
    if (root / HF_INDEX).is_file():
        weight_map = _read_json(root / HF_INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / HF_INDEX} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise ValueError(f"{root / HF_INDEX} names shard(s) {missing} that are not in {root}")
        return TensorStore(root / f for f in files)
    return TensorStore([root / HF_WEIGHTS])


@dataclasses.dataclass(frozen=True)
class _Format:
    """How to read one checkpoint format: its config, and its tensors in our layout."""

    config: Callable[[Path], ModelConfig]
    params: Callable[[Path, ModelConfig, Mapping[str, jax.ShapeDtypeStruct]], dict[str, np.ndarray]]


def _llm_jax_config(root: Path) -> ModelConfig:
    return ModelConfig.from_dict(_read_json(root / LLM_JAX_CONFIG)["model"])


def _llm_jax_params(root: Path, cfg: ModelConfig,
                    targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    store = TensorStore([root / LLM_JAX_PARAMS])
    unused = sorted(set(store.names()) - set(targets))
    if unused:
        raise ValueError(
            f"{root / LLM_JAX_PARAMS} has tensor(s) the model does not have: {unused[:5]}")
    return {k: np.asarray(store.get(k, t.shape)).astype(t.dtype) for k, t in targets.items()}


def _openai_config(root: Path) -> ModelConfig:
    cfg = openai_config_to_model_config(_read_json(root / "config.json"))
    store = TensorStore(sorted(root.glob("*.safetensors")))
    if "embedding.weight" in store:  # OpenAI's config.json has no dtype; take the weights'
        dt = store.get("embedding.weight").dtype
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


FORMATS: dict[str, _Format] = {
    "orbax": _Format(_orbax_config, _orbax_params),
    "llm_jax": _Format(_llm_jax_config, _llm_jax_params),
    "hf": _Format(
        lambda root: hf_config_to_model_config(_read_json(root / "config.json")),
        lambda root, cfg, t: _read_specs(_hf_store(root), _hf_specs(cfg), cfg, t)),
    "openai": _Format(
        _openai_config,
        lambda root, cfg, t: _read_specs(TensorStore(sorted(root.glob("*.safetensors"))),
                                         _openai_specs(cfg), cfg, t)),
}


# ====================================================================== model <-> flat params
def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's params as {"layers.attn.q_proj": numpy array, ...}."""
    return {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _abstract_targets(cfg: ModelConfig) -> tuple[nnx.Module, dict[str, jax.ShapeDtypeStruct]]:
    from llm_jax.model import abstract_model
    model = abstract_model(cfg)
    targets = {".".join(str(p) for p in path): v.get_value()
               for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return model, targets


def model_from_params(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> nnx.Module:
    """A Transformer for `cfg` holding `params` (flat keys), built without random initialisation."""
    model, targets = _abstract_targets(cfg)
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
    _, targets = _abstract_targets(cfg)
    return model_from_params(cfg, reader.params(root, cfg, targets))


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
