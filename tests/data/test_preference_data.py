"""Preference data (data/preference.py): each accepted form of prompt and response, the loss
mask over exactly the response's tokens (a plain chat template and harmony's renderer, token by
token), malformed and too-long lines named and counted, the held-out split by prompt, batches of
pairs [B, 2, T] and an iterator that resumes where it was saved."""

from __future__ import annotations

import json

import ml_collections
import numpy as np
import pytest

from llm_jax.data.hf_tokenizer import HFTokenizer
from llm_jax.data.preference import (
    make_preference_data,
    read_pairs,
    split_pairs,
    to_pair,
    tokenize_response,
)
from llm_jax.data.preference_synthetic import synthetic_pairs, write_synthetic_preferences
from llm_jax.data.sft import BadLines


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    write_synthetic_preferences(d)
    return d


def section(files, **changes) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"files": str(files), "validation_fraction": 0.2,
                                      "on_bad_line": "skip", **changes})


def test_prompts_and_responses_in_every_accepted_form():
    user = {"role": "user", "content": "hi"}
    answer = {"role": "assistant", "content": "hello"}
    pair = to_pair({"prompt": "hi", "chosen": "hello", "rejected": answer})
    assert pair.prompt == [user] and pair.chosen == [answer] and pair.rejected == [answer]
    tool_turn = [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "1"}, {"role": "assistant", "content": "one"}]
    pair = to_pair({"prompt": [{"role": "system", "content": "be brief"}, user],
                    "chosen": tool_turn, "rejected": [answer], "reasoning_effort": "low"})
    assert len(pair.prompt) == 2 and pair.chosen == tool_turn
    assert pair.options == {"reasoning_effort": "low"}


@pytest.mark.parametrize("record, error", [
    ([1, 2], "expected a JSON object"),
    ({"prompt": "a", "chosen": "b"}, r"missing field\(s\) \['rejected'\]"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "'chosen' must be a string"),
    ({"prompt": "a", "chosen": "b", "rejected": {"role": "user", "content": "c"}},
     "'rejected' has no assistant message"),
    ({"prompt": [{"role": "user"}], "chosen": "b", "rejected": "c"},
     r"prompt \+ chosen: messages\[0\] needs a string 'content'"),
])
def test_a_malformed_record_is_refused_saying_why(record, error):
    with pytest.raises(ValueError, match=error):
        to_pair(record)


def test_malformed_lines_are_named_by_file_and_line_and_skipped_or_stop(tmp_path):
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"{good}\n\nnot json\n{good}\n" + json.dumps({"prompt": "p"}) + "\n")
    bad = BadLines()
    assert len(list(read_pairs(str(path), "skip", bad))) == 2
    assert bad.count == 2 and bad.first[0].startswith(f"{path}:3: ")
    assert bad.first[1].startswith(f"{path}:5: missing field(s)")
    with pytest.raises(ValueError, match=f"malformed preference line {path}:3: .*"
                                         "dpo.on_bad_line='skip'"):
        list(read_pairs(str(path), "stop", BadLines()))
    with pytest.raises(ValueError, match="dpo.files='nothing-here' matches no file"):
        list(read_pairs("nothing-here", "skip", BadLines()))


def test_the_mask_covers_the_response_only(data_dir):
    tok = HFTokenizer(data_dir)
    prompt = [{"role": "user", "content": "what kind of thing is cat?"},
              {"role": "assistant", "content": "an earlier reply"},
              {"role": "user", "content": "and?"}]
    ids, mask = tokenize_response(tok, prompt, [{"role": "assistant",
                                                 "content": "cat is an animal."}], {})
    assert tok.decode(ids[mask == 1]) == "cat is an animal.<|end|>"
    assert tok.decode(ids[mask == 0]).endswith("and?<|end|><|start|>assistant<|message|>")


def test_on_harmony_the_mask_runs_from_the_channel_to_the_return(harmony_tokenizer):
    tok = HFTokenizer(harmony_tokenizer)  # no template: harmony's renderer
    prompt = [{"role": "user", "content": "What is 2 + 2?"},
              {"role": "assistant", "content": "2 + 2 = 4."},
              {"role": "user", "content": "Say hi."}]
    response = [{"role": "assistant", "reasoning_content": "Greet.", "content": "Hi! 👋"}]
    ids, mask = tokenize_response(tok, prompt, response, {"reasoning_effort": "low"})
    assert tok.decode(ids[mask == 1]) == (
        "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hi! 👋<|return|>")  # the earlier turn's reply is prompt, not response


def test_the_held_out_split_keeps_each_prompts_pairs_together_in_any_order():
    pairs = [to_pair(p) for p in synthetic_pairs()]
    train, held = split_pairs(pairs, 0.2)
    assert 0 < len(held) < len(pairs) and len(train) + len(held) == len(pairs)
    assert not {p.key() for p in train} & {p.key() for p in held}
    train_r, held_r = split_pairs(pairs[::-1], 0.2)
    assert sorted(p.key() for p in held_r) == sorted(p.key() for p in held)
    with pytest.raises(ValueError, match="dpo.validation_fraction=1.0 is invalid"):
        split_pairs(pairs, 1.0)


def test_batches_are_pairs_of_rows_and_too_long_pairs_are_skipped_and_counted(data_dir):
    data = make_preference_data(section(data_dir / "pairs.jsonl"), tokenizer_path=str(data_dir),
                                seq_len=48, batch_size=4, seed=0)
    batch = next(data.train_iter)
    assert {k: v.shape for k, v in batch.items()} == {
        k: (4, 2, 48) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    assert data.batch_shapes(8)["loss_mask"] == (8, 2, 48)
    tok = data.tokenizer
    for chosen, rejected, mask in zip(batch["targets"][:, 0], batch["targets"][:, 1],
                                      batch["loss_mask"]):
        said = [tok.decode(t[m == 1]) for t, m in ((chosen, mask[0]), (rejected, mask[1]))]
        subject = said[0].split()[0]
        assert said[1].startswith(subject) and said[0] != said[1]  # one word, two categories
    assert data.too_long.count == 0 and len(data.rows["inputs"]) + len(data.eval_rows[
        "inputs"]) == 180
    # The held-out pairs in batches padded with empty pairs (no response token).
    evals = list(data.make_eval_iter(12))
    assert sum(int((b["loss_mask"][:, 0].sum(-1) > 0).sum()) for b in evals) == len(
        data.eval_rows["inputs"])
    short = make_preference_data(section(data_dir / "pairs.jsonl"),
                                 tokenizer_path=str(data_dir), seq_len=42, batch_size=1, seed=0)
    assert short.too_long.count > 0 and ":" in short.too_long.first[0]
    assert len(short.rows["inputs"]) + len(short.eval_rows.get("inputs", [])) \
        + short.too_long.count == 180


def test_the_iterator_resumes_where_its_state_was_saved(data_dir):
    def make(seed=0):
        return make_preference_data(section(data_dir / "pairs.jsonl"),
                                    tokenizer_path=str(data_dir), seq_len=48, batch_size=4,
                                    seed=seed)

    first = make()
    for _ in range(3):
        next(first.train_iter)
    state = first.train_iter.get_state()
    want = [next(first.train_iter)["inputs"] for _ in range(2)]
    second = make()
    second.train_iter.set_state(json.loads(json.dumps(state)))  # as the checkpoint stores it
    np.testing.assert_array_equal([next(second.train_iter)["inputs"] for _ in range(2)], want)
    with pytest.raises(ValueError, match="shuffle_seed: saved 0, now 1"):
        make(seed=1).train_iter.set_state(state)


def test_attached_reference_log_probs_follow_their_pairs(data_dir):
    data = make_preference_data(section(data_dir / "pairs.jsonl"), tokenizer_path=str(data_dir),
                                seq_len=48, batch_size=4, seed=0)
    next(data.train_iter)  # attached after the pipeline has started reading ahead
    n, m = len(data.rows["inputs"]), len(data.eval_rows["inputs"])
    data.attach_reference(np.stack([np.arange(n), -np.arange(n)], 1).astype(np.float32),
                          np.stack([np.arange(m), -np.arange(m)], 1).astype(np.float32))
    assert data.batch_shapes(8)["reference_logp"] == (8, 2)
    for _ in range(3):
        batch = next(data.train_iter)
        for inputs, ref in zip(batch["inputs"], batch["reference_logp"]):
            np.testing.assert_array_equal(data.rows["inputs"][int(ref[0])], inputs)
            assert ref[1] == -ref[0]
    first = next(data.make_eval_iter(1))
    np.testing.assert_array_equal(first["reference_logp"][:, 0], np.arange(4))
    with pytest.raises(ValueError, match="reference log-probs of shape"):
        data.attach_reference(np.zeros((n + 1, 2), np.float32), None)


def test_a_process_that_holds_no_pair_out_runs_the_same_eval_batches(data_dir):
    """Fewer held-out pairs than processes: every process runs the asked number of eval
    batches (an eval step is collective), the same arrays (the reference log-probs of full
    fine-tuning included), an empty share on padding only."""
    path = data_dir / "pairs.jsonl"
    _, held = split_pairs(list(read_pairs(str(path), "skip", BadLines())), 0.2)
    count = len(held) + 1
    data = [make_preference_data(section(path), tokenizer_path=str(data_dir), seq_len=48,
                                 batch_size=count, seed=0, process_index=i, process_count=count)
            for i in (0, count - 1)]
    assert not data[0].eval_rows and data[1].eval_rows
    for d in data:
        m = len(d.eval_rows.get("inputs", []))
        d.attach_reference(np.zeros((len(d.rows["inputs"]), 2), np.float32),
                           np.ones((m, 2), np.float32) if m else None)
    evals = [list(d.make_eval_iter(2)) for d in data]
    shapes = [[{k: v.shape for k, v in b.items()} for b in e] for e in evals]
    assert shapes[0] == shapes[1] and shapes[0][0]["reference_logp"] == (1, 2)
    assert all(b["loss_mask"].sum() == 0 for b in evals[0]) and evals[1][0]["loss_mask"].sum()
    assert evals[1][0]["reference_logp"].sum() == 2  # the share's own pair, not padding


def test_the_run_samples_replies_to_held_out_prompts(data_dir):
    """What a DPO run's end-of-run samples reply to (`loop.sample_text`): held-out prompts,
    rendered up to the generation prompt."""
    data = make_preference_data(section(data_dir / "pairs.jsonl"), tokenizer_path=str(data_dir),
                                seq_len=48, batch_size=4, seed=0)
    (shown, ids), = data.sample_prompts(1)
    conv = data.sample_conversations[0]
    assert shown == conv.messages[-1]["content"] and shown.endswith("?")
    assert ids == data.tokenizer.encode(data.tokenizer.render(
        conv.messages, add_generation_prompt=True))
    _, held = split_pairs(list(read_pairs(str(data_dir / "pairs.jsonl"), "skip", BadLines())),
                          0.2)
    assert conv.messages == held[0].prompt
