"""One MoE layer's forward + backward per dispatch path as the number of experts grows.

    python -m llm_jax.bench moe [--repeats 5] [--experts 8,16,32,64]
        [--paths dense,ragged,blocked,capacity]

T = 8 x 256 tokens, D 256, F 256, k = 2 experts per token, float32. The active compute (k experts
per token) is the same at every E, so a sparse dispatch (blocked, capacity; ragged but on CPU,
where XLA computes ragged_dot densely) should stay flat while the dense one (every expert on
every token) grows linearly in E. The timed call is the jitted grad of sum(MoE(x) * cotangent)
+ the load-balancing loss w.r.t. the layer's params and x; every (E, path) pair takes its turn
in each round (A B C ... A B C ...).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm_jax.bench.common import alternate, machine, median, table
from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.moe import MoE

EXPERTS = (8, 16, 32, 64)
PATHS = ("dense", "ragged", "blocked", "capacity")


def fwd_bwd(cfg: ModelConfig, execution: ExecutionConfig, tokens: int, seed: int = 0):
    """A zero-argument call running one jitted forward + backward of a fresh MoE layer."""
    layer = MoE(cfg, rngs=nnx.Rngs(params=seed))
    graphdef, params = nnx.split(layer)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(1, tokens, cfg.hidden_size)), cfg.compute_dtype)
    ct = jnp.asarray(rng.normal(size=(1, tokens, cfg.hidden_size)), cfg.compute_dtype)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params)(x, train=True, execution=execution)
        return jnp.sum(y * ct) + aux.load_balancing_loss

    step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return lambda: jax.block_until_ready(step(params, x))


def run(*, repeats: int = 5, quick: bool = False, experts: tuple[int, ...] = EXPERTS,
        paths: tuple[str, ...] = PATHS, tokens: int = 8 * 256, hidden: int = 256,
        intermediate: int = 256, k: int = 2) -> dict[str, Any]:
    if quick:
        experts, tokens, hidden, intermediate, repeats = (4, 8), 64, 16, 16, 1
        # The table's wiring with one sparse dispatch of each kind (dropless, capacity); the
        # blocked dispatch's own tests are in tests/model/test_moe.py.
        paths = tuple(p for p in paths if p != "blocked") or paths
    fns = {}
    for e in experts:
        cfg = ModelConfig(num_experts=e, experts_per_token=k, hidden_size=hidden,
                          intermediate_size=intermediate)
        fns.update({(e, p): fwd_bwd(cfg, ExecutionConfig(moe_dispatch=p), tokens)
                    for p in paths})
    # Every (E, path) in one interleaved round, so load drift cannot fake a growth in E.
    times = alternate(fns, repeats=repeats)
    rows = [{"num_experts": e, **{p: {"time_s": median(times[e, p]), "times_s": times[e, p]}
                                  for p in paths}} for e in experts]
    first = rows[0]
    growth = {p: rows[-1][p]["time_s"] / first[p]["time_s"] for p in paths}
    return {"benchmark": "moe", "machine": machine(), "repeats": repeats, "tokens": tokens,
            "hidden": hidden, "intermediate": intermediate, "experts_per_token": k,
            "paths": list(paths), "rows": rows,
            "growth": {"from_experts": first["num_experts"], "to_experts": rows[-1]["num_experts"],
                       **growth}}


def format_rows(rows: list[dict[str, Any]], paths) -> str:
    return table(["E", *[f"{p} ms" for p in paths]],
                 [[r["num_experts"], *[f"{r[p]['time_s'] * 1e3:.1f}" for p in paths]]
                  for r in rows])


def format_result(r: dict[str, Any]) -> str:
    g = r["growth"]
    growth = ", ".join(f"{p} {g[p]:.2f}x" for p in r["paths"])
    return (f"MoE layer fwd+bwd, {r['tokens']} tokens, D {r['hidden']}, F {r['intermediate']}, "
            f"k {r['experts_per_token']}; medians of {r['repeats']}; load "
            f"{r['machine']['load_average']}\n" + format_rows(r["rows"], r["paths"])
            + f"\ntime at E={g['to_experts']} / at E={g['from_experts']}: {growth}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=EXPERTS)
    p.add_argument("--paths", type=lambda s: tuple(s.split(",")), default=PATHS)


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(repeats=a.repeats, quick=a.quick, experts=a.experts, paths=a.paths)
