"""The RL objective on the model (training/rl_step.py): its value and its gradients with respect
to every parameter equal those of the plain computation (full logits / temperature, log-softmax,
`policy_loss`), with and without routing replay. Tolerance: 2e-5 of each gradient's largest
entry (float32; the two paths sum the vocabulary in different orders)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL

from llm_jax.model import init_model
from llm_jax.training.policy_loss import PolicyLossConfig, policy_loss
from llm_jax.training.rl_step import policy_objective

B, T, TEMP = 4, 10, 0.8


def rollout_batch(model, seed=0, replay=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SMALL_MODEL.vocab_size, (B, T + 1)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    for b, (start, end) in enumerate([(3, 10), (5, 8), (2, 10), (6, 7)]):
        mask[b, start:end] = 1  # prompt before, padding after
    logits, aux = model(jnp.asarray(tokens[:, :-1]), return_aux=True)
    logp = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits / TEMP),
                                          tokens[:, 1:, None], -1)[..., 0])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "completion_mask": mask,
             "old_logp": logp + rng.normal(0, 0.3, (B, T)).astype(np.float32),
             "sampler_logp": logp + rng.normal(0, 0.1, (B, T)).astype(np.float32),
             "ref_logp": logp + rng.normal(0, 0.2, (B, T)).astype(np.float32),
             "advantages": rng.normal(0, 1, B).astype(np.float32)}
    if replay:  # another routing than the model's own: every MoE layer must follow it
        batch["experts"] = np.asarray((jnp.moveaxis(aux.experts, 0, 2) + 1)
                                      % SMALL_MODEL.num_experts)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def plain(model, batch, cfg):
    logits = model(batch["inputs"], experts_BTLk=batch.get("experts")) / TEMP
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    return policy_loss(logp, batch["old_logp"], batch["advantages"], batch["completion_mask"],
                       cfg, logp_ref_BT=batch["ref_logp"], logp_sampler_BT=batch["sampler_logp"])


# Both checked in one compiled program (one compile, one model, one rollout batch).
CASES = [
    (PolicyLossConfig(), False),
    (PolicyLossConfig(ratio="sequence", aggregation="sequence", beta=0.05, importance_cap=2.0),
     True),
]


@pytest.mark.slow
def test_value_and_gradients_equal_the_plain_full_logits_computation():
    model = init_model(SMALL_MODEL, seed=1)
    replayed = rollout_batch(model, replay=True)
    own = {k: v for k, v in replayed.items() if k != "experts"}  # the model's own routing

    @nnx.jit
    def both(model, own, replayed):
        out = []
        for cfg, replay in CASES:
            batch = replayed if replay else own
            fused = nnx.value_and_grad(lambda m: policy_objective(m, batch, cfg,
                                                                  temperature=TEMP)[0])(model)
            ref = nnx.value_and_grad(lambda m: plain(m, batch, cfg)[0])(model)
            out.append((fused, ref))
        return out

    for (cfg, replay), ((value, grads), (ref_value, ref_grads)) in zip(
            CASES, both(model, own, replayed)):
        msg = f"{cfg}, replay={replay}"
        np.testing.assert_allclose(value, ref_value, rtol=1e-5, err_msg=msg)
        flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
        assert len(flat) == len(ref_flat) and max(np.abs(g).max() for g in ref_flat) > 1e-3
        for g, r in zip(flat, ref_flat):
            np.testing.assert_allclose(g, r, atol=2e-5 * max(np.abs(r).max(), 1e-6), rtol=0,
                                       err_msg=msg)
