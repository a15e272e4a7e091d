"""The Grain batch pipeline: exact chunking, sharding, shuffling, resumption, eval bytes."""

from __future__ import annotations

import dataclasses
import glob
import os

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from llm_jax.data import DataConfig, make_datasets
from llm_jax.data.pipeline import TokenChunks, train_dataset

SEQ_LEN = 32
VOCAB = 400


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("workdir"))


@pytest.fixture(scope="module")
def cfg(corpus_dir) -> DataConfig:
    return DataConfig(files=f"{corpus_dir}/*", validation_fraction=0.2, seq_len=SEQ_LEN)


def _data(cfg, workdir, *, batch=4, index=0, count=1, **overrides):
    return make_datasets(
        dataclasses.replace(cfg, **overrides),
        workdir=workdir,
        vocab_size=VOCAB,
        global_batch_size=batch,
        process_index=index,
        process_count=count,
    )


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _rows(batches, key="inputs") -> list[tuple[int, ...]]:
    return [tuple(row) for b in batches for row in b[key]]


def test_batches_are_int32_and_targets_are_inputs_shifted_by_one(cfg, workdir):
    data = _data(cfg, workdir)
    for b in _take(data.train_iter, 5):
        assert set(b) == {"inputs", "targets"}
        assert b["inputs"].shape == b["targets"].shape == (4, SEQ_LEN)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        stream = data.train_chunks.tokens
        for x, y in zip(b["inputs"], b["targets"]):
            # Find the chunk in the stream and check the shift there, row by row.
            (start,) = [s for s in range(0, len(stream) - SEQ_LEN, SEQ_LEN)
                        if np.array_equal(stream[s:s + SEQ_LEN], x)][:1]
            np.testing.assert_array_equal(y, stream[start + 1:start + SEQ_LEN + 1])


def test_chunks_tile_the_stream_without_losing_or_repeating_a_token(cfg, workdir):
    chunks = _data(cfg, workdir).train_chunks
    stream = np.asarray(chunks.tokens, np.int32)
    n = len(chunks)
    assert n == (len(stream) - 1) // SEQ_LEN
    inputs = np.concatenate([chunks(k)["inputs"] for k in range(n)])
    targets = np.concatenate([chunks(k)["targets"] for k in range(n)])
    np.testing.assert_array_equal(inputs, stream[: n * SEQ_LEN])
    np.testing.assert_array_equal(targets, stream[1 : n * SEQ_LEN + 1])


def test_token_stream_decodes_to_the_training_documents(cfg, workdir, corpus_dir):
    data = _data(cfg, workdir)
    stream = np.asarray(data.train_chunks.tokens)
    eos = data.tokenizer.eos_id
    assert stream[-1] == eos
    cuts = np.flatnonzero(stream == eos)
    files = {open(p, encoding="utf-8", newline="").read() for p in glob.glob(f"{corpus_dir}/*")}
    decoded = {data.tokenizer.decode(seg[seg != eos]) for seg in np.split(stream, cuts + 1)[:-1]}
    assert decoded <= files and len(decoded) == len(cuts)


def test_one_epoch_yields_every_chunk_exactly_once(cfg, workdir):
    data = _data(cfg, workdir)
    chunks = data.train_chunks
    n = len(chunks)
    rows = _rows(_take(data.train_iter, -(-n // 4)))[:n]
    expected = [tuple(chunks(k)["inputs"]) for k in range(n)]
    assert sorted(rows) == sorted(expected)


def test_epochs_are_shuffled_differently(cfg, workdir):
    data = _data(cfg, workdir)
    n = len(data.train_chunks)
    rows = _rows(_take(data.train_iter, 2 * (-(-n // 4))))
    epoch0, epoch1 = rows[:n], rows[n : 2 * n]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_shuffle_seed_changes_the_order(cfg, workdir):
    a = _rows(_take(_data(cfg, workdir).train_iter, 3))
    b = _rows(_take(_data(cfg, workdir, shuffle_seed=1).train_iter, 3))
    assert a == _rows(_take(_data(cfg, workdir).train_iter, 3)) and a != b


def test_two_processes_get_disjoint_halves_of_the_global_batch(cfg, workdir):
    single = _take(_data(cfg, workdir, batch=4).train_iter, 6)
    p0 = _take(_data(cfg, workdir, batch=4, index=0, count=2).train_iter, 6)
    p1 = _take(_data(cfg, workdir, batch=4, index=1, count=2).train_iter, 6)
    for s, a, b in zip(single, p0, p1):
        assert a["inputs"].shape == (2, SEQ_LEN)
        ra, rb = _rows([a]), _rows([b])
        assert not set(ra) & set(rb)
        assert sorted(ra + rb) == sorted(_rows([s]))


def test_get_state_set_state_continues_exactly(cfg, workdir):
    it = _data(cfg, workdir).train_iter
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 4)
    fresh = _data(cfg, workdir).train_iter
    fresh.set_state(state)
    for a, b in zip(expected, _take(fresh, 4)):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_orbax_checkpoint_of_the_iterator_continues_exactly(cfg, workdir, tmp_path):
    it = _data(cfg, workdir).train_iter
    _take(it, 5)
    mngr = ocp.CheckpointManager(
        str(tmp_path / "ckpt"), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = _take(it, 3)
    fresh = _data(cfg, workdir).train_iter
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    for a, b in zip(expected, _take(fresh, 3)):
        np.testing.assert_array_equal(a["targets"], b["targets"])
    mngr.close()


def test_eval_iter_is_fresh_finite_deterministic_and_counts_target_bytes(cfg, workdir):
    data = _data(cfg, workdir, batch=2)
    first = list(data.make_eval_iter(3))
    assert len(first) == 3
    again = list(data.make_eval_iter(3))
    lengths = data.tokenizer.token_byte_lengths()
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        assert a["target_bytes"].dtype == np.int32
        np.testing.assert_array_equal(a["target_bytes"], lengths[a["targets"]])
    # Over whole documents the byte counts are exact (a chunk may cut a character in two).
    stream = np.asarray(data.eval_chunks.tokens)
    cuts = np.flatnonzero(stream == data.tokenizer.eos_id)
    docs = [data.tokenizer.decode(seg) for seg in np.split(stream, cuts + 1)[:-1]]
    assert lengths[stream].sum() == sum(len(d.encode("utf-8")) for d in docs) > 0
    everything = list(data.make_eval_iter())
    assert len(everything) == len(data.eval_chunks) // 2


def test_eval_halves_are_disjoint_across_processes(cfg, workdir):
    p0 = _rows(list(_data(cfg, workdir, index=0, count=2).make_eval_iter(2)))
    p1 = _rows(list(_data(cfg, workdir, index=1, count=2).make_eval_iter(2)))
    single = _rows(list(_data(cfg, workdir).make_eval_iter(2)))
    assert not set(p0) & set(p1) and sorted(p0 + p1) == sorted(single)


def test_caches_are_reused_on_a_second_run(cfg, workdir):
    _data(cfg, workdir)
    files = sorted(glob.glob(os.path.join(workdir, "tokens", "*.npy")))
    watched = files + [os.path.join(workdir, "tokenizer.model")]
    mtimes = [os.path.getmtime(f) for f in watched]
    _data(cfg, workdir)
    assert files == sorted(glob.glob(os.path.join(workdir, "tokens", "*.npy")))
    assert mtimes == [os.path.getmtime(f) for f in watched]


def test_bad_batch_and_process_arguments_raise(cfg, workdir):
    with pytest.raises(ValueError, match="global_batch_size=5 is not divisible"):
        _data(cfg, workdir, batch=5, count=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _data(cfg, workdir, batch=10**6)


@pytest.mark.slow
def test_worker_processes_give_the_same_batches(cfg, workdir):
    expected = _take(_data(cfg, workdir).train_iter, 6)
    it = _data(cfg, workdir, worker_count=2).train_iter
    got = _take(it, 3)
    state = it.get_state()
    got += _take(it, 3)
    it.close()
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    it = _data(cfg, workdir, worker_count=2).train_iter
    it.set_state(state)
    for a, b in zip(expected[3:], _take(it, 3)):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    it.close()


def test_tfds_dataset_by_name_with_mock_data(tmp_path):
    cfg = DataConfig(tfds_name="lm1b", text_key="text", seq_len=8)
    with tfds.testing.mock_data(num_examples=200):
        data = make_datasets(cfg, workdir=str(tmp_path), vocab_size=300, global_batch_size=4,
                             process_index=0, process_count=1)
        assert data.name.startswith("lm1b/")
        b = next(data.train_iter)
        e = next(data.make_eval_iter(1))
    assert b["inputs"].shape == (4, 8) and e["target_bytes"].shape == (4, 8)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])


def test_tfds_text_key_that_is_not_a_feature_raises(tmp_path):
    cfg = DataConfig(tfds_name="lm1b", text_key="body")
    with tfds.testing.mock_data(num_examples=10), pytest.raises(ValueError, match="'body'"):
        make_datasets(cfg, workdir=str(tmp_path), vocab_size=300, global_batch_size=4,
                      process_index=0, process_count=1)


def test_train_dataset_refuses_a_split_smaller_than_a_batch(tmp_path):
    path = str(tmp_path / "t.npy")
    np.save(path, np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        train_dataset(TokenChunks(path, 4), batch_size=4, seed=0, process_index=0, process_count=1)




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
    assert data.train_chunks.num_tokens > 1_000_000 and len(data.eval_chunks) > 8
    b = next(data.train_iter)
    assert b["inputs"].shape == (8, 256)
    text = data.tokenizer.decode(b["inputs"][0])
    assert data.tokenizer.decode(data.tokenizer.encode(text)) == text and "\n" in text
    e = next(data.make_eval_iter(1))
    assert e["target_bytes"].sum() >= e["targets"].size  # code averages > 1 byte per token
