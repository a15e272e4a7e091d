"""Scoring text with the model: log-likelihood of continuations given contexts, and rolling
log-likelihood of long texts in windows that fit the context (lm-evaluation-harness' two
scoring requests), for token ids.

Shapes: B batch rows, T time (padded), c time steps per chunk, D hidden, V vocab.

A request (context, continuation) is scored by one forward pass over context + continuation
minus its last token: the logits at the last len(continuation) positions give the
continuation's log-probabilities, and it is greedy when each of its tokens is the argmax there.
Requests are sorted by length and run B at a time, either right-padded (one request per row;
padding is segment 0) or packed (several requests per row, each its own segment with positions
from 0, as training packs documents): the same attention masks as a single forward, so the
numbers equal it (tests/inference/test_scoring.py: within 1e-5 in float32). The unembedding runs
over chunks of time, so no [B, T, V] array is held (model/unembed_loss.py's chunking).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm_jax.inference.loop import bucket
from llm_jax.inference.sampling import greedy_tokens
from llm_jax.model.unembed_loss import chunk_steps
from llm_jax.runtime.backend import InferenceJit


class Score(NamedTuple):
    """One continuation's summed log-probability (natural log) and whether greedy decoding
    would have produced it."""

    logprob: float
    is_greedy: bool


def _token_scores(graphdef, state, tokens_BT, positions_BT, segments_BT, targets_BT):
    """(log p(target) [B, T] float32, target == argmax [B, T]) at every position."""
    model = nnx.merge(graphdef, state)
    h_BTD, _, _ = model.hidden_states(tokens_BT, positions_BT, segments_BT)
    b, t, d = h_BTD.shape
    c = chunk_steps(b, t)
    n = -(-t // c)
    h_nBcD = jnp.moveaxis(jnp.pad(h_BTD, ((0, 0), (0, n * c - t), (0, 0))).reshape(b, n, c, d),
                          1, 0)
    tgt_nBc = jnp.moveaxis(jnp.pad(targets_BT, ((0, 0), (0, n * c - t))).reshape(b, n, c), 1, 0)

    def chunk(xs):
        h_BcD, tgt_Bc = xs
        logits_BcV = model.logits(h_BcD)
        lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
        logp_Bc = jnp.take_along_axis(logits_BcV, tgt_Bc[..., None], axis=-1)[..., 0] - lse_Bc
        best_Bc = greedy_tokens(logits_BcV.reshape(-1, logits_BcV.shape[-1])).reshape(tgt_Bc.shape)
        return logp_Bc, best_Bc == tgt_Bc

    logp_nBc, greedy_nBc = jax.lax.map(chunk, (h_nBcD, tgt_nBc))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
    return unchunk(logp_nBc), unchunk(greedy_nBc)


token_scores_jit = InferenceJit(_token_scores, static_argnames=("graphdef",))


def _check_requests(requests: Sequence[tuple[Sequence[int], Sequence[int]]], vocab: int) -> None:
    for i, (context, continuation) in enumerate(requests):
        if len(context) == 0:
            raise ValueError(f"requests[{i}] has an empty context: expected at least one token "
                             f"(a BOS or end-of-text token to condition on)")
        if len(continuation) == 0:
            raise ValueError(f"requests[{i}] has an empty continuation: expected at least one "
                             f"token to score")
        for part in (context, continuation):
            bad = [t for t in part if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"requests[{i}] holds {bad[0]!r}, outside the vocabulary: "
                                 f"expected integer ids in [0, {vocab})")


class _Row(NamedTuple):
    """A request laid out for one forward pass: input tokens and how many trailing targets
    count."""

    index: int
    inputs: list[int]
    targets: list[int]
    scored: int  # the last `scored` targets are the continuation


def _rows(requests, max_length: int) -> list[_Row]:
    out = []
    for i, (context, continuation) in enumerate(requests):
        full = list(context) + list(continuation)
        # Longer than the window: keep its last max_length + 1 tokens (the harness' rule); a
        # continuation longer than the window loses its first tokens' scores.
        full = full[-(max_length + 1):]
        scored = min(len(continuation), len(full) - 1)
        out.append(_Row(i, full[:-1], full[1:], scored))
    return out


def _batches_padded(rows: list[_Row], batch_size: int):
    """One request per row, rows sorted longest first: batches of up to `batch_size`
    rows, each row a list of one request."""
    rows = sorted(rows, key=lambda r: -len(r.inputs))
    for i in range(0, len(rows), batch_size):
        group = rows[i:i + batch_size]
        yield [[r] for r in group]


def _batches_packed(rows: list[_Row], batch_size: int, row_len: int):
    """First-fit-decreasing packing of requests into rows of `row_len` tokens."""
    rows = sorted(rows, key=lambda r: -len(r.inputs))
    bins: list[list[_Row]] = []
    room: list[int] = []
    for r in rows:
        for j, free in enumerate(room):
            if len(r.inputs) <= free:
                bins[j].append(r)
                room[j] -= len(r.inputs)
                break
        else:
            bins.append([r])
            room.append(row_len - len(r.inputs))
    for i in range(0, len(bins), batch_size):
        yield bins[i:i + batch_size]


def _run(model: nnx.Module, batch: list[list[_Row]], batch_size: int,
         out: list[Score | None]) -> None:
    longest = max(sum(len(r.inputs) for r in row) for row in batch)
    t = bucket(longest)
    tokens, positions, segments, targets = (np.zeros((batch_size, t), np.int32) for _ in range(4))
    for b, row in enumerate(batch):
        start = 0
        for s, r in enumerate(row, start=1):
            n = len(r.inputs)
            tokens[b, start:start + n] = r.inputs
            targets[b, start:start + n] = r.targets
            positions[b, start:start + n] = np.arange(n)
            segments[b, start:start + n] = s
            start += n
    graphdef, state = nnx.split(model)
    logp, greedy = token_scores_jit(graphdef, state, *map(jnp.asarray,
                                                          (tokens, positions, segments, targets)))
    logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
    for b, row in enumerate(batch):
        start = 0
        for r in row:
            end = start + len(r.inputs)
            out[r.index] = Score(float(logp[b, end - r.scored:end].sum()),
                                 bool(greedy[b, end - r.scored:end].all()))
            start = end


def loglikelihood(model: nnx.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                  max_length: int = 2048, batch_size: int = 8, pack: bool = False) -> list[Score]:
    """log p(continuation | context) and whether it is the greedy continuation, per request.

    requests: (context ids, continuation ids) pairs; the context needs at least one token.
    max_length: the most positions one forward pass holds; a longer request keeps its last
      max_length + 1 tokens (its context is cut on the left).
    pack: put several short requests in one row (each its own segment) instead of one per row.
    """
    _check_requests(requests, model.cfg.vocab_size)
    if max_length < 1 or batch_size < 1:
        raise ValueError(f"max_length={max_length}, batch_size={batch_size}: expected both >= 1")
    rows = _rows(requests, max_length)
    out: list[Score | None] = [None] * len(rows)
    batches = (_batches_packed(rows, batch_size, bucket(max(len(r.inputs) for r in rows)))
               if pack and rows else _batches_padded(rows, batch_size))
    for batch in batches:
        _run(model, batch, batch_size, out)
    return out  # type: ignore[return-value]


def rolling_windows(tokens: Sequence[int], prefix_id: int, max_length: int,
                    stride: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) requests that together score every token of `tokens` once,
    the first given `prefix_id` alone: windows of at most max_length inputs, each predicting
    the next `stride` tokens (default max_length: disjoint windows, as lm-evaluation-harness'
    loglikelihood_rolling) after as much earlier text as still fits."""
    stride = max_length if stride is None else stride
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride={stride} is invalid: expected 1 <= stride <= max_length="
                         f"{max_length}")
    full = [prefix_id, *tokens]
    out = []
    for s in range(1, len(full), stride):  # predict full[s:e]
        e = min(s + stride, len(full))
        a = max(0, e - 1 - max_length)  # inputs full[a:e-1], at most max_length of them
        out.append((full[a:s], full[s:e]))
    return out


def loglikelihood_rolling(model: nnx.Module, texts: Sequence[Sequence[int]], prefix_id: int, *,
                          max_length: int = 2048, stride: int | None = None,
                          batch_size: int = 8, pack: bool = False) -> list[float]:
    """log p(text) of each token list, scored in windows (`rolling_windows`), the first token
    conditioned on `prefix_id` (BOS or end-of-text)."""
    requests, owner = [], []
    for i, tokens in enumerate(texts):
        windows = rolling_windows(tokens, prefix_id, max_length, stride)
        requests += windows
        owner += [i] * len(windows)
    scores = loglikelihood(model, requests, max_length=max_length, batch_size=batch_size,
                           pack=pack) if requests else []
    totals = [0.0] * len(texts)
    for i, s in zip(owner, scores):
        totals[i] += s.logprob
    return totals
