"""Preference data: pairs of responses to one prompt, rendered with the chat template as SFT
renders them (data/sft.py, harmony tokenizers included), the loss mask over each response.

A JSONL line is `{"prompt", "chosen", "rejected"}`: the prompt a string (one user message) or a
list of chat messages; each response a string (one assistant message), an assistant message, or
a list of messages (tool calls and their results included). Like an SFT line it may carry
`tools` and `reasoning_effort` for the renderer. A malformed line is named by file and line and
skipped (counted, `dpo.on_bad_line="skip"`) or stops the run ("stop"); so is a pair whose
rendering the template refuses, or whose chosen and rejected render to the same tokens.

Each response is rendered after its prompt, `render(prompt + response)`; its tokens are those
past `render(prompt, add_generation_prompt=True)` that SFT's mask counts as the assistant's
(so on harmony, from after `<|start|>assistant` through the closing `<|return|>`, `<|call|>`
or `<|end|>`). A pair of which either side is longer than seq_len + 1 tokens is skipped and
counted, never cut: a cut response may lose the very part that makes it the better one.

Held out: a pair is validation when the hash of its prompt's canonical JSON (with the
renderer's options) falls below `dpo.validation_fraction` (of two or more prompts: at least one
when > 0, never all), so the pairs of one prompt are never split between train and validation;
sharded across processes as SFT data is (each process renders its contiguous 1/P of each split).

Batch (B pairs, T = seq_len): inputs, targets, positions, segment_ids int32 [B, 2, T] (index 0
the chosen response, 1 the rejected; segment 1 over the sequence, 0 = padding); loss_mask
float32 [B, 2, T] (1 where the target is a response token). Full-fine-tuning DPO adds
reference_logp float32 [B, 2] (`attach_reference`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
from absl import logging

from llm_jax.data.hf_tokenizer import HFTokenizer, Message
from llm_jax.data.local_text import path_hash_fraction, split_shares
from llm_jax.data.resume import TaggedIterator, check_saved_state
from llm_jax.data.sft import (
    RENDER_OPTIONS,
    BadLines,
    Conversation,
    process_share,
    read_lines,
    refuse_or_count,
    sample_prompts,
    to_conversation,
    tokenize_conversation,
)

ROW_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One line: the prompt's messages, each response's messages, the renderer's options."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    where: str = ""  # file:line

    def key(self) -> str:
        """The prompt's canonical JSON (with the options), hashed for the held-out split."""
        return json.dumps({"prompt": self.prompt, **self.options}, sort_keys=True,
                          ensure_ascii=False)


def _messages(value: Any, field: str, role: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise ValueError(f"'{field}' must be a string, a message or a non-empty list of messages")


def to_pair(record: Any, where: str = "") -> PreferencePair:
    """A JSONL record as a PreferencePair; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise ValueError(f"missing field(s) {missing}: expected 'prompt', 'chosen', 'rejected'")
    prompt = _messages(record["prompt"], "prompt", "user")
    options = {k: record[k] for k in RENDER_OPTIONS if record.get(k) is not None}
    sides = {}
    for side in ("chosen", "rejected"):
        response = _messages(record[side], side, "assistant")
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in response):
            raise ValueError(f"'{side}' has no assistant message: nothing to compare")
        try:  # SFT's checks of every message and of the options
            to_conversation({"messages": prompt + response, **options})
        except ValueError as e:
            raise ValueError(f"prompt + {side}: {e}") from e
        sides[side] = response
    return PreferencePair(prompt, sides["chosen"], sides["rejected"], options, where)


def read_pairs(pattern: str, on_bad_line: str, bad: BadLines) -> Iterator[PreferencePair]:
    """Pairs from every file matching `pattern`, in order; a bad line is named by file and line
    and either skipped (counted in `bad`) or raised."""
    return read_lines(pattern, "dpo", "preference", to_pair, on_bad_line, bad)


def tokenize_response(tok: HFTokenizer, prompt: list[Message], response: list[Message],
                      options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [S], response mask [S]) of `prompt + response` (module doc)."""
    conv = Conversation(prompt + response, options)
    ids, mask = tokenize_conversation(tok, conv)
    full = tok.render(conv.messages, **options)
    prefix = tok.render(prompt, add_generation_prompt=True, **options)
    if not full.startswith(prefix):
        raise ValueError("the chat template renders the prompt + generation prompt as "
                         "something that is not a prefix of prompt + response")
    offset_ids, offsets = tok.encode_offsets(full)
    if list(offset_ids) != ids.tolist():
        raise ValueError("the tokenizer encodes the rendered conversation two ways")
    after = np.asarray([start >= len(prefix) for start, _ in offsets], np.float32)
    mask = mask * after
    if not mask.any():
        raise ValueError("the response has no token the loss counts")
    return ids, mask


def pair_rows(pair: tuple[tuple[np.ndarray, np.ndarray], ...], seq_len: int
              ) -> dict[str, np.ndarray]:
    """((ids, mask) chosen, (ids, mask) rejected) as one example's arrays [2, T]."""
    out = {k: np.zeros((2, seq_len), np.float32 if k == "loss_mask" else np.int32)
           for k in ROW_KEYS}
    for j, (ids, mask) in enumerate(pair):
        n = len(ids) - 1
        out["inputs"][j, :n], out["targets"][j, :n] = ids[:-1], ids[1:]
        out["positions"][j, :n] = np.arange(n)
        out["segment_ids"][j, :n] = 1
        out["loss_mask"][j, :n] = mask[1:]
    return out


def split_pairs(pairs: list[PreferencePair], validation_fraction: float
                ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, validation) by the hash of each pair's prompt (module doc), in reading order."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"config field dpo.validation_fraction={validation_fraction!r} is "
                         "invalid: expected a fraction in [0, 1)")
    prompts = sorted({p.key() for p in pairs}, key=path_hash_fraction)
    n_val = sum(path_hash_fraction(k) < validation_fraction for k in prompts)
    if validation_fraction > 0 and len(prompts) >= 2:
        n_val = min(max(n_val, 1), len(prompts) - 1)
    held = set(prompts[:n_val])
    return [p for p in pairs if p.key() not in held], [p for p in pairs if p.key() in held]


class PairIterator(TaggedIterator):
    """Batches of pairs; once a reference is attached (`PreferenceData.attach_reference`), each
    with its pairs' reference log-probs, looked up by the pair's index: the pipeline's own
    read-ahead never sees them, so attaching after it was built or restored is safe."""

    def __init__(self, parent: grain.DatasetIterator, identity: dict[str, Any]):
        super().__init__(parent, identity)
        self.reference: np.ndarray | None = None  # [P, 2]

    def __next__(self) -> dict[str, np.ndarray]:
        batch = dict(next(self._parent))
        index = batch.pop("pair_index")
        if self.reference is not None:
            batch["reference_logp"] = self.reference[index]
        return batch


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceData:
    """What the trainer needs (the fields it reads from `pipeline.Data` and `SFTData`)."""

    train_iter: PairIterator
    tokenizer: HFTokenizer
    name: str
    rows: dict[str, np.ndarray]  # this process's train pairs, [P, 2, T] each
    eval_rows: dict[str, np.ndarray]  # this process's held-out pairs ({} if none)
    bad_lines: BadLines  # malformed or unrenderable lines skipped
    too_long: BadLines  # pairs longer than seq_len + 1 tokens, skipped
    batch_size: int  # pairs per process
    process_count: int
    # Whether any process holds out a pair: then every process runs the eval batches, those
    # whose share is empty on padding only (an eval step is collective).
    held_out: bool = False
    # A few prompts (held out when there are such): what the run samples replies to at its end.
    sample_conversations: list[Conversation] = dataclasses.field(default_factory=list)

    def sample_prompts(self, n: int) -> list[tuple[str, list[int]]]:
        return sample_prompts(self.tokenizer, self.sample_conversations, n)

    def check_checkpoint(self, step_dir: str) -> None:
        """Raises ValueError if the data state saved in `step_dir` was not made by these pairs
        (another file, seq_len, batch size, seed, split or process count)."""
        check_saved_state(os.path.join(step_dir, "data"), self.train_iter.identity)

    def _batch_arrays(self) -> dict[str, np.ndarray]:
        out = dict(self.rows)
        if self.train_iter.reference is not None:
            out["reference_logp"] = self.train_iter.reference
        return out

    @property
    def batch_dtypes(self) -> dict[str, np.dtype]:
        """Each array of a training batch and its dtype."""
        return {k: v.dtype for k, v in self._batch_arrays().items()}

    def batch_shapes(self, global_batch: int) -> dict[str, tuple[int, ...]]:
        """Each array of a global training batch of `global_batch` pairs and its shape."""
        return {k: (global_batch, *v.shape[1:]) for k, v in self._batch_arrays().items()}

    def attach_reference(self, train_B2: np.ndarray, eval_B2: np.ndarray | None) -> None:
        """Adds each pair's reference log-probs [P, 2] (full-fine-tuning DPO) to the train and
        held-out pairs' batches, as `reference_logp`."""
        if train_B2.shape != (len(self.rows["inputs"]), 2):
            raise ValueError(f"reference log-probs of shape {train_B2.shape} for "
                             f"{len(self.rows['inputs'])} train pairs")
        self.train_iter.reference = np.asarray(train_B2, np.float32)
        if self.eval_rows:
            self.eval_rows["reference_logp"] = np.asarray(eval_B2, np.float32)

    def padded_batches(self, split: str, num_batches: int
                       ) -> Iterator[dict[str, np.ndarray]]:
        """`num_batches` batches of this process's "train" or "eval" pairs in order, unshuffled,
        padded with empty pairs (no response token) where the pairs run out: every array a
        training batch has, `reference_logp` included once attached, whatever this share holds."""
        rows = self.rows if split == "train" else self.eval_rows
        for i in range(num_batches):
            batch = {k: np.zeros((self.batch_size, *v.shape[1:]), v.dtype)
                     for k, v in self._batch_arrays().items()}
            for k, v in rows.items():
                part = v[i * self.batch_size:(i + 1) * self.batch_size]
                batch.setdefault(k, np.zeros((self.batch_size, *v.shape[1:]), v.dtype))
                batch[k][:len(part)] = part
            yield batch

    def make_eval_iter(self, num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The first `num_batches` batches of this process's held-out pairs (`padded_batches`),
        so every process runs the same number, an empty share on padding only (None = the whole
        share: one process only). Nothing when no process holds anything out."""
        if not self.held_out:
            return
        if num_batches is None and self.process_count > 1:
            raise ValueError("make_eval_iter(None) reads each process's whole share, a "
                             "different number of batches per process: pass num_batches")
        n = -(-len(self.eval_rows.get("inputs", ())) // self.batch_size)
        yield from self.padded_batches("eval", n if num_batches is None else num_batches)


def _render(tok: HFTokenizer, pairs: list[PreferencePair], seq_len: int, on_bad_line: str,
            bad: BadLines, too_long: BadLines) -> dict[str, np.ndarray]:
    """The pairs' arrays [P, 2, T], those that do not render (per `on_bad_line`) or do not fit
    skipped and counted."""
    out = []
    for p in pairs:
        try:
            sides = tuple(tokenize_response(tok, p.prompt, r, p.options)
                          for r in (p.chosen, p.rejected))
            if np.array_equal(sides[0][0], sides[1][0]):
                raise ValueError("chosen and rejected render to the same tokens")
        except ValueError as e:
            refuse_or_count(f"{p.where}: {e}", "dpo", "preference", on_bad_line, bad)
            continue
        if max(len(ids) for ids, _ in sides) > seq_len + 1:
            too_long.add(f"{p.where} ({max(len(ids) for ids, _ in sides)} tokens)")
            continue
        out.append(pair_rows(sides, seq_len))
    return {k: np.stack([o[k] for o in out]) for k in ROW_KEYS} if out else {}


def make_preference_data(dpo: Any, *, tokenizer_path: str, seq_len: int, batch_size: int,
                         seed: int, process_index: int | None = None,
                         process_count: int | None = None) -> PreferenceData:
    """Reads the pairs of `dpo.files`, holds out `dpo.validation_fraction` of the prompts,
    renders this process's share of each split and serves shuffled batches of `batch_size` /
    process_count pairs through Grain, so the iterator checkpoints with the run. `batch_size`
    is the global batch in pairs (train.batch_size)."""
    process_index, process_count, local_batch = process_share(batch_size, process_index,
                                                              process_count)
    tok = HFTokenizer(tokenizer_path)
    bad, too_long = BadLines(), BadLines()
    pairs = list(read_pairs(dpo.files, dpo.on_bad_line, bad))
    fraction = float(dpo.validation_fraction)
    train, held = split_pairs(pairs, fraction)

    def share(split: list[PreferencePair]) -> dict[str, np.ndarray]:
        first, stop = split_shares(len(split), process_count)[process_index]
        return _render(tok, split[first:stop], seq_len, dpo.on_bad_line, bad, too_long)

    rows, eval_rows = share(train), share(held)
    if bad.count:
        logging.warning("skipped %d malformed preference line(s), e.g. %s", bad.count, bad.first)
    if too_long.count:
        logging.warning("skipped %d preference pair(s) longer than data.seq_len=%d + 1 tokens, "
                        "e.g. %s", too_long.count, seq_len, too_long.first)
    if not rows or len(rows["inputs"]) < local_batch:
        raise ValueError(f"preference data {dpo.files!r} has {len(rows.get('inputs', []))} "
                         f"usable train pairs for process {process_index} of {process_count}: "
                         f"fewer than its batch of {local_batch} (train.batch_size={batch_size};"
                         f" {bad.count} malformed, {too_long.count} longer than data.seq_len="
                         f"{seq_len})")
    if fraction > 0 and not held:
        logging.warning("preference data %r: dpo.validation_fraction=%s holds out no pair: no "
                        "held-out accuracy", dpo.files, fraction)
    elif held and not eval_rows:
        logging.info("preference data %r: process %d renders none of the %d held-out pairs: "
                     "its eval batches are padding", dpo.files, process_index, len(held))
    logging.info("preference data %s: %d train / %d held-out pairs; process %d of %d renders "
                 "%d train pairs", dpo.files, len(train), len(held), process_index,
                 process_count, len(rows["inputs"]))
    ds = (grain.MapDataset.range(len(rows["inputs"])).shuffle(seed=seed).repeat()
          .map(lambda i: {**{k: v[i] for k, v in rows.items()}, "pair_index": i})
          .batch(local_batch, drop_remainder=True).to_iter_dataset())
    # The saved iterator state is only meaningful for these same pairs in this order.
    identity = {"dataset": f"preference:{dpo.files}", "pairs": len(rows["inputs"]),
                "seq_len": seq_len, "batch_size": batch_size, "shuffle_seed": seed,
                "validation_fraction": fraction, "process_index": process_index,
                "process_count": process_count}
    return PreferenceData(PairIterator(iter(ds), identity), tok, dpo.files, rows, eval_rows,
                          bad, too_long, local_batch, process_count, held_out=bool(held),
                          sample_conversations=[Conversation(p.prompt, p.options)
                                                for p in (held or train)[:8]])
