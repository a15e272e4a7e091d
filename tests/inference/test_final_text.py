"""A generation's final text is the tokenizer's decode of all its tokens (stop strings aside), also
when it ends in bytes that never formed a character (the token limit reached mid-character, or
invalid bytes): streaming holds such bytes back and the end releases them, as U+FFFD, as a
full decode gives them. With a byte-level BPE tokenizer (tests/helpers.make_checkpoint's), on
random id sequences and on `generate_until` of a random model."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_checkpoint

from llm_jax.inference.completions import GenerationRequest, generate_until
from llm_jax.inference.stops import StopText
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("final_text") / "tiny")


def test_streamed_and_final_text_equal_the_full_decode_of_random_ids(ckpt):
    tok = load_tokenizer(ckpt)
    rng = np.random.default_rng(0)
    partial = 0
    for n in range(200):
        ids = [int(i) for i in rng.integers(0, tok.vocab_size, int(rng.integers(1, 12)))]
        text = StopText(tok.decode)
        streamed = "".join(text.push(i) for i in ids) + text.finish()
        assert streamed == text.text == tok.decode(ids), ids
        partial += tok.decode(ids).endswith("\ufffd")
    assert partial > 10  # the case in question came up often


def test_generate_until_keeps_the_bytes_of_a_generation_cut_mid_character(ckpt):
    model, tok = load_pretrained(ckpt), load_tokenizer(ckpt)
    prompts = [tok.encode(w) for w in ("the cat", "one two three", "a", "blue water", "x y",
                                       "sat on", "birds", "park", "dog ran", "the the")]
    requests = [GenerationRequest(p, max_new_tokens=n, stop_ids=list(tok.stop_ids))
                for p in prompts for n in (3, 7)]
    out = generate_until(model, requests, tok.decode, slots=4)
    assert [g.text for g in out] == [tok.decode(g.tokens) for g in out]
    assert any(g.text.endswith("\ufffd") for g in out)  # generations that end mid-character
