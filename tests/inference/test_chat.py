"""The chat command line: each reply is the greedy continuation of the whole conversation
through the checkpoint's chat template, streamed; /reset forgets; bad flags exit 2."""

from __future__ import annotations

import io
import shutil

import pytest
from helpers import make_checkpoint

from llm_jax.chat import main
from llm_jax.inference.sampler import sample
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("chat") / "tiny")


def _greedy(ckpt, messages: list[dict], n: int) -> str:
    tok = load_tokenizer(ckpt)
    ids = sample(load_pretrained(ckpt), tok.encode(tok.render(messages)), max_new_tokens=n)
    cut = next((i for i, t in enumerate(ids) if t in tok.stop_ids), len(ids))
    return tok.decode(ids[:cut])


def test_replies_continue_the_templated_conversation_and_reset_forgets(ckpt):
    out = io.StringIO()
    stdin = io.StringIO("the cat\nand the dog\n/reset\nthe cat\n")
    assert main(["--checkpoint", str(ckpt), "--max_tokens", "8", "--max_len", "256",
                 "--system", "be brief"], stdin=stdin, stdout=out) == 0
    replies = [r.split("\nyou> ")[0].removesuffix(" [length]")
               for r in out.getvalue().split("assistant> ")[1:]]
    system = {"role": "system", "content": "be brief"}
    first = _greedy(ckpt, [system, {"role": "user", "content": "the cat"}], 8)
    second = _greedy(ckpt, [system, {"role": "user", "content": "the cat"},
                            {"role": "assistant", "content": first},
                            {"role": "user", "content": "and the dog"}], 8)
    assert replies == [first, second, first]


def test_a_checkpoint_without_a_chat_template_is_refused(ckpt, tmp_path, capsys):
    d = tmp_path / "no_template"
    shutil.copytree(ckpt, d)
    (d / "chat_template.jinja").unlink()
    assert main(["--checkpoint", str(d)], stdin=io.StringIO(""), stdout=io.StringIO()) == 2
    assert "no tokenizer.json with a chat template" in capsys.readouterr().err
