"""The RL loop: GRPO-family training with verifiable rewards, run by `python -m llm_jax.train`
when the run config's `rl.rewards` is set (training/loop.py dispatches here).

Shapes: P prompts a step (rl.prompts_per_step), G completions per prompt (rl.group_size),
B = P G rows, T = rl.max_prompt_tokens + rl.max_new_tokens - 1 positions per row.

One RL step: the task's next P train prompts (`task.example("train", i)`, i from the prompt index
kept in the checkpoint) rendered with the tokenizer's chat template up to the assistant's turn;
G completions of each sampled by the engine (inference/engine.py) on the current weights, each
token's log-prob and MoE routing recorded (training/rollouts.py); each completion scored by the
weighted rewards (training/rewards.py) on its reply (harmony's final channel on a harmony
tokenizer); group advantages (training/policy_loss.py); the rollout policy's log-probs computed
once by the trainer (`old_logp`, the routing replayed with rl.replay) and the reference's when
rl.beta > 0; then rl.updates_per_rollout optimizer steps of the policy objective on that one
batch (training/rl_step.py), each with ratios against the rollout. The engine then decodes with
the updated arrays (`Engine.set_weights`: no copy, bar the per-layer slices a platform that
slices before decoding takes). Every row is padded to T, so the step compiles once.

The reference policy (rl.beta > 0) is the base with its adapters zeroed under LoRA (no second
copy), else a frozen copy of the initial params. The MoE runs dropless: a dispatch that drops
tokens in training (capacity, expert_parallel*) would drop tokens the sampler did not, and is
refused unless rl.allow_dropping_dispatch.

Resume is exact: params, optimizer, step and prompt index are restored, and step n's rollout
draws from a seed derived from (seed, n), so a resumed run samples, scores and updates as the
uninterrupted one would. A checkpoint stores the task's identity and the rewards; a resumed run
with either changed is refused by name. The tokenizer is the copy the first start made in
WORKDIR/tokenizer/ (a changed rl.tokenizer is refused; a deleted one is not needed). A reward
that raises or returns a non-finite value stops the run naming it (RewardError); nothing saved
is touched.

Metrics (metrics.jsonl, TensorBoard), per logged step: reward_mean / reward_std, reward_<name>
(each reward's unweighted mean), pass_rate (share of completions whose weighted reward reaches
rl.pass_threshold), eval_pass_rate (greedy, on rl.eval_examples of the eval split), kl,
clip_fraction, ratio_mean, entropy (the mean of -log p of the sampled tokens under the sampler: a
one-sample estimate of the policy's entropy), response_length, truncated (share cut at
rl.max_new_tokens), sampler_logp_gap (mean |log p trainer - log p sampler|: the replay
mismatch), informative_groups / uninformative_groups, rollout_tokens_per_sec, rollout_share
(of the step's time), update_to_first_token (seconds from the updated weights to the next
rollout's first token), step_time; plus the update's loss, grad_norm and lr. The reward curve is
drawn to WORKDIR/rewards.png at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from contextlib import closing
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from llm_jax.config import ModelConfig
from llm_jax.data.hf_tokenizer import run_tokenizer
from llm_jax.data.tasks import Example, Task, make_task
from llm_jax.execution import ExecutionConfig
from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import EngineConfig, SamplingParams
from llm_jax.inference.tokenizer import CheckpointTokenizer, load_tokenizer
from llm_jax.model.lora import LoRAParam
from llm_jax.parallel import distributed
from llm_jax.parallel.sharding import mesh_from_config, with_mesh
from llm_jax.training import faults, finetune
from llm_jax.training.metrics import MetricsWriter, read_metrics
from llm_jax.training.plots import plot_rewards
from llm_jax.training.policy_loss import group_advantages, informative_groups
from llm_jax.training.preemption import Interrupted, StopRequest, save_and_stop
from llm_jax.training.rewards import parse_rewards, reply_of, score
from llm_jax.training.rl_step import completion_logprobs, rl_objective
from llm_jax.training.rollouts import Completion, rl_batch, rollout
from llm_jax.training.run_config import execution_config, rl_loss_config, tokenizer_source
from llm_jax.training.step import Steps, TrainState, compile_steps, make_optimizer
from llm_jax.weights.checkpointing import Checkpointer

# Dispatches that drop a token when its expert's slots are full (training calls only).
DROPPING_DISPATCHES = ("capacity", "expert_parallel", "expert_parallel_gmm")


def train_rl(cfg: ml_collections.ConfigDict, workdir: str, stop: StopRequest) -> dict[str, Any]:
    """Runs (or resumes) RL in `workdir` (validated and held by training/loop.train); returns
    the last logged metrics. Raises `Interrupted` after saving when a stop signal arrives,
    RewardError on a failing reward, FloatingPointError on a non-finite update."""
    run = setup(cfg, workdir, stop)
    with closing(run.ckpt), closing(run.writer):  # finish reads metrics.jsonl, not the writer
        last = _loop(run, stop)
    finish(run)
    return last


# ------------------------------------------------------------------------------ setup


@dataclasses.dataclass
class RLRun:
    """An RL run's pieces, built once by `setup`; `progress` is what the loop changes."""

    cfg: ml_collections.ConfigDict
    workdir: str
    mcfg: ModelConfig
    ckpt: Checkpointer
    steps: Steps
    graphdef: nnx.GraphDef
    task: Task
    rewards: list[tuple[str, float]]
    tokenizer: CheckpointTokenizer
    engine: Engine
    sampling: SamplingParams
    length: int  # T: positions of every row of the batch
    rollout_logp: Any  # jitted (params, batch) -> log p of each target [B, T]
    reference_logp: Any  # the same under the reference policy, or None (rl.beta = 0)
    reference_params: Any  # the frozen initial params (full fine-tuning with rl.beta > 0)
    eval_prompts: list[tuple[Example, list[int]]]
    writer: MetricsWriter
    start: int
    config_json: dict[str, Any]
    progress: RLProgress


@dataclasses.dataclass
class RLProgress:
    """What the loop carries from step to step (the first three are saved)."""

    state: TrainState
    prompt_index: int  # the next train example
    skipped: int  # updates skipped: non-finite, or no informative group under dynamic sampling
    step: int = 0  # RL steps done
    last_saved: int = 0
    sync_seconds: float | None = None  # the last hand-over of weights to the engine
    last: dict[str, Any] = dataclasses.field(default_factory=dict)
    samples: list[str] = dataclasses.field(default_factory=list)


def setup(cfg: ml_collections.ConfigDict, workdir: str, stop: StopRequest) -> RLRun:
    """The task, rewards, tokenizer, compiled step, engine and the restored (or new) state,
    each refused by name before the expensive parts."""
    rc = cfg.rl
    if jax.process_count() > 1:
        raise ValueError(f"RL runs in one process (its rollouts are driven by this process's "
                         f"engine); this run has {jax.process_count()}: use one host's devices")
    mesh = mesh_from_config(cfg.mesh)
    ckpt = Checkpointer(workdir, max_to_keep=cfg.checkpoint.max_to_keep,
                        async_save=cfg.checkpoint.async_save, cleanup_tmp=True,
                        checksums=cfg.checkpoint.checksums)
    latest, mcfg = finetune.run_model_config(cfg, ckpt)
    execution = dropless_execution(execution_config(cfg), rc)
    task, rewards = make_task(cfg.task), parse_rewards(rc.rewards)
    identity = run_identity(task, rewards)
    if latest is not None:
        check_same_task(ckpt.restore_config(latest), identity, ckpt.directory)
    tokenizer = _tokenizer(cfg, mcfg, workdir, fresh=latest is None)
    context = mcfg.initial_context_length * max(mcfg.rope_scaling_factor, 1.0)
    length = rc.max_prompt_tokens + rc.max_new_tokens
    if length > context:
        raise ValueError(f"rl.max_prompt_tokens={rc.max_prompt_tokens} + rl.max_new_tokens="
                         f"{rc.max_new_tokens} = {length} positions: more than the model's "
                         f"context ({context:.0f})")
    eval_prompts = [(ex, render_prompt(tokenizer, ex, "eval", rc.max_prompt_tokens))
                    for ex in eval_examples(task, rc.eval_examples)]
    if stop.signum:
        raise Interrupted(f"stopped by signal {stop.signum} before training", -1, stop.signum)
    loss_cfg = rl_loss_config(rc)
    build = finetune.model_fn(mcfg, cfg.lora, cfg.seed, execution)
    steps = compile_steps(mcfg, update_train_config(cfg), mesh, cfg.seed, build,
                          finetune.trainable(cfg.lora),
                          objective=rl_objective(loss_cfg, temperature=rc.temperature))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(rngs=nnx.Rngs(params=0))))
    state, saved = _initial_state(cfg, mcfg, ckpt, steps, latest)
    start = int(saved.get("rl_step", 0))
    reference_params = None
    if loss_cfg.beta > 0 and not cfg.lora.rank:  # a frozen copy of the initial params
        reference_params = (jax.tree.map(jnp.copy, state.params) if start == 0
                            else initial_params(cfg, mcfg, steps))
    logp = functools.partial(_logprobs, graphdef=graphdef, temperature=rc.temperature)
    shardings = dict(in_shardings=(steps.state_sharding.params, steps.batch_sharding),
                     out_shardings=steps.batch_sharding)
    rollout_logp = jax.jit(with_mesh(logp, mesh), **shardings)
    reference_logp = None
    if loss_cfg.beta > 0:
        reference_logp = jax.jit(with_mesh(functools.partial(
            _reference_logprobs, logp=logp, lora=bool(cfg.lora.rank)), mesh), **shardings)
    slots = rc.engine_slots or rc.prompts_per_step * rc.group_size
    engine = Engine(nnx.merge(graphdef, state.params),
                    EngineConfig(slots=slots, max_len=length, max_queue=max(64, slots),
                                 max_prefill=min(rc.engine_max_prefill, slots), record=True))
    sampling = SamplingParams(max_new_tokens=rc.max_new_tokens, temperature=rc.temperature,
                              top_p=rc.top_p, stop_ids=tokenizer.stop_ids)
    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    writer.truncate_after(start)
    logging.info("RL: task %s, rewards %s, %d prompts x %d completions a step, %d positions a "
                 "row; resuming at step %d", task.name, rewards, rc.prompts_per_step,
                 rc.group_size, length - 1, start)
    return RLRun(
        cfg=cfg, workdir=workdir, mcfg=mcfg, ckpt=ckpt, steps=steps, graphdef=graphdef,
        task=task, rewards=rewards, tokenizer=tokenizer, engine=engine, sampling=sampling,
        length=length - 1, rollout_logp=rollout_logp, reference_logp=reference_logp,
        reference_params=reference_params, eval_prompts=eval_prompts, writer=writer,
        start=start, config_json=cfg.to_dict() | {"model": mcfg.to_dict(),
                                                  "execution": execution.to_dict(), **identity},
        progress=RLProgress(state=state, prompt_index=int(saved.get("prompt_index", 0)),
                            skipped=int(saved.get("skipped_updates", 0)), step=start,
                            last_saved=start))


def dropless_execution(execution: ExecutionConfig, rc: ml_collections.ConfigDict
                       ) -> ExecutionConfig:
    """`execution`, refused when its MoE dispatch drops tokens in training (unless allowed)."""
    if execution.moe_dispatch in DROPPING_DISPATCHES and not rc.allow_dropping_dispatch:
        raise ValueError(
            f"execution.moe_dispatch={execution.moe_dispatch!r} drops tokens when an expert's "
            "slots are full, so RL would train on routes the sampler never took: use a "
            "dropless dispatch (auto, dense, ragged, gather, blocked, gmm), or set "
            "rl.allow_dropping_dispatch=True to accept the mismatch")
    return execution


def update_train_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The train section as the RL update reads it: a batch of P G completions, and a schedule
    over optimizer updates (rl.updates_per_rollout per RL step)."""
    tc, rc = cfg.train.copy_and_resolve_references(), cfg.rl
    u = rc.updates_per_rollout
    tc.batch_size = rc.prompts_per_step * rc.group_size
    tc.num_steps, tc.warmup_steps = tc.num_steps * u, tc.warmup_steps * u
    return tc


def run_identity(task: Task, rewards: list[tuple[str, float]]) -> dict[str, Any]:
    """What a resumed run must share with its checkpoints: the task and the rewards (as JSON
    reads them back)."""
    return json.loads(json.dumps({"task_identity": task.identity(),
                                  "rl_rewards": [[n, w] for n, w in rewards]}))


def check_same_task(saved: dict[str, Any], identity: dict[str, Any], directory: str) -> None:
    """Refuses to resume with another task or other rewards, naming what changed."""
    changed = []
    old_task, new_task = saved.get("task_identity", {}), identity["task_identity"]
    for k in sorted(set(old_task) | set(new_task)):
        if old_task.get(k) != new_task.get(k):
            changed.append(f"task {k}: saved {old_task.get(k)!r} vs requested {new_task.get(k)!r}")
    if saved.get("rl_rewards") != identity["rl_rewards"]:
        changed.append(f"rl.rewards: saved {saved.get('rl_rewards')!r} vs requested "
                       f"{identity['rl_rewards']!r}")
    if changed:
        raise ValueError(f"the workdir's checkpoints ({directory}) were trained on another task "
                         f"or rewards ({'; '.join(changed)}); use a new --workdir, or the saved "
                         "config, to continue")


def _tokenizer(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, workdir: str, *,
               fresh: bool) -> CheckpointTokenizer:
    """rl.tokenizer's (default train.init_from's) tokenizer, read from the run's copy in the
    workdir (llm_jax.data.hf_tokenizer.run_tokenizer), checked for a chat template and size."""
    source, field = tokenizer_source(cfg)
    if not source:
        raise ValueError("RL renders prompts with a chat template: set rl.tokenizer (or "
                         "train.init_from) to a directory holding tokenizer.json")
    path = run_tokenizer(workdir, source, field, fresh=fresh, write=jax.process_index() == 0)
    tokenizer = load_tokenizer(path)
    if tokenizer is None or not tokenizer.has_chat_template:
        raise ValueError(f"{field}={source!r} has no chat template (chat_template.jinja, "
                         "'chat_template' in tokenizer_config.json, or harmony's tokens): RL "
                         "renders the task's prompts as conversations")
    if tokenizer.vocab_size > mcfg.vocab_size:
        raise ValueError(f"{field}={source!r}: the tokenizer has {tokenizer.vocab_size} "
                         f"tokens, more than the model's vocab_size={mcfg.vocab_size}")
    if not tokenizer.stop_ids:
        logging.warning("%s=%r names no stop token: every completion runs to rl.max_new_tokens",
                        field, source)
    return tokenizer


def render_prompt(tokenizer: CheckpointTokenizer, example: Example, split: str,
                  max_tokens: int) -> list[int]:
    """The example's prompt as one user message, rendered up to the assistant's reply;
    refused, naming the example, when longer than `max_tokens`."""
    ids = tokenizer.encode(tokenizer.render([{"role": "user", "content": example.prompt}]))
    if len(ids) > max_tokens:
        raise ValueError(f"{split} example {example.id!r}: its rendered prompt has {len(ids)} "
                         f"tokens, more than rl.max_prompt_tokens={max_tokens}: raise it (the "
                         "rows grow with it) or shorten the task's prompts")
    return ids


def eval_examples(task: Task, n: int) -> list[Example]:
    size = task.size("eval")
    return [task.example("eval", i) for i in range(n if size is None else min(n, size))]


def _initial_state(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, ckpt: Checkpointer,
                   steps: Steps, latest: int | None) -> tuple[TrainState, dict[str, Any]]:
    """(train state, saved progress): the newest checkpoint that restores, else step 0 (from
    train.init_from when set)."""
    if latest is not None:
        latest, restored = ckpt.first_restorable(
            lambda s: (ckpt.restore(s, steps.abstract_state, None), ckpt.restore_progress(s)),
            move_bad=True)
    if latest is not None:
        logging.info("resumed from RL step %d in %s", latest, ckpt.directory)
        return restored
    ckpt.check_fresh_start(cfg.checkpoint.allow_fresh_start)
    if cfg.train.init_from:
        return finetune.initial_state(steps, make_optimizer(update_train_config(cfg)),
                                      cfg.train.init_from, mcfg, cfg.lora, cfg.seed), {}
    return steps.init(), {}


def initial_params(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, steps: Steps
                   ) -> nnx.State:
    """Step 0's params (train.init_from's, else the seed's initialisation), for a resumed run's
    reference policy."""
    if cfg.train.init_from:
        return finetune.initial_state(steps, make_optimizer(update_train_config(cfg)),
                                      cfg.train.init_from, mcfg, cfg.lora, cfg.seed).params
    return steps.init().params


def _logprobs(params: nnx.State, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
              temperature: float) -> jax.Array:
    """log p of each target under these params, as the objective computes it (its ratio is
    then exactly 1 on a batch's first update)."""
    return completion_logprobs(nnx.merge(graphdef, params), batch, temperature=temperature)[1]


def _reference_logprobs(params: nnx.State, batch: dict[str, jax.Array], *, logp: Any,
                        lora: bool) -> jax.Array:
    """log p under the reference policy: with LoRA the same params, adapters zeroed (their
    delta is then 0: the base exactly); else `params` are the frozen initial ones."""
    if lora:
        adapters, base = params.split(LoRAParam, ...)
        params = nnx.merge_state(jax.tree.map(jnp.zeros_like, adapters), base)
    return logp(params, batch)


# ------------------------------------------------------------------------------ the loop


def rollout_seed(seed: int, step: int) -> int:
    """Step `step`'s rollout seed: a function of the run's seed and the step only, so a resumed
    run samples what the uninterrupted one did."""
    return int(np.random.default_rng([seed, step]).integers(0, 2**31))


def _loop(run: RLRun, stop: StopRequest) -> dict[str, Any]:
    cfg, p = run.cfg, run.progress
    num_steps = cfg.train.num_steps
    bar = tqdm(total=num_steps, initial=run.start, disable=jax.process_index() != 0,
               dynamic_ncols=True, desc="rl")
    try:
        if run.start == 0 and run.eval_prompts:
            record = evaluate(run)
            run.writer.write(0, record)
            p.last = record
        for step in range(run.start, num_steps):
            if stop.should_stop(step, agree=step % cfg.train.log_every_steps == 0):
                break
            record = rl_step(run, step)
            done = p.step = step + 1
            if run.eval_prompts and (done == num_steps or cfg.rl.eval_every_steps
                                     and done % cfg.rl.eval_every_steps == 0):
                record |= evaluate(run)
            if done % cfg.train.log_every_steps == 0 or done == num_steps or \
                    done == run.start + 1 or "eval_pass_rate" in record:
                run.writer.write(done, record)
                p.last = record
                bar.set_postfix({k: f"{record[k]:.3g}" for k in
                                 ("reward_mean", "pass_rate", "eval_pass_rate", "kl")
                                 if k in record}, refresh=False)
            bar.update(1)
            run.ckpt.poll()
            if done % cfg.checkpoint.every_steps == 0 or done == num_steps:
                save(run, done)
        if stop.signum is not None:
            save_and_stop(stop, run.progress.step, run.progress.last_saved,
                          lambda step: save(run, step), run.ckpt, what="RL step")
    finally:
        bar.close()
    return p.last


def rl_step(run: RLRun, step: int) -> dict[str, Any]:
    """Step `step`: rollouts, rewards, log-probs, updates, weights to the engine; returns its
    metrics."""
    rc, p = run.cfg.rl, run.progress
    t0 = time.monotonic()
    examples = [run.task.example("train", p.prompt_index + i) for i in range(rc.prompts_per_step)]
    prompts = [render_prompt(run.tokenizer, ex, "train", rc.max_prompt_tokens) for ex in examples]
    t_rollout = time.monotonic()
    groups = rollout(run.engine, prompts, rc.group_size, run.sampling,
                     rollout_seed(run.cfg.seed, step))
    rollout_time = time.monotonic() - t_rollout
    rewards_PG, per_reward = score_groups(run, examples, groups)
    p.prompt_index += rc.prompts_per_step
    record = rollout_metrics(run, groups, rewards_PG, per_reward, rollout_time)
    if p.sync_seconds is not None:  # the weights' hand-over, then the wait for a first token
        first = min(c.first_token_at for g in groups for c in g)
        record["update_to_first_token"] = p.sync_seconds + first - t_rollout
    informative = np.asarray(informative_groups(jnp.asarray(rewards_PG)))
    if rc.dynamic_sampling and not informative.any():
        p.skipped += 1
        logging.info("RL step %d: every group's rewards are equal: no update (%d skipped so "
                     "far)", step + 1, p.skipped)
        p.sync_seconds = 0.0  # the engine's weights are still the current ones
        return record | {"skipped_updates": float(p.skipped), "step_time": time.monotonic() - t0}
    batch = make_batch(run, groups, rewards_PG, informative if rc.dynamic_sampling else None)
    record |= update(run, step, batch)
    t_sync = time.monotonic()
    run.engine.set_weights(nnx.merge(run.graphdef, p.state.params))
    p.sync_seconds = time.monotonic() - t_sync
    step_time = time.monotonic() - t0
    return record | {"step_time": step_time, "rollout_share": rollout_time / step_time,
                     "skipped_updates": float(p.skipped)}


def score_groups(run: RLRun, examples: list[Example], groups: list[list[Completion]]
                 ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(weighted rewards [P, G], each reward's values {name: [P, G]}); a reward that fails
    raises RewardError naming it and the example."""
    totals = np.zeros((len(groups), len(groups[0])), np.float32)
    per = {name: np.zeros_like(totals) for name, _ in run.rewards}
    for i, (ex, group) in enumerate(zip(examples, groups)):
        for j, c in enumerate(group):
            totals[i, j], values = score(run.rewards, ex, reply_of(run.tokenizer, c.tokens))
            for name, v in values.items():
                per[name][i, j] = v
    return totals, per


def rollout_metrics(run: RLRun, groups: list[list[Completion]], rewards_PG: np.ndarray,
                    per_reward: dict[str, np.ndarray], rollout_time: float) -> dict[str, Any]:
    rows = [c for g in groups for c in g]
    tokens = sum(len(c.tokens) for c in rows)
    informative = int(np.asarray(informative_groups(jnp.asarray(rewards_PG))).sum())
    return {
        "reward_mean": float(rewards_PG.mean()), "reward_std": float(rewards_PG.std()),
        **{f"reward_{name}": float(v.mean()) for name, v in per_reward.items()},
        "pass_rate": float((rewards_PG >= run.cfg.rl.pass_threshold).mean()),
        "response_length": tokens / len(rows),
        "truncated": float(np.mean([c.finish_reason == "length" for c in rows])),
        "entropy": -float(np.sum([np.sum(c.logprobs) for c in rows])) / max(tokens, 1),
        "informative_groups": float(informative),
        "uninformative_groups": float(len(groups) - informative),
        "rollout_tokens_per_sec": tokens / max(rollout_time, 1e-9),
        "rollout_time": rollout_time,
    }


def make_batch(run: RLRun, groups: list[list[Completion]], rewards_PG: np.ndarray,
               keep_P: np.ndarray | None) -> dict[str, jax.Array]:
    """The update's batch on the mesh: the rows (rollouts.rl_batch), their advantages, the
    rollout policy's log-probs (and the reference's); groups outside `keep_P` are masked out."""
    rc, p = run.cfg.rl, run.progress
    advantages = np.asarray(group_advantages(jnp.asarray(rewards_PG), rl_loss_config(rc)))
    host = rl_batch(groups, advantages, run.length)
    if keep_P is not None:
        host["completion_mask"] *= np.repeat(keep_P, rc.group_size)[:, None]
    if not rc.replay:
        del host["experts"]
    batch = distributed.global_batch(host, run.steps.batch_sharding)
    batch["old_logp"] = run.rollout_logp(p.state.params, batch)
    if run.reference_logp is not None:
        params = p.state.params if run.reference_params is None else run.reference_params
        batch["ref_logp"] = run.reference_logp(params, batch)
    return batch


def update(run: RLRun, step: int, batch: dict[str, jax.Array]) -> dict[str, float]:
    """rl.updates_per_rollout optimizer steps on `batch`; their metrics averaged, but lr (the
    last) and sampler_logp_gap (the first: later ones add the updates' own change of the
    policy to the trainer/sampler mismatch). A non-finite update stops the run (or is skipped
    and counted)."""
    p, tc = run.progress, run.cfg.train
    totals: dict[str, float] = {}
    n = run.cfg.rl.updates_per_rollout
    for i in range(n):
        p.state, metrics = run.steps.train(p.state, batch)
        m = jax.device_get(metrics)
        if not bool(m.pop("finite")):
            if not tc.skip_nonfinite_updates:
                run.ckpt.wait()
                raise FloatingPointError(
                    f"non-finite loss or gradients at RL step {step + 1}: training stopped and "
                    f"nothing after step {p.last_saved} was saved. Last good checkpoint: step "
                    f"{run.ckpt.latest_step()} in {run.ckpt.directory}. Lower "
                    "train.learning_rate, or set train.skip_nonfinite_updates=True to skip "
                    "such updates")
            p.skipped += 1
            logging.warning("RL step %d: non-finite loss or gradients; update skipped (%d so "
                            "far)", step + 1, p.skipped)
        for k, v in m.items():
            if np.ndim(v) == 0:
                totals[k] = totals.get(k, 0.0) + float(v) / n
        totals["lr"] = float(m["lr"])
        if i == 0 and "sampler_logp_gap" in m:
            gap = float(m["sampler_logp_gap"])
    if "sampler_logp_gap" in totals:
        totals["sampler_logp_gap"] = gap
    return totals


def evaluate(run: RLRun) -> dict[str, float]:
    """Greedy completions of the eval prompts: their pass rate and mean reward."""
    greedy = dataclasses.replace(run.sampling, temperature=0.0, top_p=1.0)
    examples = [ex for ex, _ in run.eval_prompts]
    groups = rollout(run.engine, [ids for _, ids in run.eval_prompts], 1, greedy, seed=0)
    rewards, _ = score_groups(run, examples, groups)
    run.progress.samples = [
        f"{ex.prompt}\n--> {run.tokenizer.decode(g[0].tokens)!r} (reward {r[0]:.3g})"
        for ex, g, r in zip(examples[:3], groups, rewards)]
    return {"eval_pass_rate": float((rewards >= run.cfg.rl.pass_threshold).mean()),
            "eval_reward_mean": float(rewards.mean())}


def save(run: RLRun, step: int) -> None:
    """A checkpoint of RL step `step`: state, config (with the task's identity), progress."""
    p = run.progress
    run.ckpt.save(step, p.state, config=run.config_json, data_iter=None, tokenizer_proto=None,
                  progress={"rl_step": step, "prompt_index": p.prompt_index,
                            "skipped_updates": p.skipped})
    p.last_saved = step
    faults.maybe_kill_during_save(step, run.cfg.checkpoint.inject_kill_during_save_at_step)




def finish(run: RLRun) -> None:
    """Process 0: the reward curve and the last evaluation's first completions."""
    if jax.process_index() == 0 and os.path.exists(run.writer.path):
        plot_rewards(read_metrics(run.writer.path), os.path.join(run.workdir, "rewards.png"))
        with open(os.path.join(run.workdir, "samples.txt"), "w") as f:
            f.write("\n\n".join(run.progress.samples))
    run.writer.close()
