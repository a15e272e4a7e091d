"""Sharding: one rules table, meshes from the config, clear errors, and meshes over every axis
computing the same training run as one device (losses and params after three steps, within 1e-5
in float32); the expert-parallel MoE equals the single-device MoE (outputs and gradients).

Tests that need 8 devices run this file as a script in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the rest of the suite has one device).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # helpers, as
# a script too

from helpers import EIGHT_DEVICES, batches, tiny_execution, tiny_model, tiny_train  # noqa: E402

from llm_jax.parallel import sharding as sh  # noqa: E402

# (data, fsdp, tensor, expert): every axis, each with others, in two train-step compiles.
# Pure data parallelism (8, 1, 1, 1) adds no collective these lack (its replicated params'
# all-reduce runs in (2, 1, 2, 2) too): its layout is checked without a compile; one expert
# per device (1, 1, 1, 8), and experts over four devices beside fsdp (1, 2, 1, 4), are the
# expert-parallel MoE on {"expert": 8} and {"fsdp": 2, "expert": 4} (case_expert_parallel,
# outputs and gradients); the batch and the params split over fsdp and over expert train here.
MESHES = [(2, 4, 1, 1), (2, 1, 2, 2)]


def run_steps(cfg, mesh, num_steps=3, seed=0, execution=None):
    """(losses, final params as numpy, state) of `num_steps` train steps on `mesh`."""
    from llm_jax.training.step import compile_steps

    steps = compile_steps(cfg, tiny_train(), mesh, seed,
                          execution=execution or tiny_execution())
    state = steps.init()
    losses = []
    for b in batches(num_steps):
        state, m = steps.train(state, jax.device_put(b, steps.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, jax.tree.map(np.asarray, jax.device_get(state.params)), state, steps


# --------------------------------------------------------------------------- one device


def test_rules_map_logical_names_once_per_mesh_axis():
    assert sh.logical_to_spec(("batch", "length", "embed")) == \
        jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None, None)  # fsdp taken by batch
    assert sh.logical_to_spec(("experts", "embed", "mlp")) == \
        jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
    # weights no other name splits over `expert` take it for `embed` (ZeRO-3 over fsdp x expert)
    assert sh.logical_to_spec(("vocab", "embed")) == \
        jax.sharding.PartitionSpec("tensor", ("fsdp", "expert"))
    assert sh.logical_to_spec(("embed", "heads", "head_dim")) == \
        jax.sharding.PartitionSpec(("fsdp", "expert"), "tensor", None)
    assert sh.logical_axes(("batch",)) == ("data", "fsdp", "expert")


def test_constrain_is_a_no_op_without_a_mesh():
    x = jnp.ones((4, 3, 2))
    assert sh.constrain(x, ("batch", "length", "embed")) is x


def test_mesh_product_not_the_device_count_is_refused_with_both_numbers():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"multiply to {2 * n}, but there are {n} devices"):
        sh.make_mesh({"data": 2 * n})
    with pytest.raises(ValueError, match=r"tensor=-1 cannot fill .* multiply to 3"):
        sh.make_mesh({"data": 3, "tensor": -1})
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sh.make_mesh({"data": -1, "fsdp": -1})
    with pytest.raises(ValueError, match="unknown field"):
        sh.mesh_from_config({"data": -1, "pipeline": 2})


def test_mesh_from_the_run_config_defaults_to_all_devices_on_data():
    from llm_jax.training.run_config import default_run_config

    mesh = sh.mesh_from_config(default_run_config("t", tiny_model()).mesh)
    assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "tensor": 1, "expert": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_optimizer_state_gets_the_param_shardings():
    """Adam's m and v are nnx.State trees of Params with their param's logical names."""
    from flax import nnx

    from llm_jax.training.step import init_state, make_optimizer

    tx = make_optimizer(tiny_train())
    abstract = jax.eval_shape(lambda: init_state(tiny_model(), tx, 0))
    shardings = sh.state_shardings(abstract, sh.make_mesh())
    flat_p = dict(jax.tree_util.tree_leaves_with_path(
        shardings.params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    moments = 0
    for path, s in jax.tree_util.tree_leaves_with_path(
            shardings.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(s, nnx.Variable):  # mu / nu leaf: path ends with the param's path
            match = [p for k, p in flat_p.items() if path[-len(k):] == k]
            assert match, jax.tree_util.keystr(path)
            assert s.get_metadata()["out_sharding"] == match[0].get_metadata()["out_sharding"]
            moments += 1
    assert moments == 2 * len(flat_p)


def test_describe_lists_every_param_sharding_from_the_same_rules():
    from flax import nnx

    from llm_jax.model import abstract_model, costs

    mesh = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 4}
    rows = {r["param"]: r for r in costs.param_shardings(tiny_model(), mesh)}
    state = nnx.state(abstract_model(tiny_model()), nnx.Param)
    assert len(rows) == len(jax.tree.leaves(state))
    gate_up = rows["layers/mlp/gate_up_proj"]  # [L, E, D, 2F]
    assert gate_up["spec"] == "P(None, 'expert', 'fsdp', 'tensor')"
    assert gate_up["shard"] == [2, 8 // 4, 32 // 2, 64 // 2]
    assert rows["embedding"]["spec"] == "P('tensor', ('fsdp', 'expert'))"  # ZeRO-3 over fsdp x expert


# --------------------------------------------------------------------------- eight devices


# Every eight-device case runs in ONE child process (a process launch and the JAX import cost
# about as much as a case), as one test, so pytest-xdist cannot split the cases over two workers
# and start the child twice. Each case's failure is reported under its own name.
CASES = ("meshes", "expert_parallel", "vocab_split_loss", "packed_expert_parallel",
         "sharded_decode", "bad_divisibility")


def _children(timeout: int = 900) -> dict:
    env = {**os.environ, "XLA_FLAGS": EIGHT_DEVICES, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_meshes(r: dict) -> None:
    for mesh in MESHES:
        m = r[",".join(map(str, mesh))]
        np.testing.assert_allclose(m["losses"], r["reference"]["losses"], rtol=0, atol=1e-5,
                                   err_msg=str(mesh))
        assert m["max_param_diff"] < 1e-5, (mesh, m)
        assert m["opt_state_sharded_like_params"], (mesh, m)
        assert m["params_sharded"], (mesh, m)
    # pure data parallel replicates every param and Adam moment; the batch is split 8 ways
    assert r["data=8"] == {"params_sharded": False, "opt_state_sharded_like_params": True,
                           "batch_split": 8}, r["data=8"]


def check_expert_parallel(r: dict) -> None:
    """The expert-parallel MoE equals the single-device MoE (outputs and gradients)."""
    # megablox exchanges rows zero-padded to 128 lanes (moe_parallel.exchange_width), only it,
    # only over an expert axis: values and gradients as without the padding, to float32 rounding
    # (and only where the rows received outweigh the padded weights: 8 R >= 3 El F2 = 288)
    assert r.pop("width") == [128, 32, 32, 128, 32, 128, 32], r
    assert r.pop("padding") < 1e-6, r
    assert len(r) == 5, r
    for mesh, errs in r.items():
        assert errs["output"] < 1e-5 and errs["grads"] < 1e-5, (mesh, errs)
        assert errs["drop"] == 0.0, (mesh, errs)


def check_vocab_split_loss(r: dict) -> None:
    """The fused loss under a mesh with fsdp / expert / tensor axes splits the vocabulary over
    them (unembed_loss.vocab_split) and gathers each chunk's tokens: value, dh and dW equal one
    device's to float32 rounding (1e-5 relative to each array's largest entry); a mesh of
    data only splits by tokens, as before."""
    assert r["fsdp=4,expert=2"]["split"] == "P(None, None, ('fsdp', 'expert'))", r
    assert r["data=2,fsdp=2,tensor=2"]["split"] == "P('data', None, ('tensor', 'fsdp'))", r
    assert r["data=8"]["split"] is None, r
    for mesh, errs in r.items():
        assert max(errs["errors"]) < 1e-5, (mesh, errs)
        assert errs["sharded_in"], mesh


def check_packed_expert_parallel(r: dict) -> None:
    # Packed stacks enter shard_map as blocks and scales split like the dense stack (experts on
    # `expert`, F on `tensor`) and are unpacked on the device that holds them.
    assert len(r) == 3, r
    for mesh, errs in r.items():
        assert errs["output"] < 1e-6 and errs["grads"] < 1e-6, (mesh, errs)
        assert errs["drop"] == 0.0, (mesh, errs)


def check_sharded_decode(r: dict) -> None:
    # Batch on data, kv heads on tensor: the keys' [B, K, H, S] and values' [B, K, S, H] caches
    # are constrained to their own logical specs every step; tokens and logits as unsharded.
    assert len(r) == 1, r
    for mesh, errs in r.items():
        assert errs["same_tokens"], (mesh, errs)
        assert errs["logits"] < 1e-5, (mesh, errs)


def check_bad_divisibility(r: dict) -> None:
    """A dimension not divisible by its mesh axes is refused naming both numbers."""
    assert "has size 6, not divisible by mesh axes expert=4" in r["experts"], r
    assert "(experts)" in r["experts"], r
    assert "12 sequences per microbatch is not divisible" in r["batch"], r
    assert "data=8xfsdp=1xexpert=1 = 8" in r["batch"], r


@pytest.mark.slow
def test_eight_devices_compute_what_one_device_does():
    """Every mesh trains exactly like one device; expert-parallel (dense and packed mxfp4)
    MoE, the vocabulary-split loss and decoding with a sharded cache equal one device's; bad
    divisibility is a clear error. All cases run in the one child; every failing case is
    listed."""
    results = _children()
    failures = {}
    for case in CASES:
        try:
            globals()[f"check_{case}"](results[case])
        except AssertionError as e:
            failures[case] = str(e)[-2000:]
    assert not failures, failures


# --------------------------------------------------------------------------- child cases


def case_meshes() -> dict:
    from llm_jax.training.step import compile_steps

    ref_losses, ref_params, _, _ = run_steps(tiny_model(), sh.make_mesh(devices=jax.devices()[:1]))
    out = {"reference": {"losses": ref_losses}}
    for m in MESHES:
        sizes = dict(zip(sh.MESH_AXES, m))
        dispatch = "expert_parallel" if sizes["expert"] > 1 else "capacity"
        losses, params, state, steps = run_steps(tiny_model(), sh.make_mesh(sizes),
                                                 execution=tiny_execution(moe_dispatch=dispatch))
        diff = max(float(np.max(np.abs(a - b))) for a, b in
                   zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))
        # Every Adam moment is an array laid out exactly like its param.
        adam = state.opt_state[1][0]
        same = all(m.sharding == v.sharding == p.sharding for m, v, p in zip(
            jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), jax.tree.leaves(state.params)))
        sharded = any(not p.sharding.is_fully_replicated for p in jax.tree.leaves(state.params))
        out[",".join(map(str, m))] = {"losses": losses, "max_param_diff": diff,
                                      "opt_state_sharded_like_params": bool(same),
                                      "params_sharded": bool(sharded),
                                      "dispatch": dispatch}
    steps = compile_steps(tiny_model(), tiny_train(), sh.make_mesh({"data": 8}), 0,
                          execution=tiny_execution())  # traced, not compiled
    params = jax.tree.leaves(steps.state_sharding.params)
    adam = steps.state_sharding.opt_state[1][0]
    out["data=8"] = {
        "params_sharded": any(not p.is_fully_replicated for p in params),
        "opt_state_sharded_like_params": all(m == v == p for m, v, p in zip(
            jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), params, strict=True)),
        "batch_split": 16 // steps.batch_sharding.shard_shape((16, 16))[0]}
    return out


def case_expert_parallel() -> dict:
    from llm_jax.model.experts import ExpertWeights
    from llm_jax.model.moe import route
    from llm_jax.model.moe_dispatch import moe_dense
    from llm_jax.model.moe_parallel import moe_expert_parallel

    d, e, f, k = 32, 8, 24, 2
    rng = np.random.default_rng(0)
    p = dict(router=rng.normal(size=(d, e)) * 0.5, rb=rng.normal(size=(e,)) * 0.1,
             w1=rng.normal(size=(e, d, 2 * f)) * 3 / np.sqrt(d), b1=rng.normal(size=(e, 2 * f)),
             w2=rng.normal(size=(e, f, d)) / np.sqrt(f), b2=rng.normal(size=(e, d)) * 0.1)
    p = {n: jnp.asarray(v, jnp.float32) for n, v in p.items()}
    x = jax.random.normal(jax.random.key(1), (64, d))
    ct = jax.random.normal(jax.random.key(2), (64, d)) / 64

    def loss(fn):
        def f_(x, p):
            r = route(x, p["router"], p["rb"], k)
            y, drop = fn(x, r, ExpertWeights(p["w1"], p["b1"], p["w2"], p["b2"]))
            return jnp.sum(y * ct), (y, drop)
        return jax.value_and_grad(f_, argnums=(0, 1), has_aux=True)

    ref = jax.jit(loss(lambda x, r, w: (moe_dense(x, r, w, 7.0), 0.0)))(x, p)
    out, got = {}, {}
    # The local experts by lax.ragged_dot on three meshes, and by each Pallas kernel (interpret
    # mode) on one with every axis in play.
    every_axis = {"data": 2, "tensor": 2, "expert": 2}
    runs = [(m, None) for m in ({"expert": 8}, every_axis, {"fsdp": 2, "expert": 4})]
    runs += [(every_axis, kn) for kn in ("megablox", "triton")]
    for sizes, kernel in runs:
        mesh = sh.make_mesh(sizes)
        fn = loss(lambda x, r, w, kernel=kernel: moe_expert_parallel(
            x, r, w, 7.0, 8.0, kernel=kernel, interpret=True))
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        got[str(sizes), kernel] = jax.jit(sh.with_mesh(fn, mesh))(*jax.device_put((x, p), rep))
        (_, (y, drop)), grads = got[str(sizes), kernel]
        (_, (y_ref, _)), g_ref = ref
        out[f"{sizes} {kernel or 'ragged_dot'}"] = {
            "output": float(jnp.max(jnp.abs(y - y_ref)) / (1 + jnp.max(jnp.abs(y_ref)))),
            "grads": max(float(jnp.max(jnp.abs(a - b)) / (1 + jnp.max(jnp.abs(b))))
                         for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref))),
            "drop": float(drop)}
    # megablox on a mesh with an expert axis exchanges rows padded to whole 128-lane tiles
    # (D = 32 -> 128 here): the same numbers as the unpadded exchange of lax.ragged_dot on that
    # mesh, to float32 rounding (measured 3e-8, and 0.0 against megablox unpadded).
    from llm_jax.model import moe_parallel
    from llm_jax.model.experts import ExpertWeights as W

    w = W(p["w1"], p["b1"], p["w2"], p["b2"])  # 8 experts, F2 = 48: 4 x 24 local on tensor = 2
    width = functools.partial(moe_parallel.exchange_width, w=w, tp=2)
    out["width"] = [width(d, kn, 2, rows=64) for kn in ("megablox", "triton")]
    out["width"] += [width(d, "megablox", 1, rows=64), width(128, "megablox", 2, rows=64),
                     width(d, "megablox", 2, rows=35), width(d, "megablox", 2, rows=36)]
    out["width"] += [width(d, None, 2, rows=64)]  # the reference below exchanges D = 32
    padded, plain = got[str(every_axis), "megablox"], got[str(every_axis), None]
    out["padding"] = max(float(jnp.max(jnp.abs(a - b)) / (1 + jnp.max(jnp.abs(b))))
                         for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(plain)))
    return out


def case_vocab_split_loss() -> dict:
    from jax.sharding import NamedSharding

    from llm_jax.model import unembed_loss as ul

    b, t, d, v = 8, 40, 16, 96  # 8 chunks of 5 steps at 40 tokens; V = 96 divides by 8
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (b, t, d))
    w = 0.5 * jax.random.normal(k[1], (v, d))
    tg = jax.random.randint(k[2], (b, t), 0, v)
    mask = (jax.random.uniform(k[3], (b, t)) > 0.3).astype(jnp.float32)

    def loss(h, w):
        return ul.cross_entropy_sum(h, w, tg, mask, chunk_tokens=40)

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    with jax.default_matmul_precision("highest"):
        ref = jax.tree.leaves(jax.jit(grad)(h, w))
        out = {}
        for sizes in ({"fsdp": 4, "expert": 2}, {"data": 2, "fsdp": 2, "tensor": 2},
                      {"data": 8}):
            mesh = sh.make_mesh(sizes)
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                split = ul.vocab_split(b, v)
            # h split over the batch axes and W as the params are, as in training
            h_in = jax.device_put(h, NamedSharding(mesh, sh.logical_to_spec(("batch",))))
            w_in = jax.device_put(w, NamedSharding(mesh, sh.logical_to_spec(("vocab", "embed"))))
            got = jax.tree.leaves(jax.jit(sh.with_mesh(grad, mesh))(h_in, w_in))
            errors = [float(np.max(np.abs(np.asarray(g) - np.asarray(r))) /
                            max(float(np.max(np.abs(np.asarray(r)))), 1e-30))
                      for g, r in zip(got, ref)]
            out[",".join(f"{a}={n}" for a, n in sizes.items())] = dict(
                split=None if split is None else str(split.logits), errors=errors,
                sharded_in=not h_in.sharding.is_fully_replicated)
    return out


def case_packed_expert_parallel() -> dict:
    from llm_jax.model.experts import ExpertWeights
    from llm_jax.model.moe import route
    from llm_jax.model.moe_dispatch import moe_dense
    from llm_jax.model.moe_parallel import moe_expert_parallel, moe_gmm
    from llm_jax.model.mxfp4 import PackedExperts
    from llm_jax.weights.mxfp4 import dequantize_mxfp4, to_model_layout

    d, e, f, k = 32, 8, 64, 2
    rng = np.random.default_rng(0)
    packed = {n: (rng.integers(0, 256, (e, o, i // 32, 16), dtype=np.uint8),
                  rng.integers(121, 126, (e, o, i // 32), dtype=np.uint8))
              for n, (i, o) in (("w1", (d, 2 * f)), ("w2", (f, d)))}
    p = dict(router=rng.normal(size=(d, e)) * 0.5, rb=rng.normal(size=(e,)) * 0.1,
             b1=rng.normal(size=(e, 2 * f)), b2=rng.normal(size=(e, d)) * 0.1)
    p = {n: jnp.asarray(v, jnp.float32) for n, v in p.items()}
    deq = {n: jnp.asarray(np.swapaxes(dequantize_mxfp4(*bs), -1, -2)) for n, bs in packed.items()}
    stacks = {n: PackedExperts(*map(jnp.asarray, to_model_layout(*bs)))
              for n, bs in packed.items()}
    x = jax.random.normal(jax.random.key(1), (64, d))
    ct = jax.random.normal(jax.random.key(2), (64, d)) / 64

    def loss(fn, w):
        def f_(x, p):
            r = route(x, p["router"], p["rb"], k)
            y, drop = fn(x, r, ExpertWeights(w["w1"], p["b1"], w["w2"], p["b2"]))
            return jnp.sum(y * ct), (y, drop)
        return jax.value_and_grad(f_, argnums=(0, 1), has_aux=True)

    (_, (y_ref, _)), g_ref = jax.jit(loss(lambda x, r, w: (moe_dense(x, r, w, 7.0), 0.0),
                                          deq))(x, p)
    out = {}
    # experts and F split (ragged_dot, megablox), and the grouped-matmul dispatch with F split
    # but no expert axis; one expert per device is the dense stacks' case_expert_parallel.
    runs = [({"data": 2, "tensor": 2, "expert": 2}, "ep", None),
            ({"data": 2, "tensor": 2, "expert": 2}, "ep", "megablox"),
            ({"data": 4, "tensor": 2}, "gmm", "megablox")]
    for sizes, kind, kernel in runs:
        mesh = sh.make_mesh(sizes)
        if kind == "ep":
            fn = lambda x, r, w, kernel=kernel: moe_expert_parallel(  # noqa: E731
                x, r, w, 7.0, 8.0, kernel=kernel, interpret=True)
        else:
            fn = lambda x, r, w: (moe_gmm(x, r, w, 7.0, interpret=True), 0.0)  # noqa: E731
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        stacks_on = jax.device_put(stacks, rep)
        (_, (y, drop)), grads = jax.jit(sh.with_mesh(
            lambda x, p, w: loss(fn, w)(x, p), mesh))(*jax.device_put((x, p), rep), stacks_on)
        out[f"{sizes} {kind} {kernel or 'ragged_dot'}"] = {
            "output": float(jnp.max(jnp.abs(y - y_ref)) / (1 + jnp.max(jnp.abs(y_ref)))),
            "grads": max(float(jnp.max(jnp.abs(a - b)) / (1 + jnp.max(jnp.abs(b))))
                         for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref))),
            "drop": float(drop)}
    return out


def case_sharded_decode() -> dict:
    from llm_jax.inference.sampler import sample
    from llm_jax.model import init_model

    model = init_model(tiny_model(), 0)  # the default execution: auto
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, size=n).tolist() for n in (3, 11, 7, 20)]
    ref_ids, ref_logits = sample(model, prompts, max_new_tokens=12, return_logits=True)
    out = {}
    # the batch over two axes (data x fsdp), kv heads over tensor
    for sizes in ({"data": 2, "fsdp": 2, "tensor": 2},):
        ids, logits = sample(model, prompts, max_new_tokens=12, return_logits=True,
                             mesh=sh.make_mesh(sizes))
        out[str(sizes)] = {"same_tokens": ids == ref_ids, "logits": max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(logits, ref_logits))}
    return out


def case_bad_divisibility() -> dict:
    from llm_jax.training.step import compile_steps

    out = {}
    try:
        compile_steps(tiny_model(num_experts=6), tiny_train(), sh.make_mesh({"expert": 4,
                                                                            "data": 2}), 0)
    except ValueError as e:
        out["experts"] = str(e)
    try:
        compile_steps(tiny_model(), tiny_train(batch_size=12), sh.make_mesh({"data": 8}), 0)
    except ValueError as e:
        out["batch"] = str(e)
    return out


if __name__ == "__main__":
    out = {}
    for case in sys.argv[1:]:
        t0, c0 = time.perf_counter(), time.process_time()
        out[case] = globals()[f"case_{case}"]()
        print(f"{case}: {time.perf_counter() - t0:.1f} s ({time.process_time() - c0:.1f} s CPU)",
              file=sys.stderr)
    print(json.dumps(out))
