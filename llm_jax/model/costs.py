"""What a config costs: every number it holds, its parameters, FLOPs, KV cache and memory.

    python -m llm_jax.describe --config configs/tiny.py [--config.model.FIELD=V ...]
        [--seq_len T] [--batch B] [--mesh data=2,fsdp=4,tensor=1,expert=1] [--json]

Everything is arithmetic on the config (nothing is allocated), and every number the report
prints comes from a function importable here, so the trainer's MFU (`flops_per_token`) and the
generation code's cache (`kv_cache_lengths`, `kv_cache_bytes`) use the same formulas.

Notation: L layers, D hidden, V vocab, N q heads, K kv heads, H head_dim, E experts, k experts
per token, F intermediate, W sliding window, T sequence length, B batch (sequences).
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax.numpy as jnp
import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.kernels.select import kernels_line
from llm_jax.model.moe_dispatch import capacity
from llm_jax.runtime.cli import fail, parse_flags

# ---------------------------------------------------------------------------------------------
# What each number controls.

FIELD_DOCS: dict[str, str] = {
    "num_hidden_layers": "depth: levels of abstraction, one attend-then-think round each; "
                         "params and FLOPs grow linearly",
    "num_experts": "experts per MoE layer: stored knowledge; params grow with E, FLOPs per token "
                   "do not",
    "experts_per_token": "top-k experts each token uses: active compute; FLOPs grow with k",
    "vocab_size": "granularity of the tokenizer: larger = fewer tokens per text, but two V x D "
                  "tables and a V-wide softmax",
    "hidden_size": "resolution of the residual stream: the width every layer reads and writes",
    "intermediate_size": "scratch paper: width of each expert's SwiGLU hidden layer",
    "head_dim": "width of one attention head's query-key comparison (RoPE rotates its pairs)",
    "num_attention_heads": "query heads: how many things a token looks for at once",
    "num_key_value_heads": "kv heads shared by groups of query heads (GQA): sets the KV-cache "
                           "size",
    "sliding_window": "keys an even layer sees (0 = every layer full): caps that layer's "
                      "attention cost and cache at W",
    "initial_context_length": "context of pre-training (L0): the view, and YaRN's reference "
                              "length",
    "rope_theta": "RoPE base: the slowest rotation, how far apart positions stay "
                  "distinguishable",
    "rope_scaling_factor": "YaRN extension: usable context = L0 x factor (1 = plain RoPE); the "
                           "KV memory bill grows with it",
    "rope_ntk_alpha": "YaRN beta_slow: dimensions turning fewer times than this over L0 are "
                      "fully interpolated",
    "rope_ntk_beta": "YaRN beta_fast: dimensions turning more times than this over L0 are left "
                     "as they are",
    "swiglu_limit": "clamp on the experts' SwiGLU inputs: keeps activations bounded",
    "dtype": "compute dtype of matmuls and activations: sets activation and KV-cache bytes",
    "param_dtype": "storage dtype of weights (norms, sinks, router stay float32): sets params "
                   "and grads bytes",
    "moe_dispatch": "how tokens reach experts: auto (dropless, by backend), dense (all E, E/k x "
                    "the expert FLOPs), ragged / blocked / gather / gmm (dropless; gmm by "
                    "Pallas kernels), capacity / expert_parallel / expert_parallel_gmm (fixed "
                    "slots; drop overflow in training only)",
    "attention_impl": "how self-attention runs: auto (kernels/select.py's table: splash on TPU, "
                      "direct / blockwise by shape elsewhere), direct, blockwise, splash, flash "
                      "(GPU Pallas kernel, opt-in)",
    "moe_capacity_factor": "dropping dispatches: slots per expert = factor x T k / E; runs "
                           "factor x the expert FLOPs, drops overflow",
    "prms_fraction": "pRMSNorm: estimate the RMS from this fraction of features (0 = full "
                     "RMSNorm)",
    "norm_type": "rms (gpt-oss) or layer (LayerNorm, only to compare against)",
    "remat": "recompute each layer in the backward pass: saved activations drop to the layer "
             "inputs, for ~1 extra forward",
    "scan_layers": "True: one lax.scan over the stacked layers (compile time flat in depth); "
                   "False: the loop unrolled (no stacked carry buffers; faster for few layers)",
    "initializer_range": "std of the normal initialiser (output projections / sqrt(2L))",
}

RUN_FIELD_DOCS: dict[str, str] = {
    "name": "name of the run (logs, checkpoints)",
    "seed": "seed of the parameter initialisation",
    "data.tfds_name": "TFDS text dataset by name ('' = local text files)",
    "data.text_key": "feature holding the text in a TFDS dataset",
    "data.tfds_train_split": "TFDS split to train on",
    "data.tfds_eval_split": "TFDS split to evaluate on ('' = validation, else test)",
    "data.files": "glob of local text files ('' = the standard library's .py files)",
    "data.data_dir": "where TFDS datasets are built",
    "data.validation_fraction": "share of local files held out for evaluation",
    "data.seq_len": "training sequence length T: attention cost and activations grow with it",
    "data.shuffle_seed": "seed of the data order",
    "data.shuffle_buffer_tokens": "packed rows shuffled together (long documents spread out)",
    "data.worker_count": "Grain worker processes (0 = main process)",
    "data.prefetch": "batches read ahead by a background thread",
    "data.tokenizer_train_bytes": "text used to train the BPE tokenizer",
    "train.num_steps": "optimizer steps",
    "train.batch_size": "global batch in sequences: tokens per step = batch x seq_len",
    "train.grad_accum_steps": "micro-batches per step: same batch, 1/n the activations",
    "train.learning_rate": "peak learning rate",
    "train.warmup_steps": "linear warm-up steps",
    "train.min_lr_ratio": "cosine decay ends at learning_rate x this",
    "train.weight_decay": "AdamW weight decay",
    "train.b1": "Adam first-moment decay",
    "train.b2": "Adam second-moment decay",
    "train.grad_clip_norm": "global gradient-norm clip",
    "train.load_balancing_loss_weight": "weight of the Switch load-balancing loss",
    "train.router_z_loss_weight": "weight of the ST-MoE router z-loss",
    "train.log_every_steps": "steps between log lines",
    "train.eval_every_steps": "steps between evaluations",
    "train.eval_batches": "batches per evaluation",
    "checkpoint.every_steps": "steps between checkpoints",
    "checkpoint.max_to_keep": "checkpoints kept on disk",
    "checkpoint.async_save": "write checkpoints in the background",
}

# ---------------------------------------------------------------------------------------------
# Parameters.

PARAM_COMPONENTS = ("embedding", "q", "k", "v", "o", "sinks", "router", "experts", "norms",
                    "unembedding")

ACTIVE_CONVENTION = ("active = total - embedding - (E - k)/E x experts: the embedding is a "
                     "lookup, not compute; the unembedding is a matmul and counts (this "
                     "reproduces OpenAI's 3.6B / 5.1B)")


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters per component (each with its biases), in PARAM_COMPONENTS order."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, F = cfg.num_experts, cfg.intermediate_size
    per_norm = D if cfg.norm_type == "rms" else 2 * D  # LayerNorm also has a bias
    return {
        "embedding": V * D,
        "q": L * (D * N * H + N * H),
        "k": L * (D * K * H + K * H),
        "v": L * (D * K * H + K * H),
        "o": L * (N * H * D + D),
        "sinks": L * N,
        "router": L * (D * E + E),
        "experts": L * E * (D * 2 * F + 2 * F + F * D + D),
        "norms": (2 * L + 1) * per_norm,
        "unembedding": V * D,
    }


def total_params(cfg: ModelConfig) -> int:
    return sum(param_counts(cfg).values())


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses; see ACTIVE_CONVENTION."""
    c = param_counts(cfg)
    idle_experts = c["experts"] * (cfg.num_experts - cfg.experts_per_token) // cfg.num_experts
    return total_params(cfg) - c["embedding"] - idle_experts


def matmul_params(cfg: ModelConfig, experts_run: float | None = None) -> float:
    """Weights one token multiplies by (no biases, sinks, norms or embedding lookup).

    `experts_run` experts per token (default k); the dense dispatch runs E, capacity ~factor x k.
    """
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, F = cfg.num_experts, cfg.intermediate_size
    k = cfg.experts_per_token if experts_run is None else experts_run
    per_layer = D * (N + 2 * K) * H + N * H * D + D * E + k * 3 * D * F
    return L * per_layer + V * D


# ---------------------------------------------------------------------------------------------
# FLOPs.


def keys_attended(seq_len: int, window: int = 0) -> float:
    """Mean keys a query sees under the causal mask, over positions 0..T-1 (window 0 = all).

    Full: (T + 1) / 2. Sliding, T >= W: (T W - W (W - 1) / 2) / T = W - W (W - 1) / (2 T).
    """
    t = seq_len
    if window <= 0 or t <= window:
        return (t + 1) / 2
    return window - window * (window - 1) / (2 * t)


def matmul_flops_per_token(cfg: ModelConfig) -> float:
    """Forward matmul FLOPs per token: 2 x matmul_params (one multiply and one add each)."""
    return 2 * matmul_params(cfg)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, *, skip_masked: bool = True) -> float:
    """Forward QK^T and PV FLOPs per token, averaged over a sequence of `seq_len`.

    Per layer 2 (QK^T) x 2 (PV) x T_eff x N x H. skip_masked=True: T_eff = keys_attended (what a
    kernel that skips masked blocks does, and the model-FLOPs convention); False: T_eff = T for
    every layer (what the einsum path runs: it computes the whole T x T score matrix).
    """
    n, h = cfg.num_attention_heads, cfg.head_dim
    if not skip_masked:
        return cfg.num_hidden_layers * 4 * seq_len * n * h
    return sum(4 * keys_attended(seq_len, w) * n * h for w in cfg.layer_windows)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, skip_masked: bool = True) -> float:
    return matmul_flops_per_token(cfg) + attention_flops_per_token(
        cfg, seq_len, skip_masked=skip_masked)


def flops_per_token(
    cfg: ModelConfig, seq_len: int, *, training: bool = True, skip_masked: bool = True
) -> float:
    """Model FLOPs per token, for MFU: forward, or 3 x forward when training (the backward pass
    costs two matmuls per forward matmul). Remat's recomputation is not counted (MFU, not HFU)."""
    fwd = forward_flops_per_token(cfg, seq_len, skip_masked=skip_masked)
    return 3 * fwd if training else fwd


def decode_flops_per_token(cfg: ModelConfig, context_len: int) -> float:
    """Forward FLOPs of one generated token at position `context_len - 1` with a KV cache: every
    matmul once, attention over min(context_len, W) cached keys per layer."""
    n, h = cfg.num_attention_heads, cfg.head_dim
    keys = sum(min(context_len, w) if w > 0 else context_len for w in cfg.layer_windows)
    return matmul_flops_per_token(cfg) + 4 * keys * n * h


def expert_slots_per_token(cfg: ModelConfig, num_tokens: int) -> float:
    """Expert computations a training step's dispatch runs per token: E (dense), E x C / T
    (capacity, expert_parallel*: every slot is computed, filled or not; ~factor x k), else k
    (the dropless sparse dispatches)."""
    if cfg.moe_dispatch == "dense":
        return cfg.num_experts
    if cfg.moe_dispatch in ("capacity", "expert_parallel", "expert_parallel_gmm"):
        return cfg.num_experts * capacity(num_tokens, cfg) / num_tokens
    return cfg.experts_per_token


def executed_forward_flops_per_token(cfg: ModelConfig, seq_len: int, batch: int) -> float:
    """FLOPs the einsum code actually runs per token (hardware, not model FLOPs): the full T x T
    scores, and every expert slot of the configured dispatch."""
    slots = expert_slots_per_token(cfg, batch * seq_len)
    return 2 * matmul_params(cfg, slots) + attention_flops_per_token(
        cfg, seq_len, skip_masked=False)


def flops_formula(cfg: ModelConfig, seq_len: int) -> str:
    """The FLOP formulas with this config's numbers substituted."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, k, F, T = cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size, seq_len
    windows = cfg.layer_windows
    n_slide = sum(w > 0 for w in windows)
    t_full, t_slide = keys_attended(T), keys_attended(T, cfg.sliding_window)
    att = f"{L - n_slide} x {t_full:g}"
    if n_slide:
        att += f" + {n_slide} x {t_slide:g}"
    return "\n".join([
        "matmul    = 2 [L (D(N+2K)H + NHD + DE + k 3DF) + VD]",
        f"          = 2 [{L} ({D}*{N + 2 * K}*{H} + {N}*{H}*{D} + {D}*{E} + {k}*3*{D}*{F})"
        f" + {V}*{D}] = {_si(matmul_flops_per_token(cfg))}",
        "attention = 4 N H sum_l T_eff(l); T_eff = (T+1)/2 on full layers, "
        "W - W(W-1)/(2T) on sliding layers (T >= W)",
        f"          = 4*{N}*{H}*({att}) = {_si(attention_flops_per_token(cfg, T))}",
        f"forward   = matmul + attention = {_si(flops_per_token(cfg, T, training=False))}",
        f"training  = 3 x forward = {_si(flops_per_token(cfg, T))}",
    ])


# ---------------------------------------------------------------------------------------------
# KV cache.


def kv_cache_lengths(cfg: ModelConfig, max_len: int) -> tuple[int, ...]:
    """Entries each layer's cache holds for `max_len` positions: min(max_len, W) on sliding
    layers (a ring buffer of the last W), max_len on full layers."""
    return tuple(min(max_len, w) if w > 0 else max_len for w in cfg.layer_windows)


def kv_cache_bytes(
    cfg: ModelConfig,
    seq_len: int,
    *,
    batch: int = 1,
    dtype: Any = None,
    num_kv_heads: int | None = None,
    windowed: bool = True,
) -> int:
    """Bytes of the post-RoPE k and v of every layer: sum_l len_l x K x H x 2 x bytes x batch.

    dtype defaults to the compute dtype. num_kv_heads / windowed=False price the alternatives
    (N heads = multi-head attention; no window = every layer full)."""
    itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
    heads = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
    lengths = kv_cache_lengths(cfg, seq_len) if windowed else (seq_len,) * cfg.num_hidden_layers
    return batch * sum(lengths) * heads * cfg.head_dim * 2 * itemsize


def max_context(cfg: ModelConfig) -> int:
    """initial_context_length x rope_scaling_factor: the context YaRN extends to."""
    return int(cfg.initial_context_length * cfg.rope_scaling_factor)


def kv_cache_table(cfg: ModelConfig, *, batch: int = 1) -> list[dict[str, Any]]:
    """Cache bytes at 1k, 2k, 4k, ... up to max_context, next to full MHA and GQA without window."""
    top = max_context(cfg)
    contexts = [1024 * 2 ** i for i in range(int(math.log2(max(top, 1024) / 1024)) + 1)]
    if contexts[-1] != top:
        contexts.append(top)
    rows = []
    for t in contexts:
        ours = kv_cache_bytes(cfg, t, batch=batch)
        mha = kv_cache_bytes(cfg, t, batch=batch, num_kv_heads=cfg.num_attention_heads,
                             windowed=False)
        gqa = kv_cache_bytes(cfg, t, batch=batch, windowed=False)
        rows.append({"context": t, "bytes": ours, "bytes_per_token": ours / t,
                     "mha_bytes": mha, "gqa_no_window_bytes": gqa,
                     "saving_vs_mha": mha / ours})
    return rows


# ---------------------------------------------------------------------------------------------
# Memory per device.

MESH_AXES = ("data", "fsdp", "tensor", "expert")

MEMORY_ASSUMPTIONS = (
    "weights (as the logical-axis rules of llm_jax.parallel.sharding): embed over fsdp (taken here as "
    "every parameter: the few embed-less biases and sinks are negligible); heads, kv heads, mlp "
    "and vocab over tensor; experts over expert (router, expert weights); ideal division",
    "grads in param dtype; Adam m and v in float32, sharded like the params",
    "activations sharded over data x fsdp x expert (the batch, as the rules say); tensor "
    "sharding of activations ignored (an upper bound)",
    "saved per layer per token without remat (compute dtype): layer input, attn-norm out, q k v "
    "after RoPE, attention out, residual, mlp-norm out, and per expert slot its input, 2F "
    "pre-activation, F SwiGLU out and D output; float32: attention probabilities (N x T: the "
    "einsum path materialises the T x T matrix) and router logits (E)",
    "with remat: the layer inputs, plus one layer's full set while it is recomputed",
    "after the layers: final-norm out (compute dtype), logits and log-softmax (2 V float32)",
    "not counted: XLA temporaries, fragmentation, the data pipeline, compiled code",
)


def parse_mesh(spec: str, *, allow_fill: bool = False) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1, 'expert': 1}; '' = one device.

    allow_fill: one size may be -1 (the rest of the devices; llm_jax.parallel.sharding.make_mesh)."""
    mesh = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"--mesh item {item!r} is invalid: expected AXIS=SIZE, e.g. fsdp=4")
        if name not in MESH_AXES:
            raise ValueError(f"--mesh axis {name!r} is unknown: expected one of {MESH_AXES}")
        if name in seen:
            raise ValueError(f"--mesh axis {name!r} is given twice")
        try:
            size = int(value.strip())
        except ValueError:
            raise ValueError(
                f"--mesh {name}={value.strip()!r} is invalid: expected a positive integer") from None
        if size < 1 and not (allow_fill and size == -1):
            raise ValueError(f"--mesh {name}={size} is invalid: expected a positive integer"
                             + (" or -1" if allow_fill else ""))
        mesh[name] = size
        seen.add(name)
    return mesh


def _param_shards(cfg: ModelConfig, mesh: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Per component: (bytes per stored value, number of shards)."""
    pd = jnp.dtype(cfg.param_dtype).itemsize
    f, t, e = mesh["fsdp"], mesh["tensor"], mesh["expert"]
    return {
        "embedding": (pd, f * t), "q": (pd, f * t), "k": (pd, f * t), "v": (pd, f * t),
        "o": (pd, f * t), "sinks": (4, f * t), "router": (4, f * e),
        "experts": (pd, f * t * e), "norms": (4, f), "unembedding": (pd, f * t),
    }


def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, num_tokens: int) -> float:
    """Bytes saved for the backward pass per token (see MEMORY_ASSUMPTIONS)."""
    D, V, E, F = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.intermediate_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c = jnp.dtype(cfg.dtype).itemsize
    slots = expert_slots_per_token(cfg, num_tokens)
    layer = c * (4 * D + (N + 2 * K) * H + N * H + slots * (2 * D + 3 * F)) + 4 * (N * seq_len + E)
    final = c * D + 4 * 2 * V
    if cfg.remat:
        return cfg.num_hidden_layers * c * D + layer + final
    return cfg.num_hidden_layers * layer + final


def memory_per_device(
    cfg: ModelConfig, *, batch: int, seq_len: int, mesh: dict[str, int]
) -> dict[str, Any]:
    """Estimated bytes per device of params, grads, Adam m + v and activations (training)."""
    batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    if batch % batch_shards:
        raise ValueError(
            f"--batch={batch} is invalid for --mesh data={mesh['data']},fsdp={mesh['fsdp']},"
            f"expert={mesh['expert']}: expected a multiple of data x fsdp x expert = "
            f"{batch_shards}")
    counts = param_counts(cfg)
    shards = _param_shards(cfg, mesh)
    params = sum(counts[n] * b / s for n, (b, s) in shards.items())
    adam = sum(counts[n] * 2 * 4 / s for n, (_, s) in shards.items())
    tokens = batch // batch_shards * seq_len
    activations = tokens * activation_bytes_per_token(cfg, seq_len, batch * seq_len)
    out = {"params": params, "grads": params, "adam_m_v": adam, "activations": activations}
    out["total"] = sum(out.values())
    out.update(mesh=mesh, devices=math.prod(mesh.values()), tokens_per_device=tokens,
               assumptions=list(MEMORY_ASSUMPTIONS))
    return out


def param_shardings(cfg: ModelConfig, mesh: dict[str, int]) -> list[dict[str, Any]]:
    """Every parameter's logical axes, PartitionSpec (llm_jax.parallel.sharding.RULES) and per-device
    shard shape on `mesh`; optimizer moments are laid out the same. Needs no devices."""
    import jax
    from flax import nnx

    from llm_jax.model import abstract_model
    from llm_jax.parallel.sharding import logical_to_spec, spec_axes

    rows = []
    state = nnx.state(abstract_model(cfg), nnx.Param)
    for path, v in jax.tree_util.tree_leaves_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = tuple(v.get_metadata().get("out_sharding") or ())
        spec = logical_to_spec(names)
        entries = tuple(spec) + (None,) * (len(v.shape) - len(spec))
        shard = [n // math.prod(mesh[a] for a in spec_axes(e)) for n, e in zip(v.shape, entries)]
        rows.append({"param": "/".join(str(getattr(k, "key", k)) for k in path),
                     "shape": list(v.shape), "logical": list(names), "spec": str(spec),
                     "shard": shard})
    return rows


def format_shardings(rows: list[dict[str, Any]], mesh: dict[str, int]) -> str:
    width = max(len(r["param"]) for r in rows)
    mesh_s = ",".join(f"{a}={n}" for a, n in mesh.items())
    lines = [f"## Parameter shardings (mesh {mesh_s}; Adam m and v are laid out the same)"]
    lines += [f"{r['param']:<{width}}  {str(tuple(r['shape'])):<22} {str(tuple(r['logical'])):<44}"
              f" {r['spec']:<36} shard {tuple(r['shard'])}" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The report.


def _si(x: float, unit: str = "") -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3f} {p}{unit}".rstrip()
    return f"{x:g} {unit}".rstrip()


def _bytes(x: float) -> str:
    for div, p in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if x >= div:
            return f"{x / div:.2f} {p}"
    return f"{x:.0f} B"


def _flat(d: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe(
    run_cfg: ml_collections.ConfigDict,
    *,
    seq_len: int | None = None,
    batch: int | None = None,
    mesh: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The whole report as JSON-able data (what --json prints)."""
    cfg = _model_of(run_cfg)
    seq_len = run_cfg.data.seq_len if seq_len is None else seq_len
    batch = run_cfg.train.batch_size if batch is None else batch
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name}={value!r} is invalid: expected a positive integer")
    mesh = dict.fromkeys(MESH_AXES, 1) if mesh is None else mesh
    fields = [{"field": f"model.{n}", "value": v, "doc": FIELD_DOCS.get(n, "")}
              for n, v in cfg.to_dict().items()]
    sections = ["", "data", "train", "checkpoint"]  # top-level scalars first, then sections
    rest = sorted(_flat(run_cfg).items(), key=lambda kv: (
        sections.index(s) if (s := kv[0].rpartition(".")[0]) in sections else len(sections), kv[0]))
    fields += [{"field": n, "value": v, "doc": RUN_FIELD_DOCS.get(n, "")}
               for n, v in rest if not n.startswith("model.")]
    dec = [{"context": t, "flops": decode_flops_per_token(cfg, t)}
           for t in (1024, seq_len, max_context(cfg))]
    return {
        "name": run_cfg.get("name", ""),
        "seq_len": seq_len,
        "batch": batch,
        "fields": fields,
        "params": {"components": param_counts(cfg), "total": total_params(cfg),
                   "active": active_params(cfg), "active_convention": ACTIVE_CONVENTION},
        "flops_per_token": {
            "matmul_forward": matmul_flops_per_token(cfg),
            "attention_forward": attention_flops_per_token(cfg, seq_len),
            "inference_forward": flops_per_token(cfg, seq_len, training=False),
            "training": flops_per_token(cfg, seq_len, training=True),
            "training_per_step": flops_per_token(cfg, seq_len) * batch * seq_len,
            "executed_forward": executed_forward_flops_per_token(cfg, seq_len, batch),
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
        "memory_per_device": memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh),
        "finetune_memory_per_device": _finetune_memory(run_cfg, cfg, batch, seq_len, mesh),
        "kernels": {p: kernels_line(cfg, batch, seq_len, p) for p in ("cpu", "gpu", "tpu")},
    }


def _model_of(run_cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The run's ModelConfig; a fine-tuning config's (None fields) from train.init_from."""
    model = run_cfg.model.to_dict()
    if any(v is None for v in model.values()) and run_cfg.train.get("init_from"):
        from llm_jax.training.finetune import pretrained_config, resolve_model_config
        return resolve_model_config(run_cfg.model, pretrained_config(run_cfg.train.init_from),
                                    run_cfg.train.init_from)
    return ModelConfig.from_dict(model)


def _finetune_memory(run_cfg: ml_collections.ConfigDict, cfg: ModelConfig, batch: int,
                     seq_len: int, mesh: dict[str, int]) -> dict[str, Any]:
    """Full vs LoRA fine-tuning at the config's lora.rank (rank 16 when it is 0)."""
    from llm_jax.model.lora_costs import finetune_memory_per_device

    lora = run_cfg.get("lora") or ml_collections.ConfigDict({"rank": 0, "targets": ""})
    targets = tuple(t.strip() for t in lora.targets.split(",") if t.strip()) or (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    return finetune_memory_per_device(cfg, batch=batch, seq_len=seq_len, mesh=mesh,
                                      rank=lora.rank or 16, targets=targets)


def format_report(r: dict[str, Any]) -> str:
    """The report as text."""
    lines = [f"# {r['name']}: seq_len {r['seq_len']}, batch {r['batch']}", "", "## Config"]
    width = max(len(f["field"]) for f in r["fields"])
    vwidth = max(len(repr(f["value"])) for f in r["fields"])
    lines += [f"{f['field']:<{width}}  {f['value']!r:<{vwidth}}  {f['doc']}" for f in r["fields"]]

    p = r["params"]
    lines += ["", "## Parameters"]
    lines += [f"{n:<12} {c:>16,}  {c / p['total']:6.1%}" for n, c in p["components"].items()]
    lines += [f"{'total':<12} {p['total']:>16,}", f"{'active':<12} {p['active']:>16,}  "
              f"per token; {p['active_convention']}"]

    lines += ["", "## Kernels of a training step, by backend (kernels/select.py)"]
    lines += [line for line in r.get("kernels", {}).values()]

    f = r["flops_per_token"]
    lines += ["", f"## FLOPs per token (seq_len {r['seq_len']})", f["formula"],
              f"training per step (batch x seq_len tokens): {_si(f['training_per_step'])}",
              f"executed forward (full T x T scores, every expert slot of the dispatch): "
              f"{_si(f['executed_forward'])}"]
    lines += [f"decode one token at context {d['context']}: {_si(d['flops'])}" for d in f["decode"]]

    kv = r["kv_cache"]
    lines += ["", f"## KV cache ({kv['dtype']}, batch 1): k and v after RoPE, K x H x 2 per "
              "layer per position; sliding layers keep the last W",
              f"per token: {_bytes(kv['bytes_per_token_full_layers'])} once the windows are "
              f"full (full layers only), {_bytes(kv['bytes_per_token_no_window'])} without "
              f"windows, {_bytes(kv['bytes_per_token_mha'])} for multi-head attention (K = N)",
              f"{'context':>8} {'cache':>11} {'per token':>11} {'GQA, no W':>11} {'MHA':>11}"
              f" {'saved vs MHA':>12}"]
    lines += [f"{t['context']:>8} {_bytes(t['bytes']):>11} {_bytes(t['bytes_per_token']):>11} "
              f"{_bytes(t['gqa_no_window_bytes']):>11} {_bytes(t['mha_bytes']):>11} "
              f"{t['saving_vs_mha']:>11.1f}x" for t in kv["table"]]

    m = r["memory_per_device"]
    mesh = ",".join(f"{a}={n}" for a, n in m["mesh"].items())
    lines += ["", f"## Memory per device (training; mesh {mesh}: {m['devices']} devices, "
              f"{m['tokens_per_device']} tokens each)"]
    lines += [f"{n:<12} {_bytes(m[n]):>11}" for n in
              ("params", "grads", "adam_m_v", "activations", "total")]
    lines += ["assumptions:"] + [f"- {a}" for a in m["assumptions"]]
    ft = r["finetune_memory_per_device"]
    lines += ["", f"## Fine-tuning memory per device: full vs LoRA rank {ft['rank']} "
              f"({ft['adapter_params']:,} adapter params on {','.join(ft['targets'])})",
              f"{'':<14} {'full':>11} {'LoRA':>11}"]
    lines += [f"{n:<14} {_bytes(ft['full'].get(n, 0.0)):>11} {_bytes(ft['lora'][n]):>11}"
              for n in ("params", "grads", "adam_m_v", "adapted_layer", "activations", "total")]
    lines += [f"- {a}" for a in ft["assumptions"]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from absl import flags

    del argv
    FLAGS = flags.FLAGS
    try:
        mesh = parse_mesh(FLAGS.mesh)
        report = describe(FLAGS.config, seq_len=FLAGS.seq_len, batch=FLAGS.batch, mesh=mesh)
    except ValueError as e:
        fail("llm_jax.describe", e)
    if FLAGS.shardings:
        report["shardings"] = param_shardings(ModelConfig.from_dict(FLAGS.config.model.to_dict()),
                                              mesh)
    print(json.dumps(report, indent=2) if FLAGS.json else format_report(report) + (
        "\n\n" + format_shardings(report["shardings"], mesh) if FLAGS.shardings else ""))


def cli() -> None:
    """`python -m llm_jax.describe`."""
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "configs/*.py file with get_config()",
                                    lock_config=True)
    flags.DEFINE_integer("seq_len", None, "sequence length T (default: config data.seq_len)")
    flags.DEFINE_integer("batch", None, "global batch in sequences (default: train.batch_size)")
    flags.DEFINE_string("mesh", "", "mesh axis sizes, e.g. data=2,fsdp=4,tensor=1,expert=1")
    flags.DEFINE_bool("json", False, "print the report as JSON")
    flags.DEFINE_bool("shardings", False, "also list every parameter's logical axes, "
                      "PartitionSpec and per-device shard shape on --mesh")
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=parse_flags("llm_jax.describe"))
