"""llm_jax's and MaxText's train steps compiled for the same TPU slice, model and shape, side by
side: memory_analysis, cost_analysis, the same roofline arithmetic (llm_jax.parallel.roofline),
libtpu version, compile time and the host's peak RSS per side (docs/scaling.md).

MaxText is not an llm_jax dependency: it runs from its own venv (Python >= 3.12), made once:

    python3.12 -m venv /tmp/vmaxtext && /tmp/vmaxtext/bin/pip install --no-deps maxtext==0.2.5
    /tmp/vmaxtext/bin/pip install -r /tmp/vmaxtext/lib/python3.12/site-packages/dependencies/\\
requirements/generated_requirements/decoupled-requirements.txt "jax[tpu]==0.12.*"

and llm_jax from a venv with the same jax / libtpu (pip install -e ".[tpu]" under Python 3.12).
Then, one side after the other (the host's RAM is the limit, not the chips):

    python launch/compare_maxtext.py --model 20b --topology v5p-32 --mesh fsdp=4,expert=4 \\
        --per_chip_batch 1 --seq_len 8192 --layers 2 \\
        --llm_jax_python /tmp/vjax12/bin/python --maxtext_python /tmp/vmaxtext/bin/python

writes runs/compare/<name>.json (both sides' raw results and roofline), the compiled HLO text of
each side next to it, and prints one markdown row per side. `--side llm_jax|maxtext` compiles
one; `--llm_jax_flag` / `--maxtext_flag` pass extra overrides (repeatable). Two layers (one
sliding, one full: gpt-oss's repeating unit) unrolled, so that cost_analysis counts each once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llm_jax.parallel import roofline  # noqa: E402
from llm_jax.training.aot import topology_name  # noqa: E402

GiB = 2**30
MAXTEXT_MESH = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism",
                "tensor": "ici_tensor_parallelism", "expert": "ici_expert_parallelism"}


def chips(topology: str) -> int:
    """Chips in a slice: 'v5p-32' -> 16 (libtpu's v5p:2x2x4)."""
    return math.prod(int(n) for n in topology_name(topology).partition(":")[2].split("x"))


def run(cmd: list[str], env: dict[str, str], log: pathlib.Path) -> tuple[int, str, float, float]:
    """(return code, stdout, wall seconds, peak RSS in GiB of the child) of `cmd`."""
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, time.perf_counter() - t0, usage.ru_maxrss * 1024 / GiB


def llm_jax_side(a: argparse.Namespace, out_dir: pathlib.Path, name: str) -> dict:
    mesh = a.mesh
    dispatch = "expert_parallel_gmm" if "expert=" in mesh else "gmm"
    hlo = out_dir / f"{name}.llm_jax.hlo.txt"
    cmd = [a.llm_jax_python, "-m", "llm_jax.compile", "--config",
           f"configs/gpt_oss_{a.model}.py", "--topology", a.topology, "--mesh", mesh,
           "--batch", str(a.per_chip_batch * chips(a.topology)), "--seq_len", str(a.seq_len),
           f"--config.model.num_hidden_layers={a.layers}", "--config.execution.scan_layers=False",
           "--config.execution.remat=True", "--config.execution.attention_impl=auto",
           f"--config.execution.moe_dispatch={dispatch}", *a.llm_jax_flag, "--json",
           f"--hlo_out={hlo}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rc, out, wall, rss = run(cmd, env, out_dir / f"{name}.llm_jax.log")
    if rc != 0:
        raise RuntimeError(f"llm_jax compile failed (rc {rc}); see {out_dir / name}.llm_jax.log")
    r = json.loads(out[out.index("{"):])
    versions = subprocess.run([a.llm_jax_python, "-c", "import jax, importlib.metadata as m; "
                               "print(jax.__version__, m.version('libtpu'))"],
                              capture_output=True, text=True).stdout.split()
    return {"side": "llm_jax", "command": cmd, "jax": versions[0], "libtpu": versions[1],
            "device_kind": r["device_kind"], "devices": r["devices"], "bytes": r["bytes"],
            "cost": r["cost"], "compile_seconds": r["compile_seconds"],
            "lower_seconds": r["lower_seconds"], "kernels": r["kernels"], "wall_seconds": wall,
            "peak_rss_gib": rss, "hlo": str(hlo.relative_to(ROOT))}


def maxtext_side(a: argparse.Namespace, out_dir: pathlib.Path, name: str) -> dict:
    sizes = dict(kv.split("=") for kv in a.mesh.split(","))
    hlo = out_dir / f"{name}.maxtext.hlo.txt"
    overrides = [f"model_name=gpt-oss-{a.model}", f"compile_topology={a.topology}",
                 "compile_topology_num_slices=1", f"per_device_batch_size={a.per_chip_batch}",
                 f"max_target_length={a.seq_len}", "override_model_config=true",
                 f"base_num_decoder_layers={a.layers}", "scan_layers=false",
                 *(f"{MAXTEXT_MESH[k]}={v}" for k, v in sizes.items()),
                 # llm_jax's gpt-oss configs: bf16 weights (so bf16 Adam moments) and compute,
                 # each layer recomputed in the backward pass (remat=True)
                 "weight_dtype=bfloat16", "dtype=bfloat16", "remat_policy=full",
                 "dataset_type=synthetic", "enable_checkpointing=false", f"run_name={name}",
                 f"base_output_directory={out_dir / 'maxtext_out'}", *a.maxtext_flag]
    cmd = [a.maxtext_python, str(ROOT / "launch/maxtext_compile.py"), f"--hlo_out={hlo}",
           *overrides]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE"}
    rc, out, wall, rss = run(cmd, env, out_dir / f"{name}.maxtext.log")
    line = next((x for x in out.splitlines() if x.startswith("MAXTEXT_RESULT ")), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"MaxText compile failed (rc {rc}); see {out_dir / name}.maxtext.log")
    r = json.loads(line.partition(" ")[2])
    r.update(command=cmd, wall_seconds=wall, peak_rss_gib=rss,
             hlo=str(hlo.relative_to(ROOT)), kernels=roofline.kernels_in(hlo.read_text()))
    return r


def model_flops_per_chip(a: argparse.Namespace) -> float:
    """describe's 6 N_active + attention FLOPs of the step per chip, the same for both sides."""
    import runpy

    from llm_jax.model import costs
    from llm_jax.training.run_config import model_config

    run_cfg = runpy.run_path(str(ROOT / f"configs/gpt_oss_{a.model}.py"))["get_config"]()
    run_cfg.model.num_hidden_layers = a.layers
    cfg = model_config(run_cfg)
    return costs.flops_per_token(cfg, a.seq_len, training=True) * a.per_chip_batch * a.seq_len


def with_roofline(r: dict, model_flops: float) -> dict:
    r["model_flops_per_chip"] = model_flops
    r["roofline"] = roofline.roofline(r["device_kind"], r["cost"]["flops"], r["cost"]["bytes"],
                                      model_flops)
    return r


def markdown_row(a: argparse.Namespace, r: dict) -> str:
    b, c, rf = r["bytes"], r["cost"], r["roofline"]
    kernels = ", ".join(f"{k} x{n}" for k, n in sorted(r["kernels"].items())) or "none"
    return (f"| {r['side']} | {a.model}, {a.topology}, {a.mesh} | "
            f"{a.per_chip_batch} x {a.seq_len} | {b['arguments'] / GiB:.2f} | "
            f"{b['temp'] / GiB:.2f} | {b['total'] / GiB:.2f} | {c['flops']:.3e} | "
            f"{c['bytes']:.3e} | {rf['step_seconds'] * 1e3:.1f} ms ({rf['bound']}) | "
            f"{rf['mfu_bound']:.1%} | {kernels} | {r['libtpu']} | "
            f"{r['compile_seconds'] / 60:.1f} min | {r['peak_rss_gib']:.1f} GiB |")


HEADER = ("| side | model, topology, mesh | batch x seq per chip | args GiB | temp GiB | "
          "total GiB | compiled FLOPs | bytes accessed | roofline step | MFU bound | Pallas calls "
          "| libtpu | compile | host peak RSS |\n"
          "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: "
          "| ---: |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("20b", "120b"), default="20b")
    p.add_argument("--topology", default="v5p-32")
    p.add_argument("--mesh", default="fsdp=4,expert=4", help="axis sizes, e.g. fsdp=4,expert=4")
    p.add_argument("--per_chip_batch", type=int, default=1, help="sequences per chip")
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--side", choices=("both", "llm_jax", "maxtext"), default="both")
    p.add_argument("--llm_jax_python", default=sys.executable)
    p.add_argument("--maxtext_python", default="/tmp/vmaxtext/bin/python")
    p.add_argument("--llm_jax_flag", action="append", default=[],
                   help="extra llm_jax.compile flag, e.g. "
                   "--config.execution.loss_chunk_tokens=4096")
    p.add_argument("--maxtext_flag", action="append", default=[],
                   help="extra MaxText override, e.g. sa_block_q=1024")
    p.add_argument("--name", default="", help="result name (default from the shape)")
    p.add_argument("--out_dir", default="runs/compare")
    a = p.parse_args(argv)
    name = a.name or f"{a.model}_{a.topology}_{a.per_chip_batch}x{a.seq_len}_{a.layers}l"
    out_dir = (ROOT / a.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    flops = model_flops_per_chip(a)
    path = out_dir / f"{name}.json"
    sides = {"llm_jax": llm_jax_side, "maxtext": maxtext_side}
    for side in sides if a.side == "both" else (a.side,):
        r = with_roofline(sides[side](a, out_dir, name), flops)
        results = json.loads(path.read_text()) if path.exists() else {}  # re-read: another side
        results[side] = r
        path.write_text(json.dumps(results, indent=2))
    results = json.loads(path.read_text())
    print(HEADER)
    for r in results.values():
        print(markdown_row(a, r))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
