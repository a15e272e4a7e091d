"""Training checkpoints: Orbax CheckpointManager items for everything a resumed run needs.

Items of each step: `params` and `opt_state` (sharded arrays, restored onto the current mesh),
`step`, `config` (the full run config as JSON; its `model` section is the ModelConfig),
`data` (the Grain iterator state) and `tokenizer` (the sentencepiece model, base64 in JSON).
Params are an item of their own so `load_pretrained(workdir)` restores them without the
optimizer state. Saves are asynchronous; Orbax writes each step into a temporary directory and
renames it when complete, so an interrupted save is never taken for a checkpoint.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from llm_jax.config import ModelConfig

CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def find_training_checkpoint(path: str) -> tuple[str, int | None] | None:
    """(workdir, step or None = latest) if `path` is a training workdir, its checkpoints/
    folder, or one step's folder in it; else None. Incomplete (tmp) steps do not count."""
    path = os.path.abspath(path)

    def has_steps(d: str) -> bool:
        return os.path.isdir(d) and any(n.isdigit() for n in os.listdir(d))

    if has_steps(os.path.join(path, CHECKPOINT_DIR)):
        return path, None
    if os.path.basename(path) == CHECKPOINT_DIR and has_steps(path):
        return os.path.dirname(path), None
    parent = os.path.dirname(path)
    if (os.path.basename(path).isdigit() and os.path.basename(parent) == CHECKPOINT_DIR
            and os.path.isdir(os.path.join(path, "params"))):
        return os.path.dirname(parent), int(os.path.basename(path))
    return None


class Checkpointer:
    """A thin, typed layer over `ocp.CheckpointManager` with this project's items."""

    def __init__(self, workdir: str, *, max_to_keep: int = 3, async_save: bool = True,
                 create: bool = True):
        self.directory = checkpoint_dir(workdir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, *, config: dict[str, Any],
             data_iter: grain.DatasetIterator | None, tokenizer_proto: bytes | None) -> bool:
        items: dict[str, Any] = {
            "params": ocp.args.StandardSave(state.params),
            "opt_state": ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
            "config": ocp.args.JsonSave(config),
        }
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        if tokenizer_proto is not None:
            items["tokenizer"] = ocp.args.JsonSave(
                {"sentencepiece_model": base64.b64encode(tokenizer_proto).decode("ascii")})
        return self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore_config(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        out = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(out["config"])

    def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None):
        """State restored onto the shardings carried by `abstract_state`; data_iter in place."""
        items: dict[str, Any] = {
            "params": ocp.args.StandardRestore(abstract_state.params),
            "opt_state": ocp.args.StandardRestore(
                {"step": abstract_state.step, "opt_state": abstract_state.opt_state}),
        }
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        return abstract_state.replace(params=out["params"], step=out["opt_state"]["step"],
                                      opt_state=out["opt_state"]["opt_state"])

    def restore_tokenizer_proto(self, step: int) -> bytes | None:
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                tokenizer=ocp.args.JsonRestore()))
        except (FileNotFoundError, KeyError, ValueError):
            return None
        return base64.b64decode(out["tokenizer"]["sentencepiece_model"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def check_same_model(saved_config: dict[str, Any], cfg: ModelConfig, directory: str) -> None:
    """Refuses to resume a run whose saved model config differs from the requested one."""
    saved = ModelConfig.from_dict(saved_config["model"])
    if saved != cfg:
        diff = {k: (v, getattr(cfg, k)) for k, v in saved.to_dict().items()
                if getattr(cfg, k) != v}
        lines = ", ".join(f"{k}: saved {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"the workdir's checkpoints ({directory}) were trained with a different model config "
            f"({lines}); use a new --workdir, or the saved config, to continue")


def restore_params(workdir: str, step: int | None = None):
    """(ModelConfig, params State, tokenizer proto or None) of a training workdir's checkpoint."""
    from flax import nnx

    from llm_jax.model import abstract_model

    ckpt = Checkpointer(workdir, create=False, async_save=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise ValueError(f"{ckpt.directory} holds no complete checkpoint")
    cfg = ModelConfig.from_dict(ckpt.restore_config(step)["model"])
    abstract = nnx.state(abstract_model(cfg), nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            abstract)
    params = ckpt.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract)))["params"]
    proto = ckpt.restore_tokenizer_proto(step)
    ckpt.close()
    return cfg, params, proto
