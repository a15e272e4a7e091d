"""Compile the real train step ahead of time for hardware that is not here, and price its memory
(the command line is `python -m llm_jax.compile`, llm_jax/compile.py).

`tpu_devices` are libtpu's compile-only description of a TPU slice (pip install
"llm_jax[tpu]"; no TPU needed); or any devices, such as N simulated CPU devices. The step is
lowered with abstract inputs (ShapeDtypeStructs carrying the shardings of `compile_steps`), so
nothing is allocated, and `compiled.memory_analysis()` gives per-chip bytes: arguments (params,
optimizer state, batch), outputs, temporaries; the state is donated, so outputs alias it. Next
to it, the arithmetic estimate of `costs.memory_per_device`.

`compile_generate` does the same for the generation program (`llm_jax.sample` with a mesh), and
`compile_inference` reports its per-chip memory as `compile_train_step` does (`python -m
llm_jax.compile --program generate`). A run config with `lora.rank > 0` compiles the LoRA
train step (QLoRA with `model.expert_format=mxfp4`: the packed base frozen). `compile_rl` compiles
an RL step's policy update and the engine's decode step that samples its rollouts on one mesh
(`--program rl`).

Topology names: `v5p-N`, `v4-N`, `tpu7x-N` count TensorCores (2 per chip), `v5e-N`, `v6e-N`
count chips (Cloud TPU accelerator types); or libtpu's own `v5p:2x2x4`. A v4 or v5p chip is one
jax device (its two TensorCores work as one); a TPU7x chip is two, one per TensorCore, each with
half the chip's HBM.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from llm_jax.execution import ExecutionConfig
from llm_jax.inference.engine import decode_jit
from llm_jax.inference.loop import generate_jit, slice_layers_once
from llm_jax.inference.sampler import program_inputs
from llm_jax.model import abstract_model, costs
from llm_jax.model.kv_cache import cache_shardings, init_cache
from llm_jax.model.select import kernels_line
from llm_jax.parallel import roofline
from llm_jax.parallel.sharding import MESH_AXES, make_mesh, state_shardings
from llm_jax.runtime.backend import compiling_for
from llm_jax.training import finetune
from llm_jax.training.policy_loss import PolicyLossConfig
from llm_jax.training.rl_step import rl_batch_shapes, rl_objective
from llm_jax.training.run_config import execution_config, model_config
from llm_jax.training.step import compile_steps

# HBM (bytes) per jax device, by device_kind. Cloud TPU specs: v4 32 GiB, v5e 16 GiB, v5p 95 GiB,
# v6e 32 GiB a chip; TPU7x 192 GiB a chip, two devices.
HBM_BYTES = {"TPU v4": 32 * 2**30, "TPU v5 lite": 16 * 2**30, "TPU v5": 95 * 2**30,
             "TPU v6 lite": 32 * 2**30, "TPU7x": 96 * 2**30}

_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_GENERATIONS = {"v4": (2, _SHAPES_3D), "v5p": (2, _SHAPES_3D), "v5e": (1, _SHAPES_2D),
                "v6e": (1, _SHAPES_2D), "tpu7x": (2, _SHAPES_3D)}


def topology_name(name: str) -> str:
    """'v5p-32' -> 'v5p:2x2x4' (libtpu's name); names with ':' pass through."""
    if ":" in name:
        return name
    gen, _, count = name.partition("-")
    if gen not in _GENERATIONS or not count.isdigit():
        raise ValueError(f"--topology={name!r} is invalid: expected GEN-N with GEN in "
                         f"{sorted(_GENERATIONS)} (e.g. v5p-32, v6e-16) or a libtpu name like "
                         f"v5p:2x2x4")
    per_chip, shapes = _GENERATIONS[gen]
    chips = int(count) // per_chip
    if int(count) % per_chip or chips not in shapes:
        raise ValueError(f"--topology={name!r}: {count} is not a {gen} slice size; known sizes "
                         f"are {[c * per_chip for c in shapes]}")
    return f"{gen}:{shapes[chips]}"


def tpu_devices(name: str, num_slices: int = 1) -> list[Any]:
    """Compile-only devices of a TPU topology (needs libtpu, not a TPU)."""
    # Compile-only use: let several processes (parallel tests, two compiles) load libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    libtpu_name = topology_name(name)
    if libtpu_name.endswith(":1x1"):  # one chip: libtpu's default host is 2x2 chips
        kwargs["chips_per_host_bounds"] = (1, 1, 1)
    try:
        return list(topologies.get_topology_desc(topology_name=libtpu_name,
                                                 platform="tpu", **kwargs).devices)
    except (RuntimeError, ImportError) as e:  # no libtpu
        raise RuntimeError(f"cannot describe TPU topology {name!r}: {e}; install libtpu with "
                           f"pip install 'llm_jax[tpu]'") from e


def compile_train_step(run_cfg: ml_collections.ConfigDict, devices: list[Any], *,
                       mesh: dict[str, int] | None = None, dcn: dict[str, int] | None = None,
                       batch: int | None = None, seq_len: int | None = None,
                       hlo_out: str | None = None) -> dict[str, Any]:
    """Lowers and compiles the train step for `devices`; returns memory and timing facts (and
    writes the compiled HLO text to `hlo_out` when given)."""
    cfg, execution = model_config(run_cfg), execution_config(run_cfg)
    tc = ml_collections.ConfigDict(run_cfg.train.to_dict())
    if batch is not None:
        tc.batch_size = batch
    seq_len = run_cfg.data.seq_len if seq_len is None else seq_len
    if mesh is None:  # the config's mesh section
        mesh = {a: run_cfg.mesh[a] for a in MESH_AXES}
        dcn = dcn or {a: run_cfg.mesh[f"dcn_{a}"] for a in MESH_AXES}
    m = make_mesh(mesh, devices, dcn_sizes=dcn if dcn and any(v > 1 for v in dcn.values())
                  else None)
    t0 = time.perf_counter()
    lora = run_cfg.get("lora")
    rank = lora.rank if lora is not None else 0
    steps = compile_steps(cfg, tc, m, run_cfg.seed, execution=execution,
                          **_lora_kwargs(run_cfg, cfg, execution))
    tokens = jax.ShapeDtypeStruct((tc.batch_size, seq_len), jnp.int32,
                                  sharding=steps.batch_sharding)
    platform = getattr(devices[0], "platform", "tpu")
    with compiling_for(platform):  # `auto` picks the target's kernels, not the host's
        lowered = steps.train.lower(steps.abstract_state, {"inputs": tokens, "targets": tokens})
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    kind = devices[0].device_kind
    memory = _memory(compiled, kind)
    sizes = dict(m.shape)
    adapters = (costs.Adapters(rank, lora.alpha, finetune.lora_targets(lora)) if rank
                else None)  # LoRA (QLoRA over packed experts): adapters trained, the base frozen
    estimate = costs.memory_per_device(cfg, batch=tc.batch_size, seq_len=seq_len, mesh=sizes,
                                       execution=execution, adapters=adapters, platform=platform)
    hlo = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(hlo)
    kernels = roofline.kernels_in(hlo)
    step_cost = roofline.cost(compiled)
    model_flops = costs.flops_per_token(cfg, seq_len, training=True) * tc.batch_size * seq_len
    bound = roofline.roofline(kind, step_cost["flops"], step_cost["bytes"],
                              model_flops / len(devices))
    return {
        "name": run_cfg.get("name", ""), "device_kind": kind, "devices": len(devices),
        "program": f"train step, LoRA rank {rank}" if rank else "train step",
        "expert_format": cfg.expert_format,
        "mesh": sizes, "batch": tc.batch_size, "seq_len": seq_len,
        "moe_dispatch": execution.moe_dispatch, "remat": execution.remat,
        "selected": kernels_line(cfg, execution, tc.batch_size, seq_len, platform),
        "kernels": kernels, "kernel_families": roofline.kernel_families(kernels),
        "cost": step_cost, "model_flops_per_chip": model_flops / len(devices),
        "roofline": bound,
        "lower_seconds": t1 - t0, "compile_seconds": t2 - t1, **memory,
        "estimate": {k: estimate[k] for k in ("params", "grads", "adam_m_v", "activations",
                                              "working", "total")},
    }


def _lora_kwargs(run_cfg: ml_collections.ConfigDict, cfg: Any,
                 execution: ExecutionConfig) -> dict[str, Any]:
    """`compile_steps`' model_fn and trainable for a run config with `lora.rank > 0` (adapters
    trained, the base frozen); none for full training."""
    lora = run_cfg.get("lora")
    if lora is None or not lora.rank:
        return {}
    return {"model_fn": finetune.model_fn(cfg, lora, run_cfg.seed, execution),
            "trainable": finetune.trainable(lora)}


def _memory(compiled: Any, kind: str) -> dict[str, Any]:
    """Per-chip bytes of a compiled program (memory_analysis) and whether they fit the HBM."""
    ma = compiled.memory_analysis()
    args, out, alias = ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes
    temp, code = ma.temp_size_in_bytes, ma.generated_code_size_in_bytes
    total = args + out - alias + temp + code
    hbm = HBM_BYTES.get(kind)
    return {"bytes": {"arguments": args, "outputs": out, "aliased": alias, "temp": temp,
                      "code": code, "total": total,
                      "peak": getattr(ma, "peak_memory_in_bytes", 0)},
            "hbm_bytes": hbm, "fits": None if hbm is None else total <= hbm}


def compile_inference(run_cfg: ml_collections.ConfigDict, devices: list[Any], *,
                      mesh: dict[str, int] | None = None, batch: int = 1,
                      prompt_len: int = 4096, new_tokens: int = 128) -> dict[str, Any]:
    """Lowers and compiles generation (`llm_jax.sample`: the prefill of `batch` prompts of
    `prompt_len` and the decode loop of `new_tokens`, greedy) for `devices`, the weights
    sharded by the logical-axis rules; per-chip memory next to costs.inference_memory_per_device."""
    cfg, execution = model_config(run_cfg), execution_config(run_cfg)
    if mesh is None:
        mesh = {a: run_cfg.mesh[a] for a in MESH_AXES}
    m = make_mesh(mesh, devices)
    t0 = time.perf_counter()
    compiled = compile_generate(cfg, m, batch=batch, prompt_len=prompt_len,
                                new_tokens=new_tokens, shard_weights=True, execution=execution)
    seconds = time.perf_counter() - t0
    kind = devices[0].device_kind
    sizes = dict(m.shape)
    estimate = costs.inference_memory_per_device(cfg, batch=batch,
                                                 context=prompt_len + new_tokens, mesh=sizes)
    return {"name": run_cfg.get("name", ""), "device_kind": kind, "devices": len(devices),
            "program": "generate (prefill + decode loop)", "expert_format": cfg.expert_format,
            "mesh": sizes, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "moe_dispatch": execution.moe_dispatch,
            "selected": kernels_line(cfg, execution, batch, prompt_len,
                                     getattr(devices[0], "platform", "tpu")),
            "kernels": roofline.kernels_in(compiled.as_text()),
            "compile_seconds": seconds, **_memory(compiled, kind),
            "estimate": {k: estimate[k] for k in ("weights", "kv_cache", "unpacked_experts",
                                                  "logits", "total")}}


def compile_generate(cfg, mesh, *, batch: int, prompt_len: int, new_tokens: int,
                     shard_weights: bool = False,
                     execution: ExecutionConfig = ExecutionConfig()) -> Any:
    """The compiled program of `llm_jax.sample(model, prompts, mesh=mesh)` for `cfg` (greedy,
    `batch` prompts of `prompt_len`, `new_tokens` new), lowered with abstract weights on
    `mesh`'s devices, for their platform: replicated, or `shard_weights` by the logical-axis
    rules (a model larger than one chip)."""
    plan, args = program_inputs(cfg, [[0] * prompt_len] * batch, new_tokens, 0.0, 0, 1.0, 0,
                                None, False, max_len=None, cache_dtype=None, mesh=mesh)
    graphdef, state = nnx.split(abstract_model(cfg, execution=execution))
    rep = NamedSharding(mesh, PartitionSpec())
    shardings = (state_shardings(state, mesh) if shard_weights
                 else jax.tree.map(lambda _: rep, state))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         state, shardings)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
    with compiling_for(mesh.devices.flat[0].platform):
        lowered = generate_jit.lower(graphdef, state, *args, plan=plan)
    return lowered.compile()


def compile_rl(run_cfg: ml_collections.ConfigDict, devices: list[Any], *,
               mesh: dict[str, int] | None = None, batch: int = 8,
               seq_len: int = 2048) -> dict[str, Any]:
    """The two programs of an RL step, compiled for `devices` on one mesh: the policy update
    (`rl_step.rl_objective` in the train step, over `batch` completions of `seq_len` positions
    with the rollout's routing replayed; LoRA over the frozen base when `lora.rank > 0`) and the
    engine's sampling decode step that makes the rollouts (`batch` slots of `seq_len`
    positions, recording log-probs and routing). Both read one copy of the weights, so the
    chip holds their sum less the weights counted twice (`together_bytes`)."""
    cfg, execution = model_config(run_cfg), execution_config(run_cfg)
    if mesh is None:
        mesh = {a: run_cfg.mesh[a] for a in MESH_AXES}
    m = make_mesh(mesh, devices)
    kind = devices[0].device_kind
    step = _compile_rl_step(run_cfg, cfg, execution, m, batch, seq_len)
    decode = _compile_engine_decode(run_cfg, cfg, execution, m, batch, seq_len)
    together = step["bytes"]["total"] + decode["bytes"]["total"] - decode["weights_bytes"]
    hbm = HBM_BYTES.get(kind)
    lora = run_cfg.get("lora")
    return {"name": run_cfg.get("name", ""), "device_kind": kind, "devices": len(devices),
            "program": "rl", "config": cfg.to_dict(), "mesh": dict(m.shape), "batch": batch,
            "seq_len": seq_len,
            "lora_rank": lora.rank if lora is not None else 0,
            "expert_format": cfg.expert_format, "moe_dispatch": execution.moe_dispatch,
            "remat": execution.remat, "step": step, "decode": decode,
            "together_bytes": together, "hbm_bytes": hbm,
            "fits": None if hbm is None else together <= hbm,
            "fits_with_10_percent_spare": None if hbm is None else together <= 0.9 * hbm}


def _compile_rl_step(run_cfg: ml_collections.ConfigDict, cfg: Any, execution: ExecutionConfig,
                     mesh: Any, batch: int, seq_len: int) -> dict[str, Any]:
    """The RL update (DAPO defaults, sampler log-probs and replay in the batch), compiled."""
    tc = ml_collections.ConfigDict(run_cfg.train.to_dict())
    tc.batch_size = batch
    t0 = time.perf_counter()
    steps = compile_steps(cfg, tc, mesh, run_cfg.seed, execution=execution,
                          objective=rl_objective(PolicyLossConfig()),
                          **_lora_kwargs(run_cfg, cfg, execution))
    shapes = rl_batch_shapes(batch, seq_len, cfg.num_hidden_layers, cfg.experts_per_token)
    abstract_batch = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=steps.batch_sharding)
                      for k, s in shapes.items()}
    platform = getattr(mesh.devices.flat[0], "platform", "tpu")
    with compiling_for(platform):
        lowered = steps.train.lower(steps.abstract_state, abstract_batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"lower_seconds": t1 - t0, "compile_seconds": t2 - t1,
            **_memory(compiled, mesh.devices.flat[0].device_kind)}


def _compile_engine_decode(run_cfg: ml_collections.ConfigDict, cfg: Any,
                           execution: ExecutionConfig, mesh: Any, slots: int,
                           max_len: int) -> dict[str, Any]:
    """`Engine`'s decode step (inference/engine.py `decode_jit`, sampled, recording) over
    `slots` rows of a `max_len` cache, the weights sharded by the rules, compiled."""
    lora = run_cfg.get("lora")
    model = (nnx.eval_shape(lambda: finetune.model_fn(cfg, lora, run_cfg.seed, execution)(
        rngs=nnx.Rngs(params=0))) if lora is not None else abstract_model(cfg, execution=execution))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         state, state_shardings(state, mesh))
    platform = getattr(mesh.devices.flat[0], "platform", "tpu")
    rep = NamedSharding(mesh, PartitionSpec())
    t0 = time.perf_counter()
    with compiling_for(platform):
        layers = None
        if slice_layers_once(model):  # what the Engine does on this platform
            layers = jax.eval_shape(lambda s: nnx.merge(graphdef, s).layer_states(), state)
            layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=rep), layers)
        weights, treedef = jax.tree.flatten((state, layers))
        cache = jax.eval_shape(lambda: init_cache(cfg, slots, max_len))
        cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             cache, cache_shardings(cache, mesh))
        i32, f32 = (jax.ShapeDtypeStruct((slots,), t, sharding=rep)
                    for t in (jnp.int32, jnp.float32))
        # Traced under the mesh, as the Engine's steps are: the MoE's and attention's Pallas
        # kernels run in a shard_map over it (without one a sharded program does not compile).
        lowered = decode_jit.lower(graphdef, treedef, weights, cache, i32, i32, i32, i32, f32,
                                   i32, f32, mode=1, record=True, mesh=mesh)
        compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    weights_bytes = sum(math.prod(w.sharding.shard_shape(w.shape)) * w.dtype.itemsize
                        for w in jax.tree.leaves(state))
    return {"compile_seconds": seconds, "slots": slots, "max_len": max_len,
            "weights_bytes": weights_bytes,
            **_memory(compiled, mesh.devices.flat[0].device_kind)}
