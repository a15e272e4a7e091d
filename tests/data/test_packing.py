"""Packed rows never mix documents: a document's per-token losses are the same packed or alone,
and the train/eval steps count the targets of every document once and padding never."""

from __future__ import annotations

import grain
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.data.packing import pack_rows
from llm_jax.data.tokenizer import BOS_ID, EOS_ID
from llm_jax.execution import ExecutionConfig
from llm_jax.model import init_model
from llm_jax.training.step import eval_step

T = 16
ROWS = 16
# Dense dispatch: each token's experts do not depend on the other tokens of the batch, as they
# would through the capacity limit. A sliding window of 4 on alternate layers checks positions.
SMALL = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=64,
                    hidden_size=32, intermediate_size=16, head_dim=8, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=4)
DENSE = ExecutionConfig(moe_dispatch="dense")


def _documents(lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    """TokenizeDocument's elements for random documents of these token counts."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = np.concatenate([[BOS_ID], rng.integers(4, SMALL.vocab_size, n), [EOS_ID]])
        out.append({"inputs": ids[:-1].astype(np.int32), "targets": ids[1:].astype(np.int32)})
    return out


def _rows(docs) -> dict[str, np.ndarray]:
    rows = list(pack_rows(grain.MapDataset.source(docs).to_iter_dataset(), T))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@nnx.jit
def _per_token_nll(model, inputs, targets, positions=None, segment_ids=None) -> jax.Array:
    logits = model(inputs, positions, segment_ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@pytest.fixture(scope="module")
def model():
    return init_model(SMALL, seed=0, execution=DENSE)


def _alone(model, sequences: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Per-token losses of each (inputs, targets) as a batch row of its own, from position 0.
    Rows are right-padded to T in one call of ROWS rows (one compiled program for every test):
    causal attention keeps the padding out of them, and the rows do not see each other."""
    assert len(sequences) <= ROWS
    x, y = np.zeros((2, ROWS, T), np.int32)
    for i, (inputs, targets) in enumerate(sequences):
        x[i, :len(inputs)], y[i, :len(targets)] = inputs, targets
    nll = np.asarray(_per_token_nll(model, x, y))
    return [nll[i, :len(inputs)] for i, (inputs, _) in enumerate(sequences)]


def _segments(batch) -> list[tuple[int, np.ndarray]]:
    """(row, token indices) of every segment in the rows."""
    out = []
    for r, seg in enumerate(batch["segment_ids"]):
        out += [(r, np.flatnonzero(seg == s)) for s in sorted(set(seg[seg > 0].tolist()))]
    return out


def test_a_document_has_the_same_per_token_losses_packed_or_alone(model):
    docs = _documents([5, 11, 3, 9, 20, 2, 7, 1])  # 21 tokens > T: at least one is split
    batch = _rows(docs)
    packed = np.asarray(_per_token_nll(model, batch["inputs"], batch["targets"],
                                       batch["positions"], batch["segment_ids"]))
    sequences, whole = [], 0
    for r, idx in _segments(batch):
        inputs, targets = batch["inputs"][r, idx], batch["targets"][r, idx]
        doc = [d for d in docs if np.array_equal(d["inputs"], inputs)]
        if doc:  # the whole document in one row: compare with the document on its own
            inputs, targets, whole = doc[0]["inputs"], doc[0]["targets"], whole + 1
        sequences.append((inputs, targets))  # else a piece of a split one, which starts afresh
    for (r, idx), alone in zip(_segments(batch), _alone(model, sequences)):
        np.testing.assert_allclose(packed[r, idx], alone, rtol=1e-5, atol=1e-5)
    assert whole >= len(docs) - 2 and len(sequences) - whole >= 2
    assert (batch["segment_ids"] > 0).sum() == sum(len(d["targets"]) for d in docs)


def test_eval_step_sums_each_document_once_and_ignores_padding(model):
    docs = _documents([6, 13, 4, 10])
    batch = _rows(docs)
    assert (batch["segment_ids"][-1] == 0).any()  # the last row ends in padding
    graphdef, params = nnx.split(model, nnx.Param)
    out = jax.device_get(jax.jit(eval_step, static_argnames="graphdef")(
        params, batch, graphdef=graphdef))
    pieces = [(batch["inputs"][r, idx], batch["targets"][r, idx]) for r, idx in _segments(batch)]
    assert out["tokens"] == sum(len(d["targets"]) for d in docs)
    np.testing.assert_allclose(out["nll"], np.concatenate(_alone(model, pieces)).sum(), rtol=1e-5)
