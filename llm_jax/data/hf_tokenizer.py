"""A checkpoint's own tokenizer and chat template, read offline.

`tokenizer.json` is read with the Hugging Face `tokenizers` library (its added special tokens
included); the chat template comes from `chat_template.jinja` or `tokenizer_config.json`'s
`chat_template` and is rendered with jinja2's sandbox, as transformers does (for gpt-oss it
writes the harmony format). A tokenizer without a template whose vocabulary holds harmony's
special tokens renders with `llm_jax.data.harmony.render_conversation` instead. A missing or
unreadable file is refused naming it.

Messages reach a template in transformers' shape: an assistant's `reasoning_content` (the
OpenAI-compatible servers' name) also as `thinking` (gpt-oss's template reads that), tool-call
`arguments` given as a JSON string as the object it holds, and a `content` of None left out (a
pure tool-call message), so data written for an OpenAI-style API renders as gpt-oss's template
expects.

A fine-tuning run keeps its own copy of these files in WORKDIR/tokenizer/ (`run_tokenizer`), so
that resuming it, or exporting it, needs neither its base checkpoint nor `*.tokenizer`'s folder.
"""

from __future__ import annotations

import datetime
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from absl import logging

from llm_jax.data import harmony
from llm_jax.runtime.files import write_atomically

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# What a checkpoint's text side is made of: the files a run copies and an export writes.
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, TEMPLATE_FILE, "special_tokens_map.json",
                   "generation_config.json")
RUN_TOKENIZER_DIR = "tokenizer"  # WORKDIR/tokenizer/: a run's own copy of TOKENIZER_FILES

Message = dict[str, Any]


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_dir(path: str | Path) -> Path:
    """The directory holding tokenizer.json: `path`, its parent for an OpenAI original/, or
    its tokenizer/ for a fine-tuning workdir (the run's copy, `run_tokenizer`)."""
    p = Path(path)
    if (p / TOKENIZER_FILE).exists():
        return p
    if p.name == "original":
        return p.parent
    if (p / RUN_TOKENIZER_DIR / TOKENIZER_FILE).is_file():
        return p / RUN_TOKENIZER_DIR
    return p


def run_tokenizer(workdir: str | Path, source: str, field: str, *, fresh: bool,
                  write: bool) -> Path:
    """The directory a run reads its tokenizer from: its own copy WORKDIR/tokenizer/, so that a
    resumed run does not depend on `source` (`field`'s value, e.g. sft.tokenizer or
    train.init_from) still being there.

    `write` (process 0; the others read after it): on a fresh start (`fresh`: no checkpoint),
    `source`'s tokenizer files replace any copy an earlier start left; resuming a run that has
    no copy, they are copied now. A source without tokenizer.json is not copied: it is returned,
    for the reader to refuse by name. Resuming, a source whose tokenizer.json differs from the
    copy is refused (the token ids would change mid-run); a source that is gone is not needed."""
    copy = Path(workdir) / RUN_TOKENIZER_DIR
    src = tokenizer_dir(source)
    has_source = bool(source) and (src / TOKENIZER_FILE).is_file()
    if write and has_source and (fresh or not (copy / TOKENIZER_FILE).is_file()):
        _copy_atomically(src, copy)
    elif write and fresh:  # nothing to copy: an earlier start's copy must not be read
        shutil.rmtree(copy, ignore_errors=True)
    if not (copy / TOKENIZER_FILE).is_file():
        return src
    if not has_source:
        logging.info("%s=%r holds no %s now: reading the run's copy in %s", field, source,
                     TOKENIZER_FILE, copy)
    elif (src / TOKENIZER_FILE).read_bytes() != (copy / TOKENIZER_FILE).read_bytes():
        raise ValueError(
            f"{field}={source!r}: its {src / TOKENIZER_FILE} differs from the one this run "
            f"started with ({copy / TOKENIZER_FILE}), so the token ids would change mid-run. "
            f"Point {field} back at the run's tokenizer (or at {copy}), or use a new --workdir")
    return copy


def _copy_atomically(src: Path, dst: Path) -> None:
    """Copies the TOKENIZER_FILES that `src` holds to `dst` through a temporary sibling: a
    crash never leaves a partial copy that a resumed run would trust."""

    def copy(tmp: Path) -> None:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)

    write_atomically(dst, copy)


def template_messages(messages: Sequence[Message]) -> list[Message]:
    """`messages` in the shape chat templates read (module doc); other messages unchanged."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if not (k == "content" and v is None)}
        for key in ("reasoning_content", "reasoning"):
            if "thinking" not in m and isinstance(m.get(key), str):
                m["thinking"] = m[key]
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_object_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call  # left as written: the template shows what the data says
    return {**call, "function": {**fn, "arguments": args}}


class HFTokenizer:
    """encode/decode, special tokens and `render(messages)` for one checkpoint directory;
    `harmony` holds harmony's special-token ids when the vocabulary has them (else None)."""

    def __init__(self, path: str | Path):
        d = tokenizer_dir(path)
        tok_path = d / TOKENIZER_FILE
        if not tok_path.is_file():
            raise ValueError(f"tokenizer file {tok_path} does not exist: the checkpoint needs "
                             f"its {TOKENIZER_FILE} (in a fine-tuning run, point sft.tokenizer, "
                             "dpo.tokenizer or rl.tokenizer at a directory holding one)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(tok_path))
        except MemoryError:
            raise
        except Exception as e:  # the library raises a bare Exception on bad JSON or a bad read
            raise ValueError(f"tokenizer file {tok_path} is corrupt or unreadable: {e}") from e
        config: dict[str, Any] = {}
        cfg_path = d / TOKENIZER_CONFIG
        if cfg_path.exists():
            try:
                config = json.loads(cfg_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"tokenizer config {cfg_path} is corrupt: {e}") from e
        template_path = d / TEMPLATE_FILE
        if template_path.exists():
            try:
                source, where = template_path.read_text(encoding="utf-8"), str(template_path)
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"chat template {template_path} is unreadable: {e}") from e
        else:
            source, where = config.get("chat_template"), f"{cfg_path} (chat_template)"
        self.harmony = harmony.HarmonyTokens.find(self._tok.token_to_id)
        self._template = None
        if not isinstance(source, str) and self.harmony is None:
            raise ValueError(f"no chat template in {d}: expected {TEMPLATE_FILE} or "
                             f"'chat_template' in {TOKENIZER_CONFIG} (or harmony's special "
                             f"tokens in {TOKENIZER_FILE}, to render with llm_jax.data.harmony)")
        if isinstance(source, str):
            self._template = self._compile(source, where)
        self.special = {k: _token_str(config.get(k)) for k in
                        ("bos_token", "eos_token", "pad_token")}
        eos = self.special["eos_token"]
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        self.path = d

    @staticmethod
    def _compile(source: str, where: str) -> jinja2.Template:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, **kw)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template {where} is corrupt: {e}") from e

    @property
    def has_template(self) -> bool:
        return self._template is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|start|>") are parsed."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               **variables: Any) -> str:
        """The chat template applied to `messages` (the special tokens are in the text);
        `variables` are passed to the template (gpt-oss's reads `tools`, `reasoning_effort`).
        Without a template, harmony's renderer with `variables` as its options."""
        if self._template is None:
            return harmony.render_conversation(messages,
                                               add_generation_prompt=add_generation_prompt,
                                               **variables)
        return self._template.render(messages=template_messages(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special.items() if v},
                                     **variables)
