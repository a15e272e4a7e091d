"""Verifiable tasks for RL and its SFT warm-up: prompts whose reference answers a program checks,
all offline.

Generated (any number of examples, nothing read):
- `arithmetic`: "What is 17 + 25 - 8?" -> "34": task.min_terms to task.max_terms operands drawn
  from [task.min_operand, task.max_operand], joined by operators from task.operators ("+-"),
  evaluated left to right. With task.show_work the reference reply writes the partial results
  ("17 + 25 = 42, 42 - 8 = 34") in the reasoning (harmony's analysis channel) before the answer.
- `sort`: "Sort: 5 3 9 1" -> "1 3 5 9": as many items, from the same range, sorted ascending.
Read:
- `jsonl`: users' own JSONL (task.files, a glob): one object per line, the prompt (a string)
  under task.prompt_key, the reference answer (a string or a number) under task.answer_key; the
  row's other fields are kept in `Example.fields` for reward functions. A malformed line is named
  by file:line and skipped (counted, logged) or stops the run (task.on_bad_line); an empty file,
  or files with no valid row, are refused by name.

Held out: a problem is in the eval split when the hash of its prompt falls below
task.eval_fraction, so no train example is ever an eval problem, whatever the seed, and the SFT
warm-up never sees one. Generated train example i is drawn from a generator seeded by
(task.seed, i), skipping held-out problems; the eval split is the first task.eval_size distinct
held-out problems drawn from (task.seed, eval). A JSONL task's train index walks its train rows
in a new order each epoch (seeded by task.seed and the epoch); its eval split is its held-out
rows in file order (at most task.eval_size of them when that is > 0).

`identity()` is what a resumed run compares: the task's settings and, for JSONL, each file's
sha256. `solution(example)` is the reference reply (the answer as the rewards read it) and
`conversation(task, example)` the SFT row of an example (user prompt, assistant reply with its
reasoning), what `llm_jax.data.sft` trains the warm-up on. `write_task_tokenizer` writes a
byte-level BPE tokenizer.json with harmony's special tokens, trained on the task's rendered
conversations (digits one token each), for a model trained from scratch on the task.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from absl import logging

from llm_jax.config import doc_field
from llm_jax.data import harmony
from llm_jax.data.config import ON_BAD_LINE
from llm_jax.data.hf_tokenizer import TOKENIZER_FILE
from llm_jax.data.local_text import path_hash_fraction

SPLITS = ("train", "eval")
ARITHMETIC_OPERATORS = "+-"
# Draws allowed per held-out problem found before a generator is declared too small for its
# eval split (the space of problems it can write is what is short).
_DRAWS_PER_EXAMPLE = 1000


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The run config's `task` section: which task, and its options (unused ones are ignored by
    the other tasks, except `files`: refused unless the task is jsonl)."""

    name: str = doc_field("", "verifiable task: '' = none, arithmetic, sort or jsonl")
    seed: int = doc_field(0, "the examples drawn (generators), the train order of each epoch "
                             "(jsonl)")
    eval_fraction: float = doc_field(0.1, "share of problems held out, by the prompt's hash")
    eval_size: int = doc_field(200, "held-out examples in the eval split (generators: 0 = none; "
                                    "jsonl: 0 = every held-out row)")
    sft_examples: int = doc_field(4096, "train examples the SFT warm-up renders (jsonl: at most "
                                        "its rows)")
    files: str = doc_field("", "jsonl: glob of JSONL files, one {prompt_key, answer_key} a line")
    prompt_key: str = doc_field("prompt", "jsonl: the field holding the prompt (the user's "
                                          "message, a string)")
    answer_key: str = doc_field("answer", "jsonl: the field holding the reference answer (a "
                                          "string or number)")
    on_bad_line: str = doc_field("skip", "jsonl: skip (counted, logged by file:line) or stop at "
                                         "a bad line")
    # The generators draw min_terms..max_terms operands (items) from [min_operand, max_operand].
    min_operand: int = doc_field(0, "generators: smallest operand or item")
    max_operand: int = doc_field(50, "generators: largest operand or item")
    min_terms: int = doc_field(2, "generators: fewest operands or items a problem")
    max_terms: int = doc_field(2, "generators: most operands or items a problem")
    operators: str = doc_field("+-", "arithmetic: the operators drawn from, a subset of '+-'")
    show_work: bool = doc_field(False, "arithmetic: partial results in the reference reply's "
                                       "reasoning")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_section(cls, section: Any) -> TaskConfig:
        """The `task` section (a ConfigDict, a mapping or a TaskConfig), validated: an unknown
        field or a bad value is refused naming `task.<field>`."""
        if isinstance(section, TaskConfig):
            return section.validated()
        d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown config field(s) {[f'task.{k}' for k in unknown]}; known "
                             f"in task: {sorted(known)}")
        return cls(**d).validated()

    def validated(self) -> TaskConfig:
        def bad(field: str, expected: str) -> ValueError:
            return ValueError(f"config field task.{field}={getattr(self, field)!r} is invalid: "
                              f"expected {expected}")

        if self.name and self.name not in TASKS:
            raise bad("name", f"one of {[''] + sorted(TASKS)}")
        if self.on_bad_line not in ON_BAD_LINE:
            raise bad("on_bad_line", f"one of {list(ON_BAD_LINE)}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise bad("eval_fraction", "a fraction in [0, 1)")
        for field in ("eval_size", "sft_examples", "min_operand"):
            if getattr(self, field) < 0:
                raise bad(field, ">= 0")
        if self.max_operand < self.min_operand:
            raise bad("max_operand", f">= task.min_operand={self.min_operand}")
        if self.min_terms < 1:
            raise bad("min_terms", ">= 1")
        if self.max_terms < self.min_terms:
            raise bad("max_terms", f">= task.min_terms={self.min_terms}")
        if not self.operators or set(self.operators) - set(ARITHMETIC_OPERATORS):
            raise bad("operators", f"a non-empty subset of {ARITHMETIC_OPERATORS!r}")
        if self.name == "jsonl":
            if not self.files:
                raise bad("files", "a glob of JSONL files (task.name='jsonl' reads them)")
            if not self.prompt_key or not self.answer_key or self.prompt_key == self.answer_key:
                raise bad("answer_key", f"a field name other than task.prompt_key="
                                        f"{self.prompt_key!r}, both non-empty")
        elif self.files:
            raise bad("files", f"'' for task.name={self.name!r} (only 'jsonl' reads files)")
        if self.name and self.name != "jsonl" and self.eval_size and not self.eval_fraction:
            raise bad("eval_fraction", f"> 0 for task.eval_size={self.eval_size} held-out "
                                       "problems")
        return self


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: `prompt` is the user's message, `answer` the reference answer, `fields` the
    JSONL row's other fields or the generator's parameters."""

    id: str
    prompt: str
    answer: str
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Task(Protocol):
    """A source of verifiable examples (module doc)."""

    name: str

    def example(self, split: str, index: int) -> Example:
        """Example `index` of `split` ("train": any index >= 0; "eval": < size("eval"))."""

    def size(self, split: str) -> int | None:
        """How many distinct examples `split` holds (None: train of a generator, unbounded)."""

    def identity(self) -> dict[str, Any]:
        """What a resumed run compares (JSON: the settings, files' hashes)."""

    def solution(self, example: Example) -> str:
        """The reference assistant reply: the answer as the rewards read it."""

    def reasoning(self, example: Example) -> str:
        """Reasoning written before the answer in the reference reply ("" for none)."""


def held_out(prompt: str, eval_fraction: float) -> bool:
    """Whether a problem is in the eval split (module doc)."""
    return path_hash_fraction(prompt) < eval_fraction


def _check_split(task: Task, split: str, index: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    if not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"index={index!r}: expected an integer >= 0")
    size = task.size(split)
    if split == "eval" and index >= (size or 0):
        raise IndexError(f"{task.name} eval example {index}: the eval split holds {size}")


# --------------------------------------------------------------------------- generators

class GeneratedTask:
    """Shared by the generators: the split by prompt hash, seeded draws, the distinct eval set.
    A subclass writes `draw(rng) -> (prompt, answer, fields)`."""

    name = ""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self._eval = self._eval_examples() if cfg.eval_size else []

    def draw(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
        raise NotImplementedError

    def _draws(self, rng: np.random.Generator, held: bool, limit: int, what: str):
        for _ in range(limit):
            prompt, answer, fields = self.draw(rng)
            if held_out(prompt, self.cfg.eval_fraction) == held:
                yield prompt, answer, fields
        c = self.cfg
        raise ValueError(
            f"task {self.name!r} found too few {what} problems in {limit} draws: the problems "
            f"task.min_operand={c.min_operand}..task.max_operand={c.max_operand} with "
            f"task.min_terms={c.min_terms}..task.max_terms={c.max_terms} allow are too few for "
            f"task.eval_fraction={c.eval_fraction} and task.eval_size={c.eval_size}")

    def _eval_examples(self) -> list[Example]:
        rng = np.random.default_rng([self.cfg.seed, 1])
        seen: set[str] = set()
        out = []
        limit = _DRAWS_PER_EXAMPLE * self.cfg.eval_size
        for prompt, answer, fields in self._draws(rng, True, limit, "distinct held-out"):
            if prompt in seen:
                continue
            seen.add(prompt)
            out.append(Example(f"{self.name}:eval:{len(out)}", prompt, answer, fields))
            if len(out) == self.cfg.eval_size:
                break
        return out

    def example(self, split: str, index: int) -> Example:
        _check_split(self, split, index)
        if split == "eval":
            return self._eval[index]
        rng = np.random.default_rng([self.cfg.seed, 0, int(index)])
        prompt, answer, fields = next(self._draws(rng, False, _DRAWS_PER_EXAMPLE, "train"))
        return Example(f"{self.name}:train:{index}", prompt, answer, fields)

    def size(self, split: str) -> int | None:
        return None if split == "train" else len(self._eval)

    def identity(self) -> dict[str, Any]:
        c = self.cfg
        return {"name": self.name, "seed": c.seed, "eval_fraction": c.eval_fraction,
                "eval_size": c.eval_size, "min_operand": c.min_operand,
                "max_operand": c.max_operand, "min_terms": c.min_terms,
                "max_terms": c.max_terms, **self._identity()}

    def _identity(self) -> dict[str, Any]:
        return {}

    def solution(self, example: Example) -> str:
        return example.answer

    def reasoning(self, example: Example) -> str:
        return ""

    def _numbers(self, rng: np.random.Generator) -> list[int]:
        c = self.cfg
        n = int(rng.integers(c.min_terms, c.max_terms + 1))
        return [int(v) for v in rng.integers(c.min_operand, c.max_operand + 1, n)]


Step = tuple[int, str, int, int]  # (left, operator, right, result)


def arithmetic_steps(terms: Sequence[int], operators: Sequence[str]) -> list[Step]:
    """Each step of evaluating the terms left to right."""
    steps, value = [], terms[0]
    for op, t in zip(operators, terms[1:]):
        result = value + t if op == "+" else value - t
        steps.append((value, op, t, result))
        value = result
    return steps


class ArithmeticTask(GeneratedTask):
    """Sums and differences of small integers (module doc)."""

    name = "arithmetic"

    def draw(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
        terms = self._numbers(rng)
        ops = [self.cfg.operators[int(i)]
               for i in rng.integers(0, len(self.cfg.operators), len(terms) - 1)]
        expression = " ".join([str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:])])
        steps = arithmetic_steps(terms, ops)
        value = steps[-1][3] if steps else terms[0]
        return (f"What is {expression}?", str(value),
                {"terms": terms, "operators": ops, "expression": expression})

    def _identity(self) -> dict[str, Any]:
        return {"operators": self.cfg.operators, "show_work": self.cfg.show_work}

    def reasoning(self, example: Example) -> str:
        if not self.cfg.show_work:
            return ""
        steps = arithmetic_steps(example.fields["terms"], example.fields["operators"])
        return ", ".join(f"{a} {o} {b} = {r}" for a, o, b, r in steps)


class SortTask(GeneratedTask):
    """Lists of small integers to sort ascending (module doc)."""

    name = "sort"

    def draw(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
        items = self._numbers(rng)
        return (f"Sort: {' '.join(map(str, items))}", " ".join(map(str, sorted(items))),
                {"items": items})


# --------------------------------------------------------------------------- users' JSONL

def _answer_text(value: Any) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is an empty string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"must be a string or a finite number, got {json.dumps(value)[:80]}")
    return str(value)


class JsonlTask:
    """Prompts and reference answers from users' JSONL files (module doc)."""

    name = "jsonl"

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.files = sorted(glob.glob(cfg.files))
        if not self.files:
            raise ValueError(f"task.files={cfg.files!r} matches no file")
        self.bad_lines = 0
        self.bad_examples: list[str] = []  # the first few, "file:line: why"
        rows, self._hashes = [], {}
        for path in self.files:
            found, digest = self._read(path, rows)
            self._hashes[path] = digest
            if not found:
                raise ValueError(f"task file {path} holds no JSONL row: an empty file is "
                                 "refused (task.files)")
        if self.bad_lines:
            logging.warning("task.files=%r: skipped %d malformed line(s), e.g. %s", cfg.files,
                            self.bad_lines, self.bad_examples)
        if not rows:
            raise ValueError(f"task.files={cfg.files!r} holds no valid row ({self.bad_lines} "
                             f"malformed, e.g. {self.bad_examples})")
        held = [held_out(r.prompt, cfg.eval_fraction) for r in rows]
        if cfg.eval_fraction > 0 and len(rows) >= 2 and not any(held):
            held[min(range(len(rows)), key=lambda i: path_hash_fraction(rows[i].prompt))] = True
        if all(held):
            raise ValueError(f"task.files={cfg.files!r}: task.eval_fraction="
                             f"{cfg.eval_fraction} holds out all {len(rows)} rows, none left "
                             "to train on")
        self._train = [r for r, h in zip(rows, held) if not h]
        evals = [r for r, h in zip(rows, held) if h]
        self._eval = evals[:cfg.eval_size] if cfg.eval_size else evals

    def _read(self, path: str, rows: list[Example]) -> tuple[bool, str]:
        """Appends the valid rows of `path`; (whether it holds any line, its sha256)."""
        digest = hashlib.sha256()
        found = False
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                digest.update(raw)
                if not raw.strip():
                    continue
                found = True
                try:
                    rows.append(self._row(path, lineno, raw))
                except ValueError as e:
                    where = f"{path}:{lineno}: {e}"
                    if self.cfg.on_bad_line == "stop":
                        raise ValueError(f"malformed task line {where} (task.on_bad_line="
                                         "'skip' skips such lines)") from e
                    self.bad_lines += 1
                    if len(self.bad_examples) < 5:
                        self.bad_examples.append(where)
        return found, digest.hexdigest()

    def _row(self, path: str, lineno: int, raw: bytes) -> Example:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON: {e}") from e
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        pk, ak = self.cfg.prompt_key, self.cfg.answer_key
        prompt = record.get(pk)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"field {pk!r} (task.prompt_key) must be a non-empty string")
        if ak not in record:
            raise ValueError(f"no field {ak!r} (task.answer_key)")
        try:
            answer = _answer_text(record[ak])
        except ValueError as e:
            raise ValueError(f"field {ak!r} (task.answer_key) {e}") from None
        fields = {k: v for k, v in record.items() if k not in (pk, ak)}
        return Example(f"{path}:{lineno}", prompt, answer, fields)

    def example(self, split: str, index: int) -> Example:
        _check_split(self, split, index)
        if split == "eval":
            return self._eval[index]
        epoch, i = divmod(int(index), len(self._train))
        order = np.random.default_rng([self.cfg.seed, 2, epoch]).permutation(len(self._train))
        return self._train[int(order[i])]

    def size(self, split: str) -> int | None:
        return len(self._train) if split == "train" else len(self._eval)

    def identity(self) -> dict[str, Any]:
        c = self.cfg
        return {"name": self.name, "seed": c.seed, "eval_fraction": c.eval_fraction,
                "eval_size": c.eval_size, "prompt_key": c.prompt_key,
                "answer_key": c.answer_key, "files": dict(self._hashes)}

    def solution(self, example: Example) -> str:
        return example.answer

    def reasoning(self, example: Example) -> str:
        return ""


TASKS: dict[str, Callable[[TaskConfig], Task]] = {
    "arithmetic": ArithmeticTask,
    "sort": SortTask,
    "jsonl": JsonlTask,
}


def make_task(section: Any) -> Task:
    """The task the run config's `task` section names (a ConfigDict, a mapping or a
    TaskConfig); refused naming the field when it names none or a setting is bad."""
    cfg = TaskConfig.from_section(section)
    if not cfg.name:
        raise ValueError(f"config field task.name='' names no task: expected one of "
                         f"{sorted(TASKS)}")
    return TASKS[cfg.name](cfg)


# --------------------------------------------------------------------------- SFT warm-up

def conversation(task: Task, example: Example) -> dict[str, Any]:
    """The example as an SFT row: the prompt as the user's message, the reference reply (its
    reasoning, if any, as the assistant's reasoning) as the assistant's."""
    reply: dict[str, Any] = {"role": "assistant", "content": task.solution(example)}
    reasoning = task.reasoning(example)
    if reasoning:
        reply["reasoning_content"] = reasoning
    return {"messages": [{"role": "user", "content": example.prompt}, reply]}


def sft_examples(task: Task, split: str, count: int) -> list[Example]:
    """The first `count` examples of `split` (all of a finite split when it holds fewer)."""
    size = task.size(split)
    n = count if size is None else min(count, size)
    return [task.example(split, i) for i in range(n)]


# --------------------------------------------------------------------------- a tokenizer

TOKENIZER_TEXTS = 2000  # rendered conversations the task tokenizer is trained on, at most


def write_task_tokenizer(task: Task, directory: str | Path, vocab_size: int) -> Path:
    """Writes `directory`/tokenizer.json: a byte-level BPE of at most `vocab_size` tokens with
    harmony's special tokens (no chat template: it renders with llm_jax.data.harmony), trained
    on the task's first train conversations rendered in harmony. Digits stay one token each, so
    a number's tokens are its digits. Deterministic; returns the directory."""
    import tokenizers

    floor = 256 + len(harmony.SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level tokenizer with harmony's "
                         f"special tokens needs at least {floor}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # The trainer does not split out special tokens: it is given the text between them, as
    # encoding will see it, or its merges would span the special tokens and never be used.
    specials = re.compile("|".join(map(re.escape, harmony.SPECIAL_TOKENS.values())))
    texts = [piece for ex in sft_examples(task, "train", TOKENIZER_TEXTS)
             for piece in specials.split(harmony.render_conversation(
                 conversation(task, ex)["messages"], add_generation_prompt=False)) if piece]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(harmony.SPECIAL_TOKENS.values()),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tmp = d / f".{TOKENIZER_FILE}.tmp"
    tok.save(str(tmp))
    os.replace(tmp, d / TOKENIZER_FILE)  # a crash never leaves half a file a resume would read
    return d
