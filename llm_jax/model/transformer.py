"""The gpt-oss Transformer: embedding, L pre-norm blocks (attention, MoE), final norm, unembedding.

Shapes: B batch, T time, D hidden, V vocab, L layers, E experts.

The L blocks are created stacked (every weight gets a leading `layers` axis) and run with one
`jax.lax.scan`, so compile time does not grow with depth. Even and odd layers differ only in
their sliding window, which is scanned as data next to the weights. `scan_layers=False`
(ExecutionConfig) unrolls the same scan: the weights stay stacked (one checkpoint layout), but
XLA then sees L separate layers and needs no loop-carried buffers for the saved activations and
stacked gradients.

With a KV cache (prefill and decode) the layers run as a Python loop, because a sliding layer's
cache is smaller than a full layer's; each layer's cache is its own array (model/kv_cache.py).
Training, evaluation, prefill and decode all run these same `Block`s.

How the model runs (`llm_jax.execution.ExecutionConfig`: MoE dispatch, attention kernel, loss
chunks, remat, scan) is held once, by the Transformer (`model.execution`), and passed down at call
time: changing a model's execution is one assignment, never a new model.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.attention import Attention
from llm_jax.model.kv_cache import KVCache, LayerCache
from llm_jax.model.moe import MoE, MoEAux
from llm_jax.model.norm import make_norm
from llm_jax.model.params import normal, param
from llm_jax.model.unembed_loss import cross_entropy_sum, logits, rows
from llm_jax.parallel.sharding import constrain
from llm_jax.runtime.backend import plan

RESIDUAL = ("batch", "length", "embed")  # logical axes of the residual stream


class Block(nnx.Module):
    """x + attention(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = make_norm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = make_norm(cfg, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs)

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        window: jax.Array | int,
        segment_ids_BT: jax.Array | None = None,
        cache: LayerCache | None = None,
        *,
        train: bool = False,
        execution: ExecutionConfig = ExecutionConfig(),
        experts_BTk: jax.Array | None = None,
    ) -> tuple[jax.Array, MoEAux, LayerCache | None]:
        a, cache = self.attn(self.attn_norm(x_BTD), positions_BT, window, segment_ids_BT, cache,
                             execution=execution)
        x = x_BTD + a
        y, aux = self.mlp(self.mlp_norm(x), train=train, execution=execution,
                          experts_BTk=experts_BTk)
        return x + y, aux, cache


class Transformer(nnx.Module):
    """The whole network. `model(tokens)` -> float32 logits [B, T, V]. `cfg` is what it is,
    `execution` how it runs (a static attribute: reassigning it retraces, nothing else)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
                 execution: ExecutionConfig = ExecutionConfig()):
        self.cfg = cfg
        self.execution = execution
        pd = cfg.weight_dtype
        self.embedding = param(rngs, normal(cfg.initializer_range),
                               (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.layers = make_blocks(rngs)
        self.norm = make_norm(cfg, rngs=rngs)
        self.unembedding = param(rngs, normal(cfg.initializer_range),
                                 (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)

    def hidden_states(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        train: bool = False,
        layers: tuple[nnx.State, ...] | None = None,
        experts_BTLk: jax.Array | None = None,
    ) -> tuple[jax.Array, MoEAux, KVCache | None]:
        """Final-normed hidden states [B, T, D], per-layer MoE aux (leading axis L) and the
        updated cache (None without one). `train=True` allows a dropping MoE dispatch.
        `layers`: `layer_states()` computed once outside a decode loop (with a cache only).
        `experts_BTLk`: a routing to replay in every MoE layer (what another forward of the
        same tokens recorded in `aux.experts`, moved to batch-first)."""
        cfg, execution = self.cfg, self.execution
        chex.assert_rank(tokens_BT, 2)
        b, t = tokens_BT.shape
        experts_LBTk = None
        if experts_BTLk is not None:
            chex.assert_shape(experts_BTLk, (b, t, cfg.num_hidden_layers, cfg.experts_per_token))
            experts_LBTk = jnp.moveaxis(experts_BTLk, 2, 0)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = constrain(rows(self.embedding[...], tokens_BT).astype(cfg.compute_dtype), RESIDUAL)
        graphdef, layer_state = nnx.split(self.layers)
        if cache is None:
            windows_L = jnp.asarray(cfg.layer_windows, jnp.int32)

            def body(x_BTD: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, MoEAux]:
                state, window, experts_BTk = xs
                y_BTD, aux, _ = nnx.merge(graphdef, state)(x_BTD, positions_BT, window,
                                                            segment_ids_BT, train=train,
                                                            execution=execution,
                                                            experts_BTk=experts_BTk)
                return constrain(y_BTD, RESIDUAL), aux

            if execution.remat:
                body = jax.checkpoint(body, prevent_cse=False)
            x, aux = jax.lax.scan(body, x, (layer_state, windows_L, experts_LBTk),
                                  unroll=execution.scan_unroll)
        else:
            if len(cache) != cfg.num_hidden_layers:
                raise ValueError(f"cache has {len(cache)} layers: expected num_hidden_layers="
                                 f"{cfg.num_hidden_layers} (build it with init_cache)")
            auxes, new_cache = [], []
            for i, layer_cache in enumerate(cache):
                state = (layers[i] if layers is not None else
                         _layer_slice(layer_state, i, x if plan().layer_slice_barrier else None))
                block = nnx.merge(graphdef, state)
                x, aux, layer_cache = block(
                    x, positions_BT, cfg.layer_window(i), segment_ids_BT, layer_cache,
                    train=train, execution=execution,
                    experts_BTk=None if experts_LBTk is None else experts_LBTk[i])
                x = constrain(x, RESIDUAL)
                auxes.append(aux)
                new_cache.append(layer_cache)
            aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
            cache = tuple(new_cache)
        chex.assert_shape(x, (b, t, cfg.hidden_size))
        return self.norm(x), aux, cache

    def layer_states(self) -> tuple[nnx.State, ...]:
        """Each layer's slice of the stacked layer weights, one state per layer."""
        return tuple(self.layer_state(i) for i in range(self.cfg.num_hidden_layers))

    def layer_state(self, i: int, *, after: jax.Array | None = None) -> nnx.State:
        """Layer i's slice of the stacked layer weights (`_layer_slice`)."""
        return _layer_slice(nnx.split(self.layers)[1], i, after)

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        return logits(h_BTD, self.unembedding[...], self.cfg.compute_dtype)

    def cross_entropy_sum(self, h_BTD: jax.Array, targets_BT: jax.Array,
                          weights_BT: jax.Array | None = None) -> jax.Array:
        """sum_t weights_t * nll_t of `logits(h)`, without materialising [B, T, V] logits
        (model/unembed_loss.py): what training and evaluation call."""
        return cross_entropy_sum(h_BTD, self.unembedding[...], targets_BT, weights_BT,
                                 dtype=self.cfg.compute_dtype,
                                 chunk_tokens=self.execution.loss_chunk_tokens,
                                 group_chunks=self.execution.loss_group_chunks)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
        *,
        train: bool = False,
        return_aux: bool = False,
        experts_BTLk: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, MoEAux]:
        h, aux, _ = self.hidden_states(tokens_BT, positions_BT, segment_ids_BT, train=train,
                                       experts_BTLk=experts_BTLk)
        logits = self.logits(h)
        return (logits, aux) if return_aux else logits


def init_model(cfg: ModelConfig, seed: int = 0, *,
               execution: ExecutionConfig = ExecutionConfig()) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), execution=execution)


def abstract_model(cfg: ModelConfig, *,
                   execution: ExecutionConfig = ExecutionConfig()) -> Transformer:
    """The model with ShapeDtypeStruct leaves: shapes and counts without allocating memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0), execution=execution))


def _layer_slice(layer_state: nnx.State, i: int, after: jax.Array | None) -> nnx.State:
    """Layer i's slice of the stacked layer weights `layer_state`. `after`: the layer's input,
    to which an optimization barrier ties the index (XLA cannot see that it is still i), so the
    slice is taken where the layer runs. Taken with a constant index inside a decode loop, the
    slices are loop-invariant, and while-loop invariant code motion hoists them out of the loop
    as copies: every layer's weights a second time, live for the whole loop (docs/scaling.md).
    libtpu can drop the barrier in a sharded program before that pass runs (it did for
    gpt-oss-120b on v5e-8), so the inference programs of XLA:TPU and XLA:CPU compile without that
    pass (`runtime.backend.PLANS`' inference options); the barrier stays for XLA:GPU, which
    keeps the pass (its programs were not measured), and for XLA:TPU."""
    if after is not None:
        i, _ = jax.lax.optimization_barrier((jnp.asarray(i, jnp.int32), after))
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                        layer_state)
