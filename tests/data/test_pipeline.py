"""The streaming pipeline: packed rows, every document once per epoch across processes, exact
resume through an Orbax checkpoint, refused mismatches, eval batches, named corrupt shards."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from llm_jax.data import DataConfig, make_datasets, utf8_len
from llm_jax.data.packing import TokenizeDocument
from llm_jax.data.sources import ShardReadError

SEQ_LEN = 32
VOCAB = 300
WINDOW_ROWS = 16  # row-shuffle window: 4 batches of 4, so resumes land inside and across windows
KEYS = {"inputs", "targets", "positions", "segment_ids"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("workdir"))


@pytest.fixture(scope="module")
def cfg(shard_dir) -> DataConfig:
    # The default buffer (1M tokens) would tokenize ~100 epochs of this corpus per iterator.
    return DataConfig(array_record_train=f"{shard_dir}/train-*", seq_len=SEQ_LEN,
                      array_record_eval=f"{shard_dir}/eval-*",
                      shuffle_buffer_tokens=WINDOW_ROWS * SEQ_LEN)


def _data(cfg, workdir, *, batch=4, index=0, count=1, vocab=VOCAB, **overrides):
    return make_datasets(dataclasses.replace(cfg, **overrides), workdir=workdir,
                         vocab_size=vocab, global_batch_size=batch, process_index=index,
                         process_count=count)


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _share_targets(data, split: str, index: int, count: int) -> list[tuple[int, ...]]:
    """Each document of one process's share as its tuple of target tokens."""
    docs = data.splits.share(split, index, count)
    tokenize = TokenizeDocument(data.tokenizer)
    return [tuple(tokenize(docs[i])["targets"]) for i in range(len(docs))]


def _documents_in(batches, eos: int, n_targets: int) -> list[tuple[int, ...]]:
    """The first `n_targets` targets of the rows, cut after each EOS into documents."""
    stream = np.concatenate([b["targets"].reshape(-1) for b in batches])[:n_targets]
    cuts = np.flatnonzero(stream == eos) + 1
    return [tuple(d) for d in np.split(stream, cuts) if len(d)]


def test_row_shuffle_permutes_each_window_of_packed_rows(cfg, workdir):
    window = 12  # rows; 3 batches of 4
    plain = _data(cfg, workdir, shuffle_buffer_tokens=0).train_iter
    shuffled = _data(cfg, workdir, shuffle_buffer_tokens=window * SEQ_LEN).train_iter
    for _ in range(2):  # two windows
        a = np.concatenate([b["inputs"] for b in _take(plain, 3)])
        b = np.concatenate([b["inputs"] for b in _take(shuffled, 3)])
        assert sorted(map(tuple, a)) == sorted(map(tuple, b))  # the same rows ...
        assert not np.array_equal(a, b)  # ... in another order


def test_rows_are_packed_documents_with_positions_and_segments(cfg, workdir):
    data = _data(cfg, workdir)
    starts = 0
    for b in _take(data.train_iter, 6):
        assert set(b) == KEYS
        for k in KEYS:
            assert b[k].shape == (4, SEQ_LEN) and b[k].dtype == np.int32, k
        seg, pos = b["segment_ids"], b["positions"]
        assert (seg > 0).all()  # an endless stream packs every row full
        new = np.concatenate([np.ones((4, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        np.testing.assert_array_equal(pos[new], 0)  # each segment starts at position 0 ...
        np.testing.assert_array_equal(pos[:, 1:][~new[:, 1:]], pos[:, :-1][~new[:, 1:]] + 1)
        # ... and within one, the targets are the next inputs: no target from another document.
        np.testing.assert_array_equal(b["targets"][:, :-1][~new[:, 1:]],
                                      b["inputs"][:, 1:][~new[:, 1:]])
        starts += int((new & (b["inputs"] == data.tokenizer.bos_id)).sum())
    assert starts > 0  # documents start with BOS (or continue one that a row boundary split)


@pytest.mark.parametrize("source", ["array_record", "local_text"])
def test_an_epoch_over_two_processes_has_every_document_exactly_once(source, cfg, workdir,
                                                                     corpus_dir, tmp_path):
    vocab = VOCAB
    if source == "local_text":  # the processes split the documents into contiguous halves
        cfg = DataConfig(files=f"{corpus_dir}/*", validation_fraction=0.2, seq_len=SEQ_LEN)
        workdir, vocab = str(tmp_path), 400
    cfg = dataclasses.replace(cfg, shuffle_buffer_tokens=0)  # rows in document order
    shares = []
    for p in range(2):
        data = _data(cfg, workdir, index=p, count=2, batch=4, vocab=vocab)
        if source == "array_record":  # whole shards: 0 and 2, or 1 and 3
            names = [os.path.basename(s.path) for s in data.splits.share("train", p, 2).shards]
            assert names == [f"train-0000{i}-of-00004.array_record" for i in (p, p + 2)]
        expected = _share_targets(data, "train", p, 2)
        n = sum(map(len, expected))
        rows = _take(data.train_iter, -(-n // (2 * SEQ_LEN)) + 1)
        got = _documents_in(rows, data.tokenizer.eos_id, n)
        assert sorted(got) == sorted(expected)  # the share's epoch, once, in a shuffled order
        assert got != expected
        shares.append(expected)
    everything = _share_targets(data, "train", 0, 1)
    assert sorted(shares[0] + shares[1]) == sorted(everything)


def test_order_is_fixed_by_seed_and_process_and_reshuffled_each_epoch(cfg, workdir):
    a = _take(_data(cfg, workdir).train_iter, 3)
    _assert_same(a, _take(_data(cfg, workdir).train_iter, 3))
    b = _take(_data(cfg, workdir, shuffle_seed=1).train_iter, 3)
    assert not np.array_equal(a[0]["inputs"], b[0]["inputs"])
    data = _data(cfg, workdir, batch=1, shuffle_buffer_tokens=0)  # rows in document order
    docs = _share_targets(data, "train", 0, 1)
    n = sum(map(len, docs))
    rows = _take(data.train_iter, 2 * n // SEQ_LEN + 2)
    epochs = _documents_in(rows, data.tokenizer.eos_id, 2 * n)
    assert sorted(epochs[: len(docs)]) == sorted(epochs[len(docs):]) == sorted(docs)
    assert epochs[: len(docs)] != epochs[len(docs):]


def test_resume_from_an_orbax_checkpoint_mid_epoch_equals_an_uninterrupted_run(cfg, workdir,
                                                                             tmp_path):
    reference = _take(_data(cfg, workdir).train_iter, 40)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"),
                                 options=ocp.CheckpointManagerOptions(create=True))
    for step in (0, 3, 11, 26):  # remainders of every kind, and none (step 0)
        it = _data(cfg, workdir).train_iter
        _take(it, step)
        mngr.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        fresh = _data(cfg, workdir).train_iter
        mngr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
        _assert_same(_take(fresh, 6), reference[step:step + 6])
    mngr.close()


def test_a_changed_pipeline_or_process_count_is_refused_by_name(cfg, workdir, tmp_path):
    it = _data(cfg, workdir).train_iter
    _take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    with pytest.raises(ValueError, match="seq_len: saved 32, now 16"):
        _data(cfg, workdir, seq_len=16).train_iter.set_state(state)
    with pytest.raises(ValueError, match="older data pipeline"):
        _data(cfg, workdir).train_iter.set_state({"next_index": 3})
    # A checkpoint's data folder written by one process, read by a run with two.
    step_dir = tmp_path / "7"
    (step_dir / "data").mkdir(parents=True)
    (step_dir / "data" / "process_0-of-1.json").write_text(json.dumps(state))
    _data(cfg, workdir).check_checkpoint(str(step_dir))
    with pytest.raises(ValueError, match="process_count: saved 1, now 2"):
        _data(cfg, workdir, index=0, count=2).check_checkpoint(str(step_dir))
    with pytest.raises(ValueError, match="shuffle_seed: saved 0, now 5"):
        _data(cfg, workdir, shuffle_seed=5).check_checkpoint(str(step_dir))
    _data(cfg, workdir).check_checkpoint(str(tmp_path / "no_such_step"))  # nothing saved


def test_local_text_resumes_exactly_and_refuses_a_changed_file_list_by_name(corpus_dir,
                                                                              tmp_path):
    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src)
    cfg = DataConfig(files=f"{src}/*", seq_len=SEQ_LEN, validation_fraction=0.2,
                     document_bytes=2048, shuffle_buffer_tokens=WINDOW_ROWS * SEQ_LEN)
    workdir = str(tmp_path / "wd")
    reference = _take(_data(cfg, workdir, vocab=400).train_iter, 30)
    it = _data(cfg, workdir, vocab=400).train_iter
    _take(it, 13)
    state = json.loads(json.dumps(it.get_state()))
    fresh = _data(cfg, workdir, vocab=400).train_iter
    fresh.set_state(state)
    _assert_same(_take(fresh, 10), reference[13:23])
    (src / "added.txt").write_text("a file that was not there\n")
    changed = _data(cfg, workdir, vocab=400).train_iter
    with pytest.raises(ValueError, match=r"dataset: saved 'local_text/files_\w+', now "
                                         r"'local_text/files_\w+'"):
        changed.set_state(state)
    os.remove(src / "added.txt")  # the same list again: resumes
    again = _data(cfg, workdir, vocab=400).train_iter
    again.set_state(state)
    _assert_same(_take(again, 3), reference[13:16])


def test_eval_batches_are_fixed_exact_in_number_and_count_every_byte_once(cfg, workdir):
    data = _data(cfg, workdir, batch=2)
    first = list(data.make_eval_iter(3))
    _assert_same(first, list(data.make_eval_iter(3)))
    assert set(first[0]) == KEYS | {"target_bytes"}
    lengths = data.tokenizer.token_byte_lengths()
    np.testing.assert_array_equal(first[0]["target_bytes"], lengths[first[0]["targets"]])
    whole = list(data.make_eval_iter())
    docs = data.eval_docs
    counted = sum(int((b["target_bytes"] * (b["segment_ids"] > 0)).sum()) for b in whole)
    assert counted == sum(utf8_len(docs[i]) for i in range(len(docs))) > 0
    assert (whole[-1]["segment_ids"] == 0).any()  # the tail is padding, not another epoch
    padded = list(data.make_eval_iter(len(whole) + 2))  # asks for more than there is
    assert len(padded) == len(whole) + 2 and not padded[-1]["segment_ids"].any()
    with pytest.raises(ValueError, match="pass num_batches"):
        _data(cfg, workdir, batch=2, count=2).make_eval_iter()


def test_eval_shares_of_two_processes_are_disjoint_and_cover_the_split(cfg, workdir):
    data = _data(cfg, workdir)
    halves = [_share_targets(data, "eval", p, 2) for p in range(2)]
    # One eval shard for two processes: process 1 has none and yields padding batches only.
    assert halves[1] == [] and sorted(halves[0]) == sorted(_share_targets(data, "eval", 0, 1))
    p1 = list(_data(cfg, workdir, index=1, count=2).make_eval_iter(2))
    assert len(p1) == 2 and not any(b["segment_ids"].any() for b in p1)


def test_a_corrupt_or_truncated_shard_is_named(cfg, workdir, shard_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in sorted(os.listdir(shard_dir)):
        shutil.copy(os.path.join(shard_dir, name), bad / name)
    victim = bad / "train-00002-of-00004.array_record"
    raw = bytearray(victim.read_bytes())
    raw[100:164] = b"\x5a" * 64  # inside the first chunk: its hash no longer matches
    victim.write_bytes(raw)
    broken = dataclasses.replace(cfg, array_record_train=f"{bad}/train-*")
    with pytest.raises(ShardReadError, match="train-00002-of-00004.array_record"):
        _take(_data(broken, str(tmp_path / "w")).train_iter, 50)
    # Of two processes, the one without that shard (files 1 and 3) never opens it.
    _data(cfg, workdir)  # the tokenizer, trained on the intact shards
    _take(_data(broken, workdir, index=1, count=2).train_iter, 50)
    victim.write_bytes(bytes(raw[:1000]))  # truncated: its footer is gone
    with pytest.raises(ShardReadError, match="cannot open ArrayRecord shard .*train-00002"):
        _data(broken, workdir, index=0, count=2)
    _data(broken, workdir, index=1, count=2)


def test_bad_batch_and_process_arguments_raise(cfg, workdir):
    with pytest.raises(ValueError, match="global_batch_size=5 is not divisible"):
        _data(cfg, workdir, batch=5, count=2)
    with pytest.raises(ValueError, match="holds no documents"):
        _data(cfg, workdir, batch=5, index=4, count=5)  # 4 shards for 5 processes


@pytest.mark.slow
def test_tokenizing_in_worker_processes_gives_the_same_batches_and_resumes(cfg, workdir):
    expected = _take(_data(cfg, workdir).train_iter, 8)
    it = _data(cfg, workdir, worker_count=2).train_iter
    got = _take(it, 4)
    state = json.loads(json.dumps(it.get_state()))
    got += _take(it, 4)
    it.close()
    _assert_same(got, expected)
    it = _data(cfg, workdir, worker_count=2).train_iter
    it.set_state(state)
    _assert_same(_take(it, 4), expected[4:])
    it.close()


def test_tfds_dataset_by_name_with_mock_data(tmp_path):
    cfg = DataConfig(tfds_name="lm1b", text_key="text", seq_len=8,
                     shuffle_buffer_tokens=WINDOW_ROWS * 8)
    with tfds.testing.mock_data(num_examples=200):
        data = make_datasets(cfg, workdir=str(tmp_path), vocab_size=300, global_batch_size=4,
                             process_index=0, process_count=1)
        assert data.name.startswith("lm1b/")
        b = next(data.train_iter)
        e = next(data.make_eval_iter(1))
        data.train_iter.close()
    assert b["inputs"].shape == (4, 8) and e["target_bytes"].shape == (4, 8)
    same = b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]
    np.testing.assert_array_equal(b["inputs"][:, 1:][same], b["targets"][:, :-1][same])


def test_tfds_text_key_that_is_not_a_feature_raises(tmp_path):
    cfg = DataConfig(tfds_name="lm1b", text_key="body")
    with tfds.testing.mock_data(num_examples=10), pytest.raises(ValueError, match="'body'"):
        make_datasets(cfg, workdir=str(tmp_path), vocab_size=300, global_batch_size=4,
                      process_index=0, process_count=1)


def test_eval_split_is_validation_if_present_else_test():
    from llm_jax.data.sources import pick_eval_split

    assert pick_eval_split(["train", "validation", "test"]) == "validation"
    assert pick_eval_split(["train", "test"]) == "test"
    assert pick_eval_split(["train", "validation"], "train[:1%]") == "train[:1%]"


@pytest.mark.slow
def test_stdlib_corpus_end_to_end_with_the_default_vocab(tmp_path):
    data = make_datasets(DataConfig(), workdir=str(tmp_path), vocab_size=8000,
                         global_batch_size=8, process_index=0, process_count=1)
    assert data.name.startswith("local_text/stdlib_")
    assert data.tokenizer.vocab_size == 8000
    assert len(data.splits.share("train")) > 500 and len(data.eval_docs) > 5
    b = next(data.train_iter)
    assert b["inputs"].shape == (8, 256)
    text = data.tokenizer.decode(b["inputs"][0])
    assert data.tokenizer.decode(data.tokenizer.encode(text)) == text and "\n" in text
    e = next(data.make_eval_iter(1))
    assert e["target_bytes"].sum() >= e["targets"].size  # code averages > 1 byte per token
    data.train_iter.close()
