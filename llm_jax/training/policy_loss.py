"""The policy-gradient objective of RL with verifiable rewards: GRPO and the variants users choose
between, as pure functions of per-token log-probs.

Shapes: P prompts, G completions per prompt (a group), B = P * G completions, T completion
tokens (prompt and padding positions have mask 0).

    advantage   A_i = (r_i - mean_group(r)) / (std_group(r) + eps)          GRPO [1]
                A_i =  r_i - mean_group(r)                                  Dr.GRPO [3]
    ratio       rho_it = exp(logp_it - logp_old_it)                         per token (PPO, GRPO)
                rho_it = exp(mean_t(logp_it - logp_old_it))                 per sequence (GSPO [4])
    token loss  l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)
                       * w_it + beta * k3_it
    aggregate   sum_it l_it / sum_it m_it                                   "token" (DAPO [2])
                mean_i (sum_t l_it / sum_t m_it)                            "sequence" (GRPO)
                sum_it l_it / (B * max_tokens)                              "constant" (Dr.GRPO)

`logp_old` are the log-probs of the policy that produced the rollout, computed by the trainer
(so the ratio is exactly 1 on the first optimizer step of a batch and the clip binds on later
ones). The sampler's own log-probs differ a little (other kernels, batch shapes, bfloat16): the
truncated importance weight w_it = min(exp(logp_old_it - logp_sampler_it), C) corrects for it
[5] (off: w = 1). k3_it = exp(q_it) - q_it - 1 with q_it = logp_ref_it - logp_it is Schulman's
unbiased, non-negative estimator of KL(pi || pi_ref) [6].

[1] Shao et al. 2024, DeepSeekMath (GRPO). [2] Yu et al. 2025, DAPO (token-level aggregation,
clip-higher, dynamic sampling). [3] Liu et al. 2025, Understanding R1-Zero-Like Training
(Dr. GRPO). [4] Zheng et al. 2025, Group Sequence Policy Optimization. [5] Yao et al. 2025, Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training (truncated importance
sampling). [6] Schulman 2020, Approximating KL Divergence.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from llm_jax.config import FrozenConfig, doc_field

AGGREGATIONS = ("token", "sequence", "constant")
RATIOS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(FrozenConfig):
    """How the loss of one batch of rollouts is formed. The defaults are DAPO's (token-level
    aggregation, clip-higher, no KL term); GRPO as published is aggregation="sequence",
    epsilon_high=0.2, beta=0.04; Dr.GRPO is aggregation="constant", scale_by_std=False; GSPO is
    ratio="sequence" with epsilons near 3e-4 / 4e-4."""

    aggregation: Literal["token", "sequence", "constant"] = doc_field(
        "token", "how token losses become the batch's loss: mean over all completion tokens "
        "(token, DAPO), mean over completions of each one's token mean (sequence, GRPO), or sum "
        "over a fixed B * max_tokens (constant, Dr.GRPO: no length bias)")
    scale_by_std: bool = doc_field(
        True, "divide each group's centred rewards by their standard deviation (GRPO); "
        "Dr.GRPO does not")
    epsilon_low: float = doc_field(0.2, "the ratio is clipped below at 1 - epsilon_low")
    epsilon_high: float = doc_field(
        0.28, "the ratio is clipped above at 1 + epsilon_high (DAPO's clip-higher; 0.2 is "
        "symmetric PPO/GRPO)")
    ratio: Literal["token", "sequence"] = doc_field(
        "token", "importance ratio per token, or one per completion from its mean token "
        "log-ratio (sequence, GSPO)")
    beta: float = doc_field(0.0, "weight of the k3 KL estimate to the reference policy (0: no "
                            "reference forward at all)")
    importance_cap: float | None = doc_field(
        None, "truncated importance sampling: weight each token by min(pi_old / pi_sampler, "
        "cap) against the sampler/trainer mismatch (None: off)")
    max_tokens: int = doc_field(1, "the fixed length normaliser of aggregation='constant' (the "
                                "rollouts' max new tokens)")
    std_epsilon: float = doc_field(1e-6, "added to the group std before dividing")

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got "
                             f"{self.aggregation!r}")
        if self.ratio not in RATIOS:
            raise ValueError(f"ratio: expected one of {RATIOS}, got {self.ratio!r}")
        for name in ("epsilon_low", "epsilon_high", "beta", "std_epsilon"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low: expected < 1, got {self.epsilon_low}")
        if self.importance_cap is not None and not self.importance_cap >= 1:
            raise ValueError(f"importance_cap: expected None or >= 1, got {self.importance_cap}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {self.max_tokens}")


def group_advantages(rewards_PG: jax.Array, cfg: PolicyLossConfig) -> jax.Array:
    """Each completion's reward against its group's: centred, and scaled by the group's sample
    standard deviation (ddof=1, as TRL's and DeepSeekMath's) when `cfg.scale_by_std`. A group
    whose rewards are all equal gets advantages 0 (it teaches nothing)."""
    centred = rewards_PG - rewards_PG.mean(axis=1, keepdims=True)
    if not cfg.scale_by_std:
        return centred
    std = rewards_PG.std(axis=1, ddof=1, keepdims=True)
    return centred / (std + cfg.std_epsilon)


def informative_groups(rewards_PG: jax.Array) -> jax.Array:
    """bool [P]: groups whose rewards are not all equal (DAPO's dynamic sampling keeps only
    these; the rest are counted in the metrics)."""
    return jnp.any(rewards_PG != rewards_PG[:, :1], axis=1)


def policy_loss(logp_BT: jax.Array, logp_old_BT: jax.Array, advantages_B: jax.Array,
                mask_BT: jax.Array, cfg: PolicyLossConfig, *,
                logp_ref_BT: jax.Array | None = None,
                logp_sampler_BT: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of one batch: the loss to minimise (gradients flow through `logp_BT`
    only), and clip_fraction (share of tokens where the clip binds), ratio_mean, kl (mean k3,
    when beta > 0), importance_weight_mean and importance_truncated (share capped, when the
    cap is on), each a mean over completion tokens."""
    mask = mask_BT.astype(jnp.float32)
    tokens = jnp.maximum(mask.sum(), 1.0)
    lengths_B = jnp.maximum(mask.sum(axis=1), 1.0)
    logp_old = jax.lax.stop_gradient(logp_old_BT)
    log_ratio = (logp_BT - logp_old) * mask
    if cfg.ratio == "sequence":
        log_ratio = jnp.broadcast_to((log_ratio.sum(axis=1) / lengths_B)[:, None], mask.shape)
    ratio = jnp.exp(log_ratio)
    adv = advantages_B[:, None].astype(jnp.float32)
    clipped = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv
    per_token = -jnp.minimum(unclipped_obj, clipped_obj)
    metrics = {"clip_fraction": ((clipped_obj < unclipped_obj) * mask).sum() / tokens,
               "ratio_mean": (ratio * mask).sum() / tokens}
    if cfg.importance_cap is not None:
        if logp_sampler_BT is None:
            raise ValueError("importance_cap is set: pass the sampler's log-probs "
                             "(logp_sampler_BT)")
        raw = jnp.exp(logp_old - jax.lax.stop_gradient(logp_sampler_BT))
        weight = jnp.minimum(raw, cfg.importance_cap)
        per_token = per_token * weight
        metrics["importance_weight_mean"] = (weight * mask).sum() / tokens
        metrics["importance_truncated"] = ((raw > cfg.importance_cap) * mask).sum() / tokens
    if cfg.beta > 0:
        if logp_ref_BT is None:
            raise ValueError("beta > 0: pass the reference policy's log-probs (logp_ref_BT)")
        q = jax.lax.stop_gradient(logp_ref_BT) - logp_BT
        k3 = jnp.exp(q) - q - 1.0
        per_token = per_token + cfg.beta * k3
        metrics["kl"] = (k3 * mask).sum() / tokens
    per_token = per_token * mask
    if cfg.aggregation == "token":
        loss = per_token.sum() / tokens
    elif cfg.aggregation == "sequence":
        loss = (per_token.sum(axis=1) / lengths_B).mean()
    else:
        loss = per_token.sum() / (mask.shape[0] * cfg.max_tokens)
    return loss, metrics
