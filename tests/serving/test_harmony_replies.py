"""A harmony reply built from hand-written token streams (no model): answer, reasoning and tool
calls land in their fields, streamed pieces add up to the finished reply, malformed output
(a channel never closed, an unknown recipient, bad JSON arguments, the length limit mid-message)
still makes a well-formed reply with the raw text kept, stop strings cut the answer only, and
the chat deltas and Responses events have the shapes the `openai` client's own types accept;
and prompts: tools offered or not, a forced call's header, messages reshaped for a checkpoint's own
gpt-oss chat template."""

from __future__ import annotations

from typing import get_args

import pytest
from helpers import (
    TOY_HARMONY_TOKENS as TOKENS,
    toy_decode as decode,
    toy_encode as encode,
)

from llm_jax.data import harmony
from llm_jax.data.hf_tokenizer import template_messages
from llm_jax.serving import protocol
from llm_jax.serving.replies import HarmonyReply, PlainReply
from llm_jax.serving.responses import Output, ResponsesRequest


def run(text: str, stop=(), prefill: str = "", limit: int | None = None):
    """(reply, its pieces, the finish reason) of `text` generated after `<|start|>assistant`
    (+ `prefill`), fed as the server's listener does: stop when the reply says so, cut after
    `limit` tokens."""
    reply = HarmonyReply(TOKENS, decode, stop, encode(prefill))
    pieces, reason = [], "length"
    for n, t in enumerate(encode(text)):
        if limit is not None and n == limit:
            break
        pieces += reply.push(t)
        if reply.stopped:
            reason = "stop"
            break
    pieces += reply.finish()
    return reply, pieces, reply.finish_reason(reason)


ANSWER = ("<|channel|>analysis<|message|>Simple sum: two and two.<|end|><|start|>assistant"
          "<|channel|>final<|message|>2 + 2 = 4 ☀.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>')
PREAMBLE = ("<|channel|>commentary<|message|>Let me look. <|end|><|start|>assistant to="
            'functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>')


def streamed_text(reply, pieces):
    """Each item's text as its pieces streamed it."""
    got = [""] * len(reply.items)
    for p in pieces:
        got[p.item] += p.text
    return got


@pytest.mark.parametrize("text, content, reasoning, calls, finish", [
    (ANSWER, "2 + 2 = 4 ☀.", "Simple sum: two and two.", [], "stop"),
    (CALL, None, "Need the weather tool.", [("get_weather", '{"city": "Paris"}')],
     "tool_calls"),
    (PREAMBLE, "Let me look. ", None, [("get_weather", '{"city": "Oslo"}')], "tool_calls"),
])
def test_each_channel_lands_in_its_field_and_the_stream_adds_up_to_it(text, content, reasoning,
                                                                      calls, finish):
    reply, pieces, reason = run(text)
    message = protocol.harmony_message(reply)
    assert message["content"] == content and message["reasoning_content"] == reasoning
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])] == calls
    assert reason == finish
    assert streamed_text(reply, pieces) == [i.text for i in reply.items]
    assert [p.item for p in pieces if p.start] == list(range(len(reply.items)))
    assert [p.item for p in pieces if p.end] == list(range(len(reply.items)))
    # the same as harmony.parse of the same tokens (all at once)
    messages = harmony.parse(TOKENS, encode(text), decode)
    assert reply.content() == harmony.answer_text(messages)
    assert reply.reasoning() == harmony.reasoning_text(messages)
    assert [(c.name, c.text) for c in reply.calls()] == [
        (c.name, c.arguments) for c in harmony.tool_calls(messages)]
    for field in (reply.content(), reply.reasoning()):
        assert "<|" not in field


def test_chat_deltas_stream_calls_as_the_openai_api_does():
    reply, pieces, _ = run(CALL)
    deltas = protocol.harmony_deltas(reply, pieces)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = calls[0]
    assert first["index"] == 0 and first["type"] == "function"
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather",
                                                                     "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather tool."
    assert not any("content" in d for d in deltas)


@pytest.mark.parametrize("text, limit, content, reasoning, calls, finish", [
    # a channel never closed, cut by the length limit: the text so far, finish "length"
    ("<|channel|>analysis<|message|>Thinking about it", None, None, "Thinking about it", [],
     "length"),
    ("<|channel|>final<|message|>Half an ans", None, "Half an ans", None, [], "length"),
    # the limit mid-character: the partial character's bytes end the text as U+FFFD
    ("<|channel|>final<|message|>Hot ☀", len(encode("<|channel|>final<|message|>Hot ")) + 1,
     "Hot \ufffd", None, [], "length"),
    # a recipient that is not one of the developer's functions: kept, as reasoning
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>", None, None,
     '{"q": 1}', [], "stop"),
    # arguments that are not JSON: kept as written
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{city: Paris<|call|>",
     None, None, None, [("f", "{city: Paris")], "tool_calls"),
    # cut inside a call's arguments
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": ", None, None,
     None, [("f", '{"a": ')], "length"),
    # the header never closed: its text kept as the answer
    ("<|channel|>fina", None, "fina", None, [], "length"),
    # a special token inside content (dropped: framing never reaches content), text outside
    # any message (kept)
    ("<|channel|>final<|message|>a<|constrain|>b<|end|>stray", None, "abstray", None, [],
     "length"),
])
def test_malformed_output_makes_a_well_formed_reply_with_the_raw_text(text, limit, content,
                                                                       reasoning, calls,
                                                                       finish):
    reply, pieces, reason = run(text, limit=limit)
    message = protocol.harmony_message(reply)
    assert (message["content"], message["reasoning_content"]) == (content, reasoning)
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])] == calls
    assert reason == finish
    assert streamed_text(reply, pieces) == [i.text for i in reply.items]
    assert all(i.done for i in reply.items)
    # what the server logs: not a cut by the length limit, only the stray tokens and text
    engine_reason = "length" if finish == "length" else "stop"
    assert bool(reply.malformed(engine_reason)) == ("stray" in text)


def test_stop_strings_cut_the_answer_only_and_end_the_reply():
    reply, pieces, reason = run(ANSWER, stop=["two", "= 4"])
    assert reply.reasoning() == "Simple sum: two and two."  # not cut
    assert reply.content() == "2 + 2 " and reason == "stop"
    assert streamed_text(reply, pieces)[1] == "2 + 2 "


def test_a_forced_call_is_parsed_from_the_prefilled_header():
    header = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    reply, pieces, reason = run('{"city": "Rome"}<|call|>', prefill=header)
    assert [(c.name, c.text) for c in reply.calls()] == [("get_weather", '{"city": "Rome"}')]
    assert reason == "tool_calls" and pieces[0].start and pieces[0].kind == "call"
    reply, _, _ = run('get_weather <|constrain|>json<|message|>{}<|call|>',
                      prefill="<|channel|>commentary to=functions.")
    assert [(c.name, c.text) for c in reply.calls()] == [("get_weather", "{}")]


def test_a_plain_reply_is_its_text_with_nothing_dropped():
    ids = list("héllo".encode()) + [0xE2, 0x98]  # ends inside a character
    reply = PlainReply(lambda ids: bytes(ids).decode("utf-8", "replace"))
    pieces = [p for t in ids for p in reply.push(t)] + reply.finish()
    assert "".join(p.text for p in pieces) == reply.text.text == "héllo\ufffd"
    assert pieces[0].start and pieces[-1].end


@pytest.mark.parametrize("text, limit", [(ANSWER, None), (CALL, None), (PREAMBLE, None),
                                         (ANSWER, 40)])
def test_responses_events_and_response_have_the_openai_clients_shapes(text, limit):
    types = pytest.importorskip("openai.types.responses")
    reply, pieces, reason = run(text, limit=limit)
    body = ResponsesRequest(input="hi", stream=True)
    out = Output(body, "toy", reply.items, harmony=True)
    events = out.opening()
    for p in pieces[:-1]:
        events += out.events(p)
    out.finish("length" if limit else "stop", 5, 40, reply.reasoning_tokens())
    events += out.events(pieces[-1]) + out.closing()
    classes = {get_args(c.model_fields["type"].annotation)[0]: c
               for c in get_args(get_args(types.ResponseStreamEvent)[0])}
    parsed = [classes[e["type"]].model_validate(e) for e in events]  # strict: every field
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert parsed[0].type == "response.created" and parsed[-1].type == (
        "response.incomplete" if limit else "response.completed")
    final = types.Response.model_validate(parsed[-1].response.model_dump())
    assert [i.type for i in final.output] == [
        {"text": "message", "reasoning": "reasoning", "call": "function_call"}[i.kind]
        for i in reply.items]
    deltas = "".join(getattr(e, "delta", "") for e in parsed)
    assert deltas == "".join(i.text for i in reply.items)
    assert final.output_text == reply.content()
    if limit:
        assert final.incomplete_details.reason == "max_output_tokens"
        assert final.output[-1].status == "incomplete"


def test_messages_are_reshaped_for_transformers_gpt_oss_template():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "Need it.",
                 "tool_calls": [{"id": "c", "type": "function", "function": {
                     "name": "w", "arguments": '{"city": "Paris"}'}},
                                {"id": "d", "type": "function", "function": {
                                    "name": "v", "arguments": "not json"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "20"}]
    out = template_messages(messages)
    assert out[1]["thinking"] == "Need it."
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [
        {"city": "Paris"}, "not json"]
    assert out[0] == messages[0] and out[2] == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_the_prompt_offers_the_tools_and_forces_a_call_as_tool_choice_says():
    from llm_jax.inference.tokenizer import CheckpointTokenizer
    from llm_jax.serving.prompts import chat_prompt

    class HarmonyRenderer:  # what an HFTokenizer without a chat template renders with
        harmony = TOKENS

        def render(self, messages, *, add_generation_prompt, **options):
            return harmony.render_conversation(messages, **options,
                                               add_generation_prompt=add_generation_prompt)

    tok = CheckpointTokenizer(encode, decode, 256 + 16, None, None, frozenset(), HarmonyRenderer())
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "Weather?"}]
    render = harmony.render_conversation
    assert chat_prompt(tok, messages, tools=[tool]).ids == encode(render(messages, tools=[tool]))
    assert chat_prompt(tok, messages, tools=[tool], offer_tools=False).ids == encode(
        render(messages))
    assert chat_prompt(tok, messages, reasoning_effort="high").ids == encode(
        render(messages, reasoning_effort="high"))
    named = chat_prompt(tok, messages, tools=[tool], forced="w")
    header = "<|channel|>commentary to=functions.w <|constrain|>json<|message|>"
    assert named.prefill == encode(header)
    assert named.ids == encode(render(messages, tools=[tool])) + encode(header)
    assert decode(chat_prompt(tok, messages, tools=[tool], forced="").prefill) == (
        "<|channel|>commentary to=functions.")
    with pytest.raises(ValueError, match=r"^tool_choice.function.name: 'x'"):
        chat_prompt(tok, messages, tools=[tool], forced="x")
