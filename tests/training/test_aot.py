"""Ahead-of-time compilation: the real train step compiles for a TPU topology from this CPU
machine (libtpu's compile-only devices) and for 8 simulated CPU devices, and reports per-chip
memory next to the arithmetic estimate; so do the RL step's programs, generation and the fused
loss.

The programs compile in this process: libtpu's compile-only devices need no fresh interpreter,
and a process launch with libtpu costs about as much as one of these compiles. The command line
(`python -m llm_jax.compile`) runs in a subprocess where its own flags are the subject:
--cpu_devices (which must take effect before JAX starts), --hlo_out, --topology, --program."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import HAVE_LIBTPU, NEEDS_LIBTPU
from jax.sharding import NamedSharding, PartitionSpec

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model import init_model
from llm_jax.model.unembed_loss import cross_entropy_sum
from llm_jax.parallel.sharding import make_mesh
from llm_jax.training import aot

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = {"num_hidden_layers": 2, "num_experts": 8, "hidden_size": 64, "intermediate_size": 64,
        "head_dim": 16, "vocab_size": 256}
# test_describe's small model of the compiled-memory cases (its SMALL), layers scanned: the
# TPU cases, at --batch 16 x --seq_len 128
DESCRIBE_SMALL = {"num_hidden_layers": 2, "num_experts": 8, "vocab_size": 512,
                  "hidden_size": 128, "intermediate_size": 128, "head_dim": 32}


def cli(*args):
    """`python -m llm_jax.compile` on CPU, under the suite's cheap XLA:CPU code generation
    (conftest's XLA_FLAGS, inherited)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    model = [f"--config.model.{k}={v}" for k, v in TINY.items()]
    return subprocess.run([sys.executable, "-m", "llm_jax.compile", "--config",
                           str(ROOT / "configs/tiny.py"), *model, "--seq_len=32", "--batch=8",
                           *args, "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def run_config(model: dict, lora_rank: int = 0, **execution):
    """configs/tiny.py with `model`'s fields, `execution`'s and LoRA of `lora_rank` (0: none)."""
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.get_config()
    for k, v in model.items():
        rc.model[k] = v
    for k, v in execution.items():
        rc.execution[k] = v
    rc.lora.rank = lora_rank
    return rc


def test_topology_names_follow_cloud_tpu_accelerator_types():
    assert aot.topology_name("v5p-32") == "v5p:2x2x4"  # 32 TensorCores = 16 chips
    assert aot.topology_name("v5e-16") == "v5e:4x4"
    assert aot.topology_name("v6e-64") == "v6e:8x8"
    assert aot.topology_name("tpu7x-16") == "tpu7x:2x2x2"  # 16 TensorCores = 8 chips
    assert aot.topology_name("v4:2x2x1") == "v4:2x2x1"
    from llm_jax.parallel.roofline import CHIP_PEAKS
    assert set(CHIP_PEAKS) == set(aot.HBM_BYTES)  # every chip with a roofline has its HBM size
    with pytest.raises(ValueError, match="v5p-24.*24 is not a v5p slice size"):
        aot.topology_name("v5p-24")
    with pytest.raises(ValueError, match="expected GEN-N"):
        aot.topology_name("h100-8")


@pytest.mark.slow
def test_train_step_compiles_for_eight_cpu_devices(tmp_path):
    hlo = tmp_path / "step.hlo.txt"
    out = cli("--cpu_devices", "8", "--mesh", "data=2,tensor=2,expert=-1",
              "--config.execution.moe_dispatch=expert_parallel", f"--hlo_out={hlo}")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout[out.stdout.index("{"):])
    assert r["devices"] == 8 and r["mesh"]["expert"] == 2 and r["fits"] is None
    assert r["bytes"]["arguments"] > 0 and r["compile_seconds"] > 0
    assert hlo.read_text().startswith("HloModule")  # --hlo_out: the compiled program's text


def test_rl_program_compiles_the_update_and_the_engine_decode_step_around_one_weight_copy():
    rc = run_config({**TINY, "sliding_window": 0}, 4)
    r = aot.compile_rl(rc, jax.devices()[:1], batch=4, seq_len=32)
    step, decode = r["step"], r["decode"]
    assert (r["program"], r["batch"], r["seq_len"], r["lora_rank"]) == ("rl", 4, 32, 4)
    # The decode step reads the weights (base + adapters), the cache of 4 slots x 32 positions
    # and five int32 / float32 vectors a slot (tokens, positions, seeds, steps, temperatures;
    # sampling without top-k / top-p filtering does not read those two, and jit drops them).
    from llm_jax.model.costs import kv_cache_bytes
    from llm_jax.model.lora import add_lora

    cfg = ModelConfig.from_dict(r["config"])
    model = add_lora(init_model(cfg), rank=4, alpha=16.0, targets=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"), seed=0)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert decode["weights_bytes"] == weights
    assert decode["bytes"]["arguments"] == weights + kv_cache_bytes(cfg, 32, batch=4) + 5 * 4 * 4
    # The update's arguments: the same weights, Adam's moments of the adapters and the batch.
    assert step["bytes"]["arguments"] > weights
    assert r["together_bytes"] == step["bytes"]["total"] + decode["bytes"]["total"] - weights


def test_bad_mesh_for_the_topology_names_both_numbers():
    # The command line's RL program (the compiles themselves run in this process) for the
    # devices of --topology where libtpu is installed (the command line's path to a TPU
    # compile), else of 8 simulated CPU devices.
    devices, n = (["--topology", "v5e-4"], 4) if HAVE_LIBTPU else (["--cpu_devices", "8"], 8)
    out = cli(*devices, "--program", "rl", "--mesh", "data=3")
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"multiply to 3, but there are {n} devices" in out.stderr


def test_a_flag_the_program_does_not_read_is_refused_by_name():
    from llm_jax.compile import check_program_flags

    check_program_flags("train", ["num_slices", "dcn", "hlo_out"])
    check_program_flags("generate", ["prompt_len", "new_tokens"])
    with pytest.raises(ValueError) as e:
        check_program_flags("rl", ["dcn", "hlo_out", "new_tokens"])
    assert str(e.value) == ("--program rl does not read --dcn (read by --program train), "
                            "--hlo_out (read by --program train), --new_tokens (read by "
                            "--program generate)")
    with pytest.raises(ValueError, match="--program generate does not read --num_slices"):
        check_program_flags("generate", ["num_slices"])


# ------------------------------------------------------------------ TPU topologies (libtpu)


@pytest.fixture(scope="module")
def v5e_4():
    return aot.tpu_devices("v5e-4")


@NEEDS_LIBTPU
def test_train_step_compiles_for_a_tpu_topology_and_reports_memory_near_the_estimate(v5e_4):
    r = aot.compile_train_step(run_config(DESCRIBE_SMALL, scan_layers=True, moe_dispatch="expert_parallel"), v5e_4,
                               mesh={"fsdp": 2, "expert": 2}, batch=16, seq_len=128)
    json.dumps(r)  # what `python -m llm_jax.compile --json` prints
    assert r["device_kind"] == "TPU v5 lite" and r["devices"] == 4
    assert r["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}
    assert r["fits"] is True and r["hbm_bytes"] == 16 * 2**30
    b, e = r["bytes"], r["estimate"]
    # Arguments are the sharded params + optimizer state (+ a small batch): the estimate's
    # params + Adam m, v within 10% (the estimate treats embed-less vectors as fsdp-sharded).
    state = e["params"] + e["adam_m_v"]
    assert 0.9 * state < b["arguments"] < 1.1 * state + 2**20
    assert b["aliased"] > 0.9 * state  # the state is donated: outputs reuse its buffers
    # describe's per-chip total (costs.memory_per_device, the same function, with its TPU
    # terms) against the compiled bytes less its code, which the estimate does not price.
    compiled = b["total"] - b["code"]
    assert abs(e["total"] / compiled - 1) < 0.15, (compiled, e["total"])
    # The roofline report of the compiled step: v5e's peaks, XLA's cost of the program.
    assert r["roofline"] is not None and r["roofline"]["step_seconds"] > 0, r["roofline"]
    assert r["cost"]["flops"] > 0 and r["model_flops_per_chip"] > 0


@NEEDS_LIBTPU
def test_rl_program_compiles_for_a_tpu_topology_with_the_weights_sharded(v5e_4):
    rc = run_config(DESCRIBE_SMALL, 4, scan_layers=True, moe_dispatch="auto")
    r = aot.compile_rl(rc, v5e_4, mesh={"fsdp": 2, "expert": 2}, batch=8, seq_len=128)
    assert r["device_kind"] == "TPU v5 lite" and r["devices"] == 4
    assert r["fits"] is True and r["fits_with_10_percent_spare"] is True
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(init_model(
        ModelConfig.from_dict(r["config"])))))
    # Both programs read the weights split over the four chips (experts over `expert`, the
    # rest over `fsdp`), not a replica each: a chip's share is between a quarter and a half
    # (the replicated norms, biases and adapters are a few percent).
    assert weights / 4 < r["decode"]["weights_bytes"] < 0.6 * weights, (r["decode"], weights)
    assert r["step"]["bytes"]["arguments"] > r["decode"]["weights_bytes"]


@NEEDS_LIBTPU
def test_sharded_generation_compiles_its_pallas_kernels_under_the_mesh(v5e_4):
    # Prefill runs splash attention and the grouped-matmul MoE (Pallas): on a mesh of several
    # chips they must be traced under it (shard_map) or the program does not compile. Here the
    # prompts split over both batch axes (splash's batch spec is data x fsdp x expert, fsdp the
    # same as data) and the experts over `expert`; the decode loop below splits heads over
    # `tensor`.
    cfg = ModelConfig(num_hidden_layers=2, num_experts=8, hidden_size=64, intermediate_size=64,
                      head_dim=16, vocab_size=256)
    compiled = aot.compile_generate(cfg, make_mesh({"data": 2, "expert": 2}, v5e_4), batch=4,
                                    prompt_len=300, new_tokens=20)
    assert compiled.as_text().count("tpu_custom_call") > 0


# The decode loop's model: 3 layers of 2048-wide packed experts, so that the weights dominate
# the temporaries (with 2 layers, a prompt of 128 and 4 new tokens the hoisting did not happen
# without the fix either: 0.24 of the arguments).
LAYERS, PROMPT, NEW = 3, 256, 16


@NEEDS_LIBTPU
def test_sharded_decode_loop_keeps_no_copy_of_the_layer_weights(v5e_4):
    # A decode step slices each layer's weights out of the stack with a constant index. In a
    # sharded program libtpu dropped the optimization barrier that ties the index to the layer's
    # input, and while-loop invariant code motion hoisted the slices out of the decode loop as
    # copies (gpt-oss-120b on v5e-8: 16.60 GB of 15.75; here the temporaries were 1.01 of the
    # arguments with the pass, 0.20 without). The inference programs compile without that pass
    # on TPU (runtime.backend.PLANS). At hidden 1024 the other temporaries alone are 0.7 of the
    # arguments: the weights must dominate for the ratio to tell.
    cfg = ModelConfig(num_hidden_layers=LAYERS, num_experts=8, experts_per_token=2,
                      hidden_size=2048, intermediate_size=2048, head_dim=32,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      dtype="bfloat16", param_dtype="bfloat16", expert_format="mxfp4")
    mesh = make_mesh({"expert": 2, "tensor": 2}, v5e_4)
    compiled = aot.compile_generate(cfg, mesh, batch=1, prompt_len=PROMPT, new_tokens=NEW,
                                    shard_weights=True,
                                    execution=ExecutionConfig(moe_dispatch="expert_parallel_gmm"))
    # Under a mesh of heads over `tensor` and experts over `expert`, the prefill's Pallas kernels
    # (splash attention, the grouped matmul) compile too.
    assert compiled.as_text().count("tpu_custom_call") > 0
    m = compiled.memory_analysis()
    args, temp = m.argument_size_in_bytes, m.temp_size_in_bytes
    # Per chip the arguments are almost all packed experts: a quarter of the layers' 8 experts
    # of 3 x 2048 x 2048 values, 4.25 bits each (E2M1 + one 8-bit scale per 32).
    experts = LAYERS * 8 * 3 * 2048 * 2048 * 4.25 / 8 / 4
    assert 0.9 * experts < args < 1.3 * experts, (args, temp)
    assert temp < 0.5 * args, (args, temp)


# batch, tokens, width, vocabulary, tokens a chunk: 4 chunks whose float32 logits dominate the
# temporaries (at 2048 tokens of a vocabulary of 8192 XLA:TPU fuses them away and the ratio
# reads 0 either way)
FUSED = (1, 4096, 256, 32768, 1024)


@NEEDS_LIBTPU
def test_fused_loss_holds_one_chunk_of_logits_at_a_time_on_tpu():
    # The unrolled chunks of the fused loss are independent but for their carry; XLA:TPU ran
    # them side by side (3.0 chunks of float32 logits live at once in 4) until each chunk was
    # tied to the previous one's carry (model.unembed_loss._after).
    rep = NamedSharding(make_mesh({"data": 1}, aot.tpu_devices("v5e-1")), PartitionSpec())
    b, t, d, v, chunk = FUSED
    f = lambda h, w, y: cross_entropy_sum(h, w, y, dtype=jnp.bfloat16, chunk_tokens=chunk)  # noqa: E731
    spec = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=rep)  # noqa: E731
    c = jax.jit(jax.grad(f, argnums=(0, 1))).lower(
        spec((b, t, d), jnp.bfloat16), spec((v, d), jnp.bfloat16),
        spec((b, t), jnp.int32)).compile()
    chunks = c.memory_analysis().temp_size_in_bytes / (chunk * v * 4)
    assert chunks < 1.5, f"{chunks:.2f} chunks of float32 logits live at once"
