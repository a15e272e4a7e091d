"""Continuous batching: the engine gives each prompt the tokens `sample` gives it alone (greedy
and sampled), a request's greedy tokens do not change when it joins a busy batch, slots return
to the pool (finish, cancel, timeout), the queue is bounded, `generate_until` honours stop
strings, stop tokens and per-request settings, and streamed text never shows a stop string."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from helpers import make_checkpoint

from llm_jax.config import ModelConfig
from llm_jax.inference import engine as engine_module
from llm_jax.inference.completions import GenerationRequest, generate_until
from llm_jax.inference.engine import Engine, decode_jit, prefill_jit
from llm_jax.inference.requests import EngineConfig, QueueFull, SamplingParams, Sequence
from llm_jax.inference.sampler import sample
from llm_jax.inference.stops import StopText
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.model import init_model

CFG = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=97, hidden_size=32,
    intermediate_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=8, initializer_range=0.3,  # logits that spread, so the argmax is clear
)
# Two prompt buckets (16, 32): the warmup test compiles the second one's prefills.
ENGINE = EngineConfig(slots=4, max_len=32, max_queue=8, max_prefill=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
           [40], [41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, ENGINE)


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> Sequence:
    seq = engine.submit(Sequence(prompt, params))
    engine.run_until_idle()
    return seq


def test_each_sequence_gets_the_greedy_tokens_sample_gives_it_alone(model, engine):
    seqs = [engine.submit(Sequence(p, SamplingParams(max_new_tokens=12))) for p in PROMPTS[:4]]
    engine.run_until_idle()
    for p, s in zip(PROMPTS, seqs):
        assert s.tokens == sample(model, p, max_new_tokens=12)
        assert s.finish_reason == "length"
    assert engine.stats()["free_slots"] == ENGINE.slots


def test_greedy_tokens_are_the_same_alone_and_after_joining_a_busy_batch(engine):
    alone = run(engine, PROMPTS[2], SamplingParams(max_new_tokens=20)).tokens
    busy = [engine.submit(Sequence(p, SamplingParams(max_new_tokens=20))) for p in PROMPTS[:3]]
    for _ in range(5):
        engine.step()
    late = engine.submit(Sequence(PROMPTS[2], SamplingParams(max_new_tokens=20)))
    engine.step()
    assert late.slot is not None and sum(s.slot is not None for s in busy) == 3
    engine.run_until_idle()
    assert late.tokens == alone
    assert engine.stats()["free_slots"] == ENGINE.slots


@pytest.mark.slow
def test_sampled_tokens_equal_sample_with_the_same_seed(model, engine):
    for top_p in (1.0, 0.9):
        params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=top_p, seed=3)
        seqs = [engine.submit(Sequence(p, params)) for p in PROMPTS[:2]]
        engine.run_until_idle()
        for p, s in zip(PROMPTS, seqs):
            assert s.tokens == sample(model, p, max_new_tokens=10, temperature=0.8, top_p=top_p,
                                      seed=3)


def test_cancelled_and_timed_out_sequences_free_their_slots(engine):
    a = engine.submit(Sequence(PROMPTS[0], SamplingParams(max_new_tokens=20)))
    b = engine.submit(Sequence(PROMPTS[1], SamplingParams(max_new_tokens=20), timeout=0.0))
    engine.step()
    a.cancel()
    engine.run_until_idle()
    assert (a.finish_reason, b.finish_reason) == ("cancelled", "timeout")
    assert len(a.tokens) < 20 and engine.stats() | {"steps": 0} == {
        "slots": 4, "busy_slots": 0, "free_slots": 4, "waiting": 0, "steps": 0}


def test_a_full_queue_refuses_and_a_request_that_cannot_fit_is_a_value_error(engine):
    with pytest.raises(ValueError, match="needs 70 positions, more than max_len=32"):
        engine.submit(Sequence([1] * 10, SamplingParams(max_new_tokens=60)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(Sequence([1, 97], SamplingParams()))
    with pytest.raises(ValueError, match="temperature"):
        engine.submit(Sequence([1], SamplingParams(temperature=-1.0)))
    seqs = [engine.submit(Sequence([1, 2], SamplingParams(max_new_tokens=2)))
            for _ in range(ENGINE.max_queue)]
    with pytest.raises(QueueFull, match="max_queue=8"):
        engine.submit(Sequence([1, 2], SamplingParams()))
    engine.run_until_idle()
    assert all(s.finish_reason == "length" for s in seqs)


def test_generate_until_honours_stop_strings_stop_tokens_and_per_request_settings(model, engine):
    greedy = [sample(model, p, max_new_tokens=12) for p in PROMPTS[:3]]
    text0 = letters(greedy[0])
    stop = text0[4:6]  # a stop string that first appears at character 4 or earlier
    requests = [
        GenerationRequest(PROMPTS[0], max_new_tokens=12, stop=[stop]),
        GenerationRequest(PROMPTS[1], max_new_tokens=12, stop_ids=[greedy[1][3]]),
        GenerationRequest(PROMPTS[2], max_new_tokens=5),
        GenerationRequest(PROMPTS[3], max_new_tokens=7, temperature=1.0, seed=5),
    ]
    out = generate_until(engine, requests, letters)
    assert out[0].text == text0[:text0.find(stop)] and out[0].finish_reason == "stop"
    i = greedy[1].index(greedy[1][3])
    assert out[1].tokens == greedy[1][:i] and out[1].finish_reason == "stop"
    assert out[2].tokens == greedy[2][:5] and out[2].finish_reason == "length"
    assert out[3].tokens == sample(model, PROMPTS[3], max_new_tokens=7, temperature=1.0, seed=5)
    assert engine.stats()["free_slots"] == ENGINE.slots


def test_streamed_text_never_shows_a_stop_string_or_half_a_character():
    pieces = {1: b"he", 2: b"llo", 3: b" wo", 4: b"rld", 5: b"\xc3", 6: b"\xa9", 7: b"!"}

    def decode(ids: list[int]) -> str:  # byte-level, as a BPE or byte-fallback tokenizer
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    t = StopText(decode, stop=["lo w", "xyz"])
    out = [t.push(1), t.push(2), t.push(3)]
    assert out == ["he", "l", ""] and t.stopped and t.text == "hel"
    t = StopText(decode, stop=["ld!"])
    shown = "".join(t.push(i) for i in (1, 2, 3, 4)) + t.finish()
    assert shown == "hello world" and not t.stopped
    t = StopText(decode)
    assert [t.push(1), t.push(5), t.push(6), t.push(7)] == ["he", "", "\xe9", "!"]
    t = StopText(decode)
    assert [t.push(1), t.push(5), t.finish()] == ["he", "", "\ufffd"]  # cut off mid-character
    t = StopText(decode, stop=["\xe9!"])  # a stop string that starts inside a character
    assert "".join([t.push(1), t.push(5), t.push(6), t.push(7)]) == "he" and t.stopped


def test_incremental_text_equals_decoding_everything_at_once():
    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(make_checkpoint(Path(d) / "ck"))
    ids = tok.encode("the cat sat on a mat \u00e9t\u00e9 \U0001f389 near blue water " * 3)
    for stop in ([], ["blue w"]):
        t = StopText(tok.decode, stop)
        shown = "".join(t.push(i) for i in ids) + t.finish()
        full = tok.decode(ids)
        assert shown == (full[:full.find(stop[0])] if stop else full)


def test_the_engine_thread_serves_submissions_from_other_threads(model):
    engine = Engine(model, ENGINE)
    engine.start()
    try:
        seq = engine.submit(Sequence(PROMPTS[0], SamplingParams(max_new_tokens=12)))
        assert seq.done.wait(120)
        assert seq.tokens == sample(model, PROMPTS[0], max_new_tokens=12)
    finally:
        engine.close()
    assert engine.thread is not None and not engine.thread.is_alive()


def test_warmup_compiles_every_prompt_bucket_and_mode_and_changes_no_result(model, engine):
    warm = Engine(model, ENGINE)
    assert warm.prompt_buckets() == [16, 32]
    warm.warmup()
    sizes = prefill_jit.for_platform()._cache_size(), decode_jit.for_platform()._cache_size()
    prompts = [list(range(1, 1 + n)) for n in (3, 20, 9, 5)]
    # each mode: greedy, sampled (a request's default, temperature 1), sampled with top-p
    greedy = SamplingParams(max_new_tokens=6)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=1), greedy,
              SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=2), greedy]

    def requests(e: Engine) -> list[Sequence]:
        """Four at once (filtered mode), then one greedy and one sampled alone."""
        seqs = [e.submit(Sequence(p, sp)) for p, sp in zip(prompts, params)]
        e.run_until_idle()
        for i in (1, 0):
            seqs.append(e.submit(Sequence(prompts[i], params[i])))
            e.run_until_idle()
        return seqs

    seqs = requests(warm)
    compiled = prefill_jit.for_platform()._cache_size(), decode_jit.for_platform()._cache_size()
    assert compiled == sizes
    # The reference: the module's engine, never warmed up, running the same requests with the
    # programs just compiled (engine == `sample`: the tests above).
    assert [s.tokens for s in seqs] == [s.tokens for s in requests(engine)]
    assert seqs[4].tokens == seqs[1].tokens and seqs[5].tokens == seqs[0].tokens
    # and the second bucket's prompt (20 tokens, padded to 32) gets what `sample` gives it
    assert seqs[1].tokens == sample(model, prompts[1], max_new_tokens=6)


def test_a_failing_step_ends_its_sequences_with_an_error_and_the_engine_goes_on(model,
                                                                                 monkeypatch):
    engine = Engine(model, ENGINE)
    real = engine_module.decode_jit
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "decode_jit", broken)
    engine.start()
    try:
        bad = engine.submit(Sequence(PROMPTS[0], SamplingParams(max_new_tokens=5)))
        assert bad.done.wait(120) and bad.finish_reason == "error"
        good = engine.submit(Sequence(PROMPTS[0], SamplingParams(max_new_tokens=5)))
        assert good.done.wait(120) and good.finish_reason == "length"
        assert good.tokens == sample(model, PROMPTS[0], max_new_tokens=5)
    finally:
        engine.close()
    assert engine.stats()["free_slots"] == ENGINE.slots


def test_recorded_log_probs_and_routing_are_what_a_training_forward_of_the_same_tokens_gives(
        model):
    """An engine with `record` (RL rollouts): each sampled token's log-prob equals the training
    forward's log-softmax(logits / T) at that token (float32, 2e-5), the experts each fed
    position was routed to equal the training forward's, and replaying them there changes no
    logit. One sequence stops at a stop token, one at its length, one is greedy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    engine = Engine(model, dataclasses.replace(ENGINE, record=True))
    params = [SamplingParams(max_new_tokens=10, temperature=0.7, seed=3),
              SamplingParams(max_new_tokens=10, temperature=1.3, seed=4,
                             stop_ids=frozenset(range(0, 97, 3))),
              SamplingParams(max_new_tokens=6)]
    seqs = [engine.submit(Sequence(p, sp)) for p, sp in zip(PROMPTS, params)]
    engine.run_until_idle()
    assert {s.finish_reason for s in seqs} == {"length", "stop"}
    # One training forward over the three sequences right-padded to one length (causal: the
    # padding changes nothing before it), so one program serves them all; the replay feeds the
    # recorded experts and, past each sequence, the forward's own.
    forward = jax.jit(lambda m, t, e: m(t, return_aux=True, experts_BTLk=e), static_argnums=0)
    fulls = [s.prompt + s.tokens + ([s.stop_token] if s.stop_token is not None else [])
             for s in seqs]
    width = max(len(f) for f in fulls) - 1
    inputs = jnp.asarray([f[:-1] + [0] * (width - len(f) + 1) for f in fulls], jnp.int32)
    logits, aux = forward(model, inputs, None)
    routed = np.moveaxis(np.asarray(aux.experts), 0, 2)  # [B, T, L, k]
    replay = routed.copy()
    for b, (seq, sp, full) in enumerate(zip(seqs, params, fulls)):
        sampled = full[len(seq.prompt):]
        temp = sp.temperature or 1.0
        n = len(full) - 1
        logp = jax.nn.log_softmax(logits[b, :n] / temp)[np.arange(n), full[1:]]
        assert len(seq.logprobs) == len(sampled)
        np.testing.assert_allclose(seq.logprobs, logp[len(seq.prompt) - 1:], atol=2e-5)
        routing = np.stack(seq.routing)
        assert routing.shape == (n, CFG.num_hidden_layers, CFG.experts_per_token)
        np.testing.assert_array_equal(routing, routed[b, :n])
        replay[b, :n] = routing
    replayed, _ = forward(model, inputs, jnp.asarray(replay))
    np.testing.assert_array_equal(replayed, logits)
    plain = Engine(model, ENGINE)  # without `record`: the same tokens, nothing recorded
    again = [plain.submit(Sequence(p, sp)) for p, sp in zip(PROMPTS, params)]
    plain.run_until_idle()
    assert [s.tokens for s in again] == [s.tokens for s in seqs]
    assert all(s.logprobs == [] and s.routing == [] for s in again)
