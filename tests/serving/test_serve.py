"""The OpenAI-compatible server, started as `python -m llm_jax.serve` on 127.0.0.1 and driven by
the real `openai` client: completions, chat and responses (plain and streamed) equal greedy
`sample` on the same checkpoint, stop strings cut the text, a request's greedy tokens do not change when it
joins a busy batch, a full queue answers 429, and 200 bad requests (malformed JSON, wrong types,
huge max_tokens, empty messages, clients that disconnect mid-stream) each get a clear 4xx while
the server stays up with every slot back in the pool."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import make_checkpoint, start_server

from llm_jax.inference.sampler import sample
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
SLOTS, MAX_LEN, MAX_QUEUE = 4, 128, 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    yield from start_server(
        ["--checkpoint", str(ckpt), "--slots", str(SLOTS), "--max_len", str(MAX_LEN),
         "--max_queue", str(MAX_QUEUE), "--max_prefill", "4", "--request_timeout", "120",
         "--log_level", "warning", "--warmup", "short"], log)
    text = log.read_text()
    assert "llm_jax.serve: tiny on http" in text  # the server's own log ...
    assert "Traceback" not in text, text  # ... where no request crashed anything


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy continuations computed in this process with `sample` (no server)."""
    model, tok = load_pretrained(ckpt), load_tokenizer(ckpt)

    def greedy(text: str, n: int) -> tuple[str, list[int]]:
        # The first n of 32 greedy tokens (a greedy reply of n is the start of a longer one):
        # every reference shares one compiled program.
        assert n <= 32
        ids = sample(model, tok.encode(text), max_new_tokens=32)[:n]
        cut = next((i for i, t in enumerate(ids) if t in tok.stop_ids), len(ids))
        return tok.decode(ids[:cut]), ids[:cut]

    return tok, greedy


def _health(server) -> dict:
    return httpx.get(f"{server}/health", timeout=10).json()


def _idle(server, timeout: float = 30) -> dict:
    """/health once no slot is busy and nothing waits (or the last answer at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        h = _health(server)
        if (h["busy_slots"], h["waiting"]) == (0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def test_completion_equals_greedy_sample(client, reference):
    tok, greedy = reference
    out = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12,
                                    temperature=0)
    want, ids = greedy("the cat sat", 12)
    assert out.choices[0].text == want
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.prompt_tokens == len(tok.encode("the cat sat"))


def test_streamed_completion_equals_the_plain_one(client):
    plain = client.completions.create(model="tiny", prompt="one two", max_tokens=16,
                                      temperature=0).choices[0]
    chunks = list(client.completions.create(model="tiny", prompt="one two", max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.text
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason


def test_chat_uses_the_template_and_streams_the_same_text(client, reference):
    tok, greedy = reference
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                         temperature=0)
    want, _ = greedy(tok.render(messages), 10)
    msg = out.choices[0].message
    assert (msg.role, msg.content) == ("assistant", want)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_stop_strings_cut_the_text_in_plain_and_streamed_replies(client, reference):
    _, greedy = reference
    full, _ = greedy("the dog", 24)
    stop = full[3:6]
    assert stop and full.find(stop) >= 0
    out = client.completions.create(model="tiny", prompt="the dog", max_tokens=24,
                                    temperature=0, stop=[stop, "zzzz"])
    assert out.choices[0].text == full[:full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="the dog", max_tokens=24,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.find(stop)]


def test_a_request_gets_the_same_greedy_text_alone_and_in_a_busy_batch(client, server):
    alone = client.completions.create(model="tiny", prompt="birds sang", max_tokens=20,
                                      temperature=0).choices[0].text
    busy = [client.completions.create(model="tiny", prompt=p, max_tokens=100, temperature=0.7,
                                      seed=i, stream=True)
            for i, p in enumerate(["the park", "blue water"])]
    next(iter(busy[0]))  # both running
    joined = client.completions.create(model="tiny", prompt="birds sang", max_tokens=20,
                                       temperature=0).choices[0].text
    for s in busy:
        s.close()
    assert joined == alone
    assert _idle(server)["busy_slots"] == 0


def test_a_full_queue_answers_429_and_every_slot_comes_back(server):
    results: list[int] = []

    def post():
        r = httpx.post(f"{server}/v1/completions", timeout=120, json={
            "prompt": "the cat", "max_tokens": MAX_LEN - 8, "temperature": 0})
        results.append(r.status_code)
        if r.status_code == 429:
            assert "max_queue" in r.json()["error"]["message"]

    threads = [threading.Thread(target=post) for _ in range(3 * (SLOTS + MAX_QUEUE))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 429 in results and 200 in results and set(results) <= {200, 429}
    assert _idle(server)["free_slots"] == SLOTS


BAD = [  # (body or raw bytes, route, status, words in the message)
    (b"{not json", "completions", 400, "not valid JSON"),
    (b'["a list"]', "completions", 400, "body"),
    ({"prompt": 5}, "completions", 400, "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, "completions", 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, "completions", 400, "max_len=128"),
    ({"prompt": "hi", "max_tokens": 0}, "completions", 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "completions", 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "completions", 400, "top_p"),
    ({"prompt": "hi", "stream": "yes"}, "completions", 400, "stream"),
    ({"prompt": "hi", "n": 3}, "completions", 400, "n"),
    ({"prompt": [1, 2, 10**6]}, "completions", 400, "outside the vocabulary"),
    ({"prompt": []}, "completions", 400, "prompt"),
    ({"prompt": "hi", "stop": 7}, "completions", 400, "stop"),
    ({"prompt": "hi", "seed": -1}, "completions", 400, "seed"),
    ({"messages": []}, "chat/completions", 400, "messages"),
    ({"messages": [{"role": "user"}], "max_tokens": 10**9}, "chat/completions", 400, "max_len"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "chat/completions", 400, "role"),
    ({"messages": "hello"}, "chat/completions", 400, "messages"),
    ({"prompt": "hi"}, "nonexistent", 404, "Not Found"),
]


def test_200_bad_requests_each_get_a_clear_4xx_and_the_server_stays_up(server):
    with httpx.Client(base_url=f"{server}/v1", timeout=60) as http:
        for i in range(200):
            body, route, status, words = BAD[i % len(BAD)]
            if i % 20 == 19:  # a client that disconnects mid-stream
                with http.stream("POST", "/completions", json={
                        "prompt": "the cat", "max_tokens": 100, "stream": True}) as r:
                    assert r.status_code == 200
                    next(r.iter_lines())
                continue
            kw = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            r = http.post(f"/{route}", **kw)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert words in err["message"], (body, err)
    h = _idle(server)
    assert h["status"] == "ok" and (h["busy_slots"], h["free_slots"], h["waiting"]) == (
        0, SLOTS, 0)


def test_health_and_models(server, client):
    assert _health(server)["slots"] == SLOTS
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match="max_len"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    json.dumps(_health(server))


def test_responses_on_a_checkpoint_without_harmony_is_one_message_of_its_text(client,
                                                                             reference):
    tok, greedy = reference
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    want, ids = greedy(tok.render(messages), 10)
    out = client.responses.create(model="tiny", instructions="be brief", input="count",
                                  max_output_tokens=10, temperature=0)
    assert [i.type for i in out.output] == ["message"] and out.output_text == want
    assert out.usage.output_tokens == len(ids)
    events = list(client.responses.create(model="tiny", instructions="be brief", input="count",
                                          max_output_tokens=10, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want
    with pytest.raises(openai.BadRequestError, match="harmony"):
        client.responses.create(model="tiny", input="hi", tools=[{
            "type": "function", "name": "f", "parameters": {"type": "object"}}])
