"""The pure training and evaluation steps: objective, AdamW update, gradient accumulation.

Shapes: B global batch, A accumulation steps, M = B / A microbatch, T seq_len, V vocab,
L layers, E experts.

`train_step(state, batch) -> (state, metrics)` is a pure function; `compile_steps` compiles it
(and `eval_step`) with explicit in/out shardings and a donated state, so the same step runs on
one CPU or a mesh. The params it does not train (LoRA's base, packed experts) go in beside the
state, neither donated nor returned (`TrainStep`): a step that returned them would write a copy
of each one whenever donation cannot alias its buffer, as on CPU, where the loader's arrays are
zero-copy views of host memory (QLoRA of gpt-oss-20b: 12.8 GiB more a step).
"""

from __future__ import annotations

import dataclasses
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

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model import Transformer
from llm_jax.model.params import TRAINABLE
from llm_jax.parallel.sharding import (
    batch_sharding,
    check_divisible,
    logical_axes,
    replicated,
    state_shardings,
    with_mesh,
)
from llm_jax.training import faults

# The model's matrices get weight decay; norms, biases, sinks and LoRA adapters do not.
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


ModelFn = Callable[..., nnx.Module]  # called as model_fn(rngs=nnx.Rngs(...))


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int,
               model_fn: ModelFn | None = None, trainable: Any = TRAINABLE, *,
               execution: ExecutionConfig = ExecutionConfig()) -> TrainState:
    """Fresh params from `model_fn` (default: the Transformer running as `execution` says);
    optimizer state only for the `trainable` ones (training/finetune.py: the LoRA adapters)."""
    model = (model_fn or functools.partial(Transformer, cfg, execution=execution))(
        rngs=nnx.Rngs(params=seed))
    params = nnx.state(model, nnx.Param)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(nnx.filter_state(params, trainable)))


def target_mask(batch: Batch) -> jax.Array:
    """float32 [B, T]: 1 for targets the loss counts, 0 for padding (segment id 0) and for
    targets a `loss_mask` drops (SFT: everything but the assistant's tokens).

    Packed batches (llm_jax.data) never hold a target from another document, so padding is
    all the segments mask; a batch without segment ids or loss mask counts every target.
    """
    mask = jnp.ones(batch["targets"].shape, jnp.float32)
    if "segment_ids" in batch:
        mask = mask * (batch["segment_ids"] > 0)
    if "loss_mask" in batch:
        mask = mask * batch["loss_mask"].astype(jnp.float32)
    return mask


# An objective: (model, batch, train config, num_targets) -> (loss, metrics), differentiated
# by the step. `num_targets` is the global batch's counted targets / grad_accum_steps, so that
# losses summed over a microbatch's targets and divided by it add up to the batch's mean; an
# objective that normalises otherwise (RL's, DPO's) ignores it and its microbatch losses are
# averaged. Metrics must hold "total_loss" (the value the step checks for finiteness).
Objective = Callable[[Any, Batch, ml_collections.ConfigDict, jax.Array],
                     tuple[jax.Array, dict[str, jax.Array]]]


def lm_objective(model: Any, batch: Batch, train: ml_collections.ConfigDict,
                 num_targets: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy summed over counted targets / `num_targets` (so microbatches add up to the
    global batch's mean), + weighted MoE auxiliary losses (Switch load balancing, z-loss)."""
    h_BTD, aux, _ = model.hidden_states(batch["inputs"], batch.get("positions"),
                                        batch.get("segment_ids"), train=True)
    ce = model.cross_entropy_sum(h_BTD, batch["targets"], target_mask(batch)) / num_targets
    lb = aux.load_balancing_loss.mean()
    z = aux.router_z_loss.mean()
    loss = ce + train.load_balancing_loss_weight * lb + train.router_z_loss_weight * z
    metrics = {"loss": ce, "total_loss": loss, "load_balancing_loss": lb, "router_z_loss": z,
               "expert_load": aux.expert_load, "drop_fraction": aux.drop_fraction.mean()}
    return loss, metrics


def loss_fn(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: Batch,
    train: ml_collections.ConfigDict,
    num_targets: jax.Array,
    objective: Objective = lm_objective,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`objective` (default: the language-model loss) of the model these params make."""
    return objective(nnx.merge(graphdef, params), batch, train, num_targets)


def split_frozen(state: TrainState, trainable: Any = TRAINABLE) -> tuple[TrainState, nnx.State]:
    """(the state with only its `trainable` params, the other params): works on a state of
    arrays, abstract values or shardings alike."""
    trained, frozen = state.params.split(trainable, ...)
    return state.replace(params=trained), frozen


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    train: ml_collections.ConfigDict,
    trainable: Any = TRAINABLE,
    objective: Objective = lm_objective,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update of `objective` from `grad_accum_steps` microbatches of the global
    batch; only the `trainable` params get gradients and updates (the rest is frozen)."""
    trained, frozen = split_frozen(state, trainable)
    new, metrics = train_step_frozen_apart(trained, frozen, batch, graphdef=graphdef, tx=tx,
                                           train=train, objective=objective)
    return new.replace(params=nnx.merge_state(new.params, frozen)), metrics


def train_step_frozen_apart(
    state: TrainState,
    frozen: nnx.State,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    train: ml_collections.ConfigDict,
    objective: Objective = lm_objective,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`train_step` on a state whose params are the trained ones only, the others in `frozen`
    (read, never returned: see `TrainStep`); returns the state the same way."""
    trained = state.params
    loss = lambda p, batch, num_targets: loss_fn(nnx.merge_state(p, frozen), graphdef, batch,  # noqa: E731
                                                 train, num_targets, objective)
    loss = faults.poison_loss(loss, state.step, train.get("inject_nan_at_step", -1))
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    a = train.grad_accum_steps
    # Each microbatch's summed cross-entropy over 1/a of the batch's targets: their mean over
    # the a microbatches is the batch's mean, however the targets fall between them.
    per_micro = jnp.maximum(target_mask(batch).sum(), 1.0) / a
    if a == 1:
        (_, metrics), grads = grad_fn(trained, batch=batch, num_targets=per_micro)
    else:
        micro = jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)

        def accumulate(carry, mb):
            (_, m), g = grad_fn(trained, batch=mb, num_targets=per_micro)
            return jax.tree.map(jnp.add, carry, (g, m)), None

        (_, metrics_shape), grads_shape = jax.eval_shape(
            grad_fn, trained, batch=jax.tree.map(lambda x: x[0], micro),
            num_targets=per_micro)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, metrics_shape))
        (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
        grads, metrics = jax.tree.map(lambda x: x / a, (grads, metrics))
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, trained)
    params = optax.apply_updates(trained, updates)
    # One scalar the loop reads per step (training/loop.py): a non-finite update is never saved.
    finite = jnp.isfinite(metrics["total_loss"]) & jnp.isfinite(grad_norm)
    if train.get("skip_nonfinite_updates", False):  # keep the old params and moments
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (trained, state.opt_state))
    metrics = {**metrics, "grad_norm": grad_norm, "finite": finite,
               "lr": learning_rate_schedule(train)(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """The jitted step, called like `train_step` with a whole TrainState: the params it does not
    train are split off and passed as an argument the step neither donates nor returns, then
    put back beside the updated ones (the same arrays). `lower` takes the same arguments."""

    jitted: Any  # jit of train_step_frozen_apart(state, frozen, batch)
    trainable: Any

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        trained, frozen = split_frozen(state, self.trainable)
        new, metrics = self.jitted(trained, frozen, batch)
        return new.replace(params=nnx.merge_state(new.params, frozen)), metrics

    def lower(self, state: Any, batch: Any) -> Any:
        return self.jitted.lower(*split_frozen(state, self.trainable), batch)

    def compile(self, state: Any, batch: Any) -> TrainStep:
        """Compiled ahead of time for these (possibly abstract) arguments; called the same way."""
        return dataclasses.replace(self, jitted=self.lower(state, batch).compile())

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def jit_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                   train: ml_collections.ConfigDict, trainable: Any = TRAINABLE,
                   mesh: Mesh | None = None, state_sharding: Any = None,
                   batch_sharding: Any = None,
                   objective: Objective = lm_objective) -> TrainStep:
    """`train_step` of `objective` jitted with its state donated and its frozen params apart
    (`TrainStep`); with `state_sharding`, explicit in/out shardings."""
    fn = with_mesh(functools.partial(train_step_frozen_apart, graphdef=graphdef, tx=tx,
                                     train=train, objective=objective), mesh)
    kwargs: dict[str, Any] = {}
    if state_sharding is not None:
        trained_sh, frozen_sh = split_frozen(state_sharding, trainable)
        kwargs = dict(in_shardings=(trained_sh, frozen_sh, batch_sharding),
                      out_shardings=(trained_sh, replicated(mesh)))
    return TrainStep(jax.jit(fn, donate_argnums=(0,), **kwargs), trainable)


def eval_step(params: nnx.State, batch: Batch, *, graphdef: nnx.GraphDef) -> dict[str, jax.Array]:
    """Sums over the batch's counted targets: negative log-likelihood (nats), targets, and
    their UTF-8 bytes (padding counts for nothing)."""
    model = nnx.merge(graphdef, params)
    h_BTD, _, _ = model.hidden_states(batch["inputs"], batch.get("positions"),
                                      batch.get("segment_ids"))
    mask_BT = target_mask(batch)
    out = {"nll": model.cross_entropy_sum(h_BTD, batch["targets"], mask_BT),
           "tokens": mask_BT.sum()}
    if "target_bytes" in batch:
        out["bytes"] = (batch["target_bytes"] * mask_BT).sum()
    return out


class Steps(flax.struct.PyTreeNode):
    """The compiled steps and the shardings they were compiled for."""

    train: TrainStep = flax.struct.field(pytree_node=False)
    eval: Callable = flax.struct.field(pytree_node=False)
    init: Callable = flax.struct.field(pytree_node=False)
    state_sharding: Any = flax.struct.field(pytree_node=False)
    batch_sharding: Any = flax.struct.field(pytree_node=False)
    abstract_state: Any = flax.struct.field(pytree_node=False)


def compile_steps(cfg: ModelConfig, train: ml_collections.ConfigDict, mesh: Mesh,
                  seed: int, model_fn: ModelFn | None = None,
                  trainable: Any = TRAINABLE, *,
                  execution: ExecutionConfig = ExecutionConfig(),
                  objective: Objective = lm_objective,
                  evaluation: Callable[..., dict[str, jax.Array]] = eval_step) -> Steps:
    """Jitted init/train/eval with shardings derived from the params' logical axes;
    `model_fn`/`trainable`/`execution` as in init_state (LoRA: training/finetune.py); the
    train step minimises `objective` (default: the language-model loss), the eval step sums
    `evaluation(params, batch, graphdef=...)` (default: `eval_step`'s)."""
    if train.batch_size % train.grad_accum_steps:
        raise ValueError(f"train.batch_size={train.batch_size} is not divisible by "
                         f"train.grad_accum_steps={train.grad_accum_steps}")
    tx = make_optimizer(train)
    model_fn = model_fn or functools.partial(Transformer, cfg, execution=execution)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_fn(rngs=nnx.Rngs(params=0))))
    init_fn = functools.partial(init_state, cfg, tx, seed, model_fn, trainable)
    abstract = jax.eval_shape(init_fn)
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
    init = jax.jit(with_mesh(init_fn, mesh), out_shardings=state_sh)
    step = jit_train_step(graphdef, tx, train, trainable, mesh, state_sh, batch_sh, objective)
    evaluate = jax.jit(with_mesh(functools.partial(evaluation, graphdef=graphdef), mesh),
                       in_shardings=(state_sh.params, batch_sh), out_shardings=rep)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sh)
    return Steps(train=step, eval=evaluate, init=init, state_sharding=state_sh,
                 batch_sharding=batch_sh, abstract_state=abstract)
