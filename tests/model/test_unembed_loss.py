"""The chunked unembedding + cross-entropy against optax on full logits: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from llm_jax.execution import ExecutionConfig
from llm_jax.model import unembed_loss
from llm_jax.model.unembed_loss import cross_entropy_sum

B, T, D, V = 3, 37, 16, 101  # T prime: the last chunk is padded


def _inputs(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    h_BTD = jax.random.normal(k[0], (B, T, D))
    w_VD = 0.5 * jax.random.normal(k[1], (V, D))
    targets_BT = jax.random.randint(k[2], (B, T), 0, V)
    mask_BT = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.float32)
    return h_BTD, w_VD, targets_BT, mask_BT


def _reference(h_BTD, w_VD, targets_BT, weights_BT):
    logits_BTV = jnp.einsum("BTD,VD->BTV", h_BTD, w_VD, preferred_element_type=jnp.float32)
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    return (nll_BT * weights_BT).sum() / weights_BT.sum()


def _fused(chunk_tokens, group_chunks=1):
    def f(h_BTD, w_VD, targets_BT, weights_BT):
        return cross_entropy_sum(h_BTD, w_VD, targets_BT, weights_BT, chunk_tokens=chunk_tokens,
                                 group_chunks=group_chunks) / weights_BT.sum()
    return f


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def full_logits_reference():
    """{masked: (inputs, weights, the full-logits loss and its gradients)}, each computed once."""
    h, w, tg, mask = _inputs()
    out = {}
    for masked in (True, False):
        weights = mask if masked else jnp.ones_like(mask)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(jax.value_and_grad(_reference, argnums=(0, 1)))(h, w, tg, weights)
        out[masked] = h, w, tg, weights, ref
    return out


# (chunk_tokens, group_chunks, masked). 37 steps of 3 sequences: chunk_tokens 16 -> 5 steps a
# chunk, 8 chunks; 1 -> 37 one-step chunks. Groups: 3 of 8 chunks -> groups of 3, one chunk of
# padding; 4 -> two groups of 4; 5 of 37 -> 8 groups of 5 (3 chunks of padding); 100 -> one group.
@pytest.mark.parametrize("chunk_tokens, group_chunks, masked", [
    (1, 1, True), (16, 1, False), (16, 1, True), (10_000, 1, True),  # 1 step, padded, 1 chunk
    (16, 3, True), (16, 4, False), (1, 5, True), (16, 100, True), (10_000, 4, True)])
def test_values_and_gradients_match_full_logits(chunk_tokens, group_chunks, masked,
                                                full_logits_reference):
    h, w, tg, weights, (ref_v, ref_g) = full_logits_reference[masked]
    fused = _fused(chunk_tokens, group_chunks)
    with jax.default_matmul_precision("highest"):
        v, g = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w, tg, weights)
    _close(v, ref_v)
    _close(g[0], ref_g[0])
    _close(g[1], ref_g[1])


def test_masked_tokens_get_exactly_zero_gradient():
    h, w, tg, mask = _inputs(1)
    g_BTD = jax.jit(jax.grad(lambda h: cross_entropy_sum(h, w, tg, mask, chunk_tokens=16)))(h)
    assert np.all(np.asarray(g_BTD)[np.asarray(mask) == 0] == 0)
    assert np.all(np.abs(np.asarray(g_BTD)[np.asarray(mask) == 1]).sum(-1) > 0)


def test_without_gradients_matches_and_weights_default_to_ones():
    h, w, tg, _ = _inputs(2)
    with jax.default_matmul_precision("highest"):
        ref = _reference(h, w, tg, jnp.ones((B, T))) * B * T
        _close(cross_entropy_sum(h, w, tg, chunk_tokens=16), ref)
        _close(jax.jit(lambda h: cross_entropy_sum(h, w, tg))(h), ref)


def test_gradient_with_respect_to_weights_is_the_token_nll():
    h, w, tg, mask = _inputs(3)
    logits = jnp.einsum("BTD,VD->BTV", h, w, precision="highest")
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits, tg)
    with jax.default_matmul_precision("highest"):
        g_BT = jax.jit(jax.grad(lambda m: cross_entropy_sum(h, w, tg, m, chunk_tokens=16)))(mask)
    _close(g_BT, nll_BT)


def test_bfloat16_matmuls_stay_close():
    h, w, tg, mask = _inputs(4)
    ref = _reference(h.astype(jnp.bfloat16).astype(jnp.float32),
                     w.astype(jnp.bfloat16).astype(jnp.float32), tg, mask)
    v = cross_entropy_sum(h.astype(jnp.bfloat16), w, tg, mask, dtype=jnp.bfloat16) / mask.sum()
    np.testing.assert_allclose(float(v), float(ref), rtol=1e-3)
    g = jax.grad(lambda h: cross_entropy_sum(h, w, tg, mask, dtype=jnp.bfloat16))(
        h.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16


def test_shape_errors_name_the_expected_shape():
    h, w, tg, mask = _inputs()
    with pytest.raises(ValueError, match=r"targets shape \(3, 36\).*expected \(3, 37\)"):
        cross_entropy_sum(h, w, tg[:, :-1])
    with pytest.raises(ValueError, match=r"unembedding shape \(101, 8\): expected \(vocab, 16\)"):
        cross_entropy_sum(h, w[:, :8], tg)
    with pytest.raises(ValueError, match=r"weights shape \(3,\): expected \(3, 37\)"):
        cross_entropy_sum(h, w, tg, mask[:, 0])


def test_training_loss_and_gradients_equal_the_full_logits_loss():
    """loss_fn's fused cross-entropy against optax on `model(tokens)` logits, through the model."""
    from flax import nnx

    from llm_jax.config import ModelConfig
    from llm_jax.model import init_model
    from llm_jax.training.run_config import default_run_config
    from llm_jax.training.step import eval_step, loss_fn

    cfg = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=97,
                      hidden_size=32, intermediate_size=16, head_dim=8, num_attention_heads=4,
                      num_key_value_heads=2)
    train = default_run_config("t", cfg).train
    graphdef, params = nnx.split(init_model(cfg, seed=5,
                                            execution=ExecutionConfig(moe_dispatch="dense")),
                                 nnx.Param)
    tokens = jax.random.randint(jax.random.key(6), (2, 33), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def reference(params):
        logits, _ = nnx.merge(graphdef, params)(batch["inputs"], train=True, return_aux=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def fused(params):
        return loss_fn(params, graphdef, batch, train, batch["targets"].size)[1]["loss"]

    with jax.default_matmul_precision("highest"):
        ref_v, ref_g = jax.jit(jax.value_and_grad(reference))(params)
        v, g = jax.jit(jax.value_and_grad(fused))(params)
        ev = eval_step(params, batch, graphdef=graphdef)
    _close(v, ref_v)
    jax.tree.map(_close, g, ref_g)
    _close(ev["nll"] / ev["tokens"], ref_v)


def test_train_step_holds_no_full_logits():
    from llm_jax.bench.train import quick_model_config, random_batch, tiny_run_config
    from llm_jax.parallel.sharding import make_mesh
    from llm_jax.training.step import compile_steps

    cfg = quick_model_config().replace(vocab_size=347)  # a V no other array has
    train = tiny_run_config().train.copy_and_resolve_references()
    train.batch_size, train.grad_accum_steps = 4, 1
    steps = compile_steps(cfg, train, make_mesh(devices=jax.devices()[:1]), 0)
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg.vocab_size, 4, 128).items()}
    hlo = steps.train.lower(steps.abstract_state, batch).compile().as_text()
    assert "f32[4,128,347]" not in hlo and "f32[512,347]" not in hlo  # [B, T, V], [B T, V]
    assert "f32[4,64,347]" in hlo  # one chunk: 256 tokens at a time


def test_chunks_count_tokens_per_batch_shard():
    from llm_jax.model.unembed_loss import chunk_steps, loop_unroll

    assert ExecutionConfig().loss_chunk_tokens == 256  # the CPU default: 256 tokens per chunk
    assert chunk_steps(4, 128) == 64  # one device: B c = 256
    # 16 sequences over 16 devices (one per device): 256 tokens per device, not 256 / 16
    assert chunk_steps(16, 8192, 256, batch_shards=16) == 256
    assert chunk_steps(16, 8192, 4096, batch_shards=16) == 4096  # 2 chunks of 4096 tokens
    assert chunk_steps(16, 8192, 1 << 20, batch_shards=16) == 8192  # at most T
    assert loop_unroll(4) == 4 and loop_unroll(64) == 2  # few chunks: unrolled, so XLA costs all


def test_chunks_per_group_spread_evenly_over_the_fewest_groups():
    from llm_jax.model.unembed_loss import chunks_per_group

    assert ExecutionConfig().loss_group_chunks == 1  # the default: one product per chunk
    assert chunks_per_group(4, 1) == 1 and chunks_per_group(4, 4) == 4
    assert chunks_per_group(4, 2) == 2 and chunks_per_group(4, 3) == 2  # 2 groups of 2, no pad
    assert chunks_per_group(5, 4) == 3  # 2 groups of 3 (1 chunk of padding), not 4 + 1
    assert chunks_per_group(3, 100) == 3 and chunks_per_group(1, 4) == 1  # at most all chunks
    assert chunks_per_group(8, 3) == 3  # 3 groups: 3, 3, 2 + 1 of padding


def test_groups_equal_single_chunks_to_rounding():
    """Grouping changes only the order of float32 sums (the loss's over tokens, dW's over
    tokens, dh's as the matmul blocks it): all three agree with one product a chunk to 1e-6
    relative, 10x tighter than against the full-logits reference."""
    h, w, tg, mask = _inputs(5)
    grad = jax.jit(jax.value_and_grad(lambda h, w, k: _fused(16, k)(h, w, tg, mask),
                                      argnums=(0, 1)), static_argnums=2)
    v1, (dh1, dw1) = grad(h, w, 1)
    v4, (dh4, dw4) = grad(h, w, 4)
    for a, b in ((v4, v1), (dh4, dh1), (dw4, dw1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_group_holds_one_gradient_buffer_and_one_chunk_of_logits():
    """Groups of 2 chunks of 32 steps, B = 4, T = 128: the group's gradient g is one [B, 64, V]
    buffer written in place (no stack of chunks, no [B, T, V]); the logits a chunk at a time."""
    h = jnp.ones((4, 128, 16))
    w, tg = jnp.ones((347, 16)), jnp.zeros((4, 128), jnp.int32)
    f = jax.jit(jax.grad(lambda h, w: cross_entropy_sum(h, w, tg, chunk_tokens=128,
                                                        group_chunks=2), argnums=(0, 1)))
    hlo = f.lower(h, w).compile().as_text()
    assert "f32[4,64,347]" in hlo and "f32[4,32,347]" in hlo  # g of the group; one chunk
    assert "f32[4,128,347]" not in hlo and "f32[2,4,32,347]" not in hlo  # [B, T, V]; a stack


def test_vocab_split_uses_the_mesh_axes_that_divide_the_vocabulary():
    from jax.sharding import PartitionSpec as P

    from llm_jax.model.unembed_loss import vocab_split
    from llm_jax.parallel.sharding import MESH_AXES

    def split(sizes, batch=8, vocab=96):
        mesh = jax.sharding.AbstractMesh(sizes, MESH_AXES)  # (data, fsdp, tensor, expert)
        with jax.sharding.use_abstract_mesh(mesh):
            return vocab_split(batch, vocab)

    assert vocab_split(8, 96) is None  # no mesh
    s = split((1, 4, 1, 2))
    assert s.tokens == P(None, None, None) and s.logits == P(None, None, ("fsdp", "expert"))
    assert s.weight == P(("fsdp", "expert"), None)
    assert split((2, 2, 2, 1)).logits == P("data", None, ("tensor", "fsdp"))  # data keeps tokens
    assert split((8, 1, 1, 1)) is None  # data alone: split by tokens
    assert split((1, 1, 2, 1)) is None  # tensor alone splits no tokens: nothing to gain
    assert split((1, 4, 1, 2), vocab=100) is None  # 8 does not divide V = 100


def test_chunk_size_under_a_mesh_is_per_device(monkeypatch):
    """Under a mesh that splits the batch 4 ways, `chunk_tokens` counts one device's tokens."""
    import llm_jax.model.unembed_loss as ul
    from llm_jax.parallel.sharding import MESH_AXES

    seen = []
    real = ul._split
    monkeypatch.setattr(ul, "_split", lambda x, c, fill=0: seen.append(c) or real(x, c, fill))
    h, w, tg, mask = _inputs()
    h, tg, mask = (jnp.concatenate([a] * 4)[:8] for a in (h, tg, mask))  # B = 8
    mesh = jax.sharding.AbstractMesh((4, 1, 1, 1), MESH_AXES)
    with jax.sharding.use_abstract_mesh(mesh):
        jax.eval_shape(lambda *a: cross_entropy_sum(*a, chunk_tokens=16), h, w, tg, mask)
    assert seen and set(seen) == {8}  # 2 sequences per device x 8 steps = 16 tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_logits_by_vocab_chunks_equal_one_product(monkeypatch, dtype):
    # On CPU a 16-bit unembedding's logits walk the vocabulary in chunks (the last overlapping
    # its predecessor); reference: NumPy float64 of the same 16-bit values. Tolerance 1e-5
    # relative to the largest |logit| (float32 sums of D = 48 exact products).
    monkeypatch.setattr(unembed_loss, "CPU_VOCAB_CHUNK", 64)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 3, 48)), dtype)
    w = jnp.asarray(rng.normal(size=(203, 48)), dtype)  # 4 chunks, the last starting at 139
    got = jax.jit(lambda h, w: unembed_loss.logits(h, w, dtype))(h, w)
    want = np.einsum("btd,vd->btv", np.asarray(h, np.float64), np.asarray(w, np.float64))
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 203)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    # Rows of a 16-bit table move as bit patterns: the same values as plain indexing.
    idx = jnp.asarray([[0, 202, 7]])
    np.testing.assert_array_equal(np.asarray(unembed_loss.rows(w, idx)), np.asarray(w)[idx])
