"""The config.json of each checkpoint format <-> ModelConfig: Hugging Face's GptOssConfig (each
field it reads checked, what llm_jax cannot compute refused by name), OpenAI's (the 16 architecture
numbers under ModelConfig's own names), and the fields read from any JSON object by type.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from llm_jax.config import RMS_NORM_EPS, SWIGLU_ALPHA, ModelConfig
from llm_jax.weights.json_fields import Fields

# The 16 architecture numbers: OpenAI's config.json uses exactly these names (docs/model.md).
ARCH_FIELDS = (
    "num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
    "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
    "sliding_window", "initial_context_length", "rope_theta", "rope_scaling_factor",
    "rope_ntk_alpha", "rope_ntk_beta", "swiglu_limit",
)
# The ModelConfig fields a caller may ask of the weights at load time: a conversion of what the
# checkpoint stores (a cast; expert_format "dense" dequantizes MXFP4 experts exactly, "mxfp4" over
# dense weights quantizes them, a lossy choice the caller makes). Every other field is fixed by
# the checkpoint; how the model runs is its ExecutionConfig, free to choose.
LOAD_CONVERSIONS = ("dtype", "param_dtype", "expert_format")

# What gpt-oss's released config.json says of its MXFP4 experts (transformers reads it).
MXFP4_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}

# Hugging Face's names of two of them (for errors).
HF_NAMES = {"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"}


def model_config_from_fields(f: Fields, keys: Iterable[str]) -> ModelConfig:
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
                              "'mxfp4' (kept packed; expert_format='dense' dequantizes) or none")

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
        **({"quantization_config": MXFP4_QUANTIZATION} if cfg.expert_format == "mxfp4" else {}),
    }


def model_config_to_openai_config(cfg: ModelConfig) -> dict[str, Any]:
    _check_exportable(cfg)
    return {k: getattr(cfg, k) for k in ARCH_FIELDS}


def openai_config_to_model_config(d: Mapping[str, Any],
                                  source: str = "OpenAI gpt-oss config.json") -> ModelConfig:
    f = Fields(d, source)
    missing = [k for k in ARCH_FIELDS if k not in f.d]
    if missing:
        raise ValueError(f"{source} is missing {missing}")
    return model_config_from_fields(f, ARCH_FIELDS)
