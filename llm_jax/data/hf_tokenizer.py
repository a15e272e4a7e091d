"""A checkpoint's own tokenizer and chat template, read offline.

`tokenizer.json` is read with the Hugging Face `tokenizers` library (its added special tokens
included); the chat template comes from `chat_template.jinja` or `tokenizer_config.json`'s
`chat_template` and is rendered with jinja2's sandbox, as transformers does (for gpt-oss it
writes the harmony format). A missing or unreadable file is refused naming it.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"

Message = dict[str, Any]


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_dir(path: str | Path) -> Path:
    """The directory holding tokenizer.json: `path`, or its parent for an OpenAI original/."""
    p = Path(path)
    if not (p / TOKENIZER_FILE).exists() and p.name == "original":
        return p.parent
    return p


class HFTokenizer:
    """encode/decode, special tokens and `render(messages)` for one checkpoint directory."""

    def __init__(self, path: str | Path):
        d = tokenizer_dir(path)
        tok_path = d / TOKENIZER_FILE
        if not tok_path.is_file():
            raise ValueError(f"tokenizer file {tok_path} does not exist: the checkpoint needs "
                             f"its {TOKENIZER_FILE} (set sft.tokenizer to a directory holding one)")
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
            source, where = template_path.read_text(), str(template_path)
        else:
            source, where = config.get("chat_template"), f"{cfg_path} (chat_template)"
        if not isinstance(source, str):
            raise ValueError(f"no chat template in {d}: expected {TEMPLATE_FILE} or "
                             f"'chat_template' in {TOKENIZER_CONFIG}")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, **kw)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template {where} is corrupt: {e}") from e
        self.special = {k: _token_str(config.get(k)) for k in
                        ("bos_token", "eos_token", "pad_token")}
        eos = self.special["eos_token"]
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        self.path = d

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
        `variables` are passed to the template (gpt-oss's reads `tools`, `reasoning_effort`)."""
        return self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special.items() if v},
                                     **variables)
