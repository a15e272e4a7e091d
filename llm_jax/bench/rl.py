"""RL on the engine: what MoE routing replay removes in bfloat16, and rollouts at engine speed.

    python -m llm_jax.bench rl [--repeats 5] [--prompts 4] [--group 8] [--prompt_len 32]
        [--new_tokens 96] [--steps 4]

Random weights of configs/tiny.py's model (4 layers, 16 experts, top-2) in bfloat16 (dtype and
param_dtype), the dropless MoE dispatch RL trains with, temperature 1.

Replay: `prompts` x `group` completions by `rollouts.rollout` (the engine recording each token's
log-prob and each position's experts), then the trainer's forward of the same rows
(`rl_step.completion_logprobs`, the train path, the batch as `rollouts.rl_batch` lays it out)
without and with the recorded routing replayed. Per case: the share of (position, layer) whose
top-k expert set differs from the rollout's (every position the engine fed to the model:
prompts and completions), and the mean |log p_trainer - log p_sampler| over completion tokens.

Speed: the same rollout (record=True, its own engine) against the engine's own throughput on
the same prompts, lengths and batch (record=False: `Engine.submit` + `run_until_idle`),
interleaved; completions never stop early (no stop tokens), so both sample the same number of
tokens. Then `steps` RL steps as the loop runs them: rollout, the trainer's forward for the
old log-probs, the jitted update (`jit_train_step` with `rl_step.rl_objective`), and
`Engine.set_weights` with the updated model; the hand-over is the time from the update's end
to the next rollout's first token. Means over the steps after the first (which compiles);
the old log-probs phase includes the host's work between rollout and update (the batch's layout,
advantages, transfers).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm_jax.bench.common import alternate, machine, median, table
from llm_jax.bench.train import quick_model_config, tiny_run_config
from llm_jax.config import ModelConfig
from llm_jax.inference.engine import Engine
from llm_jax.inference.loop import bucket
from llm_jax.inference.requests import EngineConfig, SamplingParams, Sequence
from llm_jax.model import init_model
from llm_jax.model.params import TRAINABLE
from llm_jax.training.policy_loss import PolicyLossConfig, group_advantages
from llm_jax.training.rl_step import completion_logprobs, rl_objective
from llm_jax.training.rollouts import rl_batch, rollout
from llm_jax.training.run_config import execution_config, model_config
from llm_jax.training.step import TrainState, jit_train_step, make_optimizer


class ClockedEngine(Engine):
    """An Engine that notes when the first token after `arm()` is drawn: what the hand-over
    from an optimizer update to the next rollout ends at."""

    first_token_at: float | None = None

    def arm(self) -> None:
        self.first_token_at = None

    def step(self) -> bool:
        busy = super().step()
        if self.first_token_at is None:
            drawn = [s.first_token_at for s in self.running.values() if s.first_token_at]
            if drawn:
                self.first_token_at = min(drawn)
        return busy


def trainer_forward(graphdef: nnx.GraphDef, params: nnx.State,
                    batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(log p of each target [B, T] by `completion_logprobs` on the train path, the experts the
    trainer routed each position to [B, T, L, k]); the batch's routing is replayed when it
    holds one."""
    model = nnx.merge(graphdef, params)
    _, logp = completion_logprobs(model, batch, temperature=1.0, train=True)
    _, aux, _ = model.hidden_states(batch["inputs"], train=True,
                                    experts_BTLk=batch.get("experts"))
    return logp, jnp.moveaxis(aux.experts, 0, 2)


trainer_forward_jit = jax.jit(trainer_forward, static_argnums=0)


def replay_figures(batch: dict[str, np.ndarray], lengths: np.ndarray, logp: np.ndarray,
                   experts: np.ndarray) -> dict[str, float]:
    """The share of (position, layer) whose expert set differs from the rollout's (over the
    first `lengths[b]` positions of row b: those the engine fed), and the mean |logp -
    sampler_logp| over completion tokens."""
    fed = np.arange(batch["inputs"].shape[1])[None, :] < lengths[:, None]
    differs = np.any(np.sort(experts, -1) != np.sort(batch["experts"], -1), axis=-1)  # [B,T,L]
    mask = batch["completion_mask"]
    return {"topk_mismatch": float(differs[fed].mean()),
            "topk_mismatch_completion": float(differs[mask > 0].mean()),
            "logp_gap": float((np.abs(logp - batch["sampler_logp"]) * mask).sum() / mask.sum())}


def prompts_for(cfg: ModelConfig, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(4, cfg.vocab_size, (n, length)).tolist()


def measure_replay(model: nnx.Module, engine: Engine, prompts: list[list[int]], group: int,
                   params: SamplingParams, seed: int) -> dict[str, Any]:
    groups = rollout(engine, prompts, group, params, seed)
    length = len(prompts[0]) + params.max_new_tokens
    batch = rl_batch(groups, np.zeros((len(prompts), group)), length)
    lengths = np.asarray([len(c.prompt) + len(c.tokens) - 1 for g in groups for c in g])
    graphdef, state = nnx.split(model)
    out: dict[str, Any] = {"completions": len(lengths), "positions": int(lengths.sum()),
                           "completion_tokens": int(batch["completion_mask"].sum())}
    for case, keys in (("without_replay", ("experts",)), ("with_replay", ())):
        fed = {k: jnp.asarray(v) for k, v in batch.items() if k not in keys}
        logp, experts = map(np.asarray, trainer_forward_jit(graphdef, state, fed))
        out[case] = replay_figures(batch, lengths, logp, experts)
    out["logp_gap_ratio"] = out["without_replay"]["logp_gap"] / out["with_replay"]["logp_gap"]
    return out


def measure_speed(model: nnx.Module, ecfg: EngineConfig, prompts: list[list[int]], group: int,
                  params: SamplingParams, repeats: int) -> dict[str, Any]:
    """Rollout tokens/s (record=True) against the engine's own (record=False) on the same
    requests, interleaved."""
    recording = Engine(model, dataclasses.replace(ecfg, record=True))
    plain = Engine(model, dataclasses.replace(ecfg, record=False))
    seeds = np.random.default_rng(0).integers(0, 2**31, len(prompts) * group)
    tokens = len(prompts) * group * params.max_new_tokens

    def engine_alone():
        seqs = [plain.submit(Sequence(list(p), dataclasses.replace(params, seed=int(s))))
                for p, s in zip([p for p in prompts for _ in range(group)], seeds)]
        plain.run_until_idle()
        assert sum(len(s.tokens) for s in seqs) == tokens

    def rollouts():
        groups = rollout(recording, prompts, group, params, seed=0)
        assert sum(len(c.tokens) for g in groups for c in g) == tokens

    times = alternate({"rollout": rollouts, "engine": engine_alone}, repeats=repeats)
    out = {name: {"seconds": median(t), "times_s": t, "tokens_per_s": tokens / median(t)}
           for name, t in times.items()}
    out["tokens"] = tokens
    out["ratio"] = out["rollout"]["tokens_per_s"] / out["engine"]["tokens_per_s"]
    return out


def measure_steps(model: nnx.Module, ecfg: EngineConfig, train: Any, prompts: list[list[int]],
                  group: int, params: SamplingParams, steps: int) -> dict[str, Any]:
    """`steps` RL steps (rollout, old log-probs, update, set_weights) with their phases timed."""
    engine = ClockedEngine(model, dataclasses.replace(ecfg, record=True))
    graphdef, params_state = nnx.split(model)
    tx = make_optimizer(train)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params_state,
                       opt_state=tx.init(nnx.filter_state(params_state, TRAINABLE)))
    policy = PolicyLossConfig()
    update = jit_train_step(graphdef, tx, train, objective=rl_objective(policy))
    length = len(prompts[0]) + params.max_new_tokens
    rng = np.random.default_rng(0)
    rows, updated_at = [], None
    for i in range(steps):
        t0 = time.monotonic()
        if updated_at is not None:  # the previous update's weights, as the loop hands them over
            engine.set_weights(nnx.merge(graphdef, state.params))
        handed_over = time.monotonic()
        engine.arm()
        groups = rollout(engine, prompts, group, params, seed=i)
        t1 = time.monotonic()
        rewards = rng.random((len(prompts), group)).astype(np.float32)
        batch = rl_batch(groups, np.asarray(group_advantages(jnp.asarray(rewards), policy)),
                         length)
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        batch["old_logp"] = jax.block_until_ready(
            trainer_forward_jit(graphdef, state.params, batch)[0])
        t2 = time.monotonic()
        state, metrics = update(state, batch)
        jax.block_until_ready((state, metrics))
        t3 = time.monotonic()
        row = {"rollout_s": t1 - t0, "old_logp_s": t2 - t1, "update_s": t3 - t2,
               "step_s": t3 - t0, "loss": float(metrics["loss"])}
        if updated_at is not None:  # the previous update ended right before this step began
            row["handover_s"] = engine.first_token_at - updated_at
            row["set_weights_s"] = handed_over - t0
        rows.append(row)
        updated_at = t3
    # Means over the steps after the first (which compiles), so that the phases add up to the
    # step and each share is its phase's part of the time spent.
    timed = rows[1:]
    keys = ("rollout_s", "old_logp_s", "update_s", "step_s", "handover_s", "set_weights_s")
    out = {"steps": rows, **{k: sum(r[k] for r in timed) / len(timed) for k in keys}}
    for k in keys:
        out[k.removesuffix("_s") + "_share"] = out[k] / out["step_s"]
    return out


def run(*, repeats: int = 3, quick: bool = False, prompts: int = 4, group: int = 8,
        prompt_len: int = 32, new_tokens: int = 96, steps: int = 4,
        seed: int = 0) -> dict[str, Any]:
    run_cfg = tiny_run_config()
    cfg = quick_model_config() if quick else model_config(run_cfg)
    if quick:
        prompts, group, prompt_len, new_tokens, steps, repeats = 2, 2, 8, 8, 2, 1
    for name, value, least in (("prompts", prompts, 1), ("group", group, 1),
                               ("prompt_len", prompt_len, 1), ("new_tokens", new_tokens, 1),
                               ("steps", steps, 2)):  # the first step compiles: one more
        if value < least:
            raise ValueError(f"--{name}={value}: expected at least {least}")
    cfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    execution = dataclasses.replace(execution_config(run_cfg), moe_dispatch="auto")
    model = init_model(cfg, seed, execution=execution)
    rows = prompts * group
    ecfg = EngineConfig(slots=rows, max_len=bucket(prompt_len + new_tokens), max_queue=rows)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    ps = prompts_for(cfg, prompts, prompt_len, seed)
    replay = measure_replay(model, Engine(model, dataclasses.replace(ecfg, record=True)), ps,
                            group, params, seed)
    speed = measure_speed(model, ecfg, ps, group, params, repeats)
    rl = measure_steps(model, ecfg, run_cfg.train, ps, group, params, steps)
    return {"benchmark": "rl", "machine": machine(), "config": cfg.to_dict(),
            "moe_dispatch": execution.moe_dispatch, "prompts": prompts, "group": group,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
            "replay": replay, "speed": speed, "rl_steps": rl}


def format_result(r: dict[str, Any]) -> str:
    rp, sp, st = r["replay"], r["speed"], r["rl_steps"]
    w, wo = rp["with_replay"], rp["without_replay"]
    return "\n".join([
        f"{r['prompts']} prompts x {r['group']} completions, {r['prompt_len']} + "
        f"{r['new_tokens']} tokens, bfloat16, {r['moe_dispatch']} dispatch; load "
        f"{r['machine']['load_average']}",
        table(["trainer forward", "top-k differs (all positions)",
               "top-k differs (completion)", "mean |logp trainer - sampler|"],
              [["without replay", wo["topk_mismatch"], wo["topk_mismatch_completion"],
                wo["logp_gap"]],
               ["with replay", w["topk_mismatch"], w["topk_mismatch_completion"],
                w["logp_gap"]]]),
        f"replay shrinks the log-prob gap {rp['logp_gap_ratio']:.2f}x",
        table(["", "tok/s", "s"],
              [["rollout (record=True)", sp["rollout"]["tokens_per_s"], sp["rollout"]["seconds"]],
               ["engine (record=False)", sp["engine"]["tokens_per_s"], sp["engine"]["seconds"]]]),
        f"rollout / engine: {sp['ratio']:.2f}x",
        table(["RL step (mean)", "s", "share of the step"],
              [[name, st[f"{k}_s"], f"{st[f'{k}_share']:.1%}"] for name, k in (
                  ("rollout (set_weights included)", "rollout"),
                  ("old log-probs forward", "old_logp"), ("update", "update"),
                  ("update -> next rollout's first token", "handover"),
                  ("  of which Engine.set_weights", "set_weights"), ("whole step", "step"))]),
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=4, help="RL steps timed (the first compiles)")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, prompts=a.prompts, group=a.group,
               prompt_len=a.prompt_len, new_tokens=a.new_tokens, steps=a.steps)
