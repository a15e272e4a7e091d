"""The server's routes in-process (FastAPI's TestClient, no socket): a request past its timeout
is a 504 (plain) or an error event (streamed), a closed engine answers 503 and /health says
so, and a checkpoint without a tokenizer takes token ids only."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from llm_jax.config import ModelConfig
from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import EngineConfig
from llm_jax.model import init_model
from llm_jax.serving.app import Server, create_app

CFG = ModelConfig(
    num_hidden_layers=1, num_experts=4, experts_per_token=2, vocab_size=64, hidden_size=16,
    intermediate_size=16, head_dim=8, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _client(model, timeout: float) -> tuple[TestClient, Engine]:
    engine = Engine(model, EngineConfig(slots=2, max_len=32, max_queue=4))
    return TestClient(create_app(Server(engine, None, "toy", request_timeout=timeout))), engine


def test_a_request_past_its_timeout_is_a_504_or_an_error_event(model):
    client, _ = _client(model, timeout=0.0)
    with client as http:
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 504 and "request timeout" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": [1, 2], "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert r.status_code == 200 and "request timeout" in events[-1]["error"]["message"]
        assert http.get("/health").json()["free_slots"] == 2


def test_a_closed_engine_answers_503_and_health_says_unavailable(model):
    client, engine = _client(model, timeout=60.0)
    with client as http:
        assert http.get("/health").json()["status"] == "ok"
        engine.close()
        r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        h = http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "unavailable"


def test_without_a_tokenizer_text_prompts_and_chat_are_refused_token_ids_work(model):
    client, _ = _client(model, timeout=60.0)
    with client as http:
        r = http.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 400 and "send the prompt as token ids" in r.text
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                  "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.text
        r = http.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 3,
                                               "temperature": 0})
        body = r.json()
        assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6,
                                 "total_tokens": 9}

