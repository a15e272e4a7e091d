"""A checkpoint's text side for serving, evaluation and chat: encode, decode, its stop tokens and,
where it has one, its chat template.

Two kinds of checkpoint carry a tokenizer: a Hugging Face / OpenAI gpt-oss directory
(`tokenizer.json`, the chat template in `chat_template.jinja` or `tokenizer_config.json`, stop
tokens from `tokenizer_config.json`'s eos_token and `generation_config.json`'s eos_token_id),
and an llm_jax training workdir (sentencepiece `tokenizer.model` beside or above it; no chat
template; EOS 3).

A tokenizer.json whose vocabulary holds harmony's special tokens (gpt-oss's does) speaks
harmony (`harmony` is set): its turns end at `<|return|>` or `<|call|>` as well, and without a
chat template of its own its conversations render with `llm_jax.data.harmony`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_jax.data import harmony
from llm_jax.data.hf_tokenizer import (
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    HFTokenizer,
    tokenizer_dir,
)
from llm_jax.inference.text import find_tokenizer, text_decoder

GENERATION_CONFIG = "generation_config.json"


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is corrupt: {e}") from e
    return out if isinstance(out, dict) else {}


class CheckpointTokenizer:
    """encode / decode / stop_ids / render(messages) for one checkpoint; `render` raises a
    ValueError when the checkpoint has neither a chat template nor harmony tokens. `template`:
    the checkpoint's `HFTokenizer` when it renders conversations (its `render` and `harmony`
    are used), else None."""

    def __init__(self, encode, decode, vocab_size: int, eos_id: int | None,
                 bos_id: int | None, stop_ids: frozenset[int], template: HFTokenizer | None):
        self._encode, self.decode = encode, decode
        self.vocab_size, self.eos_id, self.bos_id = vocab_size, eos_id, bos_id
        self._template = template
        self.harmony = template.harmony if template is not None else None
        self.stop_ids = stop_ids | (self.harmony.stops if self.harmony else frozenset())

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def render(self, messages: Sequence[dict[str, Any]], **options: Any) -> str:
        """The conversation so far, ending where the assistant's reply starts: the checkpoint's
        chat template (given `options` as template variables, e.g. gpt-oss's `tools` and
        `reasoning_effort`), else, for a harmony checkpoint, harmony's renderer with the same
        options (`HFTokenizer.render`)."""
        if self._template is None:
            raise ValueError("this checkpoint has no chat template (chat_template.jinja or "
                             "'chat_template' in tokenizer_config.json): use completions")
        return self._template.render(messages, add_generation_prompt=True, **options)


def _from_hf(d: Path) -> CheckpointTokenizer:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(d / TOKENIZER_FILE))
    config = _json(d / TOKENIZER_CONFIG)
    has_template = (d / TEMPLATE_FILE).is_file() or isinstance(config.get("chat_template"), str)
    speaks_harmony = harmony.HarmonyTokens.find(tok.token_to_id) is not None
    template = HFTokenizer(d) if has_template or speaks_harmony else None

    def token_id(key: str) -> int | None:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(value) if isinstance(value, str) else None

    eos, bos = token_id("eos_token"), token_id("bos_token")
    stops = {eos} if eos is not None else set()
    gen_eos = _json(d / GENERATION_CONFIG).get("eos_token_id")
    stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None
                 else [])
    return CheckpointTokenizer(
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda ids: tok.decode(list(ids), skip_special_tokens=False),
        tok.get_vocab_size(with_added_tokens=True), eos, bos,
        frozenset(i for i in stops if isinstance(i, int)), template)


def load_tokenizer(path: str | Path) -> CheckpointTokenizer | None:
    """The tokenizer of the checkpoint at `path`, or None when it has none."""
    d = tokenizer_dir(path)
    if (d / TOKENIZER_FILE).is_file():
        return _from_hf(d)
    sp = find_tokenizer(path)
    if sp is None:
        return None
    return CheckpointTokenizer(sp.encode, text_decoder(sp), sp.vocab_size, sp.eos_id, sp.bos_id,
                               frozenset([sp.eos_id]), None)
