"""ExecutionConfig: how a model runs, as one frozen, hashable, validated dataclass.

Every field chooses how the same function is computed (MoE dispatch, attention kernel, grouped
matmul tiles, the MXFP4 unpack budget, loss chunks, remat, scan), never what the model is: it is
no part of a checkpoint's identity (llm_jax.config.ModelConfig is), so a loaded model takes any
(`load_pretrained(path, execution=...)`, or `model.execution = ...`) and a training run may
resume with another. The dropping MoE dispatches (capacity, expert_parallel*) change the
function only where a training call asks for them (`train=True`). Each field's documentation is
its `doc` metadata, which `describe` prints and docs/config.md lists.
"""

from __future__ import annotations

import dataclasses

import jax

from llm_jax.config import FrozenConfig, doc_field

# model/moe_dispatch.py's table; "auto" picks a dropless one by shape and backend.
MOE_DISPATCHES = ("auto", "dense", "ragged", "gather", "blocked", "gmm", "capacity",
                  "expert_parallel", "expert_parallel_gmm")
# model/select.py's table; "auto" picks by backend and shape.
ATTENTION_IMPLS = ("auto", "direct", "blockwise", "splash", "flash")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ExecutionConfig(FrozenConfig):
    """How the model is computed; the defaults pick by backend and shape."""

    moe_dispatch: str = doc_field(
        "auto", "how tokens reach experts (model/moe_dispatch.py): auto (dropless, by backend "
        "and shape), dense (all E, E/k x the expert FLOPs), ragged / blocked / gather / gmm "
        "(dropless; gmm by Pallas kernels), capacity / expert_parallel / expert_parallel_gmm "
        "(fixed slots; drop overflow in training calls only)")
    moe_capacity_factor: float = doc_field(
        1.25, "dropping dispatches: slots per expert = factor x T k / E; runs factor x the "
        "expert FLOPs, drops overflow")
    attention_impl: str = doc_field(
        "auto", "how self-attention runs (model/select.py): auto (splash on TPU, direct / "
        "blockwise by shape elsewhere), direct, blockwise, splash, flash (GPU Pallas kernel, "
        "opt-in); a kernel that cannot take a shape falls back to the shape rule")
    mxfp4_unpack_mib: int = doc_field(
        256, "dispatches over packed experts (gmm, blocked, expert_parallel_gmm): unpack a "
        "layer's experts in groups of at most this many MiB (at least one expert; 0 = all at "
        "once), bounding the unpacked weights held at a time")
    gmm_tile_m: int = doc_field(
        512, "megablox (TPU grouped matmul) rows per tile, a multiple of 128: each row tile "
        "re-reads its expert's weights")
    gmm_tile_k: int = doc_field(
        1024, "megablox contracted lanes per tile, a multiple of 128 (with m and n, bounded by "
        "the kernel's scoped VMEM)")
    gmm_tile_n: int = doc_field(
        1024, "megablox output lanes per tile, a multiple of 128: each output tile re-reads "
        "the rows (the GPU kernel picks its own tiles)")
    loss_chunk_tokens: int = doc_field(
        256, "tokens per device in one chunk of the fused unembedding + loss "
        "(model/unembed_loss.py): each holds [tokens, vocab] float32 logits; fewer chunks "
        "re-read the unembedding and its gradient fewer times")
    loss_group_chunks: int = doc_field(
        1, "loss chunks whose gradients go into dh and dW in one product: the unembedding's "
        "float32 gradient is reduced once a group, for more chunks of [tokens, vocab] gradient "
        "held at once; only where the loss splits by tokens (a mesh with fsdp or expert axes "
        "that, times tensor, divide the vocabulary splits it by vocabulary, and keeps dW on "
        "each device: no groups)")
    remat: bool = doc_field(
        False, "recompute each layer in the backward pass: saved activations drop to the layer "
        "inputs, for ~1 extra forward")
    scan_layers: bool = doc_field(
        True, "True: one lax.scan over the stacked layers (compile time flat in depth); False: "
        "the loop unrolled (no stacked carry buffers; faster for few layers)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad field, its value and what is allowed."""

        def bad(field: str, allowed: str) -> None:
            raise ValueError(f"ExecutionConfig.{field}={getattr(self, field)!r} is invalid: "
                             f"expected {allowed}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "str": str, "bool": bool}[f.type]
            if isinstance(v, bool) and f.type != "bool" or not isinstance(v, want):
                bad(f.name, f"a value of type {f.type}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            bad("moe_dispatch", f"one of {MOE_DISPATCHES}")
        if not self.moe_capacity_factor > 0:
            bad("moe_capacity_factor", "a positive number")
        if self.attention_impl not in ATTENTION_IMPLS:
            bad("attention_impl", f"one of {ATTENTION_IMPLS}")
        if self.mxfp4_unpack_mib < 0:
            bad("mxfp4_unpack_mib", "0 (a whole layer at once) or a positive size in MiB")
        for name in ("gmm_tile_m", "gmm_tile_k", "gmm_tile_n"):
            if getattr(self, name) <= 0 or getattr(self, name) % 128:
                bad(name, "a positive multiple of 128 (TPU lanes)")
        for name in ("loss_chunk_tokens", "loss_group_chunks"):
            if getattr(self, name) <= 0:
                bad(name, "a positive integer")

    @property
    def scan_unroll(self) -> int | bool:
        """`unroll` for the `lax.scan` over the layers of a forward without a KV cache
        (training, scoring); with a cache (prefill, decode) the layers are a Python loop."""
        return 1 if self.scan_layers else True
