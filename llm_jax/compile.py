"""`python -m llm_jax.compile`: the train step (or generation, or an RL step) compiled ahead of
time for a TPU slice or a simulated CPU mesh, with its per-chip memory (the compiling is
llm_jax/training/aot.py).

    python -m llm_jax.compile --config configs/gpt_oss_20b.py --topology v5p-32 \\
        --mesh fsdp=4,expert=4 [--num_slices 2 --dcn data=2] [--batch 16] [--seq_len 4096] \\
        [--config.execution.moe_dispatch=expert_parallel ...] [--json] [--hlo_out FILE]
    python -m llm_jax.compile --config configs/tiny.py --cpu_devices 8 --mesh data=2,fsdp=4
    python -m llm_jax.compile --config configs/gpt_oss_20b.py --topology v5e-1 --program generate \\
        --config.model.expert_format=mxfp4 [--batch 1 --prompt_len 4096 --new_tokens 128]
    python -m llm_jax.compile --config configs/gpt_oss_20b.py --topology v6e-1 --program rl \\
        --config.lora.rank=16 --config.model.expert_format=mxfp4 --config.execution.remat=True \\
        --config.train.grad_accum_steps=8 [--batch 8 --seq_len 2048]

`--program rl` compiles the two programs of an RL step on one mesh: the policy update
(`rl_step.rl_objective`, routing replayed) over --batch completions of --seq_len positions, and
the engine's decode step that samples them (--batch slots); it reports what the two hold
together on one chip (one copy of the weights).
`--program generate` compiles `llm_jax.sample` (prefill + decode loop, weights sharded by the
rules); with `--config.lora.rank=R` the train and rl programs compile the LoRA step (QLoRA
over packed experts with `--config.model.expert_format=mxfp4`). Multi-slice (--num_slices,
--dcn) and --hlo_out are the train step's, --prompt_len and --new_tokens generation's: given to
another program, they are refused by name (`PROGRAM_FLAGS`).

With --topology the devices are libtpu's compile-only description of that TPU slice (pip install
"llm_jax[tpu]"; no TPU needed); with --cpu_devices N, N simulated CPU devices.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
from absl import app, flags
from ml_collections import config_flags

from llm_jax.parallel.sharding import parse_mesh
from llm_jax.runtime.cli import fail, parse_flags
from llm_jax.runtime.units import format_bytes
from llm_jax.training.aot import compile_inference, compile_rl, compile_train_step, tpu_devices

# Flags only some programs read: given with another program they are refused, not ignored.
PROGRAM_FLAGS = {"num_slices": ("train",), "dcn": ("train",), "hlo_out": ("train",),
                 "prompt_len": ("generate",), "new_tokens": ("generate",)}


def check_program_flags(program: str, given: list[str]) -> None:
    """Raises ValueError naming each flag in `given` that `program` does not read."""
    unread = [f"--{name} (read by --program {' / '.join(PROGRAM_FLAGS[name])})"
              for name in given if program not in PROGRAM_FLAGS.get(name, (program,))]
    if unread:
        raise ValueError(f"--program {program} does not read {', '.join(unread)}")


def _fits(r: dict[str, Any]) -> str:
    return ("no HBM size known for this device" if r["fits"] is None else
            f"{'fits' if r['fits'] else 'does NOT fit'} in {format_bytes(r['hbm_bytes'])} HBM")


def format_inference(r: dict[str, Any]) -> str:
    b, e = r["bytes"], r["estimate"]
    mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items())
    return "\n".join([
        f"# {r['name']} {r['program']} on {r['devices']} x {r['device_kind']}, mesh {mesh}, "
        f"batch {r['batch']}, prompt {r['prompt_len']} + {r['new_tokens']} new, experts "
        f"{r['expert_format']}, dispatch {r['moe_dispatch']}",
        f"compiled in {r['compile_seconds']:.1f} s; selected: {r['selected']}",
        "per chip, compiled (memory_analysis):",
        f"  arguments {format_bytes(b['arguments'])} (weights + prompts), outputs "
        f"{format_bytes(b['outputs'])}, temporaries {format_bytes(b['temp'])} (KV cache, "
        f"activations, unpacked experts), code {format_bytes(b['code'])}",
        f"  total {format_bytes(b['total'])}: {_fits(r)}",
        f"per chip, estimated (costs.inference_memory_per_device): weights "
        f"{format_bytes(e['weights'])}, KV cache {format_bytes(e['kv_cache'])}, unpacked experts "
        f"{format_bytes(e['unpacked_experts'])}, total {format_bytes(e['total'])}",
    ])


def format_rl(r: dict[str, Any]) -> str:
    """The RL update step and the engine's decode step, and the two on one chip."""
    s, d = r["step"], r["decode"]
    mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items())
    spare = r["fits_with_10_percent_spare"]
    return "\n".join([
        f"# {r['name']} RL step on {r['devices']} x {r['device_kind']}, mesh {mesh}, "
        f"{r['batch']} completions x {r['seq_len']} positions, LoRA rank {r['lora_rank']}, "
        f"experts {r['expert_format']}, dispatch {r['moe_dispatch']}, remat {r['remat']}",
        "per chip, compiled (memory_analysis):",
        f"  policy update: arguments {format_bytes(s['bytes']['arguments'])}, temporaries "
        f"{format_bytes(s['bytes']['temp'])}, total {format_bytes(s['bytes']['total'])} "
        f"(compiled in {s['compile_seconds']:.1f} s)",
        f"  engine decode step ({d['slots']} slots x {d['max_len']}): arguments "
        f"{format_bytes(d['bytes']['arguments'])} of which weights "
        f"{format_bytes(d['weights_bytes'])}, temporaries {format_bytes(d['bytes']['temp'])}, "
        f"total {format_bytes(d['bytes']['total'])} (compiled in {d['compile_seconds']:.1f} s)",
        f"  together, one copy of the weights: {format_bytes(r['together_bytes'])}: "
        f"{_fits(r)}" + ("" if spare is None else
                         f"; {'with' if spare else 'WITHOUT'} 10 % to spare"),
    ])


def _compile_rl(devices: list[Any], mesh: dict[str, int] | None) -> dict[str, Any]:
    """`--program rl`: the policy update and the rollouts' decode step (training/aot.py)."""
    FLAGS = flags.FLAGS
    return compile_rl(FLAGS.config, devices, mesh=mesh, batch=FLAGS.batch or 8,
                      seq_len=FLAGS.seq_len or 2048)


def format_result(r: dict[str, Any]) -> str:
    if r["program"] == "rl":
        return format_rl(r)
    if r["program"].startswith("generate"):
        return format_inference(r)
    b, e = r["bytes"], r["estimate"]
    mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items())
    fits = _fits(r)
    return "\n".join([
        f"# {r['name']} {r['program']} on {r['devices']} x {r['device_kind']}, mesh {mesh}, "
        f"batch {r['batch']} x seq {r['seq_len']}, experts {r['expert_format']}, dispatch "
        f"{r['moe_dispatch']}, remat {r['remat']}",
        f"lowered in {r['lower_seconds']:.1f} s, compiled in {r['compile_seconds']:.1f} s",
        "per chip, compiled (memory_analysis):",
        f"  arguments {format_bytes(b['arguments'])} (params + optimizer state + batch), outputs "
        f"{format_bytes(b['outputs'])} of which aliased (donated) {format_bytes(b['aliased'])}, temporaries "
        f"{format_bytes(b['temp'])}, code {format_bytes(b['code'])}",
        f"  total {format_bytes(b['total'])}: {fits}",
        f"per chip, estimated (costs.memory_per_device): params {format_bytes(e['params'])}, grads "
        f"{format_bytes(e['grads'])}, Adam m+v {format_bytes(e['adam_m_v'])}, activations "
        f"{format_bytes(e['activations'])}, total {format_bytes(e['total'])}",
        *_roofline_lines(r),
    ])


def _roofline_lines(r: dict[str, Any]) -> list[str]:
    """The kernels found in the compiled program, its cost and roofline (when known)."""
    if "cost" not in r:
        return []
    c, rf = r["cost"], r["roofline"]
    found = ", ".join(f"{n} x{k}" for n, k in sorted(r["kernels"].items())) or "none"
    lines = [f"selected: {r['selected']}; Pallas kernels in the compiled program: {found}",
             f"per chip, compiled (cost_analysis): {c['flops']:.4g} FLOPs, {c['bytes']:.4g} bytes "
             f"accessed; model FLOPs {r['model_flops_per_chip']:.4g}"]
    if rf is not None:
        lines.append(
            f"roofline on {rf['peak_flops'] / 1e12:.0f} TFLOP/s, {rf['hbm_bandwidth'] / 1e9:.0f} "
            f"GB/s: step >= {rf['step_seconds'] * 1e3:.1f} ms ({rf['bound']}-bound; FLOPs "
            f"{rf['flops_seconds'] * 1e3:.1f} ms, bytes {rf['bytes_seconds'] * 1e3:.1f} ms), "
            f"MFU <= {rf['mfu_bound']:.1%}")
    return lines


def main(argv: list[str]) -> None:
    del argv
    FLAGS = flags.FLAGS
    try:
        check_program_flags(FLAGS.program, [n for n in PROGRAM_FLAGS if FLAGS[n].present])
        if FLAGS.topology:
            devices = tpu_devices(FLAGS.topology, FLAGS.num_slices)
        else:
            devices = jax.devices()
        mesh = parse_mesh(FLAGS.mesh, allow_fill=True) if FLAGS.mesh else None
        dcn = parse_mesh(FLAGS.dcn) if FLAGS.dcn else None
        if FLAGS.program == "rl":
            result = _compile_rl(devices, mesh)
        elif FLAGS.program == "generate":
            result = compile_inference(FLAGS.config, devices, mesh=mesh, batch=FLAGS.batch or 1,
                                       prompt_len=FLAGS.prompt_len or FLAGS.seq_len or 4096,
                                       new_tokens=FLAGS.new_tokens)
        else:
            result = compile_train_step(FLAGS.config, devices, mesh=mesh, dcn=dcn,
                                        batch=FLAGS.batch, seq_len=FLAGS.seq_len,
                                        hlo_out=FLAGS.hlo_out or None)
    except (ValueError, RuntimeError) as e:
        fail("llm_jax.compile", e)
    print(json.dumps(result, indent=2) if FLAGS.json else format_result(result))


def _define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "configs/*.py file with get_config()",
                                    lock_config=True)
    flags.DEFINE_string("topology", "", "TPU slice, e.g. v5p-32, v5e-16, v6e-64 or v5p:2x2x4 "
                        "('' = this machine's devices)")
    flags.DEFINE_integer("num_slices", 1, "TPU slices joined by DCN (multi-slice)")
    flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (no --topology)")
    flags.DEFINE_string("mesh", "", "mesh axis sizes within a slice, one may be -1, e.g. "
                        "fsdp=-1,expert=4 ('' = the config's mesh section)")
    flags.DEFINE_string("dcn", "", "mesh axis sizes across slices, e.g. data=2")
    flags.DEFINE_integer("batch", None, "global batch in sequences (default: train.batch_size; "
                         "--program generate 1, rl 8)")
    flags.DEFINE_integer("seq_len", None, "sequence length (default: data.seq_len; --program rl "
                         "2048)")
    flags.DEFINE_enum("program", "train", ["train", "generate", "rl"], "the train step, "
                      "generation (prefill + decode loop), or an RL step's policy update and "
                      "the engine's decode step (--batch completions, default 8; --seq_len "
                      "positions each, default 2048)")
    flags.DEFINE_integer("prompt_len", None, "generate: prompt length (default --seq_len, "
                         "else 4096)")
    flags.DEFINE_integer("new_tokens", 128, "generate: tokens decoded after the prompt")
    flags.DEFINE_bool("json", False, "print the result as JSON")
    flags.DEFINE_string("hlo_out", "", "also write the compiled program's HLO text to this file")
    flags.mark_flag_as_required("config")


def _cpu_devices_from_argv(argv: list[str]) -> None:
    """--cpu_devices must take effect before JAX creates its CPU backend."""
    for i, a in enumerate(argv):
        value = a.partition("=")[2] if a.startswith("--cpu_devices=") else (
            argv[i + 1] if a == "--cpu_devices" and i + 1 < len(argv) else None)
        if value and int(value) > 0:
            jax.config.update("jax_num_cpu_devices", int(value))


def cli() -> None:
    """`python -m llm_jax.compile`."""
    _define_flags()
    _cpu_devices_from_argv(sys.argv)
    app.run(main, flags_parser=parse_flags("llm_jax.compile"))


if __name__ == "__main__":
    cli()
