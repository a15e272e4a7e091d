"""Preference optimisation (training/preference.py): DPO and SimPO against a NumPy reference on
hand-made log-probs (values to 1e-6 relative, float32; gradients' signs and values), the
sequence log-probs and the objective's gradients against a plain full-logits computation on a
tiny model (2e-5 of each gradient's largest entry: the two paths sum the vocabulary in different
orders), the LoRA reference equal to the base model, and a DPO run through loop.train whose
held-out preference accuracy rises from 0.5 (every margin 0 at step 0) and that resumes."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL, read_records, stop_after_step, tiny_train

from llm_jax.data.preference_synthetic import write_synthetic_preferences
from llm_jax.execution import ExecutionConfig
from llm_jax.model import Transformer, init_model
from llm_jax.model.lora import LoRAParam, add_lora
from llm_jax.training.loop import train
from llm_jax.training.preemption import Interrupted
from llm_jax.training.preference import (
    PreferenceConfig,
    adapters_off,
    flat_rows,
    pair_sums,
    preference_loss,
    preference_objective,
    sequence_logprobs,
    step_functions,
)
from llm_jax.training.run_config import default_run_config
from llm_jax.training.step import init_state, make_optimizer, train_step

# Four pairs: chosen ahead, rejected ahead, a tie, and one far from the reference.
LOGP = np.array([[-3.0, -5.0], [-10.0, -4.0], [-2.5, -2.5], [-40.0, -1.0]], np.float32)
REF = np.array([[-4.0, -4.0], [-9.0, -6.0], [-2.5, -2.5], [-30.0, -30.0]], np.float32)
LENGTH = np.array([[3, 5], [10, 2], [4, 4], [20, 1]], np.float32)


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def numpy_rewards(cfg: PreferenceConfig):
    """(chosen, rejected) rewards [B] as the papers write them."""
    if cfg.loss == "dpo":  # Rafailov et al. 2023, eq. 7
        return cfg.beta * (LOGP[:, 0] - REF[:, 0]), cfg.beta * (LOGP[:, 1] - REF[:, 1])
    # Meng et al. 2024, eq. 6
    return cfg.beta * LOGP[:, 0] / LENGTH[:, 0], cfg.beta * LOGP[:, 1] / LENGTH[:, 1]


def numpy_loss(cfg: PreferenceConfig) -> np.ndarray:
    chosen, rejected = numpy_rewards(cfg)
    h = chosen.astype(np.float64) - rejected
    if cfg.loss == "simpo":
        return -log_sigmoid(h - cfg.gamma)
    e = cfg.label_smoothing
    return -(1 - e) * log_sigmoid(h) - e * log_sigmoid(-h)


CONFIGS = [PreferenceConfig("dpo", beta=0.1), PreferenceConfig("dpo", beta=0.5,
                                                               label_smoothing=0.2),
           PreferenceConfig("simpo", beta=2.0, gamma=0.5)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss}-{c.label_smoothing}")
def test_losses_and_metrics_equal_the_numpy_reference(cfg):
    loss, metrics = preference_loss(jnp.asarray(LOGP), jnp.asarray(REF), jnp.asarray(LENGTH),
                                    cfg)
    np.testing.assert_allclose(loss, numpy_loss(cfg).mean(), rtol=1e-6)
    chosen, rejected = numpy_rewards(cfg)
    margin = chosen - rejected
    np.testing.assert_allclose(metrics["chosen_reward"], chosen.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["rejected_reward"], rejected.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_margin"], margin.mean(), rtol=1e-6, atol=1e-7)
    wins = np.where(margin > 0, 1.0, np.where(margin == 0, 0.5, 0.0))
    assert float(metrics["preference_accuracy"]) == wins.mean()
    if cfg.loss == "dpo":
        assert margin[2] == 0 and wins.tolist() == [1.0, 0.0, 0.5, 0.0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss}-{c.label_smoothing}")
def test_a_gradient_step_raises_the_chosen_and_lowers_the_rejected(cfg):
    grad = jax.grad(lambda lp: preference_loss(lp, jnp.asarray(REF), jnp.asarray(LENGTH),
                                               cfg)[0])(jnp.asarray(LOGP))
    grad = np.asarray(grad)
    if cfg.label_smoothing == 0:  # with smoothing, a pair far ahead is pulled back
        assert np.all(grad[:, 0] < 0) and np.all(grad[:, 1] > 0)
    # The value: dL/dlogp_chosen = -(dL/dh) dh/dlogp_chosen, per pair, / B.
    chosen, rejected = numpy_rewards(cfg)
    h = chosen.astype(np.float64) - rejected - (cfg.gamma if cfg.loss == "simpo" else 0.0)
    e = cfg.label_smoothing
    dl_dh = -(1 - e) * (1 - 1 / (1 + np.exp(-h))) + e / (1 + np.exp(-h))
    scale = cfg.beta / (LENGTH if cfg.loss == "simpo" else np.ones_like(LENGTH))
    want = np.stack([dl_dh * scale[:, 0], -dl_dh * scale[:, 1]], 1) / len(LOGP)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="dpo.loss='ipo'"):
        PreferenceConfig("ipo")
    with pytest.raises(ValueError, match="dpo.beta=0"):
        PreferenceConfig(beta=0)
    with pytest.raises(ValueError, match="dpo.label_smoothing=0.5"):
        PreferenceConfig(label_smoothing=0.5)
    cfg = default_run_config("t", SMALL_MODEL)
    cfg.dpo.files, cfg.sft.files = "a.jsonl", "b.jsonl"
    from llm_jax.training.run_config import validate_run_config

    with pytest.raises(ValueError, match="dpo.files='a.jsonl' and sft.files"):
        validate_run_config(cfg)


# ------------------------------------------------------------------------------ on a model

B, T = 3, 12


def pair_batch(seed=0) -> dict[str, jax.Array]:
    """B pairs of random tokens [B, 2, T]: a shared prompt, responses of different lengths,
    padding after."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SMALL_MODEL.vocab_size, (B, 2, T + 1)).astype(np.int32)
    tokens[:, 1, :4] = tokens[:, 0, :4]
    seg = np.zeros((B, 2, T), np.int32)
    mask = np.zeros((B, 2, T), np.float32)
    for b in range(B):
        for j, end in enumerate([(12, 9), (7, 11), (10, 10)][b]):
            seg[b, j, :end] = 1
            mask[b, j, 3:end] = 1  # targets from the 5th token on are the response
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, 2, T)).copy()
    return {"inputs": jnp.asarray(tokens[..., :-1]), "targets": jnp.asarray(tokens[..., 1:]),
            "positions": jnp.asarray(pos), "segment_ids": jnp.asarray(seg),
            "loss_mask": jnp.asarray(mask)}


def plain_sums(model, batch) -> jax.Array:
    """Summed response log-probs [B, 2] from the full logits of model(tokens)."""
    rows = flat_rows(batch)
    logits = model(rows["inputs"], rows["positions"], rows["segment_ids"])
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                               rows["targets"][..., None], -1)[..., 0]
    return (logp * rows["loss_mask"]).sum(-1).reshape(-1, 2)


def lora_model(seed=1):
    """SMALL_MODEL with rank-4 adapters whose B is not zero (so the adapters change it), and
    the base it adapts."""
    base = init_model(SMALL_MODEL, seed=seed)
    model = add_lora(copy.deepcopy(base), rank=4, alpha=8.0,
                     targets=("q_proj", "v_proj", "gate_up_proj"), seed=0)
    adapters = nnx.state(model, LoRAParam)
    key = jax.random.key(3)
    nnx.update(model, jax.tree.map(lambda x: 0.3 * jax.random.normal(key, x.shape, x.dtype),
                                   adapters))
    return model, base


# DPO (with label smoothing) and SimPO: the objectives whose gradients are checked below.
OBJECTIVES = (PreferenceConfig("dpo", beta=0.5, label_smoothing=0.1),
              PreferenceConfig("simpo", beta=2.0, gamma=0.3))


@pytest.fixture(scope="module")
def on_a_model():
    """(adapted model, its base, pair_batch(), and what the tests below compare, computed in one
    compiled program): the base's sequence log-prob sums, and its plain_sums; the adapted
    model's plain_sums, adapters on and off; for each of OBJECTIVES, the value and the
    adapters' gradients of the fused objective and of the plain full-logits computation."""
    model, base = lora_model()
    batch = pair_batch()

    @nnx.jit
    def compute(model, base, batch):
        _, logp, mask = sequence_logprobs(base, flat_rows(batch), train=False)
        ref = plain_sums(base, batch)
        length = batch["loss_mask"].sum(-1)
        objectives = []
        for cfg in OBJECTIVES:
            fused = nnx.value_and_grad(lambda m: preference_objective(m, batch, cfg)[0],
                                       argnums=nnx.DiffState(0, LoRAParam))(model)
            plain = nnx.value_and_grad(
                lambda m: preference_loss(plain_sums(m, batch), ref, length, cfg)[0],
                argnums=nnx.DiffState(0, LoRAParam))(model)
            objectives.append((fused, plain))
        return {"sequence_logprobs": pair_sums(logp, mask), "base": ref,
                "adapted": plain_sums(model, batch),
                "adapters_off": plain_sums(adapters_off(model), batch),
                "objectives": objectives}

    return model, base, batch, compute(model, base, batch)


def test_sequence_logprob_sums_equal_a_log_softmax_of_the_logits(on_a_model):
    *_, out = on_a_model
    want = out["base"]
    assert np.all(np.abs(np.asarray(want)) > 1.0)
    np.testing.assert_allclose(out["sequence_logprobs"], want, rtol=1e-5)


def test_the_lora_reference_is_the_base_model_exactly(on_a_model):
    model, *_, out = on_a_model
    want = out["base"]
    np.testing.assert_array_equal(out["adapters_off"], want)
    assert np.abs(np.asarray(out["adapted"]) - np.asarray(want)).max() > 1e-2  # adapters count
    assert jax.tree.leaves(nnx.state(model, LoRAParam))[0].any()  # `model` left unchanged


def test_value_and_gradients_equal_the_plain_full_logits_computation(on_a_model):
    """DPO (with label smoothing) and SimPO, both in one compiled program."""
    *_, out = on_a_model
    for cfg, ((value, grads), (want_value, want_grads)) in zip(OBJECTIVES, out["objectives"]):
        np.testing.assert_allclose(value, want_value, rtol=1e-5, err_msg=cfg.loss)
        flat, want_flat = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
        assert len(flat) == len(want_flat) == 6 and max(np.abs(g).max() for g in want_flat) > 1e-3
        for g, w in zip(flat, want_flat):
            np.testing.assert_allclose(g, w, atol=2e-5 * max(np.abs(w).max(), 1e-6), rtol=0,
                                       err_msg=cfg.loss)


def test_gradient_accumulation_over_pairs_equals_one_batch():
    """Microbatches split the batch by pairs, never a pair: two of two pairs each make the
    update one batch of four makes."""
    batch = {k: jnp.concatenate([v, v[:1]]) for k, v in pair_batch().items()}  # 4 pairs
    execution = ExecutionConfig(moe_dispatch="dense")  # the cheapest MoE to compile
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: Transformer(SMALL_MODEL, rngs=nnx.Rngs(params=0), execution=execution)))
    objective = step_functions(PreferenceConfig("simpo", beta=2.0))["objective"]

    @jax.jit
    def both(batch):  # the train step without and with accumulation, in one compiled program
        out = []
        for accumulate in (1, 2):
            # No warmup: the first step's learning rate is the peak, not 0, so params move.
            train_cfg = tiny_train(batch_size=4, grad_accum_steps=accumulate, warmup_steps=0)
            tx = make_optimizer(train_cfg)
            state = init_state(SMALL_MODEL, tx, 0, execution=execution)
            before = jax.tree.leaves(state.params)
            state, metrics = train_step(state, batch, graphdef=graphdef, tx=tx, train=train_cfg,
                                        objective=objective)
            out.append((metrics["loss"], metrics["grad_norm"], before,
                        jax.tree.leaves(state.params)))
        return out

    (loss1, norm1, before, params1), (loss2, norm2, _, params2) = both(batch)
    np.testing.assert_allclose(loss1, loss2, rtol=1e-6)
    np.testing.assert_allclose(norm1, norm2, rtol=1e-5)  # the accumulated gradient's norm
    lr = tiny_train().learning_rate
    assert max(float(np.max(np.abs(p - b))) for p, b in zip(params1, before)) > 0.5 * lr
    # Adam's first step moves each param by about lr g / (|g| + eps): a gradient element near
    # float32's rounding of the sum over pairs can move differently, by a small part of a step
    # (measured 2.2e-6 = 2e-4 lr on one of 16,384 elements).
    for one, two in zip(params1, params2):
        np.testing.assert_allclose(one, two, rtol=0, atol=1e-3 * lr)


def test_dpo_without_adapters_or_precomputed_reference_is_refused(on_a_model):
    _, base, batch, _ = on_a_model
    with pytest.raises(ValueError, match="needs a reference policy"):  # refused while tracing
        jax.eval_shape(lambda: preference_objective(base, batch, PreferenceConfig()))


# ------------------------------------------------------------------------------ through loop.train


def dpo_run_config(data_dir, **changes):
    model = SMALL_MODEL.replace(vocab_size=320, hidden_size=64, intermediate_size=64,
                                head_dim=16, sliding_window=0)
    cfg = default_run_config("dpo", model)
    cfg.dpo.update(files=str(data_dir / "pairs.jsonl"), tokenizer=str(data_dir),
                   validation_fraction=0.2, beta=0.5)
    cfg.data.seq_len = 48
    cfg.train.update(num_steps=60, batch_size=8, learning_rate=3e-3, warmup_steps=5,
                     weight_decay=0.0, log_every_steps=10, eval_every_steps=10, eval_batches=5,
                     num_samples=0, peak_flops=1e11)
    cfg.checkpoint.update(every_steps=60, async_save=False, checksums=False)
    for key, value in changes.items():
        section, field = key.split(".")
        cfg[section][field] = value
    return cfg


@pytest.mark.slow
def test_full_fine_tuning_dpo_learns_the_held_out_preferences_and_resumes(tmp_path,
                                                                           monkeypatch):
    write_synthetic_preferences(tmp_path / "data")
    workdir = tmp_path / "run"
    # Stopped after step 10 as a preemption stops it, then resumed with the same config: one
    # compiled train step for both.
    cfg = dpo_run_config(tmp_path / "data")
    stop_after_step(monkeypatch, 10)
    with pytest.raises(Interrupted, match="after step 10"):
        train(cfg, str(workdir))
    monkeypatch.undo()
    reference = workdir / "dpo_reference" / "process_0-of-1.npz"
    assert reference.exists()
    reference.touch()
    before = reference.stat().st_mtime_ns
    # resumes at step 10, and samples replies to two held-out prompts at its end
    last = train(dpo_run_config(tmp_path / "data", **{"train.num_samples": 2}), str(workdir))
    assert reference.stat().st_mtime_ns == before  # read, not computed again
    assert (workdir / "samples.txt").read_text().count("?\n->") == 2
    records = read_records(workdir)
    assert [r["step"] for r in records] == [1, 10, 11, 20, 30, 40, 50, 60]
    assert records[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy = reference
    assert records[1]["val_preference_accuracy"] < 0.8 <= 0.9 <= last["val_preference_accuracy"]
    assert last["val_reward_margin"] > 0
    # Without its reference log-probs a resumed run cannot go on: the initial params are gone.
    reference.unlink()
    with pytest.raises(ValueError, match="has no reference log-probs .*dpo_reference"):
        train(dpo_run_config(tmp_path / "data", **{"train.num_steps": 70}), str(workdir))
