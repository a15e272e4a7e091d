"""The RL objective (training/policy_loss.py) against a NumPy reference written loop by loop from
the papers' formulas, on hand-made log-probs and rewards; and one gradient step that moves
probability toward the above-average completion. Tolerance: 1e-5 relative (float32 sums)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.training.policy_loss import (
    PolicyLossConfig,
    group_advantages,
    informative_groups,
    policy_loss,
)

RTOL = 1e-5


def reference(logp, logp_old, adv, mask, cfg, logp_ref=None, logp_sampler=None):
    """Loop-by-loop NumPy: per completion i and token t."""
    B, T = logp.shape
    losses = np.zeros((B, T))
    clipped = 0
    for i in range(B):
        n = mask[i].sum()
        seq_log_ratio = sum(logp[i, t] - logp_old[i, t] for t in range(T) if mask[i, t]) / max(n, 1)
        for t in range(T):
            if not mask[i, t]:
                continue
            r = math.exp(seq_log_ratio if cfg.ratio == "sequence" else logp[i, t] - logp_old[i, t])
            c = min(max(r, 1 - cfg.epsilon_low), 1 + cfg.epsilon_high)
            obj = min(r * adv[i], c * adv[i])
            clipped += c * adv[i] < r * adv[i]
            w = 1.0
            if cfg.importance_cap is not None:
                w = min(math.exp(logp_old[i, t] - logp_sampler[i, t]), cfg.importance_cap)
            loss = -obj * w
            if cfg.beta:
                q = logp_ref[i, t] - logp[i, t]
                loss += cfg.beta * (math.exp(q) - q - 1)
            losses[i, t] = loss
    if cfg.aggregation == "token":
        total = losses.sum() / mask.sum()
    elif cfg.aggregation == "sequence":
        total = np.mean([losses[i].sum() / mask[i].sum() for i in range(B)])
    else:
        total = losses.sum() / (B * cfg.max_tokens)
    return total, clipped / mask.sum()


def batch(seed=0, B=6, T=5):
    rng = np.random.default_rng(seed)
    logp_old = -rng.uniform(0.1, 3.0, (B, T))
    logp = logp_old + rng.normal(0, 0.3, (B, T))  # ratios from about 0.4 to 2.5: clips both sides
    mask = np.ones((B, T))
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    return (logp.astype(np.float32), logp_old.astype(np.float32),
            rng.normal(0, 1, B).astype(np.float32), mask.astype(np.float32),
            (logp_old + rng.normal(0, 0.2, (B, T))).astype(np.float32),
            (logp_old + rng.normal(0, 0.1, (B, T))).astype(np.float32))


VARIANTS = [dict(aggregation=a, ratio=r, beta=b, importance_cap=c, max_tokens=7)
            for a, r, b, c in itertools.product(("token", "sequence", "constant"),
                                                ("token", "sequence"), (0.0, 0.1), (None, 1.5))]


def test_every_variant_equals_the_numpy_reference():
    logp, logp_old, adv, mask, logp_ref, logp_sampler = batch()
    for kwargs in VARIANTS:
        cfg = PolicyLossConfig(**kwargs)
        loss, metrics = jax.jit(policy_loss, static_argnums=4)(
            logp, logp_old, adv, mask, cfg, logp_ref_BT=logp_ref, logp_sampler_BT=logp_sampler)
        want, clip_fraction = reference(logp, logp_old, adv, mask, cfg, logp_ref, logp_sampler)
        np.testing.assert_allclose(loss, want, rtol=RTOL, err_msg=str(kwargs))
        np.testing.assert_allclose(metrics["clip_fraction"], clip_fraction, rtol=RTOL)
        if cfg.ratio == "token":  # the batch was made so that both sides of the clip bind
            assert 0 < clip_fraction < 1


def test_padding_and_prompt_positions_change_nothing():
    logp, logp_old, adv, mask, logp_ref, _ = batch()
    cfg = PolicyLossConfig(beta=0.1, ratio="sequence")
    loss, _ = policy_loss(logp, logp_old, adv, mask, cfg, logp_ref_BT=logp_ref)
    noise = np.where(mask, 0, 5.0).astype(np.float32)
    moved, _ = policy_loss(logp + noise, logp_old - noise, adv, mask, cfg,
                           logp_ref_BT=logp_ref + noise)
    np.testing.assert_allclose(moved, loss, rtol=RTOL)


def test_on_the_first_step_the_ratio_is_one_and_nothing_clips():
    logp, _, adv, mask, _, _ = batch()
    loss, metrics = policy_loss(logp, logp, adv, mask, PolicyLossConfig())
    assert metrics["clip_fraction"] == 0 and metrics["ratio_mean"] == pytest.approx(1.0)
    np.testing.assert_allclose(loss, -(adv[:, None] * mask).sum() / mask.sum(), rtol=RTOL)


def test_advantages_are_centred_and_scaled_per_group_and_all_equal_groups_are_flagged():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]],
                       np.float32)
    grpo = np.asarray(group_advantages(jnp.asarray(rewards), PolicyLossConfig()))
    for g in range(3):
        r = rewards[g]
        want = (r - r.mean()) / (np.std(r, ddof=1) + 1e-6)
        np.testing.assert_allclose(grpo[g], want, rtol=RTOL, atol=1e-6)
    dr = group_advantages(jnp.asarray(rewards), PolicyLossConfig(scale_by_std=False))
    np.testing.assert_allclose(dr, rewards - rewards.mean(axis=1, keepdims=True), rtol=RTOL)
    assert not np.any(grpo[1]) and not np.any(np.isnan(grpo))
    assert list(informative_groups(jnp.asarray(rewards))) == [True, False, True]


def test_a_gradient_step_favours_the_above_average_completion():
    """Two completions of one prompt, one rewarded: a step on the loss raises the rewarded one's
    log-probs and lowers the other's, for every variant."""
    rewards = jnp.array([[1.0, 0.0]])
    tokens = jnp.array([[0, 1, 2], [3, 4, 5]])
    mask = jnp.ones((2, 3))
    for kwargs in VARIANTS:
        cfg = PolicyLossConfig(**kwargs)
        logits = jnp.zeros((2, 3, 6))

        def logp_of(logits):
            return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]

        adv = group_advantages(rewards, cfg)[0]
        old = logp_of(logits)

        def loss(logits):
            return policy_loss(logp_of(logits), old, adv, mask, cfg, logp_ref_BT=old,
                               logp_sampler_BT=old)[0]

        new = logp_of(logits - 1.0 * jax.grad(loss)(logits))
        assert np.all(new[0] > old[0]) and np.all(new[1] < old[1]), kwargs


@pytest.mark.parametrize("field, value", [("aggregation", "mean"), ("ratio", "group"),
                                          ("epsilon_low", 1.0), ("epsilon_high", -0.1),
                                          ("beta", -1.0), ("importance_cap", 0.5),
                                          ("max_tokens", 0)])
def test_a_bad_setting_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**{field: value})


def test_missing_reference_or_sampler_log_probs_are_named():
    logp, logp_old, adv, mask, _, _ = batch()
    with pytest.raises(ValueError, match="logp_ref_BT"):
        policy_loss(logp, logp_old, adv, mask, PolicyLossConfig(beta=0.1))
    with pytest.raises(ValueError, match="logp_sampler_BT"):
        policy_loss(logp, logp_old, adv, mask, PolicyLossConfig(importance_cap=2.0))
