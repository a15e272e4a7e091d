"""Scoring: batched log-likelihoods (padded and packed) equal one full forward per request
(each token's log-probability within 1e-5, float32, so a sum of n within n 1e-5), greediness
matches the argmax, long requests are cut on the left, rolling windows score every token once,
and bad requests raise a ValueError naming them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.inference.scoring import (
    loglikelihood,
    loglikelihood_rolling,
    rolling_windows,
    token_scores_jit,
)
from llm_jax.model import init_model

TOL = 1e-5
REF_LEN = 64
CFG = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=97, hidden_size=32,
    intermediate_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=8, initializer_range=0.3,  # logits that spread, so the argmax is clear
)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def reference_logits(model, inputs: list[int]) -> np.ndarray:
    """Logits [REF_LEN, V] (float64) of one forward over `inputs` alone, right-padded to REF_LEN
    (by causality the padding changes nothing before it), so that every reference shares one
    compiled forward. Remembered per input: several tests score the same requests."""
    key = (id(model), tuple(inputs))
    if key not in _REFERENCE:
        padded = list(inputs) + [0] * (REF_LEN - len(inputs))
        out = _forward(*nnx.split(model), jnp.asarray([padded], jnp.int32))
        _REFERENCE[key] = np.asarray(out[0], np.float64)
    return _REFERENCE[key]


_REFERENCE: dict[tuple, np.ndarray] = {}


def forward_score(model, context, continuation) -> tuple[float, bool]:
    """The reference: one forward over the request alone, log-softmax in numpy."""
    full = list(context) + list(continuation)
    logits = reference_logits(model, full[:-1])
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)
    n = len(continuation)
    rows = np.arange(len(full) - 1 - n, len(full) - 1)
    targets = np.asarray(full[-n:])
    return float(logp[rows, targets].sum()), bool((logits[rows].argmax(-1) == targets).all())


def requests(seed: int = 0, n: int = 11) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CFG.vocab_size, rng.integers(1, 30)).tolist(),
             rng.integers(0, CFG.vocab_size, rng.integers(1, 6)).tolist()) for _ in range(n)]


@pytest.mark.parametrize("pack", [False, True])
def test_batched_loglikelihoods_equal_a_full_forward_per_request(model, pack):
    reqs = requests()
    # batch_size 8 as the other tests here, so they share compiled programs: 11 requests still
    # run as a full and a partial batch.
    scores = loglikelihood(model, reqs, batch_size=8, pack=pack)
    for (ctx, cont), s in zip(reqs, scores):
        want, greedy = forward_score(model, ctx, cont)
        # each token's log-probability within TOL, so their sum within len(cont) TOL
        assert abs(s.logprob - want) <= TOL * len(cont), (s.logprob, want)
        assert s.is_greedy == greedy


@pytest.mark.parametrize("pack", [False, True])
def test_every_single_token_log_probability_is_within_1e_5_of_a_full_forward(model, pack):
    seq = np.random.default_rng(5).integers(0, CFG.vocab_size, 40).tolist()
    reqs = [(seq[:i], [seq[i]]) for i in range(1, 40)]
    for (ctx, cont), s in zip(reqs, loglikelihood(model, reqs, batch_size=8, pack=pack)):
        assert abs(s.logprob - forward_score(model, ctx, cont)[0]) <= TOL


def test_greedy_flag_is_true_exactly_for_the_argmax_continuation(model):
    ctx = [5, 6, 7, 8]
    logits = reference_logits(model, ctx)[len(ctx) - 1]
    best = int(logits.argmax())
    other = int(np.argsort(logits)[-2])
    scores = loglikelihood(model, [(ctx, [best]), (ctx, [other])])
    assert scores[0].is_greedy and not scores[1].is_greedy
    assert scores[0].logprob > scores[1].logprob
    for (c, cont), s in zip([(ctx, [best]), (ctx, [other])], scores):
        assert s.is_greedy == forward_score(model, c, cont)[1]


def test_a_request_longer_than_max_length_keeps_its_last_tokens(model):
    ctx, cont = list(range(1, 40)), [50, 51, 52]
    (s,) = loglikelihood(model, [(ctx, cont)], max_length=16)
    want, _ = forward_score(model, (ctx + cont)[-17:-3], cont)
    assert abs(s.logprob - want) <= TOL * len(cont)


def test_rolling_windows_score_every_token_once_with_the_most_context_that_fits():
    tokens = list(range(10, 30))
    for stride in (8, 3):
        windows = rolling_windows(tokens, prefix_id=1, max_length=8, stride=stride)
        assert [t for _, cont in windows for t in cont] == tokens
        full = [1, *tokens]
        for ctx, cont in windows:
            assert len(ctx) + len(cont) - 1 <= 8  # inputs fit the window
            start = len(full) - len(full[full.index(cont[0]):])  # cont[0]'s place in full
            assert ctx == full[start - len(ctx):start]
        if stride == 3:
            assert all(len(ctx) + len(cont) - 1 == 8 for ctx, cont in windows[3:-1])


def test_rolling_loglikelihood_with_the_whole_text_in_one_window_is_one_forward(model):
    tokens = list(range(3, 23))
    (total,) = loglikelihood_rolling(model, [tokens], prefix_id=2, max_length=64)
    want, _ = forward_score(model, [2], tokens)
    assert abs(total - want) <= TOL * len(tokens)
    (windowed,) = loglikelihood_rolling(model, [tokens], prefix_id=2, max_length=8)
    pieces = rolling_windows(tokens, 2, 8)
    want = sum(forward_score(model, c, t)[0] for c, t in pieces)
    assert abs(windowed - want) <= TOL * len(tokens)


@pytest.mark.parametrize("reqs, match", [
    ([([], [1])], r"requests\[0\] has an empty context"),
    ([([1], [])], r"requests\[0\] has an empty continuation"),
    ([([1], [2]), ([1, 500], [2])], r"requests\[1\] holds 500, outside the vocabulary"),
])
def test_bad_requests_raise_value_error_naming_them(model, reqs, match):
    with pytest.raises(ValueError, match=match):
        loglikelihood(model, reqs)


def test_new_requests_in_the_same_length_bucket_reuse_the_compiled_program(model):
    loglikelihood(model, [([1, 2, 3], [4]), ([5] * 9, [6, 7])], batch_size=8)
    size = token_scores_jit.for_platform()._cache_size()
    loglikelihood(model, [([8] * 12, [9, 10]), ([11], [12])], batch_size=8)
    assert token_scores_jit.for_platform()._cache_size() == size
