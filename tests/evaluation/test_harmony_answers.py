"""The lm-eval model on a checkpoint that answers in harmony: a generation after a chat prompt
is scored by its final channel (no reasoning, no framing tokens), the task's `until` strings cut
that answer and not the reasoning, a tool call answers "", and a prompt that opens no assistant
message is generated as plain text."""

from __future__ import annotations

import json
import shutil
import types

import pytest
from helpers import HARMONY_CHATS

from llm_jax.inference.completions import GenerationRequest, generate_until
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained

pytest.importorskip("lm_eval")
from llm_jax.evaluation.harness import LlmJaxLM  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(harmony_checkpoint, tmp_path_factory):
    """The harmony checkpoint with gpt-oss's end-of-text token named (lm_eval needs one)."""
    d = tmp_path_factory.mktemp("harmony_eval") / "ckpt"
    shutil.copytree(harmony_checkpoint, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    return d


def _request(context: str, **kwargs):
    return types.SimpleNamespace(args=(context, kwargs))


def test_generate_until_reads_the_final_channel(checkpoint):
    lm = LlmJaxLM(str(checkpoint), max_length=512, max_gen_toks=64)
    sum_chat, call_chat, hi_chat = HARMONY_CHATS[0], HARMONY_CHATS[1], HARMONY_CHATS[3]
    prompt = lm.apply_chat_template(sum_chat[1][:-1])
    assert prompt.endswith("<|start|>assistant") and "Reasoning: medium" in prompt
    tok = load_tokenizer(checkpoint)
    out = lm.generate_until([
        _request(prompt, until=["\n\n"]),
        # "two" is in the reasoning ("Simple sum: two and two."): it must not cut there
        _request(prompt, until=["two", "="]),
        _request(tok.render(hi_chat[1][:-1], **hi_chat[0]), until=["\n\n"]),
        _request(tok.render(call_chat[1][:-1], **call_chat[0])),
        _request("What is 2 + 2?", max_gen_toks=8),
    ])
    plain = generate_until(load_pretrained(checkpoint), [GenerationRequest(
        tok.encode("What is 2 + 2?"), max_new_tokens=8, stop_ids=list(tok.stop_ids))],
        tok.decode)[0].text
    assert out == ["2 + 2 = 4.", "2 + 2 ", "Hi! 👋", "", plain]


def test_reasoning_effort_goes_to_the_chat_template(checkpoint):
    lm = LlmJaxLM(str(checkpoint), reasoning_effort="low")
    assert "Reasoning: low" in lm.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="reasoning_effort='max' is invalid"):
        LlmJaxLM(str(checkpoint), reasoning_effort="max")
