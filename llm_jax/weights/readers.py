"""Reading model checkpoints: training workdirs, llm_jax, Hugging Face gpt-oss and OpenAI gpt-oss.

`load_pretrained(path)` detects the format of a directory and returns a `Transformer` with its
config attached (`model.cfg`) and the execution config the caller gives (`model.execution`):
- llm_jax: `config.json` ({"format": "llm_jax", "model": ModelConfig}) + `params.safetensors`
  holding the flattened param tree ("layers.attn.q_proj", ...; layer weights stacked on axis 0).
- Hugging Face: `config.json` (GptOssConfig) + `model.safetensors` or a sharded
  `model.safetensors.index.json`; MoE weights plain or MXFP4 (`*_blocks` / `*_scales`).
- OpenAI: `config.json` in the reference's naming (the same names as ModelConfig) + `*.safetensors`
  with `block.N.*` names, fused qkv, MoE weights (E, out, in), plain or MXFP4
  (`*.blocks` / `*.scales`).
  A directory holding no other checkpoint but an OpenAI `original/` subdirectory is read from
  there.
Layouts and names: layouts.py and docs/model.md, "Checkpoints"; checking and reading a layout's
tensors: layout_reader.py; writing: writers.py. Only safetensors are read; pickles are refused.
Weights are filled into an abstract model (`nnx.eval_shape`), so nothing is randomly initialised.

Hostile files (docs/reliability.md): every safetensors header is validated field by field before
any tensor is read (llm_jax.weights.safetensors_header), config.json fields are checked for type and
range by name, and the shapes the config implies are compared with the headers before anything
sized by the config is built or allocated. Every problem is a ValueError naming the file, the
tensor or field, and what was expected; the tensors themselves are read by `safetensors`.

Shapes: L layers, V vocab, D hidden, N q heads, K kv heads, H head_dim, E experts, F intermediate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from llm_jax.config import LEGACY_EXECUTION_FIELDS, ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.weights.checkpointing import Checkpointer, find_training_checkpoint, restore_params
from llm_jax.weights.configs import (
    HF_NAMES,
    LOAD_CONVERSIONS,
    hf_config_to_model_config,
    model_config_from_fields,
    openai_config_to_model_config,
)
from llm_jax.weights.flat import abstract_targets, aligned_empty, model_from_params
from llm_jax.weights.json_fields import Fields, read_json_object
from llm_jax.weights.layout_reader import (
    check_layout,
    check_tensor,
    read_layout,
    with_stored_expert_format,
)
from llm_jax.weights.layouts import (
    HF_INDEX,
    HF_WEIGHTS,
    LLM_JAX_CONFIG,
    LLM_JAX_PARAMS,
    LLM_JAX_VERSION,
    hf_specs,
    openai_specs,
)
from llm_jax.weights.mxfp4 import (
    dequantize_experts,
    log_quantization,
    quantize_experts,
    to_model_layout,
)
from llm_jax.weights.tensor_store import TensorStore

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
class Format:
    """How to read one checkpoint format: its config; a check of the weight files' headers
    against it, before anything sized by the config is built; its tensors in our layout."""

    config: Callable[[Path], ModelConfig]
    check: Callable[[Path, ModelConfig], None]
    params: Callable[[Path, ModelConfig, Mapping[str, jax.ShapeDtypeStruct]], dict[str, np.ndarray]]
    # params() fills experts in either format; else the model is built as stored, then converted
    any_expert_format: bool = True


def _llm_jax_config(root: Path) -> ModelConfig:
    path = root / LLM_JAX_CONFIG
    model = Fields(read_json_object(path), str(path)).obj("model")
    if model is None:
        raise ValueError(f"{path} has no 'model' object (the ModelConfig)")
    # Saved models written before ExecutionConfig also stored its fields here (as from_saved).
    keys = [k for k in model.d if k not in LEGACY_EXECUTION_FIELDS]
    return model_config_from_fields(model, keys)


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
    path = root / LLM_JAX_CONFIG
    version = Fields(read_json_object(path), str(path)).int("version", default=1)
    if version > LLM_JAX_VERSION:
        raise ValueError(f"{path}: version={version}, but this llm_jax reads versions up to "
                         f"{LLM_JAX_VERSION}: it was written by a newer llm_jax")
    v1 = version < 2  # packed stacks as the HF checkpoint orders them
    shapes = {k: _v1_packed_shape(k, tuple(t.shape)) if v1 else tuple(t.shape)
              for k, t in targets.items()}
    for k, t in targets.items():  # every shape before the first read; MXFP4 bytes are uint8
        check_tensor(store, k, shapes[k], t.dtype == np.uint8, root / LLM_JAX_CONFIG, cfg, {})
    params = {k: np.asarray(store.get(k)).astype(t.dtype) for k, t in targets.items()
              if not (v1 and k.endswith(("_blocks", "_scales")))}
    for k in targets:
        if v1 and k.endswith("_blocks"):
            stack = k.removesuffix("_blocks")
            blocks, scales = store.get(k), store.get(stack + "_scales")
            pb = params[k] = aligned_empty(targets[k].shape, np.uint8)
            ps = params[stack + "_scales"] = aligned_empty(targets[stack + "_scales"].shape,
                                                           np.uint8)
            for n, e in np.ndindex(*blocks.shape[:2]):
                pb[n, e], ps[n, e] = to_model_layout(blocks[n, e], scales[n, e])
    return params


def _v1_packed_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A version-1 llm_jax tensor's shape: packed stacks (L, E, out, G, 16) / (L, E, out, G)."""
    if key.endswith("_blocks"):
        *lead, g, b, o = shape
        return (*lead, o, g, b)
    if key.endswith("_scales"):
        *lead, g, o = shape
        return (*lead, o, g)
    return shape


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
    return with_stored_expert_format(cfg, store, openai_specs(cfg), path)


def _hf_config(root: Path) -> ModelConfig:
    path = root / "config.json"
    cfg = hf_config_to_model_config(read_json_object(path), str(path))
    return with_stored_expert_format(cfg, _hf_store(root), hf_specs(cfg), path)


def _orbax_config(root: Path) -> ModelConfig:
    workdir, step = find_training_checkpoint(str(root))
    ckpt = Checkpointer(workdir, create=False, async_save=False)
    try:
        return ModelConfig.from_saved(ckpt.restore_config(step)["model"])
    finally:
        ckpt.close()


def _orbax_params(root: Path, cfg: ModelConfig,
                  targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
    workdir, step = find_training_checkpoint(str(root))
    _, params, _ = restore_params(workdir, step)
    flat = {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(params)}
    return {k: flat[k].astype(t.dtype) for k, t in targets.items() if k in flat}


def _openai_store(root: Path) -> TensorStore:
    return TensorStore(sorted(root.glob("*.safetensors")))


FORMATS: dict[str, Format] = {
    "orbax": Format(_orbax_config, lambda root, cfg: None, _orbax_params,
                    any_expert_format=False),
    "llm_jax": Format(_llm_jax_config, _llm_jax_check, _llm_jax_params, any_expert_format=False),
    "hf": Format(_hf_config,
        lambda root, cfg: check_layout(_hf_store(root), hf_specs(cfg), cfg,
                                       root / "config.json", HF_NAMES),
        lambda root, cfg, t: read_layout(_hf_store(root), hf_specs(cfg), cfg, t)),
    "openai": Format(
        _openai_config,
        lambda root, cfg: check_layout(_openai_store(root), openai_specs(cfg), cfg,
                                       root / "config.json", {}),
        lambda root, cfg, t: read_layout(_openai_store(root), openai_specs(cfg), cfg, t)),
}


def _apply_conversions(cfg: ModelConfig, dtype: str | None,
                       conversions: Mapping[str, Any]) -> ModelConfig:
    execution = sorted(set(conversions) & {f.name for f in dataclasses.fields(ExecutionConfig)})
    if execution:
        raise ValueError(f"load_pretrained: {execution} say how the model runs, not what it is: "
                         f"pass execution=ExecutionConfig({execution[0]}=...)")
    bad = sorted(set(conversions) - set(LOAD_CONVERSIONS))
    if bad:
        raise ValueError(f"load_pretrained cannot convert {bad}: only {LOAD_CONVERSIONS} "
                         f"(the rest is fixed by the checkpoint)")
    if dtype is not None:
        name = jnp.dtype(dtype).name
        cfg = cfg.replace(dtype=name, param_dtype=name)
    return cfg.replace(**conversions)


def load_pretrained(path: str | Path, *, dtype: str | None = None,
                    execution: ExecutionConfig = ExecutionConfig(),
                    **conversions: Any) -> nnx.Module:
    """Loads an llm_jax, Hugging Face or OpenAI gpt-oss checkpoint directory as a Transformer
    that runs as `execution` says.

    `dtype` sets both the weights' and the compute dtype (default: the checkpoint's);
    `conversions` may set the LOAD_CONVERSIONS (e.g. param_dtype="bfloat16").
    MXFP4 experts stay packed (`expert_format="mxfp4"`, the checkpoint's bytes; never a dense
    copy); `expert_format="dense"` dequantizes them, as the model computes either way.
    """
    fmt, root = detect_format(path)
    reader = FORMATS[fmt]
    stored = reader.config(root)
    cfg = _apply_conversions(stored, dtype, conversions)
    built = cfg if reader.any_expert_format else cfg.replace(expert_format=stored.expert_format)
    reader.check(root, built)  # the headers against the config, before a model is built from it
    abstract = abstract_targets(built)
    model = model_from_params(built, reader.params(root, built, abstract[1]), abstract)
    if cfg.expert_format == "dense":  # both no-ops unless the format had to be converted
        model = dequantize_experts(model)
    else:
        model, errors = quantize_experts(model)
        log_quantization(errors, f"loading {root}")
    model.execution = execution
    return model
