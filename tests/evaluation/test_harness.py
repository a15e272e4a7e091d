"""lm-evaluation-harness drives llm_jax: `llm_jax.eval`'s command line runs the local tasks in
tests/evaluation/tasks (task YAML over JSONL, offline) against a tiny checkpoint and writes the
harness' results JSON; its multiple-choice accuracy equals the accuracy computed directly from
`inference.scoring.loglikelihood`, its perplexity equals the rolling log-likelihood's, and its
generations equal `generate_until`'s."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
from helpers import make_checkpoint

from llm_jax.inference.completions import GenerationRequest, generate_until
from llm_jax.inference.scoring import loglikelihood, loglikelihood_rolling
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parent / "tasks"


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The harness' results and logged samples for the three local tasks, from the command
    line's `main` run in this process: the direct computations below then reuse the programs
    it compiled (the same model, batch and length buckets) instead of compiling them again."""
    from llm_jax.eval import main

    tmp = tmp_path_factory.mktemp("eval")
    ckpt = make_checkpoint(tmp / "tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(TASKS)  # the task YAMLs name their JSONL relative to it
        mp.setattr(sys, "argv", list(sys.argv))  # main() hands lm_eval its own argv
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            mp.setenv(name, "1")
        import datasets.config  # read the variables above if this imports it first

        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp / "hf_datasets")
        assert main(["--checkpoint", str(ckpt), "--tasks",
                     "llm_jax_tiny_choice,llm_jax_tiny_text,llm_jax_tiny_until",
                     "--include_path", ".", "--output_path", str(tmp / "out"),
                     "--log_samples"]) == 0
    (results,) = (tmp / "out").rglob("results_*.json")
    samples = {}
    for task in ("choice", "text", "until"):
        (path,) = (tmp / "out").rglob(f"samples_llm_jax_tiny_{task}_*.jsonl")
        samples[task] = sorted(_jsonl_lines(path), key=lambda s: s["doc_id"])
    return ckpt, json.loads(results.read_text()), samples


def _jsonl_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def direct(run):
    ckpt = run[0]
    return load_pretrained(ckpt), load_tokenizer(ckpt)


def _pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness' split of a causal request: the context's tokens, then the rest of the whole
    text's tokens (trailing spaces of the context move to the continuation)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def test_harness_accuracy_equals_accuracy_from_llm_jax_loglikelihoods(run, direct):
    _, results, _ = run
    model, tok = direct
    docs = _jsonl("tiny_choice.jsonl")
    requests = [_pair(tok, d["question"], " " + c) for d in docs for c in d["choices"]]
    scores = iter(loglikelihood(model, requests))
    correct = []
    for d in docs:
        lp = [next(scores).logprob for _ in d["choices"]]
        correct.append(lp.index(max(lp)) == d["answer"])
    acc = results["results"]["llm_jax_tiny_choice"]["acc,none"]
    assert acc == pytest.approx(sum(correct) / len(correct), abs=1e-12)


def test_harness_perplexity_equals_the_rolling_loglikelihood(run, direct):
    _, results, _ = run
    model, tok = direct
    texts = [d["text"] for d in _jsonl("tiny_text.jsonl")]
    totals = loglikelihood_rolling(model, [tok.encode(t) for t in texts], tok.eos_id,
                                   max_length=2048)
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    want = math.exp(-sum(totals) / words)
    got = results["results"]["llm_jax_tiny_text"]["word_perplexity,none"]
    assert got == pytest.approx(want, rel=1e-4)


def test_harness_generations_equal_generate_until(run, direct):
    _, _, samples = run
    model, tok = direct
    docs = _jsonl("tiny_until.jsonl")
    requests = [GenerationRequest(tok.encode(d["question"]), max_new_tokens=8, stop=["."],
                                  stop_ids=list(tok.stop_ids)) for d in docs]
    want = [g.text for g in generate_until(model, requests, tok.decode)]
    assert [s["resps"][0][0] for s in samples["until"]] == want
