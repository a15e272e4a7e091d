"""The RL objective (training/policy_loss.py) on the model: log-probs of sampled completions, and
exact gradients without [B, T, V] logits.

Shapes: B completions, T tokens (prompt + completion, inputs shifted by one from targets),
L layers, k experts per token.

The objective f(logp) is not a weighted sum of token nll, but its gradient is:
dL/dθ = sum_t (∂f/∂logp_t) dlogp_t/dθ. So the log-probs are computed once, chunk by chunk
(`unembed_loss.token_nll`), c_t = ∂f/∂logp_t is taken on those [B, T] numbers, and
-sum_t c_t nll_t is differentiated through the fused chunked cross-entropy
(`Transformer.cross_entropy_sum` with per-token weights c): the exact gradient of f, at the
memory and cost of the SFT loss. Sampling at temperature τ drew from logits / τ, so the
hidden states are scaled by 1 / τ before the unembedding.

Batch: inputs, targets int32 [B, T]; completion_mask [B, T] (1 where the target is a sampled
token: not the prompt, not padding); old_logp [B, T] (the rollout policy's log-probs, computed
by the trainer); advantages [B]; optional positions, segment_ids [B, T]; sampler_logp [B, T]
(for the truncated importance weight); ref_logp [B, T] (for the KL term); experts
[B, T, L, k] int32 (the sampler's routing, replayed in every MoE layer).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from llm_jax.model.unembed_loss import token_nll
from llm_jax.training.policy_loss import PolicyLossConfig, policy_loss


def completion_logprobs(model: Any, batch: dict[str, jax.Array], *, temperature: float = 1.0,
                        train: bool = True) -> tuple[jax.Array, jax.Array]:
    """(hidden states / temperature [B, T, D], log p(target) [B, T] float32, not
    differentiated) under the model, with the batch's routing replayed when it has one."""
    h_BTD, _, _ = model.hidden_states(batch["inputs"], batch.get("positions"),
                                      batch.get("segment_ids"), train=train,
                                      experts_BTLk=batch.get("experts"))
    h_BTD = h_BTD / temperature
    nll = token_nll(h_BTD, model.unembedding[...], batch["targets"],
                    dtype=model.cfg.compute_dtype,
                    chunk_tokens=model.execution.loss_chunk_tokens)
    return h_BTD, -nll


def policy_objective(model: Any, batch: dict[str, jax.Array], cfg: PolicyLossConfig, *,
                     temperature: float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of one batch of rollouts: the value of `policy_loss`, with its exact
    gradient with respect to the model's parameters (module doc). Metrics add the mean
    trainer-minus-sampler log-prob gap where the sampler's log-probs are given."""
    h_BTD, logp = completion_logprobs(model, batch, temperature=temperature)
    mask = batch["completion_mask"]

    def objective(logp_BT):
        return policy_loss(logp_BT, batch["old_logp"], batch["advantages"], mask, cfg,
                           logp_ref_BT=batch.get("ref_logp"),
                           logp_sampler_BT=batch.get("sampler_logp"))

    (value, metrics), coeff = jax.value_and_grad(objective, has_aux=True)(logp)
    surrogate = -model.cross_entropy_sum(h_BTD, batch["targets"], jax.lax.stop_gradient(coeff))
    if batch.get("sampler_logp") is not None:
        tokens = jnp.maximum(mask.sum(), 1.0)
        metrics["sampler_logp_gap"] = (jnp.abs(logp - batch["sampler_logp"]) * mask).sum() / tokens
    return value + surrogate - jax.lax.stop_gradient(surrogate), metrics


def rl_objective(cfg: PolicyLossConfig, *, temperature: float = 1.0) -> Any:
    """`policy_objective` as the train step's objective (training/step.py `Objective`): it
    normalises by itself (the step's target count is not used), and reports its value as
    "loss" and "total_loss"."""
    return functools.partial(_step_objective, cfg=cfg, temperature=temperature)


def _step_objective(model: Any, batch: dict[str, jax.Array], train: ml_collections.ConfigDict,
                    num_targets: jax.Array, *, cfg: PolicyLossConfig, temperature: float
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    del train, num_targets
    loss, metrics = policy_objective(model, batch, cfg, temperature=temperature)
    return loss, {**metrics, "loss": loss, "total_loss": loss}


def rl_batch_shapes(batch_size: int, length: int, num_layers: int, experts_per_token: int, *,
                    replay: bool = True, sampler_logp: bool = True, reference: bool = False
                    ) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays of an RL batch as the step reads them (`rollouts.rl_batch` plus old_logp, and
    ref_logp when there is a KL term), for compiling the step ahead of time."""
    b, t = batch_size, length
    f32, i32 = jnp.float32, jnp.int32
    shapes = {"inputs": ((b, t), i32), "targets": ((b, t), i32),
              "completion_mask": ((b, t), f32), "old_logp": ((b, t), f32),
              "advantages": ((b,), f32)}
    if sampler_logp:
        shapes["sampler_logp"] = ((b, t), f32)
    if reference:
        shapes["ref_logp"] = ((b, t), f32)
    if replay:
        shapes["experts"] = ((b, t, num_layers, experts_per_token), i32)
    return {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}
