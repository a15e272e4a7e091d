"""Many prompts at once, each with its own settings and stops: `generate_until` on the
continuous-batching engine (llm_jax/inference/engine.py), run to completion in this thread.

A request stops at the first of: a stop token (not in its text), a stop string (its text ends
before it), or max_new_tokens. Prompts of different lengths and settings share the slot pool;
a finished request's slot goes to the next waiting one at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from flax import nnx

from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import EngineConfig, SamplingParams, Sequence as EngineSequence
from llm_jax.inference.stops import StopText


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A prompt (token ids) and how to continue it."""

    prompt: Sequence[int]
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_ids: Sequence[int] = ()

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              stop_ids=frozenset(self.stop_ids))


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a request produced: its text (cut at a stop string), its new token ids (a stop token
    excluded) and why it ended ("stop" or "length"; "error" if `decode` raised)."""

    text: str
    tokens: list[int]
    finish_reason: str


def engine_for(model: nnx.Module, requests: Sequence[GenerationRequest],
               slots: int = 16) -> Engine:
    """An engine sized for these requests: up to `slots` rows, room for the longest."""
    need = max((len(r.prompt) + r.max_new_tokens for r in requests), default=1)
    return Engine(model, EngineConfig(slots=max(1, min(slots, len(requests))), max_len=need,
                                      max_queue=max(1, len(requests))))


def generate_until(model_or_engine: nnx.Module | Engine, requests: Sequence[GenerationRequest],
                   decode: Callable[[list[int]], str], *, slots: int = 16) -> list[Generation]:
    """Runs every request to its stop; returns their generations in order. `decode` turns ids
    into text (the tokenizer's); an Engine is reused as it is, a model gets `engine_for`."""
    engine = (model_or_engine if isinstance(model_or_engine, Engine)
              else engine_for(model_or_engine, requests, slots))
    for r in requests:  # every request checked before any runs
        engine.check(list(r.prompt), r.params())
    texts = [StopText(decode, r.stop) for r in requests]
    seqs = []
    for r, text in zip(requests, texts):
        def listen(seq, token, text=text):
            if token is None:  # the end: a trailing partial character is text too
                text.finish()
            else:
                text.push(token)
            return text.stopped
        seqs.append(EngineSequence(list(r.prompt), r.params(), listen))
    pending = list(seqs)
    while pending or engine.step():  # submit as the queue has room
        while pending and len(engine.waiting) < engine.cfg.max_queue:
            engine.submit(pending.pop(0))
        if pending:
            engine.step()
    return [Generation(t.text, s.tokens, s.finish_reason or "length") for s, t in zip(seqs, texts)]
