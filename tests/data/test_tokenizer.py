"""The byte-fallback BPE tokenizer: exact round trips, byte accounting, clear size errors."""

from __future__ import annotations

import glob
import os
import random

import numpy as np
import pytest

from llm_jax.data.tokenizer import Tokenizer, load_or_train, utf8_len

TRICKY = [
    "",
    " ",
    "\n",
    "\n\n\n",
    "\t\tx\t",
    "def f(x):\n    return x  # trailing   \n",
    "  leading and trailing  ",
    "a\r\nb\rc",
    "x\u2581y \u2581\u2581 z\u2581",  # sentencepiece's own space marker, literally
    "nul\x00 bel\x07 esc\x1b del\x7f",
    "\u00a0nbsp\u2028line\u2029para\ufeffbom",
    "naïve café — 日本語 🎉 \U0010ffff",
    "1234567890 3.14159e-10",
]


@pytest.fixture(scope="module")
def tok(corpus_dir) -> Tokenizer:
    texts = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(f"{corpus_dir}/*"))]
    return Tokenizer.train(texts, 400)


def _random_strings(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    pools = [(0, 0x80), (0, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randrange(0, 60)):
            lo, hi = rng.choice(pools)
            chars.append(rng.choice([chr(rng.randrange(lo, hi)), " ", "\n", "\t", "\u2581"]))
        out.append("".join(chars))
    return out


def test_roundtrips_tricky_whitespace_control_and_unicode(tok):
    for s in TRICKY:
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_roundtrips_random_strings(tok):
    for s in _random_strings(seed=0, n=2000):
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_roundtrips_real_code(tok, corpus_dir):
    for path in sorted(glob.glob(f"{corpus_dir}/*")):
        text = open(path, encoding="utf-8", newline="").read()
        assert tok.decode(tok.encode(text)) == text, path


def test_newline_and_indentation_are_single_pieces(tok):
    assert len(tok.encode("\n")) == 1
    assert len(tok.encode("    ")) == 1


def test_token_byte_lengths_sum_to_the_utf8_length(tok):
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (tok.vocab_size,) and lengths.dtype == np.int32
    assert lengths[[tok.pad_id, tok.bos_id, tok.eos_id]].sum() == 0
    for s in TRICKY + _random_strings(seed=1, n=500):
        assert lengths[tok.encode(s)].sum() == utf8_len(s), repr(s)


def test_special_ids_are_distinct_and_in_range(tok):
    ids = {tok.pad_id, tok.bos_id, tok.eos_id}
    assert len(ids) == 3 and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.vocab_size == 400


def test_training_is_deterministic(corpus_dir):
    texts = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(f"{corpus_dir}/*"))]
    a, b = Tokenizer.train(texts, 420), Tokenizer.train(texts, 420)
    assert a.fingerprint == b.fingerprint


def test_vocab_too_small_for_the_byte_fallback_raises_naming_the_limit(corpus_dir):
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*at least \d+"):
        Tokenizer.train(["some text\nmore text"], 100)


def test_vocab_too_large_for_the_corpus_raises_naming_the_limit():
    with pytest.raises(ValueError, match=r"vocab_size=5000 is too large.*at most \d+"):
        Tokenizer.train(["def f(x):\n    return x\n"] * 10, 5000)


def test_save_load_gives_the_same_ids(tok, tmp_path):
    path = str(tmp_path / "tok" / "tokenizer.model")
    tok.save(path)
    loaded = Tokenizer.load(path)
    s = TRICKY[5] + TRICKY[8]
    assert loaded.encode(s) == tok.encode(s) and loaded.fingerprint == tok.fingerprint


def test_load_or_train_reuses_a_saved_model_and_refuses_another_vocab(tok, tmp_path):
    path = str(tmp_path / "tokenizer.model")
    tok.save(path)
    mtime = os.path.getmtime(path)
    never = iter(())  # training would see no text and fail: proves the model was reused
    assert load_or_train(path, never, 400, 1000).fingerprint == tok.fingerprint
    assert os.path.getmtime(path) == mtime
    with pytest.raises(ValueError, match="vocab_size=400.*vocab_size=512"):
        load_or_train(path, never, 512, 1000)
