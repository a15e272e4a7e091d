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
import json
from collections.abc import Mapping
from typing import Any

import jax

# model/moe_dispatch.py's table; "auto" picks a dropless one by shape and backend.
MOE_DISPATCHES = ("auto", "dense", "ragged", "gather", "blocked", "gmm", "capacity",
                  "expert_parallel", "expert_parallel_gmm")
# model/select.py's table; "auto" picks by backend and shape.
ATTENTION_IMPLS = ("auto", "direct", "blockwise", "splash", "flash")


def _field(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the model is computed; the defaults pick by backend and shape."""

    moe_dispatch: str = _field(
        "auto", "how tokens reach experts (model/moe_dispatch.py): auto (dropless, by backend "
        "and shape), dense (all E, E/k x the expert FLOPs), ragged / blocked / gather / gmm "
        "(dropless; gmm by Pallas kernels), capacity / expert_parallel / expert_parallel_gmm "
        "(fixed slots; drop overflow in training calls only)")
    moe_capacity_factor: float = _field(
        1.25, "dropping dispatches: slots per expert = factor x T k / E; runs factor x the "
        "expert FLOPs, drops overflow")
    attention_impl: str = _field(
        "auto", "how self-attention runs (model/select.py): auto (splash on TPU, direct / "
        "blockwise by shape elsewhere), direct, blockwise, splash, flash (GPU Pallas kernel, "
        "opt-in); a kernel that cannot take a shape falls back to the shape rule")
    mxfp4_unpack_mib: int = _field(
        256, "dispatches over packed experts (gmm, blocked, expert_parallel_gmm): unpack a "
        "layer's experts in groups of at most this many MiB (at least one expert; 0 = all at "
        "once), bounding the unpacked weights held at a time")
    gmm_tile_m: int = _field(
        512, "megablox (TPU grouped matmul) rows per tile, a multiple of 128: each row tile "
        "re-reads its expert's weights")
    gmm_tile_k: int = _field(
        1024, "megablox contracted lanes per tile, a multiple of 128 (with m and n, bounded by "
        "the kernel's scoped VMEM)")
    gmm_tile_n: int = _field(
        1024, "megablox output lanes per tile, a multiple of 128: each output tile re-reads "
        "the rows (the GPU kernel picks its own tiles)")
    loss_chunk_tokens: int = _field(
        256, "tokens per device in one chunk of the fused unembedding + loss "
        "(model/unembed_loss.py): each holds [tokens, vocab] float32 logits; fewer chunks "
        "re-read the unembedding and its gradient fewer times")
    loss_group_chunks: int = _field(
        1, "loss chunks whose gradients go into dh and dW in one product: the unembedding's "
        "float32 gradient is reduced once a group, for more chunks of [tokens, vocab] gradient "
        "held at once; only where the loss splits by tokens (a mesh whose axes divide the "
        "vocabulary splits it by vocabulary, and keeps dW on each device: no groups)")
    remat: bool = _field(
        False, "recompute each layer in the backward pass: saved activations drop to the layer "
        "inputs, for ~1 extra forward")
    scan_layers: bool = _field(
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
        """`unroll` for every `lax.scan` over the layers (training, prefill, decode)."""
        return 1 if self.scan_layers else True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExecutionConfig":
        """Builds a config from a mapping; unknown keys are refused by name."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ExecutionConfig: unknown field(s) {unknown}; known fields are "
                             f"{sorted(known)}")
        for f in dataclasses.fields(cls):  # JSON has no int/float distinction for floats
            if f.name in d and f.type == "float" and isinstance(d[f.name], int) \
                    and not isinstance(d[f.name], bool):
                d[f.name] = float(d[f.name])
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "ExecutionConfig":
        return cls.from_dict(json.loads(s))

    def replace(self, **changes: Any) -> "ExecutionConfig":
        return dataclasses.replace(self, **changes)
