"""The chat command line: each reply is the greedy continuation of the whole conversation
through the checkpoint's chat template, streamed; /reset forgets; bad flags exit 2. On a harmony
checkpoint: reasoning shown apart (dimmed, marked or hidden), a tool call shown and its typed
result answered, the reasoning effort set, and the history kept by the format's rules."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from helpers import WEATHER_TOOL, make_checkpoint

from llm_jax.chat import assistant_turn, fit_conversation, main
from llm_jax.data import harmony
from llm_jax.inference.sampler import sample
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("chat") / "tiny")


def _greedy(model, tok, conversations: list[list[dict]], n: int) -> list[str]:
    """The greedy reply to each conversation, from one batched `sample` (a batch equals each
    prompt alone: test_generate)."""
    out = []
    for ids in sample(model, [tok.encode(tok.render(m)) for m in conversations], max_new_tokens=n):
        cut = next((i for i, t in enumerate(ids) if t in tok.stop_ids), len(ids))
        out.append(tok.decode(ids[:cut]))
    return out


@pytest.mark.slow
def test_replies_continue_the_templated_conversation_and_reset_forgets(ckpt):
    # A system message long enough that both turns' prompts pad to one bucket (65-128 tokens):
    # the chat's prefill and the reference compile once each.
    system = {"role": "system",
              "content": "be brief: answer with one, two or three words, never more than five or six"}
    out = io.StringIO()
    stdin = io.StringIO("the cat\nand the dog\n/reset\nthe cat\n")
    assert main(["--checkpoint", str(ckpt), "--max_tokens", "8", "--max_len", "256",
                 "--system", system["content"]], stdin=stdin, stdout=out) == 0
    replies = [r.split("\nyou> ")[0].removesuffix(" [length]")
               for r in out.getvalue().split("assistant> ")[1:]]
    model, tok = load_pretrained(ckpt), load_tokenizer(ckpt)
    # The second turn's history holds the chat's first reply, which must be `first`.
    turn = [system, {"role": "user", "content": "the cat"}]
    first, second = _greedy(model, tok, [turn, turn + [
        {"role": "assistant", "content": replies[0]}, {"role": "user", "content": "and the dog"}]], 8)
    assert replies == [first, second, first]


def test_a_checkpoint_without_a_chat_template_is_refused(ckpt, tmp_path, capsys):
    d = tmp_path / "no_template"
    shutil.copytree(ckpt, d)
    (d / "chat_template.jinja").unlink()
    assert main(["--checkpoint", str(d)], stdin=io.StringIO(""), stdout=io.StringIO()) == 2
    assert "no tokenizer.json with a chat template" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_harmony_reply_shows_reasoning_apart_and_a_tool_call_round_trip(harmony_checkpoint,
                                                                         tmp_path):
    """The harmony checkpoint reproduces HARMONY_CHATS' replies only after exactly the prompt
    it learned: the follow-up after the typed tool result shows the history kept the turn's
    reasoning and call as the format renders them."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    base = ["--checkpoint", str(harmony_checkpoint), "--max_tokens", "64", "--max_len", "512"]
    out = _Terminal()
    assert main(base + ["--tools", str(tools)],
                stdin=io.StringIO('Weather in Paris?\n{"temp": 20}\n'), stdout=out) == 0
    assert out.getvalue() == (
        "you> assistant> \x1b[2mNeed the weather tool.\x1b[0m\n"
        '[tool call] get_weather({"city": "Paris"})\ntool get_weather> '
        "assistant> It is 20 degrees in Paris. ☀\nyou> \n")
    out = io.StringIO()  # not a terminal: reasoning is marked, not dimmed
    assert main(base + ["--reasoning_effort", "low"], stdin=io.StringIO("Say hi.\n"),
                stdout=out) == 0
    assert out.getvalue() == "you> assistant> [reasoning] Greet.\nHi! 👋\nyou> \n"
    out = io.StringIO()
    assert main(base + ["--hide_reasoning"], stdin=io.StringIO("What is 2 + 2?\n"),
                stdout=out) == 0
    assert out.getvalue() == "you> assistant> 2 + 2 = 4.\nyou> \n"


def test_the_history_keeps_turns_by_the_harmony_rules_and_drops_whole_exchanges(
        harmony_checkpoint):
    tok = load_tokenizer(harmony_checkpoint)
    call = harmony.Message("assistant", "commentary", "functions.get_weather", "json",
                           '{"city": "Paris"}', "call")
    turn = assistant_turn([harmony.Message("assistant", "analysis", content="Need it.",
                                            end="end"), call], first_call=3)
    assert turn == {"role": "assistant", "reasoning_content": "Need it.", "content": None,
                    "tool_calls": [{"id": "call_3", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    history = [{"role": "user", "content": "What is 2 + 2?"},
               {"role": "assistant", "reasoning_content": "Sum.", "content": "4"},
               {"role": "user", "content": "Weather in Paris?"}, turn,
               {"role": "tool", "tool_call_id": "call_3", "content": "20"}]
    options = {"tools": [WEATHER_TOOL]}
    whole = tok.encode(tok.render(history, **options))
    assert fit_conversation(tok, history, len(whole), options) == whole
    assert fit_conversation(tok, history, len(whole) - 1, options) == tok.encode(
        tok.render(history[2:], **options))  # the first exchange goes, whole
    last = len(tok.encode(tok.render(history[2:], **options)))
    with pytest.raises(ValueError, match="this exchange takes"):
        fit_conversation(tok, history, last - 1, options)


def test_harmony_flags_are_checked(ckpt, harmony_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"type": "function", "function": {"name": "no spaces"}}]))
    for checkpoint, flags, error in [
            (ckpt, ["--reasoning_effort", "low"], "--reasoning_effort needs a checkpoint that "
                                                  "speaks harmony"),
            (harmony_checkpoint, ["--tools", str(bad)], "tools[0].function.name"),
            (harmony_checkpoint, ["--tools", str(tmp_path / "none.json")], "none.json")]:
        assert main(["--checkpoint", str(checkpoint), *flags], stdin=io.StringIO(""),
                    stdout=io.StringIO()) == 2
        assert error in capsys.readouterr().err
