"""Preference optimisation: DPO and SimPO on pairs of responses, as the train step's objective.

Shapes: B pairs, 2 (chosen, rejected), N = 2 B sequences, T tokens, D hidden.

The losses are pure functions of each response's summed log-probability under the policy (and,
for DPO, under the reference policy) and its length in tokens:
- DPO (Rafailov et al. 2023, eq. 7): rewards r = beta (log pi(y|x) - log pi_ref(y|x)),
  loss -log sigmoid(r_chosen - r_rejected); with label smoothing e (the conservative DPO of
  Mitchell 2023: each label is wrong with probability e)
  (1 - e) (-log sigmoid(h)) + e (-log sigmoid(-h)), h = r_chosen - r_rejected.
- SimPO (Meng et al. 2024, eq. 6): no reference; rewards r = beta log pi(y|x) / |y| (the
  average log-probability, the likelihood generation ranks candidates by), loss
  -log sigmoid(r_chosen - r_rejected - gamma) with a target margin gamma.
Metrics: the mean rewards, the reward margin r_chosen - r_rejected, and the preference accuracy,
the share of pairs whose margin is > 0, a tie counting a half (DPO starts with every margin 0:
the policy is the reference).

The reference of DPO: with LoRA, the same model with its adapters zeroed (the base: no second
copy), run inside the step; in full fine-tuning, per-pair log-probs computed once with the
initial params before training (`attach_reference`) and served with the batch as
`reference_logp` [B, 2].

Gradients never form [N, T, V] logits: as in training/rl_step.py, the token log-probs are
computed chunk by chunk without gradient, c_t = dloss/dlogp_t is taken on those [N, T] numbers,
and -sum_t c_t nll_t is differentiated through the fused chunked cross-entropy.

Batch (data/preference.py): inputs, targets, positions, segment_ids int32 [B, 2, T]; loss_mask
float32 [B, 2, T] (1 where the target is a response token); optional reference_logp [B, 2].
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from llm_jax.model.lora import LoRAParam
from llm_jax.parallel import distributed
from llm_jax.parallel.sharding import replicated, with_mesh
from llm_jax.training.rl_step import completion_logprobs

LOSSES = ("dpo", "simpo")
ROW_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """The `dpo` run-config section's loss fields (docs/posttraining.md)."""

    loss: str = "dpo"  # dpo | simpo
    beta: float = 0.1  # DPO: KL strength (0.1-0.5 usual); SimPO: reward scale (2.0-2.5)
    label_smoothing: float = 0.0  # DPO only: the chance a label is flipped, in [0, 0.5)
    gamma: float = 0.5  # SimPO only: the target reward margin

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"config field dpo.loss={self.loss!r} is invalid: expected one of "
                             f"{list(LOSSES)}")
        if not (self.beta > 0 and np.isfinite(self.beta)):
            raise ValueError(f"config field dpo.beta={self.beta!r} is invalid: expected a "
                             "finite number > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"config field dpo.label_smoothing={self.label_smoothing!r} is "
                             "invalid: expected a probability in [0, 0.5)")
        if not np.isfinite(self.gamma):
            raise ValueError(f"config field dpo.gamma={self.gamma!r} is invalid: expected a "
                             "finite number")

    @classmethod
    def from_section(cls, dpo: ml_collections.ConfigDict) -> PreferenceConfig:
        return cls(**{f.name: dpo[f.name] for f in dataclasses.fields(cls)})

    @property
    def needs_reference(self) -> bool:
        return self.loss == "dpo"


# ------------------------------------------------------------------------------ the losses


def pair_rewards(logp_B2: jax.Array, ref_B2: jax.Array | None, length_B2: jax.Array,
                 cfg: PreferenceConfig) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) implicit rewards [B] from summed log-probs [B, 2] (module doc)."""
    if cfg.loss == "dpo":
        if ref_B2 is None:
            raise ValueError("dpo.loss='dpo' needs the reference policy's log-probs")
        reward_B2 = cfg.beta * (logp_B2 - ref_B2)
    else:
        reward_B2 = cfg.beta * logp_B2 / jnp.maximum(length_B2, 1.0)
    return reward_B2[:, 0], reward_B2[:, 1]


def pair_losses(chosen_B: jax.Array, rejected_B: jax.Array,
                cfg: PreferenceConfig) -> jax.Array:
    """The loss of each pair [B] from its rewards (module doc)."""
    h_B = chosen_B - rejected_B
    if cfg.loss == "simpo":
        return -jax.nn.log_sigmoid(h_B - cfg.gamma)
    e = cfg.label_smoothing
    return -(1.0 - e) * jax.nn.log_sigmoid(h_B) - e * jax.nn.log_sigmoid(-h_B)


def won(margin_B: jax.Array) -> jax.Array:
    """1 where the chosen response has the larger reward, 0.5 for a tie, else 0."""
    return jnp.where(margin_B > 0, 1.0, jnp.where(margin_B == 0, 0.5, 0.0))


def preference_loss(logp_B2: jax.Array, ref_B2: jax.Array | None, length_B2: jax.Array,
                    cfg: PreferenceConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean loss over the pairs, metrics: means of the rewards, margin and accuracy)."""
    chosen_B, rejected_B = pair_rewards(logp_B2, ref_B2, length_B2, cfg)
    margin_B = chosen_B - rejected_B
    loss = pair_losses(chosen_B, rejected_B, cfg).mean()
    return loss, {"chosen_reward": chosen_B.mean(), "rejected_reward": rejected_B.mean(),
                  "reward_margin": margin_B.mean(), "preference_accuracy": won(margin_B).mean()}


# ------------------------------------------------------------------------------ on the model


def flat_rows(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The batch's [B, 2, T] arrays as [N, T] sequences, chosen and rejected of a pair
    adjacent (rows 2 i and 2 i + 1: a reshape that keeps each device's rows its own)."""
    return {k: batch[k].reshape(-1, batch[k].shape[-1]) for k in ROW_KEYS if k in batch}


def sequence_logprobs(model: Any, rows: dict[str, jax.Array], *, train: bool
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(hidden states [N, T, D], token log-probs [N, T] (not differentiated), response mask
    [N, T]) of `flat_rows`."""
    h_NTD, logp_NT = completion_logprobs(model, rows, train=train)
    mask_NT = rows["loss_mask"].astype(jnp.float32) * (rows["segment_ids"] > 0)
    return h_NTD, logp_NT, mask_NT


def pair_sums(x_NT: jax.Array, mask_NT: jax.Array) -> jax.Array:
    """[N, T] summed over each response's tokens, as [B, 2]."""
    return (x_NT * mask_NT).sum(-1).reshape(-1, 2)


def adapters_off(model: Any) -> Any:
    """The model with every LoRA adapter zeroed (the base it adapts, exactly: a zero delta),
    its params out of the gradient's reach; a new module, `model` unchanged."""
    graphdef, adapters, rest = nnx.split(model, LoRAParam, ...)
    if not jax.tree.leaves(adapters):
        raise ValueError("dpo.loss='dpo' needs a reference policy: with lora.rank > 0 it is the "
                         "base (adapters off); in full fine-tuning the batch must carry "
                         "reference_logp (training/preference.attach_reference)")
    zeros = jax.tree.map(jnp.zeros_like, adapters)
    return nnx.merge(graphdef, zeros, jax.lax.stop_gradient(rest))


def reference_sums(model: Any, batch: dict[str, jax.Array], rows: dict[str, jax.Array],
                   mask_NT: jax.Array, *, train: bool) -> jax.Array:
    """Summed reference log-probs [B, 2]: the batch's precomputed ones, else the base's."""
    if "reference_logp" in batch:
        return batch["reference_logp"].astype(jnp.float32)
    _, logp_NT = completion_logprobs(adapters_off(model), rows, train=train)
    return jax.lax.stop_gradient(pair_sums(logp_NT, mask_NT))


def preference_objective(model: Any, batch: dict[str, jax.Array], cfg: PreferenceConfig
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of a batch of pairs: the value of `preference_loss`, with its exact
    gradient with respect to the model's parameters (module doc)."""
    rows = flat_rows(batch)
    h_NTD, logp_NT, mask_NT = sequence_logprobs(model, rows, train=True)
    ref_B2 = (reference_sums(model, batch, rows, mask_NT, train=True) if cfg.needs_reference
              else None)
    length_B2 = pair_sums(jnp.ones_like(mask_NT), mask_NT)

    def objective(logp_NT):
        return preference_loss(pair_sums(logp_NT, mask_NT), ref_B2, length_B2, cfg)

    (value, metrics), coeff_NT = jax.value_and_grad(objective, has_aux=True)(logp_NT)
    surrogate = -model.cross_entropy_sum(h_NTD, rows["targets"],
                                         jax.lax.stop_gradient(coeff_NT))
    return value + surrogate - jax.lax.stop_gradient(surrogate), metrics


def dpo_objective(cfg: PreferenceConfig) -> Any:
    """`preference_objective` as the train step's objective (training/step.py `Objective`):
    a mean over pairs (the step's target count is not used), reported as "loss" and
    "total_loss"."""
    return functools.partial(_step_objective, cfg=cfg)


def step_functions(cfg: PreferenceConfig) -> dict[str, Any]:
    """The train step's objective and the eval step's sums (training/step.compile_steps)."""
    return {"objective": dpo_objective(cfg),
            "evaluation": functools.partial(preference_eval_step, cfg=cfg)}


def _step_objective(model: Any, batch: dict[str, jax.Array], train: ml_collections.ConfigDict,
                    num_targets: jax.Array, *, cfg: PreferenceConfig
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    del train, num_targets
    loss, metrics = preference_objective(model, batch, cfg)
    return loss, {**metrics, "loss": loss, "total_loss": loss}


# ------------------------------------------------------------------------------ evaluation


def preference_eval_step(params: nnx.State, batch: dict[str, jax.Array], *,
                         graphdef: nnx.GraphDef, cfg: PreferenceConfig) -> dict[str, jax.Array]:
    """Sums over the batch's pairs (an all-padding pair counts for nothing): pairs, wins
    (`won`), rewards, margin and loss; `summarise` turns the totals into the held-out metrics.
    The dropless forward of evaluation (train=False)."""
    model = nnx.merge(graphdef, params)
    rows = flat_rows(batch)
    _, logp_NT, mask_NT = sequence_logprobs(model, rows, train=False)
    ref_B2 = (reference_sums(model, batch, rows, mask_NT, train=False) if cfg.needs_reference
              else None)
    length_B2 = pair_sums(jnp.ones_like(mask_NT), mask_NT)
    chosen_B, rejected_B = pair_rewards(pair_sums(logp_NT, mask_NT), ref_B2, length_B2, cfg)
    valid_B = (length_B2[:, 0] > 0).astype(jnp.float32)
    margin_B = chosen_B - rejected_B
    return {"pairs": valid_B.sum(), "wins": (valid_B * won(margin_B)).sum(),
            "margin": (valid_B * margin_B).sum(), "chosen_reward": (valid_B * chosen_B).sum(),
            "rejected_reward": (valid_B * rejected_B).sum(),
            "loss": (valid_B * pair_losses(chosen_B, rejected_B, cfg)).sum()}


def summarise(totals: dict[str, float]) -> dict[str, float]:
    """The held-out metrics from `preference_eval_step`'s sums over every eval batch."""
    n = totals["pairs"]
    if not n:
        return {}
    return {"val_preference_accuracy": totals["wins"] / n, "val_reward_margin": totals["margin"] / n,
            "val_chosen_reward": totals["chosen_reward"] / n,
            "val_rejected_reward": totals["rejected_reward"] / n,
            "val_preference_loss": totals["loss"] / n}


# ------------------------------------------------------------------------------ full fine-tuning


def precomputed_reference(cfg: ml_collections.ConfigDict) -> bool:
    """Whether the run's DPO reference is computed before training (full fine-tuning: no
    adapters to switch off)."""
    return PreferenceConfig.from_section(cfg.dpo).needs_reference and not cfg.lora.rank


REFERENCE_DIR = "dpo_reference"  # in the workdir: one file per process


def _sums_step(params: nnx.State, batch: dict[str, jax.Array], *,
               graphdef: nnx.GraphDef) -> jax.Array:
    rows = flat_rows(batch)
    _, logp_NT, mask_NT = sequence_logprobs(nnx.merge(graphdef, params), rows, train=False)
    return pair_sums(logp_NT, mask_NT)


def pair_logps(step: Any, params: nnx.State, batches: Any, sharding: Any, n: int
               ) -> np.ndarray:
    """Summed log-probs [n, 2] of this process's first `n` pairs, from `step(params, batch)`
    over its `batches` (every process runs as many: the step is global)."""
    out = [np.zeros((0, 2), np.float32)]
    for batch in batches:
        sums = np.asarray(jax.device_get(step(params, distributed.global_batch(batch,
                                                                               sharding))))
        out.append(sums[distributed.local_rows(sharding, len(sums))])
    return np.concatenate(out)[:n]


def attach_reference(data: Any, steps: Any, params: nnx.State, model_fn: Any, mesh: Any,
                     workdir: str, *, fresh: bool, source: str) -> None:
    """Gives full-fine-tuning DPO its reference: each pair's summed log-probs under the initial
    params, computed at the run's start (one forward pass over the train and held-out pairs)
    and kept in WORKDIR/dpo_reference/process_<i>-of-<P>.npz, which a resumed run reads
    instead (its params are no longer the initial ones). Costs 8 bytes a pair, no copy of the
    params."""
    index, count = jax.process_index(), jax.process_count()
    path = os.path.join(workdir, REFERENCE_DIR, f"process_{index}-of-{count}.npz")
    identity = json.dumps({**data.train_iter.identity, "init_from": source}, sort_keys=True)
    if not fresh:
        if not os.path.exists(path):
            raise ValueError(
                f"this DPO run resumes from a checkpoint in {workdir} but has no reference "
                f"log-probs {path}: they come from the initial params, which the checkpoint no "
                "longer holds. Restore the file, or start a new --workdir")
        with np.load(path) as saved:
            if str(saved["identity"]) != identity:
                raise ValueError(f"the reference log-probs {path} were computed for other "
                                 f"data ({saved['identity']}), not {identity}: start a new "
                                 "--workdir")
            data.attach_reference(saved["train"], saved["eval"] if data.eval_rows else None)
        return
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_fn(rngs=nnx.Rngs(params=0))))
    step = jax.jit(with_mesh(functools.partial(_sums_step, graphdef=graphdef), mesh),
                   in_shardings=(steps.state_sharding.params, steps.batch_sharding),
                   out_shardings=replicated(mesh))
    logps = []
    for split in ("train", "eval"):
        rows = data.rows if split == "train" else data.eval_rows
        n = len(rows["inputs"]) if rows else 0
        num_batches = -(-n // data.batch_size)
        if count > 1:
            num_batches = int(np.max(multihost_utils.process_allgather(
                np.asarray(num_batches))))
        logps.append(pair_logps(step, params, data.padded_batches(split, num_batches),
                                steps.batch_sharding, n))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, train=logps[0], eval=logps[1], identity=np.asarray(identity))
    os.replace(tmp, path)
    data.attach_reference(logps[0], logps[1] if data.eval_rows else None)
