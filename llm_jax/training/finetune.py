"""Fine-tuning: start from pretrained weights, freeze the base under LoRA, restore and export.

`train.init_from` names any directory `load_pretrained` reads. Its model config is the run's:
a run config's `model` field left `None` (configs/finetune_*.py) takes the checkpoint's value;
a set field must equal it unless it is a conversion of the weights at load
(`llm_jax.weights.configs.LOAD_CONVERSIONS`: dtype, param_dtype, expert_format), so a changed
shape is refused by name. How the model runs is the run config's `execution` section, never
the checkpoint's. A resumed run takes the model config (and params) from its own checkpoint.

QLoRA: `model.expert_format` left None keeps the checkpoint's format, so gpt-oss as released
loads with its MoE experts packed in MXFP4 (frozen `PackedParam`s) and LoRA (lora.rank > 0)
trains adapters over them; attention and router weights are frozen as in any LoRA run. A packed
model cannot be fully fine-tuned: lora.rank=0 with expert_format="mxfp4" is refused
(`check_trainable`); `model.expert_format=dense` dequantizes the experts to train them all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
import orbax.checkpoint as ocp
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.lora import LoRAParam, add_lora
from llm_jax.model.params import TRAINABLE
from llm_jax.model.transformer import Transformer
from llm_jax.training.run_config import model_config
from llm_jax.training.step import ModelFn, Steps, TrainState
from llm_jax.weights.checkpointing import Checkpointer, check_same_model
from llm_jax.weights.configs import LOAD_CONVERSIONS
from llm_jax.weights.readers import FORMATS, detect_format, load_pretrained


def from_checkpoint_model_section() -> ml_collections.ConfigDict:
    """A `model` section whose every field is None (= the checkpoint's) but typed, so
    `--config.model.dtype=bfloat16` still parses."""
    section = ml_collections.ConfigDict()
    for f in dataclasses.fields(ModelConfig):
        section[f.name] = ml_collections.config_dict.placeholder(
            {"int": int, "float": float, "str": str, "bool": bool}[f.type])
    return section


def pretrained_config(path: str) -> ModelConfig:
    """The model config of a checkpoint directory, without reading its weights."""
    fmt, root = detect_format(path)
    return FORMATS[fmt].config(root)


def resolve_model_config(model: ml_collections.ConfigDict, base: ModelConfig,
                         source: str) -> ModelConfig:
    """`base` with the run's conversions (LOAD_CONVERSIONS); any other differing field is
    refused."""
    given = {k: v for k, v in model.to_dict().items() if v is not None}
    unknown = sorted(set(given) - set(base.to_dict()))
    if unknown:
        raise ValueError(f"unknown model config field(s) {unknown}")
    conflicts = {k: v for k, v in given.items()
                 if k not in LOAD_CONVERSIONS and v != getattr(base, k)}
    if conflicts:
        lines = ", ".join(f"model.{k}={v!r} (checkpoint: {getattr(base, k)!r})"
                          for k, v in sorted(conflicts.items()))
        raise ValueError(f"train.init_from={source!r} fixes the model's architecture, but the "
                         f"run config changes it: {lines}. Only {list(LOAD_CONVERSIONS)} may "
                         "differ; leave the others unset (None)")
    return base.replace(**{k: v for k, v in given.items() if k in LOAD_CONVERSIONS})


def check_trainable(cfg: ModelConfig, lora: ml_collections.ConfigDict, source: str) -> None:
    """Refuses a full fine-tune (lora.rank=0) of packed MXFP4 experts, which cannot be trained."""
    if cfg.expert_format == "mxfp4" and not lora.rank:
        raise ValueError(
            f"model.expert_format='mxfp4' ({source}) holds the MoE experts packed, and packed "
            "experts cannot be trained, but lora.rank=0 asks to train every weight: set "
            "lora.rank > 0 (QLoRA: adapters over the frozen packed experts, e.g. "
            "--config.lora.rank=16), or model.expert_format='dense' to dequantize the experts "
            "and train them all")


def lora_targets(lora: ml_collections.ConfigDict) -> tuple[str, ...]:
    return tuple(t.strip() for t in lora.targets.split(",") if t.strip())


def model_fn(cfg: ModelConfig, lora: ml_collections.ConfigDict, seed: int,
             execution: ExecutionConfig = ExecutionConfig()) -> ModelFn:
    """Builds the run's model: the Transformer running as `execution` says, with adapters when
    lora.rank > 0."""

    def build(*, rngs: nnx.Rngs) -> nnx.Module:
        model = Transformer(cfg, rngs=rngs, execution=execution)
        if lora.rank:
            add_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora_targets(lora),
                     seed=seed)
        return model

    return build


def trainable(lora: ml_collections.ConfigDict) -> Any:
    """What the optimizer updates (and keeps moments for): the adapters, or everything."""
    return LoRAParam if lora.rank else TRAINABLE


def initial_state(steps: Steps, tx: optax.GradientTransformation, init_from: str,
                  cfg: ModelConfig, lora: ml_collections.ConfigDict, seed: int) -> TrainState:
    """Step 0 from pretrained weights (+ fresh adapters): the optimizer starts fresh."""
    model = load_pretrained(init_from, **{k: getattr(cfg, k) for k in LOAD_CONVERSIONS})
    if lora.rank:
        add_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora_targets(lora), seed=seed)
    sh = steps.state_sharding
    params = jax.device_put(nnx.state(model, nnx.Param), sh.params)
    opt_init = jax.jit(lambda p: tx.init(nnx.filter_state(p, trainable(lora))), out_shardings=sh.opt_state)
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), sh.step), params=params,
                      opt_state=opt_init(params))


def run_model_config(cfg: ml_collections.ConfigDict, ckpt: Checkpointer
                     ) -> tuple[int | None, ModelConfig]:
    """(the newest restorable step or None, the run's ModelConfig). The newest checkpoint that
    passes its checksums and whose config reads; the corrupt ones are reported and moved to
    WORKDIR/corrupt_checkpoints. A changed model is refused before any expensive work (a
    changed execution is not: it is how the same model runs)."""
    tc = cfg.train
    latest, saved_config = ckpt.first_restorable(ckpt.restore_config, move_bad=True)
    if tc.init_from:  # a resumed run keeps its own weights and config: init_from is not read
        base = (ModelConfig.from_saved(saved_config["model"]) if latest is not None
                else pretrained_config(tc.init_from))
        mcfg = resolve_model_config(cfg.model, base, tc.init_from)
    else:
        mcfg = model_config(cfg)
    check_trainable(mcfg, cfg.lora, f"train.init_from={tc.init_from!r}" if tc.init_from
                    else "the run config")
    if latest is not None:
        check_same_model(saved_config, mcfg, ckpt.directory)
    else:
        ckpt.check_fresh_start(cfg.checkpoint.allow_fresh_start)
    return latest, mcfg


def restore_finetuned(workdir: str, step: int | None = None) -> tuple[nnx.Module, dict[str, Any]]:
    """(model with its adapters, saved run config) of a fine-tuning workdir's checkpoint; the
    model runs with the default ExecutionConfig (assign `model.execution` to change it)."""
    ckpt = Checkpointer(workdir, create=False, async_save=False)
    try:
        step = ckpt.latest_good_step() if step is None else step
        if step is None:
            raise ValueError(f"{ckpt.directory} holds no complete checkpoint")
        if problem := ckpt.check(step):
            raise ValueError(f"checkpoint step {step} in {ckpt.directory} is corrupt: {problem}")
        run = ckpt.restore_config(step)
        cfg = ModelConfig.from_saved(run["model"])
        lora = ml_collections.ConfigDict(run.get("lora", {"rank": 0}))
        abstract = nnx.eval_shape(lambda: model_fn(cfg, lora, 0)(rngs=nnx.Rngs(params=0)))
        graphdef, target, rest = nnx.split(abstract, nnx.Param, ...)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                              target)
        params = ckpt.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target)))["params"]
        return nnx.merge(graphdef, params, rest), run
    finally:
        ckpt.close()


