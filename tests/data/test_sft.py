"""SFT data in harmony: conversations with reasoning, tool calls and tool results render through
the checkpoint's tokenizer (harmony's renderer without a chat template, or a template that
writes harmony), and the loss mask covers exactly the assistant's messages on the configured
channels, checked token by token on a conversation written out by hand. A template that does
not speak harmony masks as before."""

from __future__ import annotations

import json
import shutil

import pytest
import tokenizers
from helpers import HARMONY_CHATS, WEATHER_TOOL

from llm_jax.config import ModelConfig
from llm_jax.data.hf_tokenizer import HFTokenizer
from llm_jax.data.sft import (
    Conversation,
    loss_channels,
    make_sft_data,
    to_conversation,
    tokenize_conversation,
)
from llm_jax.training.run_config import default_run_config, validate_run_config

# Two turns: the first's reasoning is dropped from the history and its final message closes
# with <|end|>; the second calls a tool, reads the result and answers.
MESSAGES = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "reasoning_content": "Simple sum: two and two.", "content": "2 + 2 = 4."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the weather tool.", "content": None,
     "tool_calls": [{"id": "call_0", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "It is 20 degrees in Paris. ☀"},
]
# The rendering after the system and developer messages, in pieces: (text, channel learned or
# None for a piece never learned).
PIECES = [
    ("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant", None),
    ("<|channel|>final<|message|>2 + 2 = 4.", "final"),
    ("<|end|><|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant", None),
    ("<|channel|>analysis<|message|>Need the weather tool.<|end|>", "analysis"),
    ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
     '<|message|>{"city": "Paris"}<|call|>', "commentary"),
    ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}'
     "<|end|><|start|>assistant", None),
    ("<|channel|>final<|message|>It is 20 degrees in Paris. ☀<|return|>", "final"),
]


def _system_and_developer(tok: HFTokenizer) -> str:
    text = tok.render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    return text[:text.index("<|start|>user")]


@pytest.mark.parametrize("channels", ["analysis,commentary,final", "commentary,final"])
def test_the_mask_covers_the_assistant_messages_on_the_chosen_channels(harmony_tokenizer,
                                                                        channels):
    tok = HFTokenizer(harmony_tokenizer)  # no chat template: harmony's renderer
    ids, mask = tokenize_conversation(tok, Conversation(MESSAGES, {"tools": [WEATHER_TOOL]}),
                                      loss_channels(channels))
    want_ids = tok.encode(_system_and_developer(tok))
    want_mask = [0.0] * len(want_ids)
    for text, channel in PIECES:
        piece = tok.encode(text)
        want_ids += piece
        want_mask += [float(channel in channels.split(","))] * len(piece)
    assert ids.tolist() == want_ids  # the pieces are the whole rendering
    assert mask.tolist() == want_mask
    learned = tok.decode(ids[mask == 1])
    assert ("Need the weather tool." in learned) == ("analysis" in channels)
    assert "Simple sum" not in tok.decode(ids)  # the finished turn's reasoning is dropped


# A chat template of the gpt-oss kind: reads `thinking`, writes the recipient in the role part
# and the content type after the channel, the tool call's arguments as an object.
HARMONY_TEMPLATE = """\
<|start|>system<|message|>Reasoning: {{ reasoning_effort or "medium" }}<|end|>
{%- for m in messages -%}
{%- if m.role == "user" -%}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "tool" -%}<|start|>functions.{{ last }} to=assistant<|channel|>commentary\
<|message|>{{ m.content }}<|end|>
{%- elif m.tool_calls -%}{% set call = m.tool_calls[0].function %}{% set last = call.name %}\
<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>\
<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>\
{{ call.arguments | tojson }}<|call|>
{%- else -%}{% if loop.last and m.thinking %}<|start|>assistant<|channel|>analysis<|message|>\
{{ m.thinking }}<|end|>{% endif %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}\
{{ "<|return|>" if loop.last and not add_generation_prompt else "<|end|>" }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


def test_a_chat_template_that_writes_harmony_is_masked_by_parsing_it(harmony_tokenizer,
                                                                     tmp_path):
    shutil.copy(harmony_tokenizer / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    tok = HFTokenizer(tmp_path)
    options, messages = HARMONY_CHATS[2]
    messages = [{**m, "content": None} if "tool_calls" in m else m for m in messages]
    ids, mask = tokenize_conversation(tok, Conversation(messages, options),
                                      loss_channels("commentary,final"))
    text = tok.decode(ids)
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>' \
        '{"city": "Paris"}<|call|>' in text  # `reasoning_content` read as `thinking`, the
    # arguments as an object
    assert tok.decode(ids[mask == 1]) == (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
        '{"city": "Paris"}<|call|><|channel|>final<|message|>It is 20 degrees in Paris. ☀'
        '<|return|>')


def test_a_template_without_harmony_masks_each_reply_as_before(tmp_path):
    special = ["<|start|>", "<|message|>", "<|end|>"]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["user assistant the cat sat"], tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=special,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}")
    hf = HFTokenizer(tmp_path)
    assert hf.harmony is None
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"},
                {"role": "user", "content": "cat"}, {"role": "assistant", "content": "the"}]
    for channels in ("final", "analysis,commentary,final"):  # not read without harmony
        ids, mask = tokenize_conversation(hf, messages, loss_channels(channels))
        assert hf.decode(ids[mask == 1]) == "sat<|end|>the<|end|>"
    # a template that is not UTF-8, or does not parse, is refused naming its file
    for bad, what in ((b"{{ m\xff }}", "unreadable"), (b"{% for m in %}", "corrupt")):
        (tmp_path / "chat_template.jinja").write_bytes(bad)
        with pytest.raises(ValueError, match=f"chat template .*chat_template.jinja is {what}"):
            HFTokenizer(tmp_path)


def test_sft_lines_with_reasoning_and_tools_pack_with_the_mask(harmony_tokenizer, tmp_path):
    lines = [{"messages": m, **o} for o, m in HARMONY_CHATS]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sft = default_run_config("t", ModelConfig()).sft
    sft.files, sft.validation_fraction = str(tmp_path / "chats.jsonl"), 0.0
    sft.loss_channels = "final"
    data = make_sft_data(sft, tokenizer_path=str(harmony_tokenizer), seq_len=512,
                         batch_size=1, seed=0)
    tok = data.tokenizer
    rows = data.rows
    learned = tok.decode(rows["targets"][rows["loss_mask"] == 1])
    # after reasoning (not learned here) the model itself opens the final message
    assert learned == "".join(
        ("<|start|>assistant" if m[-1].get("reasoning_content") else "")
        + f"<|channel|>final<|message|>{m[-1]['content']}<|return|>"
        for _, m in HARMONY_CHATS if m[-1].get("content"))
    assert "Reasoning: low" in tok.decode(rows["inputs"].ravel())  # the line's options


@pytest.mark.parametrize("record, error", [
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None}]},
     r"messages\[1\] needs a string 'content' \(or 'tool_calls'\)"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]},
     r"messages\[1\].tool_calls must be a list of calls with a function name"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "a", "thinking": 3}]},
     r"messages\[1\].thinking must be a string"),
    ({"messages": [{"role": "tool", "content": None},
                   {"role": "assistant", "content": "a"}]},
     r"messages\[0\] needs a string 'content'$"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "reasoning_effort": "max"}, "'reasoning_effort' must be one of"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "tools": {"name": "f"}}, "'tools' must be a list"),
])
def test_a_bad_line_is_named(record, error):
    with pytest.raises(ValueError, match=error):
        to_conversation(record)


def test_loss_channels_are_checked_naming_the_field():
    assert loss_channels(" final, commentary") == {"final", "commentary"}
    cfg = default_run_config("t", ModelConfig())
    validate_run_config(cfg)
    for bad in ("", "final,thinking"):
        cfg.sft.loss_channels = bad
        with pytest.raises(ValueError, match="config field sft.loss_channels=.* is invalid"):
            validate_run_config(cfg)
    assert to_conversation({"messages": HARMONY_CHATS[1][1], **HARMONY_CHATS[1][0]}).options \
        == {"tools": [WEATHER_TOOL]}


def test_a_conversation_the_renderer_refuses_is_named(harmony_tokenizer, tmp_path):
    line = {"messages": HARMONY_CHATS[0][1], "tools": [{"type": "function", "function": {}}]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(line) + "\n")
    sft = default_run_config("t", ModelConfig()).sft
    sft.files, sft.validation_fraction = str(tmp_path / "bad.jsonl"), 0.0
    with pytest.raises(ValueError, match=r"SFT conversation .*What is 2 \+ 2.*"
                                         r"tools\[0\].function.name"):
        make_sft_data(sft, tokenizer_path=str(harmony_tokenizer), seq_len=512, batch_size=1,
                      seed=0)


def test_a_task_gives_sft_its_reference_replies_and_holds_out_its_eval_split(tmp_path):
    from llm_jax.data.tasks import make_task, write_task_tokenizer

    cfg = default_run_config("t", ModelConfig())
    cfg.task.name, cfg.task.show_work, cfg.task.max_terms = "arithmetic", True, 3
    cfg.task.sft_examples, cfg.task.eval_size = 40, 8
    task = make_task(cfg.task)
    write_task_tokenizer(task, tmp_path, vocab_size=512)
    data = make_sft_data(cfg.sft, tokenizer_path=str(tmp_path), seq_len=256, batch_size=2,
                         seed=0, task=cfg.task)
    tok = data.tokenizer

    def learned(rows):  # each example's assistant tokens, in row order
        out = []
        for r in range(len(rows["inputs"])):
            for seg in range(1, rows["segment_ids"][r].max() + 1):
                keep = (rows["segment_ids"][r] == seg) & (rows["loss_mask"][r] == 1)
                out.append(tok.decode(rows["targets"][r][keep]))
        return out

    def reply(ex):
        return (f"<|channel|>analysis<|message|>{task.reasoning(ex)}<|end|><|start|>assistant"
                f"<|channel|>final<|message|>{ex.answer}<|return|>")

    assert learned(data.rows) == [reply(task.example("train", i)) for i in range(40)]
    assert learned(data.eval_rows) == [reply(task.example("eval", i)) for i in range(8)]
    assert data.train_iter.identity["task"] == task.identity()
    assert data.name == "task:arithmetic"
    # The end-of-run samples answer held-out problems, prompted up to the assistant's turn.
    shown, ids = data.sample_prompts(2)[1]
    assert shown == task.example("eval", 1).prompt
    assert tok.decode(ids).endswith(f"{shown}<|end|><|start|>assistant")
