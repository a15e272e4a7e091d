"""Training checkpoints: Orbax CheckpointManager items for everything a resumed run needs.

Items of each step: `params` and `opt_state` (sharded arrays, restored onto the current mesh;
`opt_state` also holds the `step`), `config` (the full run config as JSON; its `model` section
is the ModelConfig, its `execution` section the ExecutionConfig), and when given `data` (the
Grain iterator state), `tokenizer` (a sentencepiece model, base64 in JSON) and `progress` (loop
counters).
Params are an item of their own so `load_pretrained(workdir)` restores them without the
optimizer state. Saves are asynchronous; Orbax writes each step into a temporary directory and
renames it when complete, so an interrupted save is never taken for a checkpoint.

Crash safety (docs/reliability.md): a training run reports and removes the temporary
directories a killed save left behind. Once a save has finished, process 0 writes
`llm_jax_sha256.json` into the step's folder (size and sha256 of every file, hashed in a
background thread); before a step is restored it is checked against it, and a step that fails
(a truncated, zeroed or missing file) is named with the file, moved to WORKDIR/corrupt_checkpoints/
and the previous one is used instead. A step without the manifest (killed between the save and the
manifest) is restored unverified, with a warning; one that then fails with a read error is treated
as corrupt too. Any other failure (llm_jax.weights.restore_check: a changed train state tree,
memory, a bug) raises `RestoreError` and moves nothing, and a workdir left with quarantined steps
and none that restores is not trained again from step 0 unless
`checkpoint.allow_fresh_start` says so.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.model import abstract_model
from llm_jax.parallel import distributed
from llm_jax.weights.manifest import MANIFEST, verify_manifest, write_manifest
from llm_jax.weights.restore_check import (
    CORRUPT,
    RESTORED,
    incompatibility,
    judge,
    stop_error,
)

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
TMP_MARKER = ".orbax-checkpoint-tmp"  # Orbax's suffix for a step still being written


def tmp_leftovers(directory: str) -> list[str]:
    """Temporary step folders in `directory`: saves that were interrupted (or are running)."""
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if TMP_MARKER in n)


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, minus its own questions to JAX's preemption sync point.

    Orbax calls `reached_preemption_sync_point(step)` with the step it saves, in `save` and again
    from its finalize thread steps later. The sync manager keeps the last value it was given, so
    that call sets it back; a preemption notice handled then picks a sync point the train loop has
    already passed, and every process trains on past the preemption. The loop is the only caller
    (llm_jax.training.preemption.StopRequest); here the answer only fed Orbax's metrics and logs. We
    always save with `force=True`, so `should_save` never needs it."""

    def reached_preemption(self, step: int) -> bool:
        return False


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
                 create: bool = True, cleanup_tmp: bool = False, checksums: bool = True):
        """`cleanup_tmp` (a training run, the only writer): report and delete the temporary
        folders of interrupted saves. Readers leave them: a save may be running."""
        self.workdir = os.path.abspath(workdir)
        self.directory = checkpoint_dir(workdir)
        self.is_writer = jax.process_index() == 0
        self.checksums = checksums  # write manifests (they are verified whenever present)
        self.problems: dict[int, str] = {}  # step -> why it was not restored
        self._checked: set[int] = set()
        self._verified: set[int] = set()  # steps whose files matched their manifest
        if cleanup_tmp:
            for path in tmp_leftovers(self.directory):
                logging.warning("ignoring %s: an incomplete checkpoint (the save was interrupted); "
                                "removing it", path)
                if self.is_writer:
                    shutil.rmtree(path, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save)
        self.manager = _Manager(self.directory, options=options)
        self._unhashed: list[int] = []
        self._hashing: list[concurrent.futures.Future] = []
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha256")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, *, config: dict[str, Any],
             data_iter: grain.DatasetIterator | None, tokenizer_proto: bytes | None,
             progress: dict[str, Any] | None = None) -> bool:
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
        if progress is not None:  # loop counters, e.g. skipped_updates
            items["progress"] = ocp.args.JsonSave(progress)
        self.manager.wait_until_finished()  # Orbax's save waits for the previous one anyway
        self._hash_finished()
        saved = self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if saved and self.is_writer and self.checksums:
            self._unhashed.append(step)
            if not self.manager.is_saving_in_progress():
                self._hash_finished()
        return saved

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _hash_finished(self) -> None:
        """Manifests for the saves that have finished, hashed in the background."""
        for step in self._unhashed:
            self._hashing.append(self._hasher.submit(write_manifest, self.step_dir(step)))
        self._unhashed = []

    def poll(self) -> None:
        """Starts the manifest of a save that has finished since (call it every step: without
        it a step stays unverified until the next save, and a kill meanwhile leaves it so)."""
        if self._unhashed and not self.manager.is_saving_in_progress():
            self._hash_finished()

    def check(self, step: int) -> str | None:
        """Why step `step` must not be restored (named file), or None (warns if unverified)."""
        if step in self._checked:
            return self.problems.get(step)
        self._checked.add(step)
        try:
            problem = verify_manifest(self.step_dir(step))
        except FileNotFoundError:
            logging.warning("checkpoint step %d in %s has no checksum manifest %s (the run was "
                            "killed after the save, before the manifest, or predates manifests): "
                            "restoring it unverified", step, self.directory, MANIFEST)
            return None
        if problem:
            self.problems[step] = problem
        else:
            self._verified.add(step)
        return problem

    def quarantine(self, step: int, problem: str) -> None:
        """Reports a bad step and (training runs) moves it to WORKDIR/corrupt_checkpoints/."""
        self.problems[step] = problem
        self._checked.add(step)
        dst = os.path.join(self.workdir, CORRUPT_DIR, str(step))
        n = 1
        while os.path.exists(dst):
            dst, n = os.path.join(self.workdir, CORRUPT_DIR, f"{step}-{n}"), n + 1
        logging.error("checkpoint step %d in %s is corrupt: %s; moving it to %s", step,
                      self.directory, problem, dst)
        if self.is_writer:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(self.step_dir(step), dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"quarantine_{step}")
        self.manager.reload()

    def good_steps(self, *, move_bad: bool = False) -> Iterator[int]:
        """Steps newest first that pass `check`; reports the others (`move_bad`: quarantines)."""
        for step in sorted(self.all_steps(), reverse=True):
            problem = self.check(step)
            if problem is None:
                yield step
            elif move_bad:
                self.quarantine(step, problem)
            else:
                logging.error("checkpoint step %d in %s is corrupt: %s; not restoring it", step,
                              self.directory, problem)

    def latest_good_step(self, *, move_bad: bool = False) -> int | None:
        return next(self.good_steps(move_bad=move_bad), None)

    def first_restorable(self, restore: Callable[[int], Any], *, move_bad: bool = False
                         ) -> tuple[int | None, Any]:
        """(step, restore(step)) for the newest step that checks out and restores; the corrupt
        ones are reported (`move_bad`: quarantined). (None, None) if there is none. Raises
        RestoreError, moving nothing, when a step fails for another reason (restore_check)."""
        while (step := self.latest_good_step(move_bad=move_bad)) is not None:
            try:
                out, failure = restore(step), None
            except Exception as e:  # noqa: BLE001 - judged below: only read errors are corrupt
                out, failure = None, e
            verified = step in self._verified
            # Every process acts on the worst verdict: a shard that fails on one fails them all.
            verdict = max(distributed.process_allgather_int(judge(failure, verified=verified)))
            if verdict == RESTORED:
                return step, out
            if verdict != CORRUPT:
                raise stop_error(step, self.directory, failure, verified=verified) from failure
            problem = ("restoring it failed on another process (see its log)" if failure is None
                       else f"restoring it failed: {type(failure).__name__}: "
                            f"{str(failure)[:500]}")
            if move_bad:
                self.quarantine(step, problem)
            else:
                logging.error("checkpoint step %d in %s is corrupt: %s", step,
                              self.directory, problem)
                self.problems[step] = problem
                self._checked.add(step)
        return None, None

    def quarantined(self) -> list[str]:
        """The step folders in WORKDIR/corrupt_checkpoints/ (moved there by any run)."""
        d = os.path.join(self.workdir, CORRUPT_DIR)
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    def check_fresh_start(self, allow: bool) -> None:
        """Called when no checkpoint restores: refuses to train from step 0 in a workdir whose
        checkpoints were quarantined (new steps would reuse their numbers), unless `allow`."""
        moved = self.quarantined()
        if not moved:
            return
        where = os.path.join(self.workdir, CORRUPT_DIR)
        if allow:
            logging.warning("no checkpoint in %s restores and %s holds %s; starting from step 0 "
                            "as checkpoint.allow_fresh_start=True asks", self.directory, where,
                            moved)
            return
        raise ValueError(
            f"no checkpoint in {self.directory} restores, and {where}/ holds {moved}: checkpoints "
            f"of this workdir that were found corrupt and moved aside (by this or an earlier run). "
            f"Refusing to start again from step 0 over them. Look at {where}/ (and the log that "
            "moved them); to train from scratch here anyway, rerun with "
            "--config.checkpoint.allow_fresh_start=True (the moved steps stay), or use a new "
            "--workdir")

    def restore_config(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        out = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(out["config"])

    def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None):
        """State restored onto the shardings carried by `abstract_state`; data_iter in place.
        Raises RestoreError, before reading any array, if the saved trees do not fit."""
        targets = {"params": abstract_state.params, "opt_state": {
            "step": abstract_state.step, "opt_state": abstract_state.opt_state}}
        if (error := incompatibility(step, self.directory, targets)) is not None:
            raise error
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

    def restore_progress(self, step: int) -> dict[str, Any]:
        """The loop counters saved with `step` ({} for a checkpoint without them)."""
        if not os.path.isdir(os.path.join(self.step_dir(step), "progress")):
            return {}
        out = self.manager.restore(step, args=ocp.args.Composite(progress=ocp.args.JsonRestore()))
        return dict(out["progress"])

    def restore_tokenizer_proto(self, step: int) -> bytes | None:
        """The sentencepiece model saved with `step` (None for a checkpoint without one)."""
        if not os.path.isdir(os.path.join(self.step_dir(step), "tokenizer")):
            return None
        out = self.manager.restore(step, args=ocp.args.Composite(
            tokenizer=ocp.args.JsonRestore()))
        return base64.b64decode(out["tokenizer"]["sentencepiece_model"])

    def wait(self) -> None:
        """Until the last save and its manifest are written."""
        self.manager.wait_until_finished()
        self._hash_finished()
        for f in self._hashing:
            f.result()
        self._hashing = []

    def close(self) -> None:
        self.wait()
        self.manager.close()
        self._hasher.shutdown()


def check_same_model(saved_config: dict[str, Any], cfg: ModelConfig, directory: str) -> None:
    """Refuses to resume a run whose saved model config differs from the requested one, naming
    each differing field; how it runs (its ExecutionConfig) may differ."""
    saved = ModelConfig.from_saved(saved_config["model"])
    if saved != cfg:
        diff = {k: (v, getattr(cfg, k)) for k, v in saved.to_dict().items()
                if getattr(cfg, k) != v}
        lines = ", ".join(f"{k}: saved {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"the workdir's checkpoints ({directory}) were trained with a different model config "
            f"({lines}); use a new --workdir, or the saved config, to continue")


def restore_params(workdir: str, step: int | None = None):
    """(ModelConfig, params State, tokenizer proto or None) of a training workdir's checkpoint:
    `step`, or the newest one that passes its checksums and restores (others are reported)."""
    ckpt = Checkpointer(workdir, create=False, async_save=False)

    def restore(s: int):
        cfg = ModelConfig.from_saved(ckpt.restore_config(s)["model"])
        abstract = nnx.state(abstract_model(cfg), nnx.Param)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                                abstract)
        if (error := incompatibility(s, ckpt.directory, {"params": abstract})) is not None:
            raise error
        params = ckpt.manager.restore(s, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract)))["params"]
        return cfg, params, ckpt.restore_tokenizer_proto(s)

    try:
        if step is not None:
            if problem := ckpt.check(step):
                raise ValueError(f"checkpoint step {step} in {ckpt.directory} is corrupt: "
                                 f"{problem}")
            return restore(step)
        found, out = ckpt.first_restorable(restore)
        if found is None:
            bad = "; ".join(f"step {s}: {p}" for s, p in sorted(ckpt.problems.items()))
            raise ValueError(f"{ckpt.directory} holds no complete checkpoint"
                             + (f" that is intact ({bad})" if bad else ""))
        return out
    finally:
        ckpt.close()
