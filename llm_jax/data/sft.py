"""SFT data: conversations rendered with the checkpoint's chat template, loss on assistant tokens
only, packed into fixed rows whose examples never attend to each other.

Sources: JSONL files of `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "completion"}`
lines, a TFDS dataset by name with such a feature, or a verifiable task's reference replies
(`llm_jax.data.tasks`: the warm-up before RL). A `messages` line may also carry `tools`
(OpenAI function tools) and `reasoning_effort`, passed to the renderer; its assistant messages
may carry reasoning (`reasoning_content`, `reasoning` or `thinking`) and `tool_calls` (content
then may be null), answered by `tool` messages.

Assistant spans, for a chat template that does not speak harmony, are found by rendering
prefixes: message i's span runs from the end of `render(messages[:i], add_generation_prompt)` to
where `render(messages[:i+1])` stops agreeing with the full rendering, and a token is an
assistant token when its first character lies in a span.

A tokenizer with harmony's special tokens renders with its chat template (gpt-oss's) or, without
one, `llm_jax.data.harmony.render_conversation`; the rendered ids are cut at each `<|start|>` and
each piece parsed as one harmony message, which gives its role, channel and exact token span.
An assistant message on a channel in `sft.loss_channels` is learned from its `<|start|>` (or,
opening the assistant's turn, from after the `<|start|>assistant` the generation prompt writes)
through its closing `<|end|>`, `<|call|>` or `<|return|>`; an earlier turn's final message
closes with `<|end|>` in the history where the model wrote `<|return|>`, so that `<|end|>` is
not learned.

Held out: a conversation is validation when the hash of its canonical JSON falls below
`sft.validation_fraction` (of two or more: at least one when the fraction is > 0, never all):
the same split on every machine and in any file order, whatever the process count. Sharded like
pretraining data: every process reads the conversations (lines are cheap), then renders,
tokenizes and packs only its contiguous 1/P share of each split, and serves batches of
train.batch_size / P rows.

Batch (T = seq_len): inputs, targets int32 [B, T]; positions int32 [B, T] (from 0 in each
example); segment_ids int32 [B, T] (1, 2, ... per example in a row; 0 = padding); loss_mask
float32 [B, T] (1 where the target is an assistant token).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np
from absl import logging

from llm_jax.data import harmony, tasks
from llm_jax.data.hf_tokenizer import HFTokenizer, Message
from llm_jax.data.local_text import path_hash_fraction, split_shares
from llm_jax.data.resume import TaggedIterator, check_saved_state


@dataclasses.dataclass
class BadLines:
    """What was skipped, for the log and the run's metrics."""

    count: int = 0
    first: list[str] = dataclasses.field(default_factory=list)

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(where)


LOSS_CHANNELS = harmony.CHANNELS
DEFAULT_LOSS_CHANNELS = ",".join(LOSS_CHANNELS)  # reasoning included: docs/finetuning.md
RENDER_OPTIONS = ("tools", "reasoning_effort")  # a line's fields passed to the renderer


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One example: its messages and the renderer's options (`tools`, `reasoning_effort`)."""

    messages: list[Message]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def key(self) -> str:
        """Canonical JSON, hashed for the held-out split (a line without options hashes as its
        messages alone)."""
        value = {"messages": self.messages, **self.options} if self.options else self.messages
        return json.dumps(value, sort_keys=True, ensure_ascii=False)


def loss_channels(value: str) -> frozenset[str]:
    """`sft.loss_channels` ("analysis,commentary,final") as a set, refused naming the field."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [n for n in names if n not in LOSS_CHANNELS]
    if bad or not names:
        raise ValueError(f"config field sft.loss_channels={value!r} is invalid: expected a "
                         f"comma-separated non-empty subset of {','.join(LOSS_CHANNELS)}")
    return frozenset(names)


def _is_call(call: Any) -> bool:
    """An OpenAI tool call ({"function": {"name", "arguments"}}) or transformers' flat one."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"])


def _check_message(m: Any, where: str) -> None:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        raise ValueError(f"{where} needs a string 'role'")
    calls = m.get("tool_calls")
    if m["role"] == "assistant":
        if calls is not None:
            if not isinstance(calls, list) or not all(map(_is_call, calls)):
                raise ValueError(f"{where}.tool_calls must be a list of calls with a "
                                 "function name")
        for key in ("reasoning_content", "reasoning", "thinking"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"{where}.{key} must be a string")
        if m.get("content") is None and calls:
            return  # a pure tool call
    if not isinstance(m.get("content"), str):
        raise ValueError(f"{where} needs a string 'content'"
                         + (" (or 'tool_calls')" if m["role"] == "assistant" else ""))


def to_conversation(record: Any) -> Conversation:
    """A record as a Conversation; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        for j, m in enumerate(msgs):
            _check_message(m, f"messages[{j}]")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError("no assistant message: nothing to learn from")
        options = {k: record[k] for k in RENDER_OPTIONS if record.get(k) is not None}
        if "tools" in options and not isinstance(options["tools"], list):
            raise ValueError("'tools' must be a list of function tools")
        if "reasoning_effort" in options and \
                options["reasoning_effort"] not in harmony.REASONING_EFFORTS:
            raise ValueError(f"'reasoning_effort' must be one of {harmony.REASONING_EFFORTS}")
        return Conversation(msgs, options)
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return Conversation([{"role": "user", "content": record["prompt"]},
                             {"role": "assistant", "content": record["completion"]}])
    raise ValueError("expected 'messages' or string 'prompt' and 'completion' fields")



def refuse_or_count(where: str, section: str, what: str, on_bad_line: str, bad: BadLines) -> None:
    """A malformed line (`where`: "file:line: why"): raised when `<section>.on_bad_line` is
    "stop", else counted in `bad`."""
    if on_bad_line == "stop":
        raise ValueError(f"malformed {what} line {where} ({section}.on_bad_line='skip' skips "
                         "such lines)")
    bad.add(where)


def read_lines(pattern: str, section: str, what: str, parse: Callable[[Any, str], Any],
               on_bad_line: str, bad: BadLines) -> Iterator[Any]:
    """`parse(record, "file:line")` of each JSON line of every file matching `pattern` (the
    config field `<section>.files`), in order; a line that is not JSON or that `parse` refuses
    (ValueError) is named by file and line (`refuse_or_count`)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"{section}.files={pattern!r} matches no file")
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield parse(json.loads(line), where)
                except (json.JSONDecodeError, ValueError) as e:
                    refuse_or_count(f"{where}: {e}", section, what, on_bad_line, bad)


def read_jsonl(pattern: str, on_bad_line: str, bad: BadLines) -> Iterator[Conversation]:
    """Conversations from every file matching `pattern`, in order; a bad line is named by file
    and line and either skipped (counted in `bad`) or raised."""
    return read_lines(pattern, "sft", "SFT", lambda record, where: to_conversation(record),
                      on_bad_line, bad)


def read_tfds(name: str, split: str, data_dir: str | None) -> Iterator[Conversation]:
    import tensorflow_datasets as tfds

    for ex in tfds.as_numpy(tfds.load(name, split=split, data_dir=data_dir or None)):
        record = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in ex.items()}
        if "messages" in record:  # a sequence feature of {role, content}
            m = record["messages"]
            record["messages"] = [{"role": r.decode(), "content": c.decode()}
                                  for r, c in zip(m["role"], m["content"])]
        yield to_conversation(record)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_conversation(tok: HFTokenizer, messages: Sequence[Message] | Conversation,
                          channels: frozenset[str] = frozenset(LOSS_CHANNELS)
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [S], assistant mask [S]) of one rendered conversation; on a harmony tokenizer
    the mask covers the assistant's messages on `channels` (module doc)."""
    conv = messages if isinstance(messages, Conversation) else Conversation(list(messages))
    messages, options = conv.messages, conv.options
    full = tok.render(messages, **options)
    if tok.harmony is not None:
        return _harmony_mask(tok, full, channels)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tok.render(messages[:i], add_generation_prompt=True, **options)
        if not full.startswith(prefix):
            raise ValueError(f"the chat template renders messages[:{i}] + generation prompt as "
                             "something that is not a prefix of the whole conversation")
        spans.append((len(prefix), _common_prefix(tok.render(messages[:i + 1], **options),
                                                  full)))
    ids, offsets = tok.encode_offsets(full)
    mask = np.zeros(len(ids), np.float32)
    for j, (start, _) in enumerate(offsets):
        mask[j] = any(s <= start < e for s, e in spans)
    return np.asarray(ids, np.int32), mask


def harmony_messages(tok: HFTokenizer, ids: Sequence[int]
                     ) -> list[tuple[harmony.Message, int, int]]:
    """(message, first token, end token) of each message of rendered harmony ids: cut at every
    `<|start|>`, each piece parsed alone. Raises ValueError where the ids are not a sequence of
    well-formed messages."""
    h = tok.harmony
    starts = [i for i, t in enumerate(ids) if t == h.start]
    if not starts or starts[0] != 0:
        raise ValueError("the rendered conversation does not begin with <|start|>")
    out = []
    for s, e in zip(starts, starts[1:] + [len(ids)]):
        parser = harmony.Parser(h, tok.decode, role=None)  # the role is in the piece
        for t in ids[s + 1:e]:
            parser.push(int(t))
        parser.finish()
        if parser.errors or len(parser.messages) != 1 or parser.messages[0].end is None:
            raise ValueError(f"the rendered conversation is not well-formed harmony at tokens "
                             f"{s}-{e}: {parser.errors or 'no closed message'} in "
                             f"{tok.decode(ids[s:e])!r}")
        out.append((parser.messages[0], s, e))
    return out


def _harmony_mask(tok: HFTokenizer, text: str, channels: frozenset[str]
                  ) -> tuple[np.ndarray, np.ndarray]:
    ids = tok.encode(text)
    prompt = tok.encode("<|start|>assistant")  # what the generation prompt writes
    mask = np.zeros(len(ids), np.float32)
    previous = None
    for msg, s, e in harmony_messages(tok, ids):
        opens_turn = previous != "assistant"
        previous = msg.role
        if msg.role != "assistant":
            continue
        if msg.channel not in LOSS_CHANNELS:
            raise ValueError(f"the rendered conversation has an assistant message on channel "
                             f"{msg.channel!r} (tokens {s}-{e}): expected one of {LOSS_CHANNELS}")
        if msg.channel not in channels:
            continue
        if opens_turn:
            if ids[s:s + len(prompt)] != prompt:
                raise ValueError(f"the assistant message at tokens {s}-{e} does not begin with "
                                 "the generation prompt <|start|>assistant")
            s += len(prompt)
        if msg.channel == "final" and msg.end == "end":
            e -= 1  # the history's <|end|> for the <|return|> the model wrote
        mask[s:e] = 1
    return np.asarray(ids, np.int32), mask


def pack(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """Greedy packing of (ids, mask) into rows of `seq_len` next-token pairs; an example longer
    than seq_len + 1 tokens is cut (its tail dropped). Returns arrays [R, T]."""
    rows: list[dict[str, np.ndarray]] = []

    def new_row() -> dict[str, np.ndarray]:
        rows.append({k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32)
                     for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")})
        rows[-1]["fill"] = np.zeros(2, np.int32)  # (tokens used, segments used)
        return rows[-1]

    row = None
    for ids, mask in examples:
        ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
        n = len(ids) - 1
        if n < 1:
            continue
        if row is None or row["fill"][0] + n > seq_len:
            row = new_row()
        used, seg = row["fill"]
        sl = slice(used, used + n)
        row["inputs"][sl], row["targets"][sl] = ids[:-1], ids[1:]
        row["positions"][sl] = np.arange(n)
        row["segment_ids"][sl] = seg + 1
        row["loss_mask"][sl] = mask[1:]
        row["fill"] += (n, 1)
    return {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "fill"} if rows else {}


def split_conversations(convs: Sequence[Conversation | list[Message]],
                        validation_fraction: float) -> tuple[list, list]:
    """(train, validation) by the hash of each conversation's canonical JSON (module doc), each
    in reading order."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"sft.validation_fraction={validation_fraction!r} is invalid: expected "
                         "a fraction in [0, 1)")
    keys = [path_hash_fraction(m.key() if isinstance(m, Conversation)
                               else json.dumps(m, sort_keys=True, ensure_ascii=False))
            for m in convs]
    n_val = sum(k < validation_fraction for k in keys)
    if validation_fraction > 0 and len(convs) >= 2:
        n_val = min(max(n_val, 1), len(convs) - 1)
    held = set(sorted(range(len(convs)), key=keys.__getitem__)[:n_val])
    return ([m for i, m in enumerate(convs) if i not in held],
            [m for i, m in enumerate(convs) if i in held])


def task_conversations(section: Any) -> tuple[list[Conversation], list[Conversation],
                                               dict[str, Any]]:
    """(train, held-out, {"task": identity}) conversations of the task `section` names: its
    first `sft_examples` train examples and its whole eval split, each with its reference reply."""
    task = tasks.make_task(section)
    count = tasks.TaskConfig.from_section(section).sft_examples

    def convs(split: str, n: int) -> list[Conversation]:
        return [to_conversation(tasks.conversation(task, ex))
                for ex in tasks.sft_examples(task, split, n)]

    return (convs("train", count), convs("eval", task.size("eval") or 0),
            {"task": task.identity()})


def _tokenized(tok: HFTokenizer, conv: Conversation, channels: frozenset[str]
               ) -> tuple[np.ndarray, np.ndarray]:
    """`tokenize_conversation`, a refusal naming the conversation it refused."""
    try:
        return tokenize_conversation(tok, conv, channels)
    except ValueError as e:
        raise ValueError(f"SFT conversation {conv.key()[:300]}: {e}") from e


def sample_prompts(tok: HFTokenizer, convs: list[Conversation], n: int
                   ) -> list[tuple[str, list[int]]]:
    """(the last user message, the rendered prompt's ids) of up to `n` of `convs`, each ending
    in the generation prompt: what a fine-tuning run samples replies to at its end."""
    out = []
    for conv in convs[:n]:
        text = tok.render(conv.messages, add_generation_prompt=True, **conv.options)
        users = [m for m in conv.messages if m.get("role") == "user"]
        out.append((str(users[-1].get("content", "")) if users else "", tok.encode(text)))
    return out


def _empty_rows(batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """A batch of padding only (segment 0, loss mask 0): it adds nothing to any eval sum."""
    return {k: np.zeros((batch_size, seq_len), np.float32 if k == "loss_mask" else np.int32)
            for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}


@dataclasses.dataclass(frozen=True, eq=False)
class SFTData:
    """What the trainer needs (the same fields it reads from `pipeline.Data`)."""

    train_iter: grain.DatasetIterator
    tokenizer: HFTokenizer
    name: str
    rows: dict[str, np.ndarray]  # this process's packed train rows
    eval_rows: dict[str, np.ndarray]  # this process's packed validation rows ({} if none)
    bad_lines: BadLines
    batch_size: int  # per process
    process_count: int
    # Whether any process holds out a conversation: then every process runs the eval batches,
    # those whose share is empty on padding only (an eval step is collective).
    held_out: bool = False
    # A few conversations up to their last assistant turn (held out when there are such): what
    # the run samples replies to at its end.
    sample_conversations: list[Conversation] = dataclasses.field(default_factory=list)

    def sample_prompts(self, n: int) -> list[tuple[str, list[int]]]:
        return sample_prompts(self.tokenizer, self.sample_conversations, n)

    def check_checkpoint(self, step_dir: str) -> None:
        """Raises ValueError if the data state saved in `step_dir` was not made by these rows
        (another file, seq_len, batch size, seed, split or process count)."""
        check_saved_state(os.path.join(step_dir, "data"), self.train_iter.identity)

    @property
    def batch_dtypes(self) -> dict[str, np.dtype]:
        """Each array of a training batch and its dtype (all [batch, seq_len])."""
        return {k: v.dtype for k, v in self.rows.items()}

    def make_eval_iter(self, num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The first `num_batches` batches of this process's held-out rows, unshuffled, padded
        with empty batches where its share is shorter or empty, so every process runs the same
        number (None = the whole share: one process only). Nothing when no process holds
        anything out."""
        if not self.held_out:
            return
        if num_batches is None and self.process_count > 1:
            raise ValueError("make_eval_iter(None) reads each process's whole share, a "
                             "different number of batches per process: pass num_batches")
        n = -(-len(self.eval_rows.get("inputs", ())) // self.batch_size)
        seq_len = self.rows["inputs"].shape[1]
        for i in range(n if num_batches is None else num_batches):
            batch = _empty_rows(self.batch_size, seq_len)
            part = {k: v[i * self.batch_size:(i + 1) * self.batch_size]
                    for k, v in self.eval_rows.items()}
            for k, v in part.items():
                batch[k][:len(v)] = v
            yield batch


def process_share(batch_size: int, process_index: int | None, process_count: int | None
                  ) -> tuple[int, int, int]:
    """(this process's index, the process count, its rows of the global `batch_size`): the
    running JAX processes unless given."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if batch_size % process_count:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by the process count "
                         f"{process_count}")
    return process_index, process_count, batch_size // process_count


def make_sft_data(sft: Any, *, tokenizer_path: str, seq_len: int, batch_size: int,
                  seed: int, process_index: int | None = None,
                  process_count: int | None = None, task: Any = None) -> SFTData:
    """Reads the SFT set, holds out `sft.validation_fraction` of it, renders, masks and packs
    this process's share of each split, then serves shuffled batches of `batch_size` /
    process_count rows through Grain, so the iterator checkpoints with the run. `batch_size` is
    the global batch (train.batch_size). With no `sft.files` or `sft.tfds_name`, the set is
    the reference replies of `task` (the run config's `task` section, llm_jax.data.tasks):
    its first `task.sft_examples` train examples, and its eval split held out."""
    process_index, process_count, local_batch = process_share(batch_size, process_index,
                                                              process_count)
    channels = loss_channels(sft.get("loss_channels", DEFAULT_LOSS_CHANNELS))
    tok = HFTokenizer(tokenizer_path)
    bad = BadLines()
    fraction = float(sft.get("validation_fraction", 0.0))
    task_identity: dict[str, Any] = {}
    if not (sft.files or sft.tfds_name) and task is not None:
        train, held, task_identity = task_conversations(task)
        name, fraction = f"task:{task_identity['task']['name']}", 0.0
    else:
        if sft.tfds_name:
            convs, name = read_tfds(sft.tfds_name, sft.tfds_split, sft.data_dir), sft.tfds_name
        else:
            convs, name = read_jsonl(sft.files, sft.on_bad_line, bad), sft.files
        train, held = split_conversations(list(convs), fraction)
    if bad.count:
        logging.warning("skipped %d malformed SFT line(s), e.g. %s", bad.count, bad.first)

    def share(split: list[Conversation]) -> list[tuple[np.ndarray, np.ndarray]]:
        first, stop = split_shares(len(split), process_count)[process_index]
        return [_tokenized(tok, m, channels) for m in split[first:stop]]

    rows, eval_rows = pack(share(train), seq_len), pack(share(held), seq_len)
    if not rows or len(rows["inputs"]) < local_batch:
        raise ValueError(f"SFT data {name!r} packs into {len(rows.get('inputs', []))} rows of "
                         f"{seq_len} tokens for process {process_index} of {process_count}: "
                         f"fewer than its batch of {local_batch} (train.batch_size="
                         f"{batch_size})")
    if fraction > 0 and not held:
        logging.warning("SFT data %r: sft.validation_fraction=%s holds out no conversation: "
                        "no val_loss", name, fraction)
    elif held and not eval_rows:
        logging.info("SFT data %r: process %d holds none of the %d held-out conversations: its "
                     "eval batches are padding", name, process_index, len(held))
    logging.info("SFT data %s: %d train / %d held-out conversations; process %d of %d packs "
                 "%d train rows; %.1f%% of targets are assistant tokens", name, len(train),
                 len(held), process_index, process_count, len(rows["inputs"]),
                 100 * rows["loss_mask"].mean())
    ds = (grain.MapDataset.range(len(rows["inputs"])).shuffle(seed=seed).repeat()
          .map(lambda i: {k: v[i] for k, v in rows.items()})
          .batch(local_batch, drop_remainder=True).to_iter_dataset())
    # The saved iterator state is only meaningful for these same rows in this order.
    identity = {"dataset": f"sft:{name}", "rows": len(rows["inputs"]), "seq_len": seq_len,
                "batch_size": batch_size, "shuffle_seed": seed,
                "validation_fraction": fraction,
                "process_index": process_index, "process_count": process_count, **task_identity}
    return SFTData(TaggedIterator(iter(ds), identity), tok, name, rows, eval_rows, bad,
                   local_batch, process_count, held_out=bool(held),
                   sample_conversations=_prompts(held or train))


def _prompts(convs: list[Conversation], n: int = 8) -> list[Conversation]:
    """The first `n` conversations with a message before their last assistant turn, cut there."""
    out = []
    for conv in convs:
        last = max((i for i, m in enumerate(conv.messages) if m.get("role") == "assistant"),
                   default=0)
        if last:
            out.append(Conversation(conv.messages[:last], conv.options))
        if len(out) == n:
            break
    return out
