"""RL rollouts: G completions of each prompt from the continuous-batching engine on the current
weights, each sampled token's log-prob and each position's routing recorded, laid out as the
batch `rl_step.policy_objective` reads.

Shapes: P prompts, G completions per prompt, B = P G rows, T positions per row (prompt +
completion - 1: inputs and targets are the sequence shifted by one), L layers, k experts per
token.

The engine and the train step share one copy of the weights: `Engine.set_weights(model)` after
each RL step's optimizer updates hands the engine the updated arrays (no transfer, no
reshard). Each completion draws from its own seed, derived from the step's seed, so a rollout
is reproduced exactly by the same weights and seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import SamplingParams, Sequence as EngineSequence


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion: `tokens` as sampled (the stop token that ended it included),
    their log-probs under the sampler, the routing of every position fed to the model (the
    prompt's and all sampled tokens but the last: [len(prompt) + len(tokens) - 1, L, k]).
    `first_token_at`: when its first token was drawn (time.monotonic)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routing: np.ndarray
    finish_reason: str
    first_token_at: float | None = None


def rollout(engine: Engine, prompts: Sequence[Sequence[int]], group_size: int,
            params: SamplingParams, seed: int) -> list[list[Completion]]:
    """`group_size` completions of each prompt ([P][G]), sampled with `params` (its seed is
    replaced by one per completion drawn from `seed`). The engine must record
    (`EngineConfig(record=True)`) and be driven from this thread."""
    if not engine.cfg.record:
        raise ValueError("rollout needs an engine that records log-probs and routing: "
                         "EngineConfig(record=True)")
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: expected >= 1")
    seeds = np.random.default_rng(seed).integers(0, 2**31, (len(prompts), group_size))
    seqs = [[EngineSequence(list(p), dataclasses.replace(params, seed=int(s)))
             for s in row] for p, row in zip(prompts, seeds)]
    for row in seqs:
        for seq in row:
            engine.check(seq.prompt, seq.params)
    pending = [seq for row in seqs for seq in row]
    while pending or engine.step():  # submit as the queue has room
        while pending and len(engine.waiting) < engine.cfg.max_queue:
            engine.submit(pending.pop(0))
        if pending:
            engine.step()
    out = []
    for row in seqs:
        group = []
        for seq in row:
            if seq.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"a rollout ended with {seq.finish_reason!r}")
            tokens = seq.tokens + ([seq.stop_token] if seq.stop_token is not None else [])
            group.append(Completion(seq.prompt, tokens, list(seq.logprobs),
                                    np.stack(seq.routing), seq.finish_reason, seq.first_token_at))
        out.append(group)
    return out


def rl_batch(groups: Sequence[Sequence[Completion]], advantages_PG: np.ndarray,
             length: int) -> dict[str, np.ndarray]:
    """The rows of `groups`, right-padded to `length` positions: inputs, targets,
    completion_mask (1 where the target is a sampled token), sampler_logp, experts (the
    recorded routing, to replay) and advantages, as `rl_step.policy_objective` reads them."""
    rows = [c for g in groups for c in g]
    advantages = np.asarray(advantages_PG, np.float32).reshape(-1)
    if advantages.shape != (len(rows),):
        raise ValueError(f"advantages hold {advantages.size} values for {len(rows)} completions")
    need = max(len(c.prompt) + len(c.tokens) - 1 for c in rows)
    if need > length:
        raise ValueError(f"a completion needs {need} positions: more than length={length}")
    b = len(rows)
    _, layers, k = rows[0].routing.shape
    batch = {"inputs": np.zeros((b, length), np.int32), "targets": np.zeros((b, length), np.int32),
             "completion_mask": np.zeros((b, length), np.float32),
             "sampler_logp": np.zeros((b, length), np.float32),
             "experts": np.zeros((b, length, layers, k), np.int32), "advantages": advantages}
    for i, c in enumerate(rows):
        full = c.prompt + c.tokens
        n, start = len(full) - 1, len(c.prompt) - 1
        batch["inputs"][i, :n] = full[:-1]
        batch["targets"][i, :n] = full[1:]
        batch["completion_mask"][i, start:n] = 1
        batch["sampler_logp"][i, start:n] = c.logprobs
        batch["experts"][i, :n] = c.routing
    return batch
