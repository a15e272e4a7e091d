"""The unembedding and cross-entropy fused over chunks of time: training never holds [B, T, V].

Shapes: B batch, T time, c time steps per chunk, n chunks (n c >= T), D hidden, V vocab.

A scan walks n chunks of [B, c] tokens (a mesh that splits the batch S ways gives each device
[B / S, c]: `chunk_tokens` counts those); each computes its logits [B, c, V] in float32, their
log-sum-exp and target logit. Under differentiation the same pass also forms the chunk's
gradient at once, (softmax - one-hot) x weight, and multiplies it into dh and dW, so the
backward pass only scales two stored arrays by the incoming cotangent: three unembedding-sized
matmuls as without chunking, and no recomputation (as Liger kernel's fused linear
cross-entropy does). Evaluation runs the forward half alone.

Chunks come in groups (`group_chunks`, ExecutionConfig.loss_group_chunks): the logits are formed a
chunk at a time, but their gradients go into dh and dW once a group. dW sums over every token,
so each product into it reads, writes or (on a mesh that splits the batch) reduce-scatters a
[V, D] float32 array; a group pays that once for k chunks, and holds k chunks of gradient.
On a mesh with an fsdp or expert axis whose sizes, times tensor's, divide the vocabulary, the
loss is split by vocabulary instead (`vocab_split`; a mesh of data and tensor only splits by
tokens): each device forms its slice of every chunk's logits from the chunk's gathered hidden
states, and its slice of dW never leaves it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from llm_jax.parallel.sharding import constrain, mesh_axes, shard_count
from llm_jax.runtime.backend import plan

# Tokens per chunk and batch shard (B c / S): about 8 MB of float32 logits at V = 8,000, so a
# chunk stays in cache (ExecutionConfig.loss_chunk_tokens' default).
CHUNK_TOKENS = 256
# Chunks per loop iteration: more runs no faster on CPU and keeps more chunks alive at once.
MAX_UNROLL = 2
# Up to this many chunks the loop is unrolled whole: XLA's cost analysis counts a loop body once,
# so only an unrolled loss shows its real FLOPs and bytes in a compiled program's cost (the
# gpt-oss configs: 1,024-token chunks, eight at 8k tokens per chip). The chunks run one after
# the other either way (`_after`), so unrolling holds no more of them at once.
FULL_UNROLL = 8


# XLA:CPU has no bfloat16 matmul: it converts a bfloat16 unembedding to float32 whole before
# the logits' product (gpt-oss-20b: 2.3 GB), beside a second, transposed one for the prefill's
# logits. On CPU, `logits` of a narrower unembedding walk the vocabulary in chunks of this many
# rows, each converted in its turn: 11 MiB of float32 at D = 2,880, which stays in the cache.
# One token's logits of gpt-oss-20b (V 201,088) with the CPU inference options
# (runtime.backend) took 43 / 41 / 50 / 90 / 134 ms at 512 / 1,024 / 2,048 / 4,096 / 16,384
# rows on a 2-core host; at 1,024 they read the table at its memory bandwidth. Other backends
# multiply bfloat16 natively.
CPU_VOCAB_CHUNK = 1024


def rows(table_VD: jax.Array, index: Any) -> jax.Array:
    """table_VD[index] (a gather or a slice of rows). A 16-bit table's rows move as their bit
    patterns: XLA:CPU has no bfloat16 data movement, so it widens the whole operand of a
    bfloat16 gather or dynamic slice to float32 first (gpt-oss-20b's embedding: 2.3 GB, kept
    for a whole decode loop once hoisted out of it). Elsewhere the rows move as they are: on TPU
    the 16-bit view of the table is a copy of it."""
    if table_VD.dtype.itemsize != 2 or not plan().rows_as_bits:
        return index(table_VD) if callable(index) else table_VD[index]
    bits = jax.lax.bitcast_convert_type(table_VD, jnp.uint16)
    bits = index(bits) if callable(index) else bits[index]
    return jax.lax.bitcast_convert_type(bits, table_VD.dtype)


def logits(h_BTD: jax.Array, w_VD: jax.Array, dtype: Any) -> jax.Array:
    """h W^T in float32 [B, T, V], the operands in `dtype`: one product, or on CPU (see
    CPU_VOCAB_CHUNK) one per chunk of rows of W; each logit is the same dot product either way
    (products of `dtype` values are exact in float32, summed in float32). The last chunk starts
    at V - CPU_VOCAB_CHUNK (it overlaps its predecessor; the rows they share are written twice
    with the same values), so W is never padded or copied."""
    h_BTD = h_BTD.astype(dtype)
    product = functools.partial(jnp.einsum, "BTD,VD->BTV", preferred_element_type=jnp.float32)
    v, c = w_VD.shape[0], CPU_VOCAB_CHUNK
    if not plan().vocab_chunked_logits or w_VD.dtype == jnp.float32 or v <= c:
        return product(h_BTD, w_VD.astype(dtype))

    def chunk(k: jax.Array, out_BTV: jax.Array) -> jax.Array:
        start = jnp.minimum(k * c, v - c)
        w_cD = rows(w_VD, lambda w: jax.lax.dynamic_slice_in_dim(w, start, c, axis=0))
        return jax.lax.dynamic_update_slice_in_dim(out_BTV, product(h_BTD, w_cD.astype(dtype)),
                                                   start, axis=2)

    b, t, _ = h_BTD.shape
    return jax.lax.fori_loop(0, -(-v // c), chunk, jnp.zeros((b, t, v), jnp.float32))


def chunk_steps(batch: int, seq_len: int, chunk_tokens: int = CHUNK_TOKENS,
                batch_shards: int = 1) -> int:
    """c: time steps per chunk, so that each batch shard's chunk, (B / S) c, is about
    `chunk_tokens` (at least 1, at most T)."""
    per_shard = max(1, batch // max(batch_shards, 1))
    return max(1, min(seq_len, chunk_tokens // per_shard))


def loop_unroll(num_chunks: int) -> int:
    """`unroll` of the scan over `num_chunks` chunks."""
    return num_chunks if num_chunks <= FULL_UNROLL else MAX_UNROLL


def _split(x_BT: jax.Array, c: int, fill: int | float = 0) -> jax.Array:
    """[B, T, ...] -> [n, B, c, ...], T padded with `fill` to n c."""
    b, t = x_BT.shape[:2]
    n = -(-t // c)
    pad = [(0, 0), (0, n * c - t)] + [(0, 0)] * (x_BT.ndim - 2)
    x = jnp.pad(x_BT, pad, constant_values=fill)
    return jnp.moveaxis(x.reshape(b, n, c, *x_BT.shape[2:]), 1, 0)


class VocabSplit(NamedTuple):
    """The vocab-parallel loss's layouts: `tokens` for a chunk's hidden states [B, c, D]
    gathered over the batch shards (but `data`), `logits` for [B, c, V] split over the vocab,
    `weight` for the unembedding [V, D] split the same way."""
    tokens: P
    logits: P
    weight: P


def vocab_split(batch: int, vocab: int) -> VocabSplit | None:
    """The split of the loss over the current mesh's `tensor`, `fsdp` and `expert` axes by
    vocabulary rather than by tokens, or None (no mesh, no such axis, or sizes they do not
    divide). Split by tokens, every device multiplies its chunk by the whole unembedding,
    gathered (1.16 GB for gpt-oss) and read once a chunk, and dW [V, D] sums over all devices'
    tokens, so it is reduce-scattered (float32); split by vocabulary, each device reads its
    slice of the unembedding and keeps its slice of dW, for an all-gather of each chunk's
    hidden states and a reduce-scatter of dh ([tokens, D], small beside [V, D])."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    # The vocab's own axes (RULES: tensor) and the batch's but `data`, which keeps its tokens
    # (across slices, an all-gather of hidden states per chunk would cross the DCN).
    batch_axes = mesh_axes(mesh, ("batch",))
    data = tuple(a for a in batch_axes if a == "data")
    gathered = tuple(a for a in batch_axes if a != "data")
    axes = mesh_axes(mesh, ("vocab",)) + gathered
    if not gathered or vocab % math.prod(mesh.shape[a] for a in axes):
        return None
    if batch % math.prod(mesh.shape[a] for a in data):
        return None
    data_spec = data[0] if data else None
    return VocabSplit(tokens=P(data_spec, None, None), logits=P(data_spec, None, axes),
                      weight=P(axes, None))


def _chunk_nll(h_BcD: jax.Array, w_VD: jax.Array, targets_Bc: jax.Array, dtype: jnp.dtype,
               split: VocabSplit | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(float32 logits [B, c, V], log-sum-exp [B, c], nll [B, c]) of one chunk. Under a vocab
    `split` the chunk's tokens are gathered from every batch shard and each device forms its
    slice of the vocabulary; the target's logit is then a masked sum over V (exact: one term),
    which reduces across the shards as the log-sum-exp does, where a gather would not."""
    if split is not None:
        h_BcD = jax.lax.with_sharding_constraint(h_BcD, split.tokens)
    logits_BcV = jnp.einsum("BcD,VD->BcV", h_BcD.astype(dtype), w_VD.astype(dtype),
                            preferred_element_type=jnp.float32)
    if split is not None:
        logits_BcV = jax.lax.with_sharding_constraint(logits_BcV, split.logits)
    lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
    if split is None:
        target_Bc = jnp.take_along_axis(logits_BcV, targets_Bc[..., None], axis=-1)[..., 0]
    else:
        vocab_V = jnp.arange(logits_BcV.shape[-1], dtype=jnp.int32)
        target_Bc = jnp.sum(jnp.where(vocab_V == targets_Bc[..., None], logits_BcV, 0.0), -1)
    return logits_BcV, lse_Bc, lse_Bc - target_Bc


def _after(carry: Any, xs: Any) -> tuple[Any, Any]:
    """(carry, xs) tied by an optimization barrier: a chunk starts once the previous one has
    finished. Unrolled, the chunks are independent but for the carry, and XLA:TPU ran them side
    by side: 3.0 chunks of float32 logits live at once in a 4-chunk loss (1.0 with the
    barrier); gpt-oss-20b's 2-layer train step on v5p-32 at 8,192 tokens per chip held 15.58
    GiB of temporaries, 13.17 with it, for +0.3 % bytes."""
    return jax.lax.optimization_barrier((carry, xs))


def _split_weight(w_VD: jax.Array, split: VocabSplit | None) -> jax.Array:
    return w_VD if split is None else jax.lax.with_sharding_constraint(w_VD, split.weight)


def _loss_only(h_BTD, w_VD, targets_BT, weights_BT, dtype, c, split):
    w_VD = _split_weight(w_VD, split)

    def body(total, xs):
        total, xs = _after(total, xs)
        h, tgt, wt = xs
        _, _, nll = _chunk_nll(h, w_VD, tgt, dtype, split)
        return total + jnp.sum(wt * nll), None

    xs = (_split(h_BTD, c), _split(targets_BT, c), _split(weights_BT, c))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs,
                            unroll=loop_unroll(xs[1].shape[0]))
    return total


def token_nll(h_BTD: jax.Array, unembedding_VD: jax.Array, targets_BT: jax.Array, *,
              dtype: jnp.dtype = jnp.float32, chunk_tokens: int | None = None) -> jax.Array:
    """float32 nll [B, T] of every target, chunk by chunk as `cross_entropy_sum` forms it (no
    [B, T, V] logits), for losses that are not a weighted sum of nll (the RL objective). Not
    differentiated: gradients come from `cross_entropy_sum` with per-token weights."""
    b, t, _ = h_BTD.shape
    c = chunk_steps(b, t, chunk_tokens or CHUNK_TOKENS, shard_count(b, "batch"))
    split = vocab_split(b, unembedding_VD.shape[0])
    w_VD = _split_weight(jax.lax.stop_gradient(unembedding_VD).astype(jnp.float32), split)

    def body(carry, xs):
        carry, xs = _after(carry, xs)
        h, tgt = xs
        return carry, _chunk_nll(h, w_VD, tgt, jnp.dtype(dtype), split)[2]

    xs = (_split(jax.lax.stop_gradient(h_BTD).astype(jnp.float32), c),
          _split(targets_BT.astype(jnp.int32), c))
    _, nll_nBc = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs,
                              unroll=loop_unroll(xs[1].shape[0]))
    return jnp.moveaxis(nll_nBc, 0, 1).reshape(b, -1)[:, :t]


def chunks_per_group(num_chunks: int, group_chunks: int) -> int:
    """k: chunks per gradient group, at most `group_chunks`, spread evenly over the fewest groups
    (5 chunks in groups of at most 4: two groups of 3, one chunk of padding)."""
    k = max(1, min(group_chunks, num_chunks))
    return -(-num_chunks // -(-num_chunks // k))


def _loss_and_grads(h_BTD, w_VD, targets_BT, weights_BT, dtype, c, group_chunks, split):
    """(loss, dloss/dh [B, T, D], dloss/dW [V, D], nll [B, T]), all float32.

    A scan over groups of s = k c time steps; in each, k chunks in turn form their float32
    logits and write their gradient g (`dtype`, [B, c, V]) into one [B, s, V] buffer, and one
    product each takes the group's g into dh and dW. The buffer keeps the batch first, as the
    chunks' logits do, so both products see the unembedding as the logits' product does (a
    [k, B, c, V] buffer made XLA:TPU lay out a second copy of the gathered unembedding).
    Under a vocab `split` each device's dW is its own slice, summed in place: groups would only
    hold more, so every group is one chunk."""
    b, t, d = h_BTD.shape
    v = w_VD.shape[0]
    w_VD = _split_weight(w_VD, split)
    w_cdt = w_VD.astype(dtype)
    k = chunks_per_group(-(-t // c), 1 if split is not None else group_chunks)

    def body(carry, xs):
        carry, xs = _after(carry, xs)
        total, dw_VD = carry
        h_BsD, tgt_Bs, wt_Bs = xs
        # Written in place, chunk by chunk: a stack would copy the chunks, and zeros would
        # write the buffer once more (every chunk of it is overwritten below).
        g_BsV = jax.lax.empty((*tgt_Bs.shape, v), dtype)
        nll = []
        for j in range(k):
            h_BcD, tgt_Bc, wt_Bc = (x[:, j * c:(j + 1) * c] for x in xs)
            if j:  # after the last chunk's g and nll: one chunk of float32 logits at a time
                (g_BsV, nll), h_BcD = _after((g_BsV, nll), h_BcD)
            logits_BcV, lse_Bc, nll_Bc = _chunk_nll(h_BcD, w_VD, tgt_Bc, dtype, split)
            p_BcV = jnp.exp(logits_BcV - lse_Bc[..., None])
            onehot_BcV = jax.nn.one_hot(tgt_Bc, v, dtype=jnp.float32)
            g_BcV = ((p_BcV - onehot_BcV) * wt_Bc[..., None]).astype(dtype)
            g_BsV = jax.lax.dynamic_update_slice_in_dim(g_BsV, g_BcV, j * c, axis=1)
            nll.append(nll_Bc)
        nll_Bs = jnp.concatenate(nll, axis=1)
        dh_BsD = jnp.einsum("BsV,VD->BsD", g_BsV, w_cdt, preferred_element_type=jnp.float32)
        if split is not None:  # each device's vocab slice's share, reduce-scattered to tokens
            dh_BsD = constrain(dh_BsD, ("batch", None, None))
            h_BsD = jax.lax.with_sharding_constraint(h_BsD, split.tokens)
        dw_VD = dw_VD + _split_weight(jnp.einsum("BsV,BsD->VD", g_BsV, h_BsD.astype(dtype),
                                                 preferred_element_type=jnp.float32), split)
        return (total + jnp.sum(wt_Bs * nll_Bs), dw_VD), (dh_BsD, nll_Bs)

    xs = (_split(h_BTD, k * c), _split(targets_BT, k * c), _split(weights_BT, k * c))
    init = (jnp.zeros((), jnp.float32), _split_weight(jnp.zeros((v, d), jnp.float32), split))
    (total, dw_VD), (dh_mBsD, nll_mBs) = jax.lax.scan(body, init, xs,
                                                     unroll=loop_unroll(xs[1].shape[0]))
    dh_BTD = jnp.moveaxis(dh_mBsD, 0, 1).reshape(b, -1, d)[:, :t]
    nll_BT = jnp.moveaxis(nll_mBs, 0, 1).reshape(b, -1)[:, :t]
    return total, dh_BTD, dw_VD, nll_BT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(h_BTD, w_VD, targets_BT, weights_BT, dtype, c, group_chunks, split):
    return _loss_only(h_BTD, w_VD, targets_BT, weights_BT, dtype, c, split)


def _fused_fwd(h_BTD, w_VD, targets_BT, weights_BT, dtype, c, group_chunks, split):
    total, dh_BTD, dw_VD, nll_BT = _loss_and_grads(h_BTD, w_VD, targets_BT, weights_BT, dtype, c,
                                                   group_chunks, split)
    return total, (dh_BTD, dw_VD, nll_BT)


def _fused_bwd(dtype, c, group_chunks, split, res, g):
    dh_BTD, dw_VD, nll_BT = res
    return g * dh_BTD, g * dw_VD, None, g * nll_BT


_fused.defvjp(_fused_fwd, _fused_bwd)


def cross_entropy_sum(
    h_BTD: jax.Array,
    unembedding_VD: jax.Array,
    targets_BT: jax.Array,
    weights_BT: jax.Array | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
    chunk_tokens: int | None = None,
    group_chunks: int = 1,
) -> jax.Array:
    """sum_t weights_t (logsumexp(logits_t) - logits_t[target_t]) with logits = h W^T computed in
    `dtype` with float32 results: the value and gradients of the full-logits loss
    `(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights).sum()`.
    `weights_BT` (default all ones) is a loss mask or per-token weight: a token of weight 0
    adds nothing to the loss or to any gradient. Divide by the weights' sum for a mean.
    `group_chunks` chunks share one product into dh and dW (`_loss_and_grads`)."""
    b, t, d = h_BTD.shape
    if targets_BT.shape != (b, t):
        raise ValueError(f"targets shape {targets_BT.shape} does not match hidden states "
                         f"{h_BTD.shape}: expected {(b, t)}")
    if unembedding_VD.ndim != 2 or unembedding_VD.shape[1] != d:
        raise ValueError(f"unembedding shape {unembedding_VD.shape}: expected (vocab, {d})")
    if weights_BT is None:
        weights_BT = jnp.ones((b, t), jnp.float32)
    elif weights_BT.shape != (b, t):
        raise ValueError(f"weights shape {weights_BT.shape}: expected {(b, t)}")
    c = chunk_steps(b, t, chunk_tokens or CHUNK_TOKENS, shard_count(b, "batch"))
    # float32 in and out of the custom VJP; `astype` casts the gradients back to each input's dtype.
    f32 = jnp.float32
    return _fused(h_BTD.astype(f32), unembedding_VD.astype(f32), targets_BT.astype(jnp.int32),
                  weights_BT.astype(f32), jnp.dtype(dtype), c, group_chunks,
                  vocab_split(b, unembedding_VD.shape[0]))
