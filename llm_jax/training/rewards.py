"""Rewards for RL: functions of (example, reply) -> float, combined with weights.

A reply is read once (`reply_of`): on a tokenizer that speaks harmony its answer is the final
channel's text (what gpt-oss shows the user; reasoning on the analysis channel is not scored),
and a reply with no final message that closed (none written, or cut off by the length limit)
has no answer; on another tokenizer the answer is the whole decoded text, stop tokens left out.

The rewards (`REWARDS`, chosen and weighted by a spec such as "exact:1,format:0.1"):
- `exact`: 1 when the answer equals the reference after normalising both (surrounding
  whitespace, runs of whitespace, case, one trailing period), else 0.
- `math_verify`: 1 when HF's Math-Verify (PyPI `math-verify`) finds the answer mathematically
  equal to the reference ("1/2", "0.5" and "\\frac{1}{2}" agree), else 0.
- `format`: 1 when the reply has a non-empty answer (on harmony: a closed final message).
`score` adds the weighted rewards; a reward that raises or returns a value that is not a finite
number raises `RewardError` naming the reward and the example, so a bad reward function stops
the run with its name instead of training on garbage.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from llm_jax.data import harmony
from llm_jax.data.tasks import Example

MATH_VERIFY_PIN = "math-verify>=0.9,<0.10"


@dataclasses.dataclass(frozen=True)
class Reply:
    """A decoded completion: `text` all of it, `answer` what the rewards score (module doc),
    `has_answer` False when a harmony reply closed no final message."""

    text: str
    answer: str
    has_answer: bool


def reply_of(tokenizer: Any, token_ids: Sequence[int]) -> Reply:
    """The reply in `token_ids` (a completion: what followed the prompt's `<|start|>assistant`,
    its stop token included or not). `tokenizer` needs `decode(ids) -> str` and `harmony`
    (its HarmonyTokens, or None), as `HFTokenizer` and `CheckpointTokenizer` have; its
    `stop_ids` or `eos_id`, when it has them, are left out of a non-harmony reply's text."""
    ids = [int(t) for t in token_ids]
    tokens = getattr(tokenizer, "harmony", None)
    if tokens is not None:
        messages = harmony.parse(tokens, ids, tokenizer.decode)
        final = [m for m in messages if m.channel == "final" and m.recipient is None]
        return Reply(tokenizer.decode(ids), harmony.final_text(messages),
                     any(m.end is not None for m in final))
    stops = set(getattr(tokenizer, "stop_ids", None) or ())
    if getattr(tokenizer, "eos_id", None) is not None:
        stops.add(tokenizer.eos_id)
    while ids and ids[-1] in stops:
        ids.pop()
    text = tokenizer.decode(ids)
    return Reply(text, text, bool(text.strip()))


# --------------------------------------------------------------------------- the rewards

RewardFn = Callable[[Example, Reply], float]


def normalise(text: str) -> str:
    """Text compared by `exact`: whitespace runs as one space, trimmed, case-folded, one
    trailing period dropped."""
    text = re.sub(r"\s+", " ", text).strip().casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact(example: Example, reply: Reply) -> float:
    return float(reply.has_answer and normalise(reply.answer) == normalise(example.answer))


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(f"the math_verify reward needs the math-verify package: pip install "
                          f"'{MATH_VERIFY_PIN}' (or llm_jax's `rl` extra)") from e
    return math_verify


def _delimited(text: str) -> str:
    """LaTeX written without math delimiters, in $...$: Math-Verify reads bare "2\\sqrt{2}" as 2
    (its plain-expression reader stops at the backslash)."""
    if "\\" in text and not any(d in text for d in ("$", "\\(", "\\[")):
        return f"${text}$"
    return text


def math_equal(example: Example, reply: Reply) -> float:
    """Math-Verify's `verify(parse(reference), parse(answer))`. Its timeouts use SIGALRM,
    which only the main thread may set: off in other threads."""
    if not reply.has_answer:
        return 0.0
    mv = _math_verify()
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(_delimited(example.answer), parsing_timeout=timeout)
    answer = mv.parse(_delimited(reply.answer), parsing_timeout=timeout)
    return float(bool(gold and answer and mv.verify(gold, answer, timeout_seconds=timeout)))


def answer_format(example: Example, reply: Reply) -> float:
    return float(reply.has_answer and bool(reply.answer.strip()))


REWARDS: dict[str, RewardFn] = {
    "exact": exact,
    "math_verify": math_equal,
    "format": answer_format,
}
_NEEDS = {"math_verify": _math_verify}  # checked when a spec names the reward


def parse_rewards(spec: str, field: str = "rl.rewards") -> list[tuple[str, float]]:
    """"name:weight,name,..." (a weight left out is 1) as [(name, weight)]; an unknown or
    repeated name, a weight that is not a finite number, or an empty spec is refused naming
    `field`, and a reward whose package is missing fails here rather than mid-run."""
    out: list[tuple[str, float]] = []
    for part in str(spec).split(","):
        if not part.strip():
            continue
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"config field {field}={spec!r}: unknown reward {name!r}; known: "
                             f"{sorted(REWARDS)}")
        if any(name == n for n, _ in out):
            raise ValueError(f"config field {field}={spec!r}: reward {name!r} is given twice")
        try:
            value = float(weight) if weight.strip() else 1.0
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"config field {field}={spec!r}: the weight of {name!r} is "
                             f"{weight.strip()!r}, expected a finite number")
        if name in _NEEDS:
            _NEEDS[name]()
        out.append((name, value))
    if not out:
        raise ValueError(f"config field {field}={spec!r} names no reward: expected "
                         f"'name:weight,...' from {sorted(REWARDS)}")
    return out


class RewardError(RuntimeError):
    """A reward function raised or returned a value that is not a finite number."""

    def __init__(self, message: str, reward: str, example_id: str):
        super().__init__(message)
        self.reward, self.example_id = reward, example_id


def score(rewards: Sequence[tuple[str, float]], example: Example, reply: Reply
          ) -> tuple[float, dict[str, float]]:
    """(sum of weight * reward, each reward's unweighted value) of one reply."""
    total, each = 0.0, {}
    for name, weight in rewards:
        try:
            value = REWARDS[name](example, reply)
        except Exception as e:
            raise RewardError(f"reward {name!r} raised on example {example.id!r}: "
                              f"{type(e).__name__}: {e}", name, example.id) from e
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value!r} on example {example.id!r}: "
                              "expected a finite number", name, example.id)
        each[name] = float(value)
        total += weight * float(value)
    return total, each
