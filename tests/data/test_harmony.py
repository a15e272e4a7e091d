"""The harmony format: rendering against the format description's own examples (OpenAI's
harmony repository, docs/format.md), and parsing hand-written token streams, one token at a
time and all at once."""

import json
import re

import pytest
from helpers import (
    HARMONY_SPECIALS as SPECIALS,
    TOY_HARMONY_TOKENS as TOKENS,
    toy_decode as decode,
    toy_encode as encode,
)

from llm_jax.data import harmony
from llm_jax.inference.stops import StopText


def streamed(ids, text=None):
    """Messages and the text each message's deltas added up to, one token at a time."""
    parser = harmony.Parser(TOKENS, decode, text=text)
    got: dict[int, str] = {}
    for i in ids:
        for d in parser.push(i):
            got[d.index] = got.get(d.index, "") + d.text
    for d in parser.finish():
        got[d.index] = got.get(d.index, "") + d.text
    return parser, got


def fields(messages):
    return [(m.role, m.channel, m.recipient, m.content_type, m.content, m.end) for m in messages]


# --------------------------------------------------------------------------- parsing

ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. '
          'Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.'
          '<|return|>')
CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>'
        'assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"location":"San Francisco"}<|call|>')


@pytest.mark.parametrize("text", [None, lambda: StopText(decode)])
def test_an_answer_parses_into_analysis_and_final_streamed_or_whole(text):
    parser, deltas = streamed(encode(ANSWER), text)
    assert fields(parser.messages) == [
        ("assistant", "analysis", None, None,
         'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "end"),
        ("assistant", "final", None, None, "2 + 2 = 4.", "return")]
    assert parser.done and not parser.errors
    assert deltas == {i: m.content for i, m in enumerate(parser.messages)}
    assert fields(harmony.parse(TOKENS, encode(ANSWER), decode)) == fields(parser.messages)
    assert harmony.final_text(parser.messages) == "2 + 2 = 4."
    assert harmony.reasoning_text(parser.messages).startswith("User asks")


@pytest.mark.parametrize("output", [
    CALL,
    # the recipient in the role part and the content type after the channel (transformers'
    # gpt-oss template writes calls this way)
    '<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant '
    'to=functions.get_weather<|channel|>commentary json<|message|>{"location":"San Francisco"}'
    '<|call|>',
])
def test_a_tool_call_parses_with_its_recipient_and_content_type(output):
    parser, _ = streamed(encode(output))
    call = parser.messages[-1]
    assert (call.role, call.channel, call.recipient, call.content_type, call.end) == (
        "assistant", "commentary", "functions.get_weather", "json", "call")
    assert harmony.tool_calls(parser.messages) == [
        harmony.ToolCall("get_weather", '{"location":"San Francisco"}')]
    assert harmony.answer_text(parser.messages) == "" and parser.done


def test_a_preamble_is_answer_text_and_a_builtin_tool_call_is_reasoning():
    out = ('<|channel|>commentary<|message|>Checking two cities.<|end|><|start|>assistant'
           '<|channel|>analysis to=python<|message|>print(1)<|call|>')
    messages = harmony.parse(TOKENS, encode(out), decode)
    assert harmony.answer_text(messages) == "Checking two cities."
    assert harmony.reasoning_text(messages) == "print(1)"
    assert harmony.tool_calls(messages) == []


def test_a_character_split_over_tokens_is_never_split_in_a_delta():
    out = "<|channel|>final<|message|>café 日本 🎉<|return|>"
    parser, deltas = streamed(encode(out), lambda: StopText(decode))
    assert deltas[0] == "café 日本 🎉" and "\ufffd" not in deltas[0]
    parser = harmony.Parser(TOKENS, decode, text=lambda: StopText(decode))
    pieces = [d.text for i in encode(out) for d in parser.push(i)]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == "café 日本 🎉"


@pytest.mark.parametrize("output, expect, error", [
    # cut by the length limit inside the content: kept, not closed
    ("<|channel|>final<|message|>2 + 2 =", [("assistant", "final", None, None, "2 + 2 =",
                                             None)], "ended inside a message"),
    # cut inside a header: what it wrote is kept as text, its framing tokens left out
    ("<|channel|>fin", [("assistant", None, None, None, "fin", None)],
     "inside a message header"),
    # text and an <|end|> where a header should be (the prompt wrote the role)
    ("hello<|end|>", [("assistant", None, None, None, "hello", "end")], "inside a message header"),
    # a complete header closed by <|call|> without <|message|>: a call with no arguments
    ("<|channel|>commentary to=functions.f<|call|>",
     [("assistant", "commentary", "functions.f", None, "", "call")], "inside a message header"),
    # a header never closed before the next <|start|>
    ("<|channel|>ana<|start|>assistant<|channel|>final<|message|>ok<|return|>",
     [("assistant", None, None, None, "ana", None),
      ("assistant", "final", None, None, "ok", "return")], "not closed before <|start|>"),
    # a special token out of place is dropped (framing never reaches content)
    ("<|channel|>final<|message|>a<|message|>b<|return|>",
     [("assistant", "final", None, None, "ab", "return")], "inside a message's content"),
    # text between messages becomes a message of no channel (answer text)
    ("<|channel|>final<|message|>a<|end|>stray<|return|>",
     [("assistant", "final", None, None, "a", "end"),
      ("assistant", None, None, None, "stray", "return")], "text between messages"),
    # a message never closed before the next <|start|>
    ("<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>ok<|return|>",
     [("assistant", "analysis", None, None, "think", None),
      ("assistant", "final", None, None, "ok", "return")], "not closed before"),
    # a stop token after a closed message ends the turn without an empty message
    ("<|channel|>final<|message|>a<|end|><|return|>",
     [("assistant", "final", None, None, "a", "end")], "after <|end|>"),
    # an unknown channel is kept by name
    ("<|channel|>secret<|message|>x<|end|>", [("assistant", "secret", None, None, "x", "end")],
     "unknown channel"),
    # bad JSON arguments stay as the model wrote them
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>",
     [("assistant", "commentary", "functions.f", "json", "{oops", "call")], None),
])
def test_malformed_and_truncated_output_is_kept_and_reported(output, expect, error):
    for text in (None, lambda: StopText(decode)):
        parser, deltas = streamed(encode(output), text)
        assert fields(parser.messages) == expect
        assert deltas == {i: m.content for i, m in enumerate(parser.messages)}
        assert (error is None and not parser.errors) or any(error in e for e in parser.errors)


def test_tokens_after_the_end_of_the_turn_are_ignored():
    parser, _ = streamed(encode("<|channel|>final<|message|>a<|return|>b"))
    assert fields(parser.messages) == [("assistant", "final", None, None, "a", "return")]
    assert any("after the end" in e for e in parser.errors)


def test_harmony_tokens_are_found_only_when_all_are_in_the_vocabulary():
    assert TOKENS.stops == {SPECIALS.index("<|return|>"), SPECIALS.index("<|call|>")}
    assert harmony.HarmonyTokens.find(lambda s: None if s == "<|call|>" else 1) is None


# --------------------------------------------------------------------------- rendering

SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
          "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
          "# Valid channels: analysis, commentary, final. Channel must be included for every "
          "message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>")
DEVELOPER = """<|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|>"""
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [
    {"type": "function", "function": {"name": "get_location",
                                      "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "required": ["location"], "properties": {
            "location": {"type": "string",
                         "description": "The city and state, e.g. San Francisco, CA"},
            "format": FORMAT}}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers",
        "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "required": ["locations"], "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", '
                                         '"New York, NY"]'},
            "format": FORMAT}}}},
]
OPTIONS = {"tools": TOOLS, "reasoning_effort": "high", "current_date": "2025-06-28"}


def test_tools_render_as_the_format_description_declares_them():
    messages = [{"role": "system", "content": "Use a friendly tone."},
                {"role": "user", "content": "What is the weather like in SF?"}]
    assert harmony.render_conversation(messages, **OPTIONS) == (
        SYSTEM + DEVELOPER + "<|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant")


def test_a_tool_result_continues_with_the_reasoning_of_the_turn_in_progress():
    messages = [
        {"role": "developer", "content": "Use a friendly tone."},
        {"role": "user", "content": "What is the weather like in SF?"},
        {"role": "assistant", "reasoning_content": "Need to use function get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"location":"San Francisco"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'},
    ]
    assert harmony.render_conversation(messages, **OPTIONS) == (
        SYSTEM + DEVELOPER + "<|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"San Francisco"}<|call|><|start|>functions.get_weather '
        'to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}<|end|>'
        "<|start|>assistant")


def test_reasoning_of_finished_turns_is_dropped_and_a_training_target_ends_in_return():
    first = [{"role": "user", "content": "What is 2 + 2?"},
             {"role": "assistant", "thinking": "Simple arithmetic.", "content": "2 + 2 = 4."}]
    head = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
            "OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: low\n\n# Valid channels: analysis, "
            "commentary, final. Channel must be included for every message.<|end|>"
            "<|start|>user<|message|>What is 2 + 2?<|end|>")
    # the turn as a training example: its reasoning kept, ending in <|return|>
    assert harmony.render_conversation(first, reasoning_effort="low",
                                       add_generation_prompt=False) == (
        head + "<|start|>assistant<|channel|>analysis<|message|>Simple arithmetic.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
    # the next turn's prompt: the finished turn's reasoning dropped, its answer closed by <|end|>
    assert harmony.render_conversation(first + [{"role": "user", "content": "What about 9 / 2?"}],
                                       reasoning_effort="low") == (
        head + "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")


def test_a_rendered_conversation_parses_back_into_its_messages():
    text = harmony.render_conversation(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "reasoning_content": "greet", "content": "héllo 🎉"}],
        add_generation_prompt=False)
    reply = text[text.index("<|start|>assistant") + len("<|start|>assistant"):]
    messages = harmony.parse(TOKENS, encode(reply), decode)
    assert fields(messages) == [("assistant", "analysis", None, None, "greet", "end"),
                                ("assistant", "final", None, None, "héllo 🎉", "return")]


@pytest.mark.parametrize("messages, kwargs, field", [
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "max"}, "reasoning_effort"),
    ([{"role": "robot", "content": "x"}], {}, "messages[0].role"),
    ([{"role": "user", "content": 3}], {}, "messages[0].content"),
    ([{"role": "tool", "content": "x"}], {}, "messages[0]"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], {},
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "strnig"}}}}}]}, "tools[0].function.parameters.properties.a.type"),
    ([{"role": "user", "content": "x"}], {"tools": [{"function": {"name": "a b"}}]},
     "tools[0].function.name"),
])
def test_a_bad_conversation_or_tool_is_refused_naming_the_field(messages, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        harmony.render_conversation(messages, **kwargs)


def test_tool_call_arguments_given_as_an_object_render_as_json():
    text = harmony.render_conversation(
        [{"role": "user", "content": "x"},
         {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}])
    assert "to=functions.f <|constrain|>json<|message|>" + json.dumps({"a": 1}) + "<|call|>" in text
