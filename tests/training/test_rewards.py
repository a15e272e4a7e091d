"""Rewards: replies read from harmony's final channel (toy vocabulary and a real BPE tokenizer),
each reward's value on hand-written replies, Math-Verify's equivalences, weights, and bad reward
functions named."""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import pytest
from helpers import TOY_HARMONY_TOKENS, toy_decode, toy_encode

from llm_jax.data.hf_tokenizer import HFTokenizer
from llm_jax.data.tasks import Example
from llm_jax.training import rewards
from llm_jax.training.rewards import (
    REWARDS,
    Reply,
    RewardError,
    parse_rewards,
    reply_of,
    score,
)


class ToyHarmony:
    harmony = TOY_HARMONY_TOKENS
    decode = staticmethod(toy_decode)


class ToyPlain:
    """A tokenizer without harmony: byte b is id b, 0 is its end of sequence."""

    harmony = None
    eos_id = 0
    stop_ids = frozenset({0, 1})

    @staticmethod
    def decode(ids):
        return bytes(ids).decode()


ANSWER = "<|channel|>final<|message|>{}<|return|>"
REASONED = "<|channel|>analysis<|message|>6 times 7<|end|><|start|>assistant" + ANSWER


def example(answer: str = "42") -> Example:
    return Example("toy:0", "What is 6 * 7?", answer)


def reply(text: str) -> Reply:
    return reply_of(ToyHarmony, toy_encode(text))


# --------------------------------------------------------------------------- reading a reply

def test_harmony_reply_answer_is_the_final_channel_not_the_reasoning():
    r = reply(REASONED.format("42"))
    assert r == Reply(REASONED.format("42"), "42", True)


def test_harmony_reply_without_a_closed_final_message_has_no_answer():
    assert reply("<|channel|>analysis<|message|>42<|end|>") == \
        Reply("<|channel|>analysis<|message|>42<|end|>", "", False)
    cut = reply("<|channel|>final<|message|>42")  # the length limit struck mid-answer
    assert (cut.answer, cut.has_answer) == ("42", False)
    assert not reply("42").has_answer  # text outside any channel is no answer
    call = reply("<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{}<|call|>")
    assert not call.has_answer


def test_reply_of_a_real_harmony_tokenizer_reads_the_final_channel(harmony_tokenizer):
    tok = HFTokenizer(harmony_tokenizer)
    ids = np.asarray(tok.encode(REASONED.format("2 + 2 = 4.")), np.int32)
    r = reply_of(tok, ids)
    assert (r.answer, r.has_answer) == ("2 + 2 = 4.", True)
    assert rewards.exact(Example("x", "What is 2 + 2?", "2 + 2 = 4"), r) == 1.0


def test_plain_reply_is_the_whole_text_without_its_stop_tokens():
    r = reply_of(ToyPlain, list(b"answer: 42") + [1, 0])
    assert r == Reply("answer: 42", "answer: 42", True)
    assert not reply_of(ToyPlain, [ord(" "), 0]).has_answer


# --------------------------------------------------------------------------- each reward

@pytest.mark.parametrize("answer,expected", [
    ("42", 1.0), (" 42 ", 1.0), ("42.", 1.0), ("43", 0.0), ("4 2", 0.0), ("", 0.0)])
def test_exact_compares_normalised_answers(answer, expected):
    assert rewards.exact(example(), reply(ANSWER.format(answer))) == expected


def test_exact_normalises_case_and_whitespace_runs_on_both_sides():
    ex = Example("e", "Capital of France?", "  Paris\n")
    assert rewards.exact(ex, reply(ANSWER.format("paris."))) == 1.0
    assert rewards.exact(Example("e", "Sort: 3 1 2", "1 2 3"),
                         reply(ANSWER.format("1  2\t3"))) == 1.0


def test_exact_gives_nothing_for_the_right_text_outside_the_final_channel():
    assert rewards.exact(example(), reply("<|channel|>analysis<|message|>42<|end|>")) == 0.0
    assert rewards.exact(example(), reply("<|channel|>final<|message|>42")) == 0.0


@pytest.mark.parametrize("gold,answer", [
    ("1/2", "0.5"), ("0.5", "\\frac{1}{2}"), ("1/2", "$\\frac{1}{2}$"), ("1/2", "\\boxed{1/2}"),
    ("42", "42.0"), ("2\\sqrt{2}", "\\sqrt{8}"), ("x = 3", "3")])
def test_math_verify_accepts_equal_values_written_differently(gold, answer):
    assert rewards.math_equal(example(gold), reply(ANSWER.format(answer))) == 1.0


@pytest.mark.parametrize("gold,answer", [
    ("1/2", "0.51"), ("42", "24"), ("1/2", "banana"), ("1/2", ""),
    ("2\\sqrt{2}", "2"), ("2", "2\\sqrt{2}")])  # bare LaTeX read whole, not up to the "\\"
def test_math_verify_refuses_other_values_and_unparsable_answers(gold, answer):
    assert rewards.math_equal(example(gold), reply(ANSWER.format(answer))) == 0.0


def test_math_verify_needs_a_final_answer_and_runs_off_the_main_thread():
    assert rewards.math_equal(example("1/2"), reply("<|channel|>final<|message|>0.5")) == 0.0
    out = []
    worker = threading.Thread(target=lambda: out.append(
        rewards.math_equal(example("1/2"), reply(ANSWER.format("0.5")))))
    worker.start()
    worker.join()
    assert out == [1.0]


def test_format_rewards_a_closed_non_empty_final_answer():
    assert rewards.answer_format(example(), reply(REASONED.format("wrong"))) == 1.0
    assert rewards.answer_format(example(), reply(ANSWER.format(" "))) == 0.0
    assert rewards.answer_format(example(), reply("<|channel|>analysis<|message|>42<|end|>")) \
        == 0.0


# --------------------------------------------------------------------------- combining them

def test_parse_rewards_reads_names_and_weights():
    assert parse_rewards("exact:1, format:0.1,math_verify") == \
        [("exact", 1.0), ("format", 0.1), ("math_verify", 1.0)]
    assert parse_rewards("exact:-0.5") == [("exact", -0.5)]


@pytest.mark.parametrize("spec,match", [
    ("exact,exactly", "unknown reward 'exactly'"),
    ("exact,exact:2", "'exact' is given twice"),
    ("exact:abc", "weight of 'exact' is 'abc'"),
    ("exact:nan", "weight of 'exact' is 'nan'"),
    ("format:inf", "weight of 'format' is 'inf'"),
    (" , ", "names no reward"),
])
def test_parse_rewards_refuses_bad_specs_naming_the_field(spec, match):
    with pytest.raises(ValueError, match=f"rl.rewards={spec!r}.*{match}"):
        parse_rewards(spec)


def test_math_verify_without_its_package_is_refused_when_parsed(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    with pytest.raises(ImportError, match="math-verify>=0.9,<0.10"):
        parse_rewards("exact,math_verify")
    assert parse_rewards("exact") == [("exact", 1.0)]


def test_score_is_the_weighted_sum_and_reports_each_reward_unweighted():
    r = reply(REASONED.format("0.5"))
    total, each = score(parse_rewards("exact:2,math_verify:1,format:0.25"), example("1/2"), r)
    assert each == {"exact": 0.0, "math_verify": 1.0, "format": 1.0}
    assert total == pytest.approx(1.25)


def test_a_reward_that_raises_is_named_with_the_example(monkeypatch):
    def broken(ex, rep):
        raise KeyError("level")

    monkeypatch.setitem(REWARDS, "broken", broken)
    with pytest.raises(RewardError, match="reward 'broken' raised on example 'toy:0': "
                                          "KeyError") as info:
        score(parse_rewards("exact,broken"), example(), reply(ANSWER.format("42")))
    assert (info.value.reward, info.value.example_id) == ("broken", "toy:0")


@pytest.mark.parametrize("value", [math.nan, math.inf, None, "1"])
def test_a_reward_that_returns_no_finite_number_is_named_with_the_example(monkeypatch, value):
    monkeypatch.setitem(REWARDS, "odd", lambda ex, rep: value)
    with pytest.raises(RewardError, match=f"reward 'odd' returned {value!r} on example "
                                          "'toy:0'"):
        score([("odd", 1.0)], example(), reply(ANSWER.format("42")))


def test_a_reward_may_return_any_real_number_type(monkeypatch):
    monkeypatch.setitem(REWARDS, "np", lambda ex, rep: np.float32(0.5))
    monkeypatch.setitem(REWARDS, "flag", lambda ex, rep: True)
    assert score([("np", 2.0), ("flag", 1.0)], example(), reply("")) == \
        (2.0, {"np": 0.5, "flag": 1.0})
