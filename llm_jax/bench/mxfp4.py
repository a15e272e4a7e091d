"""gpt-oss-20b's shape with packed MXFP4 experts on this machine: load, prefill, decode, QLoRA.

    python -m llm_jax.bench mxfp4 --dir /tmp/gpt_oss_20b_random [--layers 24] [--hf]
        [--prompt_len 512] [--new_tokens 16] [--batches 1,4] [--lora_seq 256] [--lora_rank 8]
        [--rss_cap_gib 21] [--hf_rss_cap_gib 16] [--delete]

Writes a checkpoint of random weights with configs/gpt_oss_20b.py's exact config (Hugging Face
layout, one safetensors shard per layer; MoE weights as random MXFP4 blocks with the scale of
the model's initialiser, so activations stay finite; ~13.8 GB) one tensor at a time, never the
whole model in memory; a directory already holding it is reused and kept (`--delete` removes
it afterwards; `--layers N` keeps N layers, for a machine that cannot hold 24). Then, in a child process of its own, it measures:
`load_pretrained` (seconds, peak RSS), the prefill of one `--prompt_len` prompt, greedy decode
tokens/s at each batch (`sample` of --new_tokens minus `sample` of one, best of 3 each), and one QLoRA train step at `--lora_seq`
(adapters of `--lora_rank` on attention and experts over the frozen packed base: loss, grads of
the adapters, AdamW; seconds and peak RSS). Peak RSS is the kernel's VmHWM, reset before each
phase; a watchdog thread ends the child past `--rss_cap_gib` (what it reached is reported).
Each phase is printed to stderr as it ends; `--lora_seq 0` skips the QLoRA step.
The decode bound: bytes one step reads (costs.decode_bytes_per_step) over the machine's
memory bandwidth (a jitted sum over 1 GiB, in a child of its own so that its buffer adds to no
phase's RSS). `--hf` loads the same directory with transformers'
GptOssForCausalLM in another capped child and reports what happened. Not in CI; `--quick`
runs a tiny shape in a temporary directory.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from llm_jax.bench.capped import GIB, process_peak_rss, reset_peak, rss_bytes, run_capped
from llm_jax.bench.common import machine, table
from llm_jax.bench.train import quick_model_config
from llm_jax.config import ModelConfig
from llm_jax.model.costs import decode_bytes_per_step, param_bytes
from llm_jax.model.mxfp4 import random_scale
from llm_jax.runtime.backend import InferenceJit
from llm_jax.runtime.units import format_bytes
from llm_jax.training.run_config import model_config
from llm_jax.weights.configs import model_config_to_hf_config
from llm_jax.weights.layouts import HF_INDEX, hf_specs, packed_shapes
from llm_jax.weights.tensor_store import save_safetensors

DECODE_REPEATS = 3  # decode timings keep the fastest of this many calls


def gpt_oss_20b_config() -> ModelConfig:
    """configs/gpt_oss_20b.py's model (the file, so the benchmark follows its edits)."""
    path = Path(__file__).resolve().parents[2] / "configs" / "gpt_oss_20b.py"
    spec = importlib.util.spec_from_file_location("_bench_gpt_oss_20b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return model_config(module.get_config())


# ---------------------------------------------------------------------------------------------
# The checkpoint, written one tensor at a time.


def _random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], std: float,
                   dtype: Any) -> np.ndarray:
    """Norm scales 1, biases and sinks 0, matrices N(0, std), filled 2**24 values at a time."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return np.ones(shape, dtype)
    if name.endswith(("bias", "sinks")):
        return np.zeros(shape, dtype)
    out = np.empty(int(np.prod(shape)), dtype)
    for i in range(0, out.size, 2**24):
        n = min(2**24, out.size - i)
        out[i:i + n] = rng.standard_normal(n, np.float32) * std
    return out.reshape(shape)


def write_checkpoint(cfg: ModelConfig, directory: Path, seed: int = 0) -> dict[str, Any]:
    """A Hugging Face gpt-oss checkpoint of random weights with MXFP4 experts: global tensors
    in the first shard, one shard per layer; config.json last (its presence marks it whole).
    Reused when config.json already says the same. Returns bytes and seconds written."""
    hf_cfg = model_config_to_hf_config(cfg)
    config_path = directory / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()) == hf_cfg:
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        return {"reused": True, "bytes": size, "seconds": 0.0}
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    dtype = ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)
    std = cfg.initializer_range
    stds = {"gate_up_proj": std, "down_proj": std / (2 * cfg.num_hidden_layers) ** 0.5}
    top, layer = hf_specs(cfg)
    n_shards = 1 + cfg.num_hidden_layers
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        shard: dict[str, np.ndarray] = {}
        for spec in (top if i == 0 else layer):
            name = spec.src.format(n=i - 1)
            if spec.mxfp4 is None:
                shard[name] = _random_tensor(rng, name, spec.src_shape, std, dtype)
                continue
            (blocks, scales) = packed_shapes(spec)
            shard[name + spec.mxfp4[0]] = rng.integers(0, 256, blocks, np.uint8)
            shard[name + spec.mxfp4[1]] = np.full(
                scales, random_scale(stds[spec.key.rpartition(".")[2]]), np.uint8)
        save_safetensors(shard, directory / fname)
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.nbytes for t in shard.values())
        del shard
    (directory / HF_INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config_path.write_text(json.dumps(hf_cfg, indent=2))
    return {"reused": False, "bytes": total, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# The measurements (in the child).


def memory_bandwidth(nbytes: int = GIB, repeats: int = 5) -> float:
    """Bytes per second XLA reads: the best of `repeats` jitted float32 sums over `nbytes`."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def bandwidth(*, phases: dict[str, Any]) -> dict[str, Any]:
    return {"memory_bandwidth_bytes_per_s": memory_bandwidth()}


def _phase(phases: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    phases[name] = {"seconds": time.perf_counter() - t0, **out, **{
        f"{k}_rss_bytes": v for k, v in rss_bytes().items()}}
    # As it happens: at the real size a run takes half an hour, and a phase killed at the cap
    # (or by an impatient user) should not take the finished ones with it.
    print(f"[bench mxfp4] {name}: {json.dumps(phases[name])}", file=sys.stderr, flush=True)


def measure(*, phases: dict[str, Any], directory: str, prompt_len: int, new_tokens: int,
            batches: tuple[int, ...], decode_prompt_len: int, lora_seq: int, lora_rank: int,
            seed: int = 0) -> dict[str, Any]:
    """Load, prefill, decode and a QLoRA step of the checkpoint in `directory`, each with the
    seconds it took and its peak RSS; fills `phases` as it goes (the watchdog reports them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from llm_jax.execution import ExecutionConfig
    from llm_jax.inference.loop import prefill
    from llm_jax.inference.sampler import sample
    from llm_jax.model.kv_cache import init_cache
    from llm_jax.weights.readers import load_pretrained

    rng = np.random.default_rng(seed)
    phases["start"] = rss_bytes()
    holder: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        # remat: the QLoRA step recomputes each layer in its backward pass (a 24-layer step at
        # seq 256, loaded and run alone, peaked at 18.44 GiB with it, 20.26 without; this
        # bench's QLoRA phase: 19.86 GiB, docs/benchmarks.md); the inference phases, which
        # run with a KV cache, are the same programs either way.
        holder["model"] = load_pretrained(directory, execution=ExecutionConfig(remat=True))
        jax.block_until_ready(nnx.state(holder["model"]))
        cfg = holder["model"].cfg
        held = sum(x.nbytes for x in jax.tree.leaves(nnx.state(holder["model"])))
        return {"expert_format": cfg.expert_format, "param_bytes": held}

    _phase(phases, "load", load)
    model = holder["model"]
    cfg = model.cfg
    graphdef, state = nnx.split(model)

    def run_prefill(b: int, p: int, cache_len: int) -> Callable[[], Any]:
        tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (b, p)).astype(np.int32))
        lengths = jnp.full((b,), p, jnp.int32)
        fn = InferenceJit(lambda s, t, n: prefill(nnx.merge(graphdef, s), t, n,
                                                  init_cache(cfg, b, cache_len))[0])
        return lambda: jax.block_until_ready(fn(state, tokens, lengths))

    def best_of(fn: Callable[[], Any], repeats: int = DECODE_REPEATS) -> dict[str, float]:
        """The first call (compiles) and the fastest of `repeats` more."""
        t0 = time.perf_counter()
        out = fn()
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        finite = bool(np.all(np.isfinite(np.asarray(out, np.float32)))) if out is not None else True
        return {"first_s": first, "time_s": min(times), "finite": finite}

    _phase(phases, "prefill", lambda: {"batch": 1, "prompt_len": prompt_len,
                                       **best_of(run_prefill(1, prompt_len, prompt_len), 1)})
    for b in batches:
        def decode(b: int = b) -> dict[str, Any]:
            # Decode steps = sample(new_tokens) - sample(1): the same program family (prefill,
            # first token, loop) with equal cache slots, so the difference is new_tokens - 1
            # decode steps and nothing else. Best of `DECODE_REPEATS` each: on a shared
            # machine the fastest run is the one least disturbed.
            prompts = rng.integers(4, cfg.vocab_size, (b, decode_prompt_len)).astype(np.int32)
            max_len = decode_prompt_len + new_tokens

            def generate(n: int) -> Callable[[], None]:
                return lambda: sample(model, prompts, max_new_tokens=n, max_len=max_len)

            one, full = best_of(generate(1)), best_of(generate(new_tokens))
            if full["time_s"] <= one["time_s"]:
                raise RuntimeError(
                    f"decode batch {b}: {new_tokens} tokens took {full['time_s']:.2e} s, no "
                    f"longer than one ({one['time_s']:.2e} s): the timer cannot resolve the "
                    "decode steps; use more --new_tokens")
            step_s = (full["time_s"] - one["time_s"]) / (new_tokens - 1)
            return {"batch": b, "prompt_len": decode_prompt_len, "new_tokens": new_tokens,
                    "first_token_s": one["time_s"], "generate_s": full["time_s"],
                    "generate_first_s": full["first_s"], "step_s": step_s,
                    "tokens_per_s": b / step_s}
        _phase(phases, f"decode_b{b}", decode)
    if lora_seq:  # --lora_seq 0: inference only
        _phase(phases, "qlora", functools.partial(_qlora_step, model, lora_seq, lora_rank, seed))
    phases["process_peak_rss_bytes"] = process_peak_rss()
    return phases


def _qlora_step(model: Any, seq_len: int, rank: int, seed: int) -> dict[str, Any]:
    """One train step of LoRA adapters over the (packed, frozen) model: compiled, then timed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from llm_jax.model.lora import TARGETS, LoRAParam, add_lora
    from llm_jax.training.run_config import default_run_config
    from llm_jax.training.step import TrainState, jit_train_step, make_optimizer

    add_lora(model, rank=rank, alpha=2.0 * rank, targets=tuple(TARGETS), seed=seed)
    train = default_run_config("qlora", model.cfg).train
    graphdef, params = nnx.graphdef(model), nnx.state(model, nnx.Param)
    tx = make_optimizer(train)
    adapters = nnx.filter_state(params, LoRAParam)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(adapters))
    tokens = np.random.default_rng(seed).integers(4, model.cfg.vocab_size, (1, seq_len + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
             "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
    step = jit_train_step(graphdef, tx, train, LoRAParam)
    t0 = time.perf_counter()
    compiled = step.compile(state, batch)
    t1 = time.perf_counter()
    state, metrics = compiled(state, batch)
    loss = float(metrics["loss"])
    t2 = time.perf_counter()
    return {"seq_len": seq_len, "rank": rank, "targets": list(TARGETS),
            "adapter_params": sum(x.size for x in jax.tree.leaves(adapters)),
            "compile_s": t1 - t0, "step_s": t2 - t1, "loss": loss,
            "grad_norm": float(metrics["grad_norm"])}


def hf_load(*, phases: dict[str, Any], directory: str) -> dict[str, Any]:
    """transformers' GptOssForCausalLM.from_pretrained on the directory (bfloat16, CPU), then
    one greedy token; what it did and how much memory it took."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    phases["transformers"] = transformers.__version__
    reset_peak()
    t0 = time.perf_counter()
    model = transformers.GptOssForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    phases["load_s"] = time.perf_counter() - t0
    phases["load_peak_rss_bytes"] = rss_bytes()["peak"]
    phases["experts_dtype"] = str(next(
        p.dtype for n, p in model.named_parameters() if "experts" in n))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2, do_sample=False)
        phases["generate_2_tokens_s"] = time.perf_counter() - t0
    phases["peak_rss_bytes"] = rss_bytes()["peak"]
    return phases


# ---------------------------------------------------------------------------------------------
# The subcommand.


def run(*, directory: str | None, quick: bool, layers: int | None, prompt_len: int,
        new_tokens: int, batches: tuple[int, ...], lora_seq: int, lora_rank: int,
        rss_cap_gib: float, hf: bool, hf_rss_cap_gib: float, delete: bool) -> dict[str, Any]:
    cfg = gpt_oss_20b_config()
    decode_prompt_len = 16
    if quick:
        cfg = quick_model_config().replace(dtype="bfloat16", param_dtype="bfloat16")
        # 256 new tokens: enough decode steps that their time stands clear of a loaded
        # machine's noise (15 did not: sample(16) measured faster than sample(1)).
        prompt_len, new_tokens, batches, lora_rank = 32, 256, (1, 4), 4
        lora_seq = 16 if lora_seq else 0  # --lora_seq 0 still skips the QLoRA step
        decode_prompt_len = 8
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    cfg = cfg.replace(expert_format="mxfp4")
    tmp = tempfile.mkdtemp(prefix="llm_jax_mxfp4_") if directory is None else None
    path = Path(directory or tmp)
    try:
        written = write_checkpoint(cfg, path)
        # In a child of its own: the 1 GiB it reads stays in the process's allocator, which
        # would add that much to every phase's RSS measured after it. (--quick reads 64 MiB
        # here: a rough figure, and no process launch for it.)
        bw = (memory_bandwidth(64 * 2**20, repeats=2) if quick else
              run_capped(bandwidth, int(rss_cap_gib * GIB)).get("memory_bandwidth_bytes_per_s"))
        result = run_capped(measure, int(rss_cap_gib * GIB), directory=str(path),
                            prompt_len=prompt_len, new_tokens=new_tokens, batches=batches,
                            decode_prompt_len=decode_prompt_len, lora_seq=lora_seq,
                            lora_rank=lora_rank)
        hf_result = (run_capped(hf_load, int(hf_rss_cap_gib * GIB), directory=str(path))
                     if hf else None)
    finally:
        if tmp or delete:
            shutil.rmtree(path, ignore_errors=True)
    expected = {b: decode_bytes_per_step(cfg, batch=b, context=decode_prompt_len + new_tokens)
                for b in batches}
    result["memory_bandwidth_bytes_per_s"] = bw
    bounds = {b: {"bytes_per_step": e["total"], "bytes_per_token": e["total"] / b,
                  "tokens_per_s_bound": b * bw / e["total"] if bw else None}
              for b, e in expected.items()}
    return {"benchmark": "mxfp4", "machine": machine(), "config": cfg.to_dict(),
            "layers": cfg.num_hidden_layers, "directory": str(path), "checkpoint": written,
            "param_bytes_predicted": sum(param_bytes(cfg).values()),
            "llm_jax": result, "decode_bound": bounds, "transformers": hf_result}


def format_result(r: dict[str, Any]) -> str:
    j = r["llm_jax"]
    gib = lambda x: f"{x / GIB:.2f}" if x is not None else "-"  # noqa: E731
    rows = []
    for name, p in j.items():
        if isinstance(p, dict) and "seconds" in p:
            what = (f"{p['tokens_per_s']:.3g} tok/s" if "tokens_per_s" in p else
                    f"{p['time_s']:.3g} s" if "time_s" in p else
                    f"step {p['step_s']:.3g} s, loss {p['loss']:.3g}" if "step_s" in p else "")
            rows.append([name, f"{p['seconds']:.1f}", gib(p["peak_rss_bytes"]),
                         gib(p["rss_rss_bytes"]), what])
    ckpt = r["checkpoint"]
    how = "reused" if ckpt["reused"] else f"written in {ckpt['seconds']:.0f} s"
    head = (f"{r['layers']} layers of gpt-oss-20b, MXFP4 experts packed; checkpoint "
            f"{format_bytes(ckpt['bytes'])} ({how}); load {r['machine']['load_average']}\n")
    lines = [head + table(["phase", "seconds", "peak RSS GiB", "RSS after GiB", "result"], rows)]
    for key in ("killed", "error"):
        if key in j:
            lines.append(f"llm_jax child {key}: {j[key]}")
    if "process_peak_rss_bytes" in j:
        lines.append(f"whole-process peak RSS {gib(j['process_peak_rss_bytes'])} GiB")
    bw = j.get("memory_bandwidth_bytes_per_s")
    for b, d in r["decode_bound"].items():
        bound = f", bound {d['tokens_per_s_bound']:.3g} tok/s at {bw / 1e9:.1f} GB/s" if bw else ""
        lines.append(f"decode batch {b}: {d['bytes_per_token'] / 1e9:.2f} GB read per token{bound}")
    if r["transformers"] is not None:
        lines.append(f"transformers: {json.dumps(r['transformers'], default=str)}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", dest="directory", default=None,
                   help="checkpoint directory (written if absent; default: a temporary one)")
    p.add_argument("--delete", action="store_true", help="delete the checkpoint afterwards")
    p.add_argument("--layers", type=int, default=None, help="layers (default: 24, the 20b's)")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(1, 4))
    p.add_argument("--lora_seq", type=int, default=256, help="0 skips the QLoRA step")
    p.add_argument("--lora_rank", type=int, default=8)
    p.add_argument("--rss_cap_gib", type=float, default=21.0)
    p.add_argument("--hf", action="store_true", help="also load it with transformers")
    p.add_argument("--hf_rss_cap_gib", type=float, default=16.0)


def from_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(directory=a.directory, quick=a.quick, layers=a.layers, prompt_len=a.prompt_len,
               new_tokens=a.new_tokens, batches=a.batches, lora_seq=a.lora_seq,
               lora_rank=a.lora_rank, rss_cap_gib=a.rss_cap_gib, hf=a.hf,
               hf_rss_cap_gib=a.hf_rss_cap_gib, delete=a.delete)
