"""The pure training and evaluation steps: loss, AdamW update, gradient accumulation.

Shapes: B global batch, A accumulation steps, M = B / A microbatch, T seq_len, V vocab,
L layers, E experts.

`train_step(state, batch) -> (state, metrics)` is a pure function; `jit_train_step` compiles it
with explicit in/out shardings and a donated state, so the same step runs on one CPU or a mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from llm_jax.training import faults
from llm_jax.config import ModelConfig
from llm_jax.model import Transformer
from llm_jax.parallel.sharding import (batch_sharding, check_divisible, logical_axes, replicated,
                              state_shardings, with_mesh)

# Matrices get weight decay; norms, biases and sinks do not.
DECAYED = frozenset({"embedding", "unembedding", "q_proj", "k_proj", "v_proj", "o_proj",
                     "router", "gate_up_proj", "down_proj"})

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def _leaf_name(path: tuple[Any, ...]) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if isinstance(n, str) and n != "value"]
    return names[-1] if names else ""


def decay_mask(params: nnx.State) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, _: _leaf_name(p) in DECAYED, params)


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `learning_rate`, cosine decay to `learning_rate * min_lr_ratio`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.num_steps, train.warmup_steps + 1),
        end_value=train.learning_rate * train.min_lr_ratio,
    )


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(train.grad_clip_norm),
        optax.adamw(learning_rate_schedule(train), b1=train.b1, b2=train.b2,
                    weight_decay=train.weight_decay, mask=decay_mask),
    )


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> TrainState:
    params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=seed)), nnx.Param)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def loss_fn(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: Batch,
    train: ml_collections.ConfigDict,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy + weighted MoE auxiliary losses (Switch load balancing, router z-loss)."""
    model = nnx.merge(graphdef, params)
    h_BTD, aux, _ = model.hidden_states(batch["inputs"], train=True)
    ce = model.cross_entropy_sum(h_BTD, batch["targets"]) / batch["targets"].size
    lb = aux.load_balancing_loss.mean()
    z = aux.router_z_loss.mean()
    loss = ce + train.load_balancing_loss_weight * lb + train.router_z_loss_weight * z
    metrics = {"loss": ce, "total_loss": loss, "load_balancing_loss": lb, "router_z_loss": z,
               "expert_load": aux.expert_load, "drop_fraction": aux.drop_fraction.mean()}
    return loss, metrics


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    train: ml_collections.ConfigDict,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from `grad_accum_steps` microbatches of the global batch."""
    loss = functools.partial(loss_fn, graphdef=graphdef, train=train)
    loss = faults.poison_loss(loss, state.step, train.get("inject_nan_at_step", -1))
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    a = train.grad_accum_steps
    if a == 1:
        (_, metrics), grads = grad_fn(state.params, batch=batch)
    else:
        micro = jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)

        def accumulate(carry, mb):
            (_, m), g = grad_fn(state.params, batch=mb)
            return jax.tree.map(jnp.add, carry, (g, m)), None

        (_, metrics_shape), grads_shape = jax.eval_shape(
            grad_fn, state.params, batch=jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, metrics_shape))
        (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
        grads, metrics = jax.tree.map(lambda x: x / a, (grads, metrics))
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # One scalar the loop reads per step (llm_jax.train): a non-finite update is never saved.
    finite = jnp.isfinite(metrics["total_loss"]) & jnp.isfinite(grad_norm)
    if train.get("skip_nonfinite_updates", False):  # keep the old params and moments
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
    metrics = {**metrics, "grad_norm": grad_norm, "finite": finite,
               "lr": learning_rate_schedule(train)(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: nnx.State, batch: Batch, *, graphdef: nnx.GraphDef) -> dict[str, jax.Array]:
    """Sums over the batch: negative log-likelihood (nats), tokens, and target UTF-8 bytes."""
    model = nnx.merge(graphdef, params)
    h_BTD, _, _ = model.hidden_states(batch["inputs"])
    nll = model.cross_entropy_sum(h_BTD, batch["targets"])
    out = {"nll": nll, "tokens": jnp.asarray(batch["targets"].size, jnp.float32)}
    if "target_bytes" in batch:
        out["bytes"] = batch["target_bytes"].sum().astype(jnp.float32)
    return out


class Steps(flax.struct.PyTreeNode):
    """The compiled steps and the shardings they were compiled for."""

    train: Callable = flax.struct.field(pytree_node=False)
    eval: Callable = flax.struct.field(pytree_node=False)
    init: Callable = flax.struct.field(pytree_node=False)
    state_sharding: Any = flax.struct.field(pytree_node=False)
    batch_sharding: Any = flax.struct.field(pytree_node=False)
    abstract_state: Any = flax.struct.field(pytree_node=False)


def compile_steps(cfg: ModelConfig, train: ml_collections.ConfigDict, mesh: Mesh,
                  seed: int) -> Steps:
    """Jitted init/train/eval with shardings derived from the params' logical axes."""
    if train.batch_size % train.grad_accum_steps:
        raise ValueError(f"train.batch_size={train.batch_size} is not divisible by "
                         f"train.grad_accum_steps={train.grad_accum_steps}")
    tx = make_optimizer(train)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))
    abstract = jax.eval_shape(lambda: init_state(cfg, tx, seed))
    state_sh = state_shardings(abstract, mesh)
    check_divisible(abstract.params, state_sh.params, what="params")
    batch_sh = batch_sharding(mesh)
    micro = train.batch_size // train.grad_accum_steps
    axes = {a: mesh.shape[a] for a in logical_axes(("batch",))}
    if micro % math.prod(axes.values()):
        raise ValueError(
            f"train.batch_size={train.batch_size} / grad_accum_steps={train.grad_accum_steps} = "
            f"{micro} sequences per microbatch is not divisible by the batch's mesh axes "
            f"{'x'.join(f'{a}={n}' for a, n in axes.items())} = {math.prod(axes.values())}")
    rep = replicated(mesh)
    # Traced under the mesh, so activation constraints and the expert-parallel MoE see it.
    init = jax.jit(with_mesh(lambda: init_state(cfg, tx, seed), mesh), out_shardings=state_sh)
    step = jax.jit(with_mesh(functools.partial(train_step, graphdef=graphdef, tx=tx, train=train),
                             mesh),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
                   donate_argnums=(0,))
    evaluate = jax.jit(with_mesh(functools.partial(eval_step, graphdef=graphdef), mesh),
                       in_shardings=(state_sh.params, batch_sh), out_shardings=rep)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sh)
    return Steps(train=step, eval=evaluate, init=init, state_sharding=state_sh,
                 batch_sharding=batch_sh, abstract_state=abstract)
