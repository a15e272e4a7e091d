"""`python -m llm_jax.describe`: what a config costs, and what each of its numbers controls.

    python -m llm_jax.describe --config configs/tiny.py [--config.model.FIELD=V ...]
        [--config.execution.FIELD=V ...]
        [--seq_len T] [--batch B] [--mesh data=2,fsdp=4,tensor=1,expert=1] [--platform tpu]
        [--json] [--shardings]

The report (`report`, printed by `format_report`, or as JSON): every field of the run config
(each with what it controls), then parameters, the kernels each backend runs, FLOPs per token,
the KV cache, and memory per device for training, inference and full vs LoRA fine-tuning. The
arithmetic is model/costs.py and model/lora_costs.py; this module only assembles and prints it.

Notation: L layers, D hidden, V vocab, N q heads, K kv heads, H head_dim, E experts, k experts
per token, F intermediate, W sliding window, T sequence length, B batch (sequences).
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.costs import (
    ACTIVE_CONVENTION,
    active_params,
    attention_flops_per_token,
    decode_flops_per_token,
    executed_forward_flops_per_token,
    flops_formula,
    flops_per_token,
    inference_memory_per_device,
    kv_cache_bytes,
    kv_cache_lengths,
    kv_cache_table,
    matmul_flops_per_token,
    max_context,
    memory_per_device,
    param_bytes,
    param_counts,
    param_shardings,
    total_params,
)
from llm_jax.model.lora_costs import finetune_memory_per_device
from llm_jax.model.select import kernels_line
from llm_jax.parallel.sharding import MESH_AXES, parse_mesh
from llm_jax.runtime.cli import fail, parse_flags
from llm_jax.runtime.units import format_bytes, format_si
from llm_jax.training.finetune import pretrained_config, resolve_model_config
from llm_jax.training.run_config import (
    execution_config,
    field_docs,
    model_config,
    validate_run_config,
)


def format_shardings(rows: list[dict[str, Any]], mesh: dict[str, int]) -> str:
    width = max(len(r["param"]) for r in rows)
    mesh_s = ",".join(f"{a}={n}" for a, n in mesh.items())
    lines = [f"## Parameter shardings (mesh {mesh_s}; Adam m and v are laid out the same)"]
    lines += [f"{r['param']:<{width}}  {str(tuple(r['shape'])):<22} {str(tuple(r['logical'])):<44}"
              f" {r['spec']:<36} shard {tuple(r['shard'])}" for r in rows]
    return "\n".join(lines)


def _flat(d: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def report(
    run_cfg: ml_collections.ConfigDict,
    *,
    seq_len: int | None = None,
    batch: int | None = None,
    mesh: dict[str, int] | None = None,
    platform: str = "tpu",
) -> dict[str, Any]:
    """The whole report as JSON-able data (what --json prints); memory for `platform`'s
    kernels (model/select.py). A config that train refuses before it starts (the run config's
    checks, the model section) is refused here too."""
    validate_run_config(run_cfg)
    cfg, execution = _model_of(run_cfg), execution_config(run_cfg)
    seq_len = run_cfg.data.seq_len if seq_len is None else seq_len
    batch = run_cfg.train.batch_size if batch is None else batch
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name}={value!r} is invalid: expected a positive integer")
    mesh = dict.fromkeys(MESH_AXES, 1) if mesh is None else mesh
    docs = field_docs()
    fields = [{"field": f"model.{n}", "value": v, "doc": docs[f"model.{n}"]}
              for n, v in cfg.to_dict().items()]
    fields += [{"field": f"execution.{n}", "value": v, "doc": docs[f"execution.{n}"]}
               for n, v in execution.to_dict().items()]
    sections = ["", "data", "train", "checkpoint"]  # top-level scalars first, then sections
    rest = sorted(_flat(run_cfg).items(), key=lambda kv: (
        sections.index(s) if (s := kv[0].rpartition(".")[0]) in sections else len(sections), kv[0]))
    fields += [{"field": n, "value": v, "doc": docs[n]}
               for n, v in rest if not n.startswith(("model.", "execution."))]
    dec = [{"context": t, "flops": decode_flops_per_token(cfg, t)}
           for t in (1024, seq_len, max_context(cfg))]
    return {
        "name": run_cfg.get("name", ""),
        "seq_len": seq_len,
        "batch": batch,
        "fields": fields,
        "params": {"components": param_counts(cfg), "total": total_params(cfg),
                   "active": active_params(cfg), "active_convention": ACTIVE_CONVENTION,
                   "bytes": param_bytes(cfg), "expert_format": cfg.expert_format},
        "flops_per_token": {
            "matmul_forward": matmul_flops_per_token(cfg),
            "attention_forward": attention_flops_per_token(cfg, seq_len),
            "inference_forward": flops_per_token(cfg, seq_len, training=False),
            "training": flops_per_token(cfg, seq_len, training=True),
            "training_per_step": flops_per_token(cfg, seq_len) * batch * seq_len,
            "executed_forward": executed_forward_flops_per_token(cfg, seq_len, batch,
                                                                 execution=execution),
            "decode": dec,
            "formula": flops_formula(cfg, seq_len),
        },
        "kv_cache": {
            "dtype": cfg.dtype,
            "layer_lengths_at_max_context": list(kv_cache_lengths(cfg, max_context(cfg))),
            "bytes_per_token_full_layers": kv_cache_bytes(cfg, 1, windowed=False)
            // cfg.num_hidden_layers * sum(w == 0 for w in cfg.layer_windows),
            "bytes_per_token_no_window": kv_cache_bytes(cfg, 1, windowed=False),
            "bytes_per_token_mha": kv_cache_bytes(cfg, 1, windowed=False,
                                                  num_kv_heads=cfg.num_attention_heads),
            "table": kv_cache_table(cfg),
        },
        "memory_per_device": memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh,
                                               execution=execution, platform=platform),
        "inference_memory_per_device": inference_memory_per_device(
            cfg, batch=batch, context=seq_len, mesh=mesh),
        "finetune_memory_per_device": _finetune_memory(run_cfg, cfg, execution, batch, seq_len,
                                                       mesh, platform),
        "kernels": {p: kernels_line(cfg, execution, batch, seq_len, p)
                    for p in ("cpu", "gpu", "tpu")},
    }


def _model_of(run_cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The run's ModelConfig; a fine-tuning config's (None fields) from train.init_from."""
    model = run_cfg.model.to_dict()
    if any(v is None for v in model.values()) and run_cfg.train.get("init_from"):
        return resolve_model_config(run_cfg.model, pretrained_config(run_cfg.train.init_from),
                                    run_cfg.train.init_from)
    return model_config(run_cfg)


def _finetune_memory(run_cfg: ml_collections.ConfigDict, cfg: ModelConfig,
                     execution: ExecutionConfig, batch: int, seq_len: int,
                     mesh: dict[str, int], platform: str) -> dict[str, Any]:
    """Full vs LoRA fine-tuning at the config's lora.rank (rank 16 when it is 0)."""
    lora = run_cfg.get("lora") or ml_collections.ConfigDict({"rank": 0, "targets": ""})
    targets = tuple(t.strip() for t in lora.targets.split(",") if t.strip()) or (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    return finetune_memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh,
                                      rank=lora.rank or 16, targets=targets,
                                      alpha=lora.get("alpha", 16.0), platform=platform,
                                      execution=execution)


def format_report(r: dict[str, Any]) -> str:
    """The report as text."""
    lines = [f"# {r['name']}: seq_len {r['seq_len']}, batch {r['batch']}", "", "## Config"]
    width = max(len(f["field"]) for f in r["fields"])
    vwidth = max(len(repr(f["value"])) for f in r["fields"])
    lines += [f"{f['field']:<{width}}  {f['value']!r:<{vwidth}}  {f['doc']}" for f in r["fields"]]

    p = r["params"]
    lines += ["", f"## Parameters (stored bytes; experts {p['expert_format']}"
              + (": 4.25 bits a value, blocks + scales" if p["expert_format"] == "mxfp4" else "")
              + ")"]
    lines += [f"{n:<12} {c:>16,}  {c / p['total']:6.1%}  {format_bytes(p['bytes'][n]):>11}"
              for n, c in p["components"].items()]
    lines += [f"{'total':<12} {p['total']:>16,}          {format_bytes(sum(p['bytes'].values())):>11}",
              f"{'active':<12} {p['active']:>16,}  per token; {p['active_convention']}"]

    lines += ["", "## Kernels of a training step, by backend (model/select.py)"]
    lines += [line for line in r.get("kernels", {}).values()]

    f = r["flops_per_token"]
    lines += ["", f"## FLOPs per token (seq_len {r['seq_len']})", f["formula"],
              f"training per step (batch x seq_len tokens): {format_si(f['training_per_step'])}",
              f"executed forward (full T x T scores, every expert slot of the dispatch): "
              f"{format_si(f['executed_forward'])}"]
    lines += [f"decode one token at context {d['context']}: {format_si(d['flops'])}" for d in f["decode"]]

    kv = r["kv_cache"]
    lines += ["", f"## KV cache ({kv['dtype']}, batch 1): k and v after RoPE, K x H x 2 per "
              "layer per position; sliding layers keep the last W",
              f"per token: {format_bytes(kv['bytes_per_token_full_layers'])} once the windows are "
              f"full (full layers only), {format_bytes(kv['bytes_per_token_no_window'])} without "
              f"windows, {format_bytes(kv['bytes_per_token_mha'])} for multi-head attention (K = N)",
              f"{'context':>8} {'cache':>11} {'per token':>11} {'GQA, no W':>11} {'MHA':>11}"
              f" {'saved vs MHA':>12}"]
    lines += [f"{t['context']:>8} {format_bytes(t['bytes']):>11} {format_bytes(t['bytes_per_token']):>11} "
              f"{format_bytes(t['gqa_no_window_bytes']):>11} {format_bytes(t['mha_bytes']):>11} "
              f"{t['saving_vs_mha']:>11.1f}x" for t in kv["table"]]

    m = r["memory_per_device"]
    mesh = ",".join(f"{a}={n}" for a, n in m["mesh"].items())
    lines += ["", f"## Memory per device (training on {m['platform']}; mesh {mesh}: "
              f"{m['devices']} devices, {m['tokens_per_device']} tokens each)"]
    lines += [f"{n:<12} {format_bytes(m[n]):>11}" for n in
              ("params", "grads", "adam_m_v", "activations", "working", "total")]
    lines += ["assumptions:"] + [f"- {a}" for a in m["assumptions"]]
    inf = r["inference_memory_per_device"]
    lines += ["", f"## Memory per device (inference: batch {inf['batch']}, context "
              f"{inf['context']}; mesh {mesh})"]
    lines += [f"{n:<16} {format_bytes(inf[n]):>11}" for n in
              ("weights", "kv_cache", "unpacked_experts", "logits", "total")]
    lines += ["assumptions:"] + [f"- {a}" for a in inf["assumptions"]]
    ft = r["finetune_memory_per_device"]
    lines += ["", f"## Fine-tuning memory per device: full vs LoRA rank {ft['rank']} "
              f"({ft['adapter_params']:,} adapter params on {','.join(ft['targets'])})",
              f"{'':<14} {'full':>11} {'LoRA':>11}"]
    if p["expert_format"] == "mxfp4":
        lines.append("(experts packed: QLoRA; 'full' trains all but the frozen packed experts)")
    lines += [f"{n:<14} {format_bytes(ft['full'].get(n, 0.0)):>11} {format_bytes(ft['lora'][n]):>11}"
              for n in ("params", "grads", "adam_m_v", "activations", "working", "total")]
    lines += [f"- {a}" for a in ft["assumptions"]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    FLAGS = flags.FLAGS
    try:
        mesh = parse_mesh(FLAGS.mesh)
        result = report(FLAGS.config, seq_len=FLAGS.seq_len, batch=FLAGS.batch, mesh=mesh,
                        platform=FLAGS.platform)
    except ValueError as e:
        fail("llm_jax.describe", e)
    if FLAGS.shardings:
        result["shardings"] = param_shardings(_model_of(FLAGS.config),
                                              mesh)
    print(json.dumps(result, indent=2) if FLAGS.json else format_report(result) + (
        "\n\n" + format_shardings(result["shardings"], mesh) if FLAGS.shardings else ""))


def cli() -> None:
    """`python -m llm_jax.describe`."""
    config_flags.DEFINE_config_file("config", None, "configs/*.py file with get_config()",
                                    lock_config=True)
    flags.DEFINE_integer("seq_len", None, "sequence length T (default: config data.seq_len)")
    flags.DEFINE_integer("batch", None, "global batch in sequences (default: train.batch_size)")
    flags.DEFINE_string("mesh", "", "mesh axis sizes, e.g. data=2,fsdp=4,tensor=1,expert=1")
    flags.DEFINE_enum("platform", "tpu", ["tpu", "gpu", "cpu"], "the backend whose kernels "
                      "the memory estimate traces (model/select.py: auto picks by backend)")
    flags.DEFINE_bool("json", False, "print the report as JSON")
    flags.DEFINE_bool("shardings", False, "also list every parameter's logical axes, "
                      "PartitionSpec and per-device shard shape on --mesh")
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=parse_flags("llm_jax.describe"))


if __name__ == "__main__":
    cli()
