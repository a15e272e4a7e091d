"""What a config costs: its parameters, FLOPs, KV cache and memory per device, as arithmetic on
the config, and for a training step's memory from the abstract model and a trace of its loss
(nothing is allocated). The report of `python -m llm_jax.describe` (llm_jax/describe.py) prints
these numbers, the trainer's MFU uses `flops_per_token`, and `kv_cache_lengths` and
`kv_cache_bytes` count the slots the generation code's cache allocates (`kv_cache.layer_slots`,
which `kv_cache.init_cache` reads too): one set of formulas.

Notation: L layers, D hidden, V vocab, N q heads, K kv heads, H head_dim, E experts, k experts
per token, F intermediate, W sliding window, T sequence length, B batch (sequences).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

# What jax.ad_checkpoint.print_saved_residuals prints, as data (jax has no public name for it).
from jax._src.ad_checkpoint import saved_residuals

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.kv_cache import layer_slots
from llm_jax.model.lora import LoRAParam, add_lora
from llm_jax.model.moe_dispatch import capacity
from llm_jax.model.mxfp4 import BITS_PER_VALUE
from llm_jax.model.params import TRAINABLE
from llm_jax.model.select import auto_moe
from llm_jax.model.transformer import Transformer, abstract_model
from llm_jax.model.unembed_loss import chunk_steps, chunks_per_group, vocab_split
from llm_jax.parallel.sharding import MESH_AXES, logical_axes, logical_to_spec, spec_axes
from llm_jax.runtime.backend import compiling_for
from llm_jax.runtime.units import format_si

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


def expert_weight_params(cfg: ModelConfig) -> int:
    """The expert matrices' values (no biases): L E 3 D F, what MXFP4 packs."""
    return cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size


def param_bytes(cfg: ModelConfig) -> dict[str, float]:
    """Bytes stored per component: param_dtype, float32 for sinks, router and norms; packed
    MXFP4 expert matrices (expert_format='mxfp4') at BITS_PER_VALUE = 4.25 bits a value (blocks
    + one scale byte per 32), their biases in param_dtype."""
    pd = jnp.dtype(cfg.param_dtype).itemsize
    counts = param_counts(cfg)
    out = {n: c * (4 if n in ("sinks", "router", "norms") else pd) for n, c in counts.items()}
    if cfg.expert_format == "mxfp4":
        w = expert_weight_params(cfg)
        out["experts"] = w * BITS_PER_VALUE / 8 + (counts["experts"] - w) * pd
    return out


def trainable_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters an optimizer updates per component: all, but packed expert matrices are
    frozen (model/params.py TRAINABLE), so with expert_format='mxfp4' only their biases."""
    counts = param_counts(cfg)
    if cfg.expert_format == "mxfp4":
        counts["experts"] -= expert_weight_params(cfg)
    return counts


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


def expert_slots_per_token(cfg: ModelConfig, num_tokens: int, *,
                           execution: ExecutionConfig = ExecutionConfig()) -> float:
    """Expert computations a training step's dispatch runs per token: E (dense), E x C / T
    (capacity, expert_parallel*: every slot is computed, filled or not; ~factor x k), else k
    (the dropless sparse dispatches)."""
    if execution.moe_dispatch == "dense":
        return cfg.num_experts
    if execution.moe_dispatch in ("capacity", "expert_parallel", "expert_parallel_gmm"):
        return cfg.num_experts * capacity(num_tokens, cfg, execution.moe_capacity_factor) \
            / num_tokens
    return cfg.experts_per_token


def executed_forward_flops_per_token(cfg: ModelConfig, seq_len: int, batch: int, *,
                                     execution: ExecutionConfig = ExecutionConfig()) -> float:
    """FLOPs the einsum code actually runs per token (hardware, not model FLOPs): the full T x T
    scores, and every expert slot of the configured dispatch."""
    slots = expert_slots_per_token(cfg, batch * seq_len, execution=execution)
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
        f" + {V}*{D}] = {format_si(matmul_flops_per_token(cfg))}",
        "attention = 4 N H sum_l T_eff(l); T_eff = (T+1)/2 on full layers, "
        "W - W(W-1)/(2T) on sliding layers (T >= W)",
        f"          = 4*{N}*{H}*({att}) = {format_si(attention_flops_per_token(cfg, T))}",
        f"forward   = matmul + attention = {format_si(flops_per_token(cfg, T, training=False))}",
        f"training  = 3 x forward = {format_si(flops_per_token(cfg, T))}",
    ])


# ---------------------------------------------------------------------------------------------
# KV cache.


def kv_cache_lengths(cfg: ModelConfig, max_len: int) -> tuple[int, ...]:
    """Entries each layer's cache holds for `max_len` positions: min(max_len, W) on sliding
    layers (a ring buffer of the last W), max_len on full layers: the cache's own slots."""
    return tuple(layer_slots(cfg, i, max_len) for i in range(cfg.num_hidden_layers))


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

MEMORY_ASSUMPTIONS = (
    "params, gradients and Adam m and v: every variable of the abstract model (with its LoRA "
    "adapters), split over the mesh as llm_jax.parallel.sharding.RULES maps its logical axes, "
    "exactly as the train step lays out its state; gradients and moments for the trained ones "
    "only, in each one's dtype (packed MXFP4 experts and a LoRA base are frozen)",
    "activations: what the forward pass of the step's loss saves for the backward pass "
    "(jax's saved residuals of the same model code: dispatch, attention, loss chunks, remat and "
    "layer scan as configured), each split over the batch axes when it is laid out by tokens, "
    "over expert by experts and over tensor by heads, mlp or vocab (RULES); expert slots of "
    "the capacity and blocked dispatches hold the whole batch's assignments on every device",
    "on TPU with the layers scanned, the trained expert matrices' gradients twice: the "
    "backward scan accumulates them in the layout its loop writes, and XLA:TPU copies them "
    "into the parameters' layout for the optimizer update, both live at once (the other "
    "layer parameters' gradients, and LoRA adapters', feed the update as they are)",
    "working: the larger of one group of loss chunks ([tokens, vocab] float32 logits and the "
    "group's gradients; one chunk a group where the loss splits by vocabulary) and one layer's "
    "backward pass: WORKING x what the layer saves (its gradients as its saved set is freed), "
    "or with remat REMAT_WORKING x what it saves without remat (the recomputed set and its "
    "gradients); factors fitted to XLA:CPU's compiled schedule, TPU_WORKING and "
    "TPU_REMAT_WORKING to XLA:TPU's (libtpu), which holds less",
    "remat only inside the layer scan (scan_layers=True): with the layers unrolled XLA may "
    "merge the recomputation with the forward pass it repeats, so the step is priced without "
    "remat (an upper bound)",
    "not counted: the compiler's buffer packing (XLA:CPU adds up to a third over the live "
    "peak; XLA:TPU's temporaries exceed its buffer assignment's), the data pipeline, compiled "
    "code",
)


def _logical_dims(shape: tuple[int, ...], sizes: dict[str, int], stacked: bool,
                  rows_split: bool) -> list:
    """Logical names of a saved activation's dimensions, read from their sizes: a leading
    layers axis (scan outputs), then tokens (batch, batch x time or assignments) or experts
    first, and heads, kv heads, mlp, experts or vocab wherever a size names one alone; an
    expert stack's shape [E, D, 2F] or [E, F, D] carries its parameter's names.
    `rows_split`: the dispatch runs in `shard_map` over the batch axes, so the rows of what it
    saves (its slots) are laid out over them too."""
    names: list[str | None] = [None] * len(shape)
    i = 0
    if stacked and shape and shape[0] == sizes["L"]:
        names[0], i = "layers", 1
    weights = {(sizes["E"], sizes["D"], sizes["F2"]): ("experts", "embed", "mlp"),
               (sizes["E"], sizes["F"], sizes["D"]): ("experts", "mlp", "embed")}
    if tuple(shape[i:]) in weights:  # an expert stack (cast, unpacked or adapted): as its param
        return names[:i] + list(weights[tuple(shape[i:])])
    if i < len(shape):
        first, second = shape[i], (shape[i + 1] if i + 1 < len(shape) else None)
        if first in (sizes["tokens"], sizes["assignments"]) or (
                first == sizes["B"] and second in (None, sizes["T"], sizes["K"], sizes["N"])):
            names[i] = "batch"
        elif first == sizes["E"]:
            names[i] = "experts"
        elif rows_split:
            names[i] = "batch"
    ambiguous = {sizes["D"], sizes["T"], sizes["H"], sizes["B"]}
    by_size = {}
    for name, key in (("vocab", "V"), ("mlp", "F2"), ("mlp", "F"), ("experts", "E"),
                      ("kv_heads", "K"), ("heads", "N")):
        if sizes[key] not in ambiguous:
            by_size.setdefault(sizes[key], name)
    return [n or by_size.get(size) for n, size in zip(names, shape)]


def _shard_count(shape, names, mesh: dict[str, int]) -> int:
    """How many ways `mesh` splits an array of `shape` with logical `names` (RULES), counting a
    dimension only where its axes divide it (as `constrain` does)."""
    spec = logical_to_spec(names)
    count = 1
    for n, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        k = math.prod(mesh[a] for a in spec_axes(entry))
        count *= k if n % k == 0 else 1
    return count


# One layer's backward pass at the step's peak, as a multiple of what the layer saves: part of
# its gradients while its saved set is freed; with remat, the recomputed set and its gradients.
# Fitted to XLA's compiled schedule of the test's capacity-dispatch cases (CPU, 8 devices).
WORKING = 0.5
REMAT_WORKING = 1.4

# The same on TPU, fitted to libtpu 0.0.42.1's compiled steps (docs/scaling.md, "Memory per
# device"): without remat the small model's step on v5e-4 holds no more than its saved set
# (+4 % with 0, +19 % with 0.5); with remat, the recomputed layer and its gradients and no
# more (1.4 puts the 2-layer gpt-oss steps 19 % (120b) and 32 % (20b) over, 1.0 within 7 %).
TPU_WORKING = 0.0
TPU_REMAT_WORKING = 1.0

# Dispatches that run in `jax.shard_map` over the batch axes (model/moe_parallel.py).
SHARD_MAP_DISPATCHES = ("gmm", "expert_parallel", "expert_parallel_gmm")


class Adapters(NamedTuple):
    """LoRA adapters of a fine-tuning run (model/lora.py): the base is frozen."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


def _abstract_train_model(cfg: ModelConfig, adapters: Adapters | None,
                          execution: ExecutionConfig = ExecutionConfig()) -> nnx.Module:
    def build() -> nnx.Module:
        model = Transformer(cfg, rngs=nnx.Rngs(params=0), execution=execution)
        if adapters is not None:
            add_lora(model, rank=adapters.rank, alpha=adapters.alpha, targets=adapters.targets,
                     seed=0)
        return model

    return nnx.eval_shape(build)


def _variable_bytes(v: nnx.Variable, mesh: dict[str, int]) -> float:
    """Bytes of one device's shard of a parameter, laid out by its logical axes (RULES)."""
    names = tuple(v.get_metadata().get("out_sharding") or ())
    return math.prod(v.shape) * v.dtype.itemsize / _shard_count(v.shape, names, mesh)


EXPERT_STACK_AXES = (("layers", "experts", "embed", "mlp"), ("layers", "experts", "mlp", "embed"))


def _is_expert_stack(v: nnx.Variable) -> bool:
    """An expert matrix stack (gate_up_proj, down_proj: [L, E, D, 2F], [L, E, F, D]), by its
    logical axes; not its biases, nor a LoRA adapter of it."""
    return tuple(v.get_metadata().get("out_sharding") or ()) in EXPERT_STACK_AXES


def state_bytes(cfg: ModelConfig, mesh: dict[str, int],
                adapters: Adapters | None = None) -> dict[str, float]:
    """Per device: every parameter, the trained ones (TRAINABLE, or the adapters alone) and the
    trained expert matrix stacks, as the train step shards its state."""
    model = _abstract_train_model(cfg, adapters)
    trained = LoRAParam if adapters is not None else TRAINABLE
    leaves = lambda f: jax.tree.leaves(  # noqa: E731
        nnx.state(model, f), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {"params": sum(_variable_bytes(v, mesh) for v in leaves(nnx.Param)),
            "trained": sum(_variable_bytes(v, mesh) for v in leaves(trained)),
            "trained_experts": sum(_variable_bytes(v, mesh) for v in leaves(trained)
                                   if _is_expert_stack(v))}


def _abstract_mesh(mesh: dict[str, int]) -> jax.sharding.AbstractMesh:
    """`mesh` with Auto axes, as the train step's mesh (sharding.make_mesh): jax 0.12's default,
    Explicit, would make every sharding constraint an assertion."""
    return jax.sharding.AbstractMesh(tuple(mesh[a] for a in MESH_AXES), MESH_AXES,
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def _loss_bytes(cfg: ModelConfig, execution: ExecutionConfig, batch: int, seq_len: int,
                mesh: dict[str, int], batch_shards: int) -> float:
    """One group of the fused loss's chunks on a device (model/unembed_loss.py): k chunks of
    logit gradients and one of float32 logits, [tokens, vocab / tensor] each, priced as float32;
    k = 1 where the loss splits by vocabulary (groups would only hold more)."""
    c = chunk_steps(batch, seq_len, execution.loss_chunk_tokens, batch_shards)
    with jax.sharding.use_abstract_mesh(_abstract_mesh(mesh)):
        split = vocab_split(batch, cfg.vocab_size)
    k = chunks_per_group(-(-seq_len // c), 1 if split is not None else
                         execution.loss_group_chunks)
    vocab = cfg.vocab_size / _shard_count((cfg.vocab_size,), ("vocab",), mesh)
    return (k + 1) * batch // batch_shards * c * vocab * 4


def _saved_activations(cfg: ModelConfig, execution: ExecutionConfig,
                       adapters: Adapters | None, batch: int, seq_len: int,
                       mesh: dict[str, int], platform: str) -> tuple[float, float]:
    """(bytes per device the loss's forward pass saves for its backward pass, the part of them
    one layer saves), traced for `platform` on an abstract `mesh`."""
    # Every parameter is differentiated here (a frozen one is an argument all the same, never
    # saved); what it adds is the layer inputs its gradient would need, saved for the trained
    # weights beside it anyway.
    graphdef, params = nnx.split(_abstract_train_model(cfg, adapters, execution), nnx.Param)

    def loss(params, tokens):
        m = nnx.merge(graphdef, params)
        h, aux, _ = m.hidden_states(tokens, train=True)
        return m.cross_entropy_sum(h, tokens) + aux.load_balancing_loss.mean() \
            + aux.router_z_loss.mean()

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    n = batch * seq_len
    with jax.sharding.use_abstract_mesh(_abstract_mesh(mesh)), compiling_for(platform):
        saved = saved_residuals(loss, params, tokens)
        dispatch = (execution.moe_dispatch if execution.moe_dispatch != "auto"
                    else auto_moe(cfg, n))
    rows_split = dispatch in SHARD_MAP_DISPATCHES
    sizes = {"L": cfg.num_hidden_layers, "B": batch, "T": seq_len, "tokens": n,
             "assignments": n * cfg.experts_per_token, "E": cfg.num_experts,
             "N": cfg.num_attention_heads, "K": cfg.num_key_value_heads, "H": cfg.head_dim,
             "D": cfg.hidden_size, "F": cfg.intermediate_size, "F2": 2 * cfg.intermediate_size,
             "V": cfg.vocab_size}
    total = per_layer = 0.0
    for aval, source in saved:
        if "argument" in source:  # a parameter: already counted
            continue
        stacked = "scan" in source and aval.ndim > 0 and aval.shape[0] == sizes["L"]
        names = _logical_dims(aval.shape, sizes, stacked, rows_split)
        nbytes = aval.size * aval.dtype.itemsize / _shard_count(aval.shape, names, mesh)
        total += nbytes
        if names and names[0] == "layers":
            per_layer += nbytes / sizes["L"]
    return total, per_layer


def memory_per_device(
    cfg: ModelConfig, *, batch: int, seq_len: int, mesh: dict[str, int],
    execution: ExecutionConfig = ExecutionConfig(), adapters: Adapters | None = None,
    platform: str = "tpu",
) -> dict[str, Any]:
    """Estimated bytes per device of a training step (MEMORY_ASSUMPTIONS): params, gradients,
    Adam m + v, saved activations and the backward pass's working set, for `platform`'s
    kernels. `adapters`: LoRA fine-tuning (only the adapters trained)."""
    batch_axes = {a: mesh[a] for a in logical_axes(("batch",))}
    batch_shards = math.prod(batch_axes.values())
    if batch % batch_shards:
        raise ValueError(
            f"--batch={batch} is invalid for --mesh "
            f"{','.join(f'{a}={n}' for a, n in batch_axes.items())}: expected a multiple of "
            f"{' x '.join(batch_axes)} = {batch_shards}")
    state = state_bytes(cfg, mesh, adapters)
    # Remat recomputes a layer only inside the layer scan: unrolled (scan_layers=False), XLA may
    # merge the recomputation with the forward pass it repeats (jax.checkpoint's
    # prevent_cse=False): the small model of the tests saves all it saves without remat, the
    # tiny config part of it. Priced without remat there: an upper bound.
    traced = execution.replace(remat=execution.remat and execution.scan_layers)
    saved, layer = _saved_activations(cfg, traced, adapters, batch, seq_len, mesh, platform)
    working, remat_working = ((TPU_WORKING, TPU_REMAT_WORKING) if platform == "tpu"
                              else (WORKING, REMAT_WORKING))
    if traced.remat:  # the backward pass recomputes one layer's saved set, then its gradients
        layer = remat_working * _saved_activations(
            cfg, traced.replace(remat=False), adapters, batch, seq_len, mesh, platform)[1]
    else:  # the last layer's gradients, as its saved set is freed
        layer *= working
    tokens = batch // batch_shards * seq_len
    loss = _loss_bytes(cfg, execution, batch, seq_len, mesh, batch_shards)
    grads = state["trained"]
    if platform == "tpu" and execution.scan_layers:  # the scan's expert gradients, then the
        grads += state["trained_experts"]  # params' layout
    out = {"params": state["params"], "grads": grads,
           "adam_m_v": 2 * state["trained"], "activations": saved, "working": max(layer, loss)}
    out["total"] = sum(out.values())
    out.update(mesh=mesh, devices=math.prod(mesh.values()), tokens_per_device=tokens,
               platform=platform, assumptions=list(MEMORY_ASSUMPTIONS))
    return out


INFERENCE_ASSUMPTIONS = (
    "weights sharded as the train step shards its params (state_bytes: RULES; packed experts "
    "at 4.25 bits a value)",
    "KV cache (costs.kv_cache_bytes, compute dtype) over the batch's mesh axes and kv heads "
    "over tensor, ideal division",
    "unpacked experts: the widest the dispatches unpack at once, in compute dtype: a prefill "
    "(T k > E) unpacks a layer's local stack E / (expert x tensor x fsdp) x 3DF, a decode step "
    "(gather) its min(E, B k) chosen experts; 0 for dense experts (an upper bound on TPU, "
    "whose gmm dispatch unpacks groups of at most mxfp4_unpack_mib MiB)",
    "logits: B x V float32 at the last position; not counted: the prefill's activations "
    "(one layer's, freed as the scan moves on), XLA temporaries, compiled code",
)


def inference_memory_per_device(cfg: ModelConfig, *, batch: int, context: int,
                                mesh: dict[str, int]) -> dict[str, Any]:
    """Estimated bytes per device to generate: weights + KV cache of `batch` sequences of up
    to `context` positions + the widest unpacked expert stack + logits (INFERENCE_ASSUMPTIONS)."""
    weights = state_bytes(cfg, mesh)["params"]
    batch_shards = max(1, min(batch, mesh["data"] * mesh["fsdp"] * mesh["expert"]))
    kv = kv_cache_bytes(cfg, context, batch=batch) / batch_shards / min(
        mesh["tensor"], cfg.num_key_value_heads)
    expert = 3 * cfg.hidden_size * cfg.intermediate_size * jnp.dtype(cfg.dtype).itemsize
    local = cfg.num_experts / (mesh["expert"] * mesh["tensor"] * mesh["fsdp"])
    unpacked = 0.0
    if cfg.expert_format == "mxfp4":
        unpacked = max(local, min(cfg.num_experts, batch * cfg.experts_per_token)) * expert
        if context * batch * cfg.experts_per_token <= cfg.num_experts:  # only decode steps
            unpacked = min(cfg.num_experts, batch * cfg.experts_per_token) * expert
    out = {"weights": weights, "kv_cache": kv, "unpacked_experts": unpacked,
           "logits": batch * cfg.vocab_size * 4.0}
    out["total"] = sum(out.values())
    out.update(mesh=mesh, devices=math.prod(mesh.values()), batch=batch, context=context,
               assumptions=list(INFERENCE_ASSUMPTIONS))
    return out


def decode_bytes_per_step(cfg: ModelConfig, *, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step reads from memory (one device): every non-expert matrix once
    (attention, router, unembedding; the embedding is a row lookup), the min(E, B k) experts
    the batch chose in each layer (packed or dense, with their biases), and the KV cache at
    `context`. Divided by the machine's memory bandwidth: a lower bound on the step's time."""
    nbytes = param_bytes(cfg)
    experts_read = min(cfg.num_experts, batch * cfg.experts_per_token) / cfg.num_experts
    out = {"weights": sum(v for n, v in nbytes.items() if n not in ("embedding", "experts")),
           "experts": nbytes["experts"] * experts_read,
           "kv_cache": float(kv_cache_bytes(cfg, context, batch=batch))}
    out["total"] = sum(out.values())
    return out


def param_shardings(cfg: ModelConfig, mesh: dict[str, int]) -> list[dict[str, Any]]:
    """Every parameter's logical axes, PartitionSpec (llm_jax.parallel.sharding.RULES) and per-device
    shard shape on `mesh`; optimizer moments are laid out the same. Needs no devices."""
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
