"""Benchmarks: every subcommand's --quick run writes the JSON it promises; blockwise attention is
the direct attention (outputs and gradients) with masks, sliding windows and GQA."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.bench.__main__ import main
from llm_jax.config import ModelConfig
from llm_jax.model.attention import Attention, attend, attention_mask
from llm_jax.model.blockwise_attention import blockwise_attend, use_blockwise

# ------------------------------------------------------------------ blockwise attention


def _qkvs(b, t, n, kv, h, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return f(b, t, n, h), f(b, t, kv, h), f(b, t, kv, h), f(n), f(b, t, n, h)


@pytest.mark.parametrize("n, kv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "gqa6"])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("segments", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize("block", [16, 64], ids=["blocks_padded", "one_block"])
def test_blockwise_attention_equals_direct_outputs_and_grads(n, kv, window, segments, block):
    b, t, h = 2, 50, 16  # 50 keys: the last block of 16 is padded
    q, k, v, sinks, ct = _qkvs(b, t, n, kv, h)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = None
    if segments:  # packed documents and a padded tail (segment 0 sees nothing but its sink)
        seg = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 0]], [20, 15, 10, 5], axis=1))
        pos = jnp.asarray(np.concatenate([np.arange(20), np.arange(15), np.arange(10),
                                          np.arange(5)]))[None].repeat(b, 0)

    def direct(q, k, v, s):
        return attend(q, k, v, s, attention_mask(pos, pos, window, seg, seg))

    def blockwise(q, k, v, s):
        return blockwise_attend(q, k, v, s, pos, pos, window, seg, seg, block=block)

    np.testing.assert_allclose(blockwise(q, k, v, sinks), direct(q, k, v, sinks),
                               rtol=1e-5, atol=1e-5)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3))(q, k, v, sinks)
             for f in (direct, blockwise)]
    for name, gd, gb in zip(("q", "k", "v", "sinks"), *grads):
        np.testing.assert_allclose(gb, gd, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_blockwise_attention_memory_grows_linearly_with_length():
    def temp_bytes(t, attn):
        q, k, v, s, ct = _qkvs(1, t, 4, 2, 64)
        pos = jnp.arange(t)[None]
        f = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(attn(q, k, v, s, pos) * ct)))
        return f.lower(q, k, v, s).compile().memory_analysis().temp_size_in_bytes

    bw = lambda q, k, v, s, p: blockwise_attend(q, k, v, s, p, p, 0, block=128)  # noqa: E731
    direct = lambda q, k, v, s, p: attend(q, k, v, s, attention_mask(p, p, 0))  # noqa: E731
    # 4x the length: blockwise about 4x the memory; direct about 16x for its T x T part (10x in
    # all here).
    assert temp_bytes(2048, bw) < 5 * temp_bytes(512, bw)
    assert temp_bytes(2048, direct) > 8 * temp_bytes(512, direct)


def test_attention_layer_chooses_blockwise_for_long_sequences_with_same_output():
    assert not use_blockwise(8, 256, 256, 4)
    assert use_blockwise(1, 8192, 8192, 4)
    assert not use_blockwise(8, 1, 8192, 4)  # one decode step stays direct
    cfg = ModelConfig(num_hidden_layers=1, num_experts=4, vocab_size=64, hidden_size=32,
                      intermediate_size=32, head_dim=8, num_attention_heads=4,
                      num_key_value_heads=2)
    from flax import nnx

    layer = Attention(cfg, rngs=nnx.Rngs(params=0))
    t = 2048
    assert use_blockwise(1, t, t, cfg.num_attention_heads)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, t, 32)), jnp.float32)
    pos = jnp.arange(t)[None]
    out, _ = layer(x, pos, 0)
    q, k, v = layer.qkv(x, pos)
    ref = layer.out(attend(q, k, v, layer.sinks[...], attention_mask(pos, pos, 0)))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the CLI, --quick

EXPECTED = {
    "peak": lambda r: r["flops"]["float32"]["peak"] == max(r["flops"]["float32"]["xla"],
                                                           r["flops"]["float32"]["blas"])
    and r["flops"]["bfloat16"]["peak"] == r["flops"]["bfloat16"]["xla"] > 0,
    "attention": lambda r: all(row["direct"]["time_s"] > 0 and row["blockwise"]["temp_bytes"] > 0
                               and row["max_abs_grad_diff"] < 1e-4 for row in r["rows"]),
    "moe": lambda r: {row["num_experts"] for row in r["rows"]} == {4, 8}
    and all(row[p]["time_s"] > 0 for row in r["rows"] for p in ("dense", "ragged", "capacity"))
    and set(r["growth"]) >= {"dense", "ragged", "capacity"},
    "norm": lambda r: r["rms"]["step_s"] > 0 and r["layer"]["step_s"] > 0
    and r["layer_over_rms"] > 0,
    "malloc": lambda r: {"system", "glibc"} <= {row["name"] for row in r["rows"]}
    and all(row["step_s"] > 0 and row["minor_faults_per_step"] >= 0 for row in r["rows"])
    and next(row for row in r["rows"] if row["name"] == "glibc")["malloc"] == "glibc (tuned)",
    "train": lambda r: set(r["peak_source"]) == set(r["peak_flops"])
    and all(row["llm_jax"]["tokens_per_s"] > 0 and 0 < row["llm_jax"]["mfu"]
                           and row["transformers"]["tokens_per_s"] > 0 and row["speedup"] > 0
                           and np.isfinite(row["llm_jax"]["last_loss"]) for row in r["rows"]),
    "decode": lambda r: all(row["llm_jax"]["decode_tokens_per_s"] > 0 for row in r["decode"]),
    "prefill": lambda r: all(row["prefill_s"] > 0 and row["peak_rss_bytes"] > 2**20
                             for row in r["rows"]),
}
EXTRA_ARGS = {"train": ["--dtypes", "float32"], "decode": ["--no_hf"]}


@pytest.mark.parametrize("command", list(EXPECTED))
def test_bench_quick_writes_json_with_expected_keys(command, tmp_path, capsys):
    out = tmp_path / f"{command}.json"
    assert main([command, "--quick", "--json_out", str(out), *EXTRA_ARGS.get(command, [])]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == command
    assert {"date", "cpu_model", "cpu_count", "load_average", "malloc"} <= set(r["machine"])
    assert EXPECTED[command](r), r
    assert "|" in capsys.readouterr().out  # printed its table
