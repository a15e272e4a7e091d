"""Continuous batching: one pool of KV-cache slots decoded together, sequences joining and leaving
between decode steps.

Shapes: B slots, S cache positions per slot, n prompts prefilled together, P prompt time
(padded), V vocab.

The cache is one `KVCache` of B rows (`init_cache(cfg, B, S)`), made once; a sequence owns a
row (its slot) from its prefill until it stops. Each `Engine.step` (1) retires cancelled and
timed-out sequences, (2) prefills up to `max_prefill` waiting prompts at once into free rows
(`loop.prefill` into a fresh cache of n rows, scattered into the pool) and draws their first
tokens, and (3) runs one `loop.decode_step` over all B rows, every running sequence at its own
position; idle rows compute a throw-away token. The model math is generation's own
(llm_jax/inference/loop.py), so a sequence gets the tokens `sample` gives it: greedy tokens do
not depend on the other rows, and sampled ones draw from the same per-step keys
(`fold_in(fold_in(key(seed), t), 0)`, as row 0 of `sample`).

With `EngineConfig.record` (RL rollouts) a sequence also records each sampled token's log-prob
under the distribution it was drawn from (the logits / temperature, before top-k / top-p
filtering; temperature 1 for greedy) and the experts each position it fed to the model was
routed to (`Sequence.logprobs`, `Sequence.routing`): what the trainer's importance ratios and
MoE routing replay need. Off, the compiled steps are the same as without it.

Compiles: the decode step once per sampling mode (greedy / sampled / sampled with top-k or
top-p filtering, the mode of the running set), the prefill per prompt bucket and mode of the
prompts admitted together, for n = 1 and n = min(max_prefill, slots) rows. Weights laid
out on a mesh (an RL run's trainer mesh) are decoded under it, with the pool laid out on it in
and out of every program, so new weights of the same layout compile nothing. The requests
themselves (settings, queue errors, a sequence's state): requests.py.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from llm_jax.inference.loop import bucket, decode_step, prefill, slice_layers_once
from llm_jax.inference.requests import (
    SAMPLING_MODES,
    EngineClosed,
    EngineConfig,
    QueueFull,
    SamplingParams,
    Sequence,
)
from llm_jax.inference.sampling import greedy_tokens, sample_logits
from llm_jax.model.kv_cache import KVCache, LayerCache, cache_shardings, init_cache, shard_cache
from llm_jax.parallel.sharding import traced_under
from llm_jax.runtime.backend import InferenceJit

log = logging.getLogger(__name__)


def _keys(seeds_B: jax.Array, steps_B: jax.Array) -> jax.Array:
    """Row b's key at its step t: sample()'s key for a prompt alone (row 0)."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), t),
                                                    0))(seeds_B, steps_B)


def _pick(logits_BV, seeds_B, steps_B, temps_B, top_k_B, top_p_B, mode: int) -> jax.Array:
    if mode == 0:
        return greedy_tokens(logits_BV)
    one = lambda lg, k, t, tk, tp: sample_logits(lg[None], k[None], t, tk, tp,  # noqa: E731
                                                  filtered=mode == 2)[0]
    return jax.vmap(one)(logits_BV, _keys(seeds_B, steps_B), temps_B, top_k_B, top_p_B)


def _logprobs(logits_BV, tokens_B, temps_B) -> jax.Array:
    """log p(token) under logits / temperature (temperature 1 where greedy)."""
    scaled = logits_BV / jnp.where(temps_B > 0, temps_B, 1.0)[:, None]
    return jnp.take_along_axis(jax.nn.log_softmax(scaled), tokens_B[:, None], -1)[:, 0]


def _prefill_into(graphdef, state, cache, tokens_nP, lengths_n, slots_n, seeds_n, temps_n,
                  top_k_n, top_p_n, *, mode: int, max_len: int, cache_dtype: str,
                  record: bool = False, mesh: Mesh | None = None):
    """(first tokens [n], the pool with rows slots_n replaced by the prompts' caches, and with
    `record` (log-probs [n], experts [n, P, L, k]) else None); a slot index past the pool
    (padding rows) writes nothing. Traced under `mesh`, the weights' (as `generate_program`
    is under its plan's)."""
    with traced_under(mesh):
        model = nnx.merge(graphdef, state)
        n = tokens_nP.shape[0]
        logits_nV, fresh, *experts = prefill(model, tokens_nP, lengths_n,
                                             init_cache(model.cfg, n, max_len, cache_dtype),
                                             with_experts=record)
        cache = tuple(LayerCache(pool.k.at[slots_n].set(new.k, mode="drop"),
                                 pool.v.at[slots_n].set(new.v, mode="drop"))
                      for pool, new in zip(cache, fresh))
        steps_n = jnp.zeros((n,), jnp.int32)
        tokens = _pick(logits_nV, seeds_n, steps_n, temps_n, top_k_n, top_p_n, mode)
        # The pool leaves every program in the layout it came in with: each compiles once.
        return tokens, shard_cache(cache, mesh), (
            (_logprobs(logits_nV, tokens, temps_n), experts[0]) if record else None)


def _decode(graphdef, treedef, weights, cache, tokens_B, positions_B, seeds_B, steps_B, temps_B,
            top_k_B, top_p_B, *, mode: int, record: bool = False, mesh: Mesh | None = None):
    """(next tokens [B], the pool with each row's fed token written at its position, and with
    `record` (log-probs [B], the fed tokens' experts [B, L, k]) else None).
    `weights`: the leaves of (state, sliced layers or None), flattened once by the Engine: a
    call then flattens a list instead of NNX states (0.7 -> 0.2 ms of dispatch per step)."""
    with traced_under(mesh):
        state, layers = jax.tree.unflatten(treedef, weights)
        model = nnx.merge(graphdef, state)
        logits_BV, cache, *experts = decode_step(model, tokens_B, positions_B, cache, layers,
                                                 with_experts=record)
        tokens = _pick(logits_BV, seeds_B, steps_B, temps_B, top_k_B, top_p_B, mode)
        return tokens, shard_cache(cache, mesh), (
            (_logprobs(logits_BV, tokens, temps_B), experts[0]) if record else None)


def weights_mesh(state: Any) -> Mesh | None:
    """The mesh `state`'s arrays are laid out on (an RL run's trainer mesh), else None."""
    for leaf in jax.tree.leaves(state):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return leaf.sharding.mesh
    return None


@functools.partial(jax.jit, static_argnums=0)
def _layer_states(graphdef, state):
    """Each layer's slice of the stacked weights (the platforms that decode from slices): one
    compiled program per model structure, so `set_weights` after every RL update runs it
    instead of compiling it again (0.57 s a call for configs/tiny.py's model on 2 cores)."""
    return nnx.merge(graphdef, state).layer_states()


prefill_jit = InferenceJit(_prefill_into, static_argnames=("graphdef", "mode", "max_len",
                                                           "cache_dtype", "record", "mesh"),
                           donate_argnames=("cache",))
decode_jit = InferenceJit(_decode, static_argnames=("graphdef", "treedef", "mode", "record",
                                                    "mesh"),
                          donate_argnames=("cache",))


class Engine:
    """The slot pool and its scheduler. Drive it with `step()` (or `run_until_idle()`) from one
    thread, or `start()` a background thread that steps whenever there is work; `submit` and
    `Sequence.cancel` may be called from any thread."""

    def __init__(self, model: nnx.Module, cfg: EngineConfig = EngineConfig()):
        self.model, self.cfg = model, cfg
        self.graphdef, self.state = nnx.split(model)
        self.cache_dtype = str(jnp.dtype(cfg.cache_dtype or model.cfg.dtype))
        # Weights laid out on a mesh (an RL run's) are decoded under it, the pool laid out on
        # it too: else the first program's output pool, on the mesh, would differ in type from
        # the pool it was given and the next call would compile the program again.
        self.mesh = weights_mesh(self.state)
        self.cache = self._empty_pool()
        self.layers = (_layer_states(self.graphdef, self.state) if slice_layers_once(model)
                       else None)
        self.weights, self.treedef = jax.tree.flatten((self.state, self.layers))
        b = cfg.slots
        self.tokens_B, self.positions_B = np.zeros(b, np.int32), np.zeros(b, np.int32)
        self.seeds_B, self.steps_B = np.zeros(b, np.int32), np.zeros(b, np.int32)
        self.temps_B, self.top_p_B = np.zeros(b, np.float32), np.ones(b, np.float32)
        self.top_k_B = np.zeros(b, np.int32)
        self.free = list(range(b))
        self.running: dict[int, Sequence] = {}
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.lock = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None
        self.steps = 0

    # ------------------------------------------------------------------ the public side
    def set_weights(self, model: nnx.Module) -> None:
        """Decodes with `model`'s current weights from the next step on (after an optimizer
        update, for RL rollouts): its arrays are used as they are, not copied, except the
        per-layer slices where this platform slices before decoding. The model's structure
        (config, LoRA targets) must be the engine's."""
        graphdef, state = nnx.split(model)
        if graphdef != self.graphdef:
            raise ValueError("set_weights: the model's structure differs from the engine's "
                             "(another config or adapters): build a new Engine")
        layers = _layer_states(graphdef, state) if self.layers is not None else None
        with self.lock:
            self.model, self.state, self.layers = model, state, layers
            self.weights, self.treedef = jax.tree.flatten((state, layers))

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming what does not fit this engine."""
        params.check()
        vocab = self.model.cfg.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty: expected at least one token")
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt holds {bad[0]!r}, outside the vocabulary: expected "
                             f"integer ids in [0, {vocab})")
        need = len(prompt) + params.max_new_tokens
        if need > self.cfg.max_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; with max_new_tokens="
                             f"{params.max_new_tokens} it needs {need} positions, more than "
                             f"max_len={self.cfg.max_len}: shorten the prompt or lower "
                             f"max_new_tokens")

    def submit(self, seq: Sequence) -> Sequence:
        """Queues a sequence; raises ValueError (bad request), QueueFull or EngineClosed."""
        self.check(seq.prompt, seq.params)
        with self.lock:
            if self.closed:
                raise EngineClosed("the engine is shutting down")
            if len(self.waiting) >= self.cfg.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting "
                                f"(max_queue={self.cfg.max_queue}): try again later")
            self.waiting.append(seq)
            self.lock.notify()
        return seq

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"slots": self.cfg.slots, "busy_slots": len(self.running),
                    "free_slots": len(self.free), "waiting": len(self.waiting),
                    "steps": self.steps}

    @property
    def prefill_rows(self) -> int:
        """Rows of a prefill of several prompts (one prompt alone runs in one row)."""
        return min(self.cfg.max_prefill, self.cfg.slots)

    def prompt_buckets(self) -> list[int]:
        """The padded prompt lengths a prefill may compile for: buckets up to max_len."""
        out, n = [], 1
        while not out or out[-1] < self.cfg.max_len:
            out.append(min(bucket(n), self.cfg.max_len))
            n = out[-1] + 1
        return out

    def warmup(self, prompt_buckets: list[int] | None = None,
               modes: tuple[int, ...] = SAMPLING_MODES) -> None:
        """Compiles the decode step and the prefill of 1 and `prefill_rows` prompts for each
        bucket (default: all) in each sampling mode (default: all three, so that no request
        waits for a compile: an API request's default temperature 1 is the sampled mode). The
        prefills write nothing (every row aims past the pool); the decode steps write only the
        idle rows, which a prefill overwrites before they are used."""
        rows = sorted({1, self.prefill_rows})
        for mode in modes:
            for p in prompt_buckets or self.prompt_buckets():
                for n in rows:
                    z = np.zeros(n, np.int32)
                    first, self.cache, _ = prefill_jit(
                        self.graphdef, self.state, self.cache, np.zeros((n, p), np.int32),
                        np.ones(n, np.int32), np.full(n, self.cfg.slots, np.int32), z,
                        np.ones(n, np.float32), z, np.ones(n, np.float32), mode=mode,
                        max_len=self.cfg.max_len, cache_dtype=self.cache_dtype,
                        record=self.cfg.record, mesh=self.mesh)
        with self.lock:
            if self.running:
                raise RuntimeError("warmup() runs before any sequence does")
        for mode in modes:
            self._decode_all(mode=mode)
        jax.block_until_ready(self.cache)

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name="llm_jax-engine", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stops the thread; what still waits or runs finishes as "cancelled"."""
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join()
        for seq in list(self.running.values()) + list(self.waiting):
            self._finish(seq, "cancelled")
        self.waiting.clear()

    # ------------------------------------------------------------------ one round
    def step(self) -> bool:
        """Retire, admit, decode one token for every running sequence. Returns whether any
        sequence still waits or runs."""
        self._retire()
        self._admit()
        if self.running:
            self._decode()
        with self.lock:
            return bool(self.running or self.waiting)

    def _serve(self) -> None:
        while True:
            with self.lock:
                while not self.closed and not self.running and not self.waiting:
                    self.lock.wait()
                if self.closed:
                    return
            try:
                self.step()
            except Exception:  # a failed step must not take the server down
                log.exception("engine step failed; finishing its sequences with an error")
                for seq in list(self.running.values()):
                    self._finish(seq, "error")
                # the step may have consumed the donated pool: start from an empty one
                self.cache = self._empty_pool()

    def _empty_pool(self) -> KVCache:
        make = functools.partial(init_cache, self.model.cfg, self.cfg.slots, self.cfg.max_len,
                                 self.cache_dtype)
        if self.mesh is None:
            return make()
        # Made in place, shard by shard: not whole on one device and then copied out.
        shardings = cache_shardings(jax.eval_shape(make), self.mesh)
        return jax.jit(make, out_shardings=shardings)()

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if seq.slot is not None:
            with self.lock:
                self.running.pop(seq.slot, None)
                self.free.append(seq.slot)
            seq.slot = None
        if seq.listener is not None:
            try:
                seq.listener(seq, None)
            except Exception:
                log.exception("listener failed")
        seq.done.set()

    def _retire(self) -> None:
        now = time.monotonic()
        expired = lambda s: s.deadline is not None and now > s.deadline  # noqa: E731
        with self.lock:
            gone = [s for s in self.waiting if s.cancelled or expired(s)]
            for s in gone:
                self.waiting.remove(s)
        for s in gone + [s for s in list(self.running.values()) if s.cancelled or expired(s)]:
            self._finish(s, "cancelled" if s.cancelled else "timeout")

    def _accept(self, seq: Sequence, token: int, logprob: float | None = None) -> None:
        """Records one new token (and its log-prob when recording); finishes the sequence at a
        stop token, its length, when the listener says so, or ("error") when the listener
        raises."""
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        if logprob is not None:
            seq.logprobs.append(logprob)
        if token in seq.params.stop_ids:
            seq.stop_token = token
            return self._finish(seq, "stop")
        seq.tokens.append(token)
        stop = False
        if seq.listener is not None:
            try:
                stop = seq.listener(seq, token)
            except Exception:
                log.exception("listener failed; cancelling its sequence")
                return self._finish(seq, "error")
        if stop:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.params.max_new_tokens:
            self._finish(seq, "length")
        else:  # feed it at the next decode step
            b = seq.slot
            self.tokens_B[b] = token
            self.positions_B[b] = len(seq.prompt) + len(seq.tokens) - 1
            self.steps_B[b] = len(seq.tokens)

    def _admit(self) -> None:
        with self.lock:
            n = min(len(self.free), len(self.waiting), self.cfg.max_prefill)
            batch = [self.waiting.popleft() for _ in range(n)]
            slots = [self.free.pop() for _ in range(n)]
            for seq, slot in zip(batch, slots):
                seq.slot = slot
                self.running[slot] = seq
        if not batch:
            return
        rows = 1 if n == 1 else self.prefill_rows
        p = min(bucket(max(len(s.prompt) for s in batch)), self.cfg.max_len)
        tokens = np.zeros((rows, p), np.int32)
        lengths = np.ones(rows, np.int32)
        slot_n = np.full(rows, self.cfg.slots, np.int32)  # past the pool: dropped
        seeds, temps = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
        top_k, top_p = np.zeros(rows, np.int32), np.ones(rows, np.float32)
        for i, (seq, slot) in enumerate(zip(batch, slots)):
            sp = seq.params
            tokens[i, :len(seq.prompt)] = seq.prompt
            lengths[i], slot_n[i], seeds[i] = len(seq.prompt), slot, sp.seed
            temps[i], top_p[i] = sp.temperature, sp.top_p
            top_k[i] = min(sp.top_k, self.model.cfg.vocab_size)
            self.seeds_B[slot], self.temps_B[slot] = sp.seed, sp.temperature
            self.top_k_B[slot], self.top_p_B[slot] = top_k[i], sp.top_p
        mode = max(s.params.mode for s in batch)
        first, self.cache, recorded = prefill_jit(
            self.graphdef, self.state, self.cache, tokens, lengths, slot_n, seeds, temps, top_k,
            top_p, mode=mode, max_len=self.cfg.max_len, cache_dtype=self.cache_dtype,
            record=self.cfg.record, mesh=self.mesh)
        first = np.asarray(first)
        logprobs, experts = (None, None) if recorded is None else map(np.asarray, recorded)
        for i, seq in enumerate(batch):
            if experts is not None:
                seq.routing.extend(experts[i, :len(seq.prompt)])
            self._accept(seq, int(first[i]), None if logprobs is None else float(logprobs[i]))

    def _decode_all(self, mode: int) -> np.ndarray:
        """One decode step over every row (idle rows: token 0 at position 0)."""
        idle = np.ones(self.cfg.slots, bool)
        idle[list(self.running)] = False
        self.tokens_B[idle] = 0
        self.positions_B[idle] = 0
        tokens, self.cache, recorded = decode_jit(
            self.graphdef, self.treedef, self.weights, self.cache, self.tokens_B, self.positions_B,
            self.seeds_B, self.steps_B, self.temps_B, self.top_k_B, self.top_p_B, mode=mode,
            record=self.cfg.record, mesh=self.mesh)
        return np.asarray(tokens), None if recorded is None else tuple(map(np.asarray, recorded))

    def _decode(self) -> None:
        running = list(self.running.items())
        tokens, recorded = self._decode_all(max(s.params.mode for _, s in running))
        self.steps += 1
        for b, seq in running:
            if seq.finish_reason is None:
                if recorded is not None:
                    seq.routing.append(recorded[1][b])  # the token fed at this step
                self._accept(seq, int(tokens[b]),
                             None if recorded is None else float(recorded[0][b]))
