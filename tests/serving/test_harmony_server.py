"""The server on a checkpoint that speaks harmony (the `harmony_checkpoint` fixture), started as
`python -m llm_jax.serve` and driven by the real `openai` client: chat's content,
reasoning_content and tool_calls, and the Responses API's output items, carry exactly what the
model generated on each channel (against `harmony.parse` of the same greedy generation done in
this process, and against the conversations it learned), streamed and not; a tool call round
trip works in both APIs; a forced tool call parses; stop strings cut the answer only; and bad
tools, tool messages and bodies of any content type get a 4xx naming the field, never a 500."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import HARMONY_CHATS, WEATHER_TOOL, start_server

from llm_jax.data import harmony
from llm_jax.inference.sampler import sample
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
NEW = 80  # tokens: more than any learned reply needs


@pytest.fixture(scope="module")
def server(harmony_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("harmony_serve") / "server.log"
    yield from start_server(
        ["--checkpoint", str(harmony_checkpoint), "--slots", "2", "--max_len", "384",
         "--request_timeout", "120", "--log_level", "warning", "--warmup", "none",
         "--model_name", "h"], log)
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


FORCED_HEADERS = {  # what the server prefills for each forced tool_choice
    "named": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    "required": "<|channel|>commentary to=functions."}


@pytest.fixture(scope="module")
def greedy(harmony_checkpoint):
    """(prompt ids, prefill ids, n) -> the messages of the greedy reply, generated in this
    process (no server) and parsed whole by `harmony.parse`. Every prompt the tests ask about
    runs in one batched `sample` (a batch equals each prompt alone: test_generate), so one
    program serves them all; a greedy reply of n tokens is the first n of a longer one."""
    model, tok = load_pretrained(harmony_checkpoint), load_tokenizer(harmony_checkpoint)
    prompts = [tok.encode(tok.render(m[:-1], **o)) for o, m in HARMONY_CHATS]
    forced = tok.encode(tok.render(HARMONY_CHATS[1][1][:1], tools=[WEATHER_TOOL]))
    prompts += [forced + tok.encode(h) for h in FORCED_HEADERS.values()]
    replies = dict(zip(map(tuple, prompts), sample(model, prompts, max_new_tokens=NEW)))

    def run(prompt: list[int], prefill: list[int] = (), n: int = NEW) -> list[harmony.Message]:
        ids = [int(i) for i in replies[tuple(prompt)][:n]]
        cut = next((i for i, t in enumerate(ids) if t in tok.stop_ids), len(ids) - 1)
        return harmony.parse(tok.harmony, list(prefill) + ids[:cut + 1], tok.decode)

    return tok, run


def expected(messages: list[harmony.Message]) -> tuple:
    """(content, reasoning_content, [(name, arguments)]) of parsed messages, as chat gives
    them: None for a field the reply has nothing on."""
    answer = [m for m in messages if harmony.is_answer(m)]
    thought = [m for m in messages if harmony.is_reasoning(m)]
    return (harmony.answer_text(answer) if answer else None,
            harmony.reasoning_text(thought) if thought else None,
            [(c.name, c.arguments) for c in harmony.tool_calls(messages)])


def learned(conversation) -> tuple:
    last = conversation[-1]
    return (last.get("content"), last.get("reasoning_content"),
            [(c["function"]["name"], c["function"]["arguments"])
             for c in last.get("tool_calls", [])])


def got_message(message) -> tuple:
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content, getattr(message, "reasoning_content", None), calls


def got_stream(chunks) -> tuple:
    content, reasoning, calls, reasons = None, None, {}, []
    for c in chunks:
        choice = c.choices[0]
        d = choice.delta
        if d.content:
            content = (content or "") + d.content
        if getattr(d, "reasoning_content", None):
            reasoning = (reasoning or "") + d.reasoning_content
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function"
                assert tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                calls[tc.index][1] += tc.function.arguments
        reasons.append(choice.finish_reason)
    assert reasons[-1] is not None and not any(reasons[:-1])
    return (content, reasoning, [tuple(calls[i]) for i in sorted(calls)]), reasons[-1]


def no_framing(*texts) -> bool:
    return not any(t and any(s in t for s in harmony.SPECIAL_TOKENS.values()) for t in texts)


@pytest.mark.parametrize("chat", range(len(HARMONY_CHATS)))
def test_chat_carries_what_the_model_wrote_on_each_channel(client, greedy, chat):
    tok, run = greedy
    options, conversation = HARMONY_CHATS[chat]
    messages = conversation[:-1]
    want = expected(run(tok.encode(tok.render(messages, **options))))
    assert want == learned(conversation)  # the model says what it learned
    out = client.chat.completions.create(model="h", messages=messages, max_tokens=NEW,
                                         temperature=0, **options)
    message = out.choices[0].message
    assert got_message(message) == want
    assert out.choices[0].finish_reason == ("tool_calls" if want[2] else "stop")
    assert no_framing(message.content, message.reasoning_content)
    stream = client.chat.completions.create(model="h", messages=messages, max_tokens=NEW,
                                            temperature=0, stream=True, **options)
    streamed, reason = got_stream(stream)
    assert streamed == want and reason == out.choices[0].finish_reason


def test_a_tool_call_round_trip(client):
    options, conversation = HARMONY_CHATS[2]
    messages = [conversation[0]]
    call = client.chat.completions.create(model="h", messages=messages, max_tokens=NEW,
                                          temperature=0, **options).choices[0]
    assert call.finish_reason == "tool_calls"
    messages.append(call.message.model_dump(exclude_none=True))
    (tc,) = call.message.tool_calls
    messages.append({"role": "tool", "tool_call_id": tc.id, "content": '{"temp": 20}'})
    answer = client.chat.completions.create(model="h", messages=messages, max_tokens=NEW,
                                            temperature=0, **options).choices[0]
    assert answer.message.content == conversation[-1]["content"]
    assert answer.finish_reason == "stop"


def response_input(messages: list[dict]) -> list[dict]:
    """Chat messages as Responses input items."""
    items = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        elif m["role"] == "assistant":
            if m.get("reasoning_content"):
                items.append({"type": "reasoning", "id": "rs_0", "summary": [], "content": [
                    {"type": "reasoning_text", "text": m["reasoning_content"]}]})
            for c in m.get("tool_calls", []):
                items.append({"type": "function_call", "call_id": c["id"],
                              "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def response_options(options: dict) -> dict:
    out = {}
    if "tools" in options:
        out["tools"] = [{"type": "function", **t["function"]} for t in options["tools"]]
    if "reasoning_effort" in options:
        out["reasoning"] = {"effort": options["reasoning_effort"]}
    return out


def got_output(output) -> tuple:
    text = [i for i in output if i.type == "message"]
    thought = [i for i in output if i.type == "reasoning"]
    return ("".join(p.text for i in text for p in i.content) if text else None,
            "".join(p.text for i in thought for p in i.content) if thought else None,
            [(i.name, i.arguments) for i in output if i.type == "function_call"])


@pytest.mark.parametrize("chat", range(len(HARMONY_CHATS)))
def test_responses_carry_what_the_model_wrote_streamed_and_not(client, chat):
    options, conversation = HARMONY_CHATS[chat]
    kw = dict(model="h", input=response_input(conversation[:-1]), max_output_tokens=NEW,
              temperature=0, **response_options(options))
    want = learned(conversation)
    out = client.responses.create(**kw)
    assert out.status == "completed" and got_output(out.output) == want
    assert out.output_text == (want[0] or "")
    assert out.usage.output_tokens > out.usage.output_tokens_details.reasoning_tokens > 0 \
        or not want[1]
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert got_output(final.output) == want
    deltas: dict[int, str] = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
    for k, item in enumerate(final.output):
        text = item.arguments if item.type == "function_call" else item.content[0].text
        assert deltas.get(k, "") == text and no_framing(text)


def test_a_responses_tool_call_round_trip(client):
    options, conversation = HARMONY_CHATS[2]
    kw = dict(model="h", max_output_tokens=NEW, temperature=0, **response_options(options))
    first = client.responses.create(input=[conversation[0]], **kw)
    (call,) = [i for i in first.output if i.type == "function_call"]
    follow = [conversation[0]] + [i.model_dump(exclude_none=True) for i in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 20}'}]
    answer = client.responses.create(input=follow, **kw)
    assert answer.output_text == conversation[-1]["content"]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_is_what_the_model_writes_after_the_prefilled_header(
        client, greedy, choice):
    tok, run = greedy
    messages = HARMONY_CHATS[1][1][:1]  # the weather question: the model learned its call
    tool_choice = ({"type": "function", "function": {"name": "get_weather"}}
                   if choice == "named" else "required")
    out = client.chat.completions.create(model="h", messages=messages, tools=[WEATHER_TOOL],
                                         tool_choice=tool_choice, max_tokens=20,
                                         temperature=0)
    prefill = tok.encode(FORCED_HEADERS[choice])
    want = run(tok.encode(tok.render(messages, tools=[WEATHER_TOOL])) + prefill, prefill, 20)
    got = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    # what the model writes past a header it was not trained to start with is its own; the
    # server must report exactly that, the named function first
    assert got == [(c.name, c.arguments) for c in harmony.tool_calls(want)]
    assert got[0][0] == "get_weather" or choice == "required"


def test_stop_strings_cut_the_answer_not_the_reasoning(client):
    options, conversation = HARMONY_CHATS[0]
    out = client.chat.completions.create(model="h", messages=conversation[:-1], stop=["= 4"],
                                         max_tokens=NEW, temperature=0)
    message = out.choices[0].message
    assert message.reasoning_content == conversation[-1]["reasoning_content"]
    assert message.content == "2 + 2 " and out.choices[0].finish_reason == "stop"


USER = [{"role": "user", "content": "hi"}]
BAD = [  # (route, body, param named in the error)
    ("chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "a b"}}]}, "tools[0].function.name"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "str"}}}}}]},
     "tools[0].function.parameters.properties.x.type"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ("chat/completions", {"messages": USER, "tools": "get_weather"}, "tools"),
    ("chat/completions", {"messages": USER, "tools": [WEATHER_TOOL, WEATHER_TOOL]},
     "tools[1].function.name"),
    ("chat/completions", {"messages": USER + [{"role": "tool", "content": "20"}]},
     "messages[1].tool_call_id"),
    ("chat/completions", {"messages": USER + [{"role": "tool", "tool_call_id": "nope",
                                               "content": "20"}]}, "messages[1].tool_call_id"),
    ("chat/completions", {"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ("chat/completions", {"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ("chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"messages": USER, "tool_choice": "always"}, "tool_choice"),
    ("responses", {"input": "hi", "tools": [{"type": "function", "name": "a b"}]},
     "tools[0].name"),
    ("responses", {"input": [{"type": "function_call_output", "output": "1"}]},
     "input[0].call_id"),
    ("responses", {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ("responses", {"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ("responses", {"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ("responses", {"input": 5}, "input"),
    ("responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
]


@pytest.mark.parametrize("route, body, param", BAD)
def test_bad_tools_and_tool_messages_are_a_400_naming_the_field(server, route, body, param):
    r = httpx.post(f"{server}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/octet-stream"]
BODIES = [b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}', b"{not json",
          b'["a list"]', b"", b'{"messages": "hello"}', "☀".encode() + b"\xff",
          json.dumps({"messages": USER, "tools": [{"type": "function"}]}).encode()]


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_every_body_of_every_content_type_gets_json_never_a_500(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    for route in ("chat/completions", "responses", "completions"):
        for body in BODIES:
            r = httpx.post(f"{server}/v1/{route}", content=body, headers=headers, timeout=60)
            assert r.status_code < 500, (route, body, content_type, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["message"], r.text
            if content_type and "json" not in content_type and body:
                assert r.status_code == 415 and "application/json" in r.text, r.text


def test_the_openai_stream_helpers_assemble_the_same_reply(client):
    options, conversation = HARMONY_CHATS[1]
    want = learned(conversation)
    with client.responses.stream(model="h", input=response_input(conversation[:-1]),
                                 max_output_tokens=NEW, temperature=0,
                                 **response_options(options)) as stream:
        for _ in stream:
            pass
        assert got_output(stream.get_final_response().output) == want
    with client.chat.completions.stream(model="h", messages=conversation[:-1], max_tokens=NEW,
                                        temperature=0, **options) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert got_message(final.message) == want and final.finish_reason == "tool_calls"
