"""Attention forward + backward: the direct T x S path against the block-sparse one as T grows,
one layer with and without a sliding window, and a 2-layer model with and without one.

    python -m llm_jax.bench attention [--repeats 5] [--parts sweep,layers,model]
        [--seq_lens 512,1024,2048,4096,8192] [--block 64] [--q_block 128] [--window 0]
        [--seq_len 8192] [--baseline FILE]

Batch 1, the tiny config's heads (N 4 q heads, K 2 kv heads, H 64), float32. Time is the median
of `repeats` calls of a jitted gradient, every contender of a part interleaved; memory is XLA's
temp_size_in_bytes of that compiled program (`compiled.memory_analysis()`): the scratch it needs
beyond its inputs and outputs.

- sweep: grad of sum(attention * cotangent) w.r.t. q, k, v and the sinks, direct against
  blockwise, for each of --seq_lens (causal, or --window).
- layers: the same gradient of `blockwise_attend` at --seq_len with window 128 and with none.
- model: grad of the mean cross-entropy w.r.t. all weights of `Transformer(ModelConfig(
  num_hidden_layers=2, sliding_window=128 | 0))` (layer 0 slides, layer 1 is full) at --seq_len,
  and of the same model with each attention replaced by its query: the cost of the rest.

--baseline FILE times another implementation of `blockwise_attend` (a module file with the same
function, e.g. an older version from `git show`) in the same rounds, in layers and model alike
(the model's attention is patched to call it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from llm_jax.bench.common import alternate, machine, median, table
from llm_jax.bench.train import quick_model_config
from llm_jax.config import ModelConfig
from llm_jax.model import attention as attention_module
from llm_jax.model.attention_math import attend, attention_mask
from llm_jax.model.blockwise_attention import (
    DEFAULT_BLOCK,
    DEFAULT_Q_BLOCK,
    blockwise_attend,
    use_blockwise,
)
from llm_jax.model.costs import flops_per_token
from llm_jax.model.transformer import Transformer

SEQ_LENS = (512, 1024, 2048, 4096, 8192)
PARTS = ("sweep", "layers", "model")
WINDOW = 128  # the sliding window of the layers and model parts


def _fwd_bwd(attn: Callable[..., jax.Array]):
    def loss(q, k, v, s, pos, ct):
        return jnp.sum(attn(q, k, v, s, pos) * ct)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _inputs(cfg: ModelConfig, t: int, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    return f(1, t, n, h), f(1, t, k, h), f(1, t, k, h), f(n), pos, f(1, t, n, h)


def _compiled(fn, *args) -> tuple[Callable[[], Any], int | None]:
    """A call that blocks until `fn(*args)` is done, and the compiled program's scratch bytes."""
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    return (lambda: jax.block_until_ready(compiled(*args))), (
        int(mem.temp_size_in_bytes) if mem else None)


def load_baseline(path: str) -> Callable[..., jax.Array]:
    """`blockwise_attend` of the module file at `path`."""
    spec = importlib.util.spec_from_file_location("_baseline_blockwise_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.blockwise_attend


@contextlib.contextmanager
def _model_attention(impl: Callable[..., jax.Array]) -> Iterator[None]:
    """`Attention` calls `impl` in place of `blockwise_attend` while a model is traced."""
    saved = attention_module.blockwise_attend
    attention_module.blockwise_attend = impl
    try:
        yield
    finally:
        attention_module.blockwise_attend = saved


def _timed(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, Any]]:
    return {name: {"time_s": median(ts), "times_s": ts}
            for name, ts in alternate(fns, repeats=repeats).items()}


def sweep(cfg: ModelConfig, seq_lens, block: int, q_block: int, window: int,
          max_direct_len: int, repeats: int) -> list[dict[str, Any]]:
    paths = {"direct": lambda q, k, v, s, pos: attend(q, k, v, s,
                                                       attention_mask(pos, pos, window)),
             "blockwise": lambda q, k, v, s, pos: blockwise_attend(q, k, v, s, pos, pos, window,
                                                                  block=block, q_block=q_block)}
    rows = []
    for t in seq_lens:
        args = _inputs(cfg, t)
        fns, row = {}, {"seq_len": t, "auto": "blockwise" if use_blockwise(
            1, t, t, cfg.num_attention_heads) else "direct"}
        for name, attn in paths.items():
            if name == "direct" and t > max_direct_len:
                continue
            fns[name], temp = _compiled(_fwd_bwd(attn), *args)
            row[name] = {"temp_bytes": temp}
        grads = {name: fn() for name, fn in fns.items()}
        if len(grads) == 2:
            row["max_abs_grad_diff"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
                *grads.values()))
        for name, timing in _timed(fns, repeats).items():
            row[name].update(timing)
        rows.append(row)
    return rows


def _by_window(fns: dict[tuple[str, int], Callable[[], Any]], temps: dict[tuple[str, int], Any],
               repeats: int) -> list[dict[str, Any]]:
    """Times every (implementation, window) contender interleaved; one row per window."""
    timings = _timed({f"{name}/{w}": fn for (name, w), fn in fns.items()}, repeats)
    rows = {w: {"window": w} for _, w in fns}
    for (name, w) in fns:
        rows[w][name] = {"temp_bytes": temps[name, w], **timings[f"{name}/{w}"]}
    return list(rows.values())


def layers(cfg: ModelConfig, t: int, impls: dict[str, Callable], repeats: int
           ) -> list[dict[str, Any]]:
    """One attention's gradient at window WINDOW and 0 (full causal), each implementation."""
    args = _inputs(cfg, t)
    fns, temps = {}, {}
    for w in (WINDOW, 0):
        for name, impl in impls.items():
            def attn(q, k, v, s, pos, impl=impl, w=w):
                return impl(q, k, v, s, pos, pos, w)

            fns[name, w], temps[name, w] = _compiled(_fwd_bwd(attn), *args)
    return _by_window(fns, temps, repeats)


def model(cfg: ModelConfig, t: int, impls: dict[str, Callable], repeats: int,
          attention_free: bool = True) -> list[dict[str, Any]]:
    """The 2-layer model's gradient with sliding_window WINDOW and 0, each implementation
    (and, with `attention_free`, the model whose attentions are replaced by their queries)."""
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t + 1)).astype(np.int32)
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    fns, temps = {}, {}
    for w in (WINDOW, 0):
        mcfg = dataclasses.replace(cfg, num_hidden_layers=2, sliding_window=w)
        graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(params=0)))

        def loss(params, graphdef=graphdef):
            logits = nnx.merge(graphdef, params)(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        # The same model with each attention replaced by its query (window 0 only: no window
        # applies): what the rest of the model costs.
        free = ({"attention_free": lambda q, *args, **kwargs: q}
                if w == 0 and attention_free else {})
        for name, impl in {**impls, **free}.items():
            with _model_attention(impl):
                fns[name, w], temps[name, w] = _compiled(jax.jit(jax.grad(loss)), params)
    rows = _by_window(fns, temps, repeats)
    for row in rows:  # model FLOPs (fwd + bwd, masked blocks skipped): the ratio's arithmetic
        mcfg = dataclasses.replace(cfg, num_hidden_layers=2, sliding_window=row["window"])
        row["model_flops"] = flops_per_token(mcfg, t) * t
    return rows


def run(*, repeats: int = 3, quick: bool = False, seq_lens: tuple[int, ...] | None = None,
        block: int = DEFAULT_BLOCK, q_block: int = DEFAULT_Q_BLOCK, window: int = 0,
        max_direct_len: int = 8192,
        seq_len: int = 8192, parts: tuple[str, ...] = PARTS,
        baseline: str | None = None) -> dict[str, Any]:
    cfg = ModelConfig()
    if quick:
        # One length of several blocks each way (block 32 over 128): blockwise's loop runs.
        seq_lens, block, q_block, repeats, seq_len = seq_lens or (128,), 32, 32, 1, 128
        cfg = quick_model_config()
    impls = {"current": blockwise_attend}
    if baseline:
        impls["baseline"] = load_baseline(baseline)
    result: dict[str, Any] = {
        "benchmark": "attention", "machine": machine(), "repeats": repeats, "block": block,
        "q_block": q_block,
        "window": window, "seq_len": seq_len, "baseline": baseline,
        "heads": {"q": cfg.num_attention_heads, "kv": cfg.num_key_value_heads,
                  "head_dim": cfg.head_dim}}
    if "sweep" in parts:
        result["rows"] = sweep(cfg, seq_lens or SEQ_LENS, block, q_block, window, max_direct_len,
                               repeats)
    if "layers" in parts:
        result["layers"] = layers(cfg, seq_len, impls, repeats)
    if "model" in parts:
        # --quick: the windowed and the full model; the attention-free one would be a third
        # compile of the model's gradient, for a figure (the rest's cost) tiny sizes cannot show.
        result["model"] = model(cfg, seq_len, impls, repeats, attention_free=not quick)
    return result


def format_result(r: dict[str, Any]) -> str:
    def cols(x):
        if x is None:
            return ["-", "-"]
        return [f"{x['time_s'] * 1e3:.1f}", f"{x['temp_bytes'] / 2**20:.1f}"]

    def ms(x):
        return f"{x['time_s'] * 1e3:.1f}"

    out = []
    if "rows" in r:
        rows = [[row["seq_len"], *cols(row.get("direct")), *cols(row.get("blockwise")),
                 f"{row['direct']['time_s'] / row['blockwise']['time_s']:.2f}x"
                 if "direct" in row else "-", row["auto"]] for row in r["rows"]]
        out.append(f"attention fwd+bwd, batch 1, heads {r['heads']}, blocks {r['q_block']} "
                   f"queries x {r['block']} keys, window {r['window']}\n"
                   + table(["T", "direct ms", "direct MiB", "blockwise ms", "blockwise MiB",
                            "blockwise speed-up", "auto"], rows))
    for part, what in (("layers", "one attention fwd+bwd"),
                       ("model", "2-layer model fwd+bwd (layer 0 window w, layer 1 full)")):
        if part not in r:
            continue
        names = [n for n in ("current", "baseline") if n in r[part][0]]
        headers = ["window", *(f"{n} ms" for n in names)]
        rows = [[row["window"] or "none", *(ms(row[n]) for n in names)] for row in r[part]]
        if "baseline" in names:
            headers.append("baseline / current")
            for row, cells in zip(r[part], rows):
                cells.append(f"{row['baseline']['time_s'] / row['current']['time_s']:.2f}x")
        windowed, full = r[part]
        ratio = ", ".join(f"{n} window/none {windowed[n]['time_s'] / full[n]['time_s']:.2f}x"
                          for n in names)
        out.append(f"{what}, T {r['seq_len']}, batch 1: {ratio}\n" + table(headers, rows))
        if "model_flops" in full:  # what the ratio would be with every part at one FLOP rate
            rates = "; ".join(
                f"{row['window'] or 'none'}: " + ", ".join(
                    f"{n} {row['model_flops'] / row[n]['time_s'] / 1e9:.0f}" for n in names)
                for row in r[part])
            out.append(f"model FLOPs window/none {windowed['model_flops'] / full['model_flops']:.3f}"
                       f" ({windowed['model_flops'] / 1e9:.1f} / {full['model_flops'] / 1e9:.1f} "
                       f"GFLOP); achieved GFLOP/s {rates}")
        if "attention_free" in full:
            rest = full["attention_free"]["time_s"]
            spent = ", ".join(f"{n}'s two attentions {(windowed[n]['time_s'] - rest) * 1e3:.1f} ms "
                              f"with a window, {(full[n]['time_s'] - rest) * 1e3:.1f} without"
                              for n in names)
            out.append(f"the model with attention replaced by its query: {rest * 1e3:.1f} ms; "
                       f"{spent}")
    out.append(f"load average {r['machine']['load_average']}")
    return "\n\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", type=lambda s: tuple(s.split(",")), default=PARTS,
                   help="which of sweep,layers,model to run")
    p.add_argument("--seq_lens", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="sweep: the lengths")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="sweep: keys per block")
    p.add_argument("--q_block", type=int, default=DEFAULT_Q_BLOCK,
                   help="sweep: queries per block")
    p.add_argument("--window", type=int, default=0, help="sweep: the window")
    p.add_argument("--max_direct_len", type=int, default=8192,
                   help="sweep: skip the direct path above this T (its memory grows as T^2)")
    p.add_argument("--seq_len", type=int, default=8192, help="layers and model: T")
    p.add_argument("--baseline", default=None,
                   help="layers and model: also time the blockwise_attend of this module file")


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    bad = set(a.parts) - set(PARTS)
    if bad:
        raise SystemExit(f"--parts {sorted(bad)} is invalid: expected some of {PARTS}")
    return run(repeats=a.repeats, quick=a.quick, seq_lens=a.seq_lens, block=a.block,
               q_block=a.q_block, window=a.window, max_direct_len=a.max_direct_len,
               seq_len=a.seq_len, parts=a.parts, baseline=a.baseline)
