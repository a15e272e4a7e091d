"""Which platform the program being traced will run on, and what that changes: the one place
traced code learns its platform (host-side tools ask about their devices themselves: the matmul
peak, the compilation cache, the ahead-of-time compile's memory report). `plan()` is the
platform's row of `PLANS`, every backend decision and CPU-only workaround by name; the model,
the kernels' callers and the inference programs read those names and never the platform itself
(model/select.py's `AUTO` table, which picks the implementations, reads `backend()`).
Ahead-of-time compilation for other hardware answers the question with `compiling_for`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

# Compiler options of the inference programs (generation, the engine's prefill and decode,
# scoring) on XLA:CPU, where a large model's weights fill most of the host's memory:
# - The memory-optimized scheduler. The default one orders a program for concurrency and
#   ignores memory: it ran every layer's weight-only work (a layer's slice, packed experts
#   unpacked) before the first layer, all of it live at once (a 16-token prefill of gpt-oss-20b:
#   12.9 GiB of temporaries, 74 GiB with the dense dispatch; 2.2 GiB with this scheduler).
# - No while-loop invariant code motion. Hoisted out of a loop, work lives for the whole loop:
#   the 16-bit copies of the embedding and unembedding that XLA:CPU makes to gather or slice
#   them (it has no bfloat16 data movement), the float32 copies of every layer's attention
#   weights (no bfloat16 matmul), and a copy of the whole table in the vocabulary-chunked
#   logits (gpt-oss-20b decoding: 20.7 GiB peak with the pass, 14.9 GiB without, as fast).
# Training keeps XLA's defaults: the scheduler made the tiny config's train step 3-5 % slower.
NO_LOOP_INVARIANT_CODE_MOTION = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
CPU_INFERENCE_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                         **NO_LOOP_INVARIANT_CODE_MOTION}
# XLA:TPU: no while-loop invariant code motion either. A decode step takes each layer's slice of
# the stacked weights with a constant index, tied to the layer's input by an optimization
# barrier (`model.transformer._layer_slice`); in a sharded program libtpu can drop the barrier
# before this pass runs, which then hoists every layer's slice out of the decode loop as a copy
# (gpt-oss-120b's generate at prompt 4096 on v5e-8: 16.60 GB needed of 15.75 with the pass,
# 14.97 GiB without). Training keeps the defaults; GPU keeps them too (not measured).

# The platform being traced for, set only inside `compiling_for` (ahead-of-time compilation for
# other hardware); a context variable, so concurrent threads tracing for different targets
# do not see each other's.
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("llm_jax_target",
                                                                     default=None)


@dataclasses.dataclass(frozen=True)
class PlatformPlan:
    """What the programs traced for one platform do differently from the others."""

    platform: str
    # Pallas kernels compile natively: the TPU ones (splash attention, megablox) on TPU, the
    # Triton ones (kernels/*_gpu.py) on GPU; elsewhere they run in interpret mode (CPU tests).
    tpu_kernels_native: bool
    triton_kernels_native: bool
    # The grouped-matmul MoE's kernel: "triton" (kernels/gmm_gpu.py) or "megablox".
    grouped_matmul_kernel: str
    # XLA:CPU has no bfloat16 matmul of its own: a 16-bit product whose layout is not a plain
    # batched matmul runs on float32 copies of its operands (model/matmul.py), which is the same
    # float32-accumulated product and faster than XLA:CPU's own conversion.
    float32_transposed_products: bool
    # XLA:CPU has no bfloat16 data movement: it widens a whole 16-bit table to float32 for one
    # gather or slice of it, so 16-bit rows move as their uint16 bit patterns (unembed_loss.rows).
    rows_as_bits: bool
    # XLA:CPU converts a 16-bit unembedding to float32 whole before the logits' product: the
    # logits walk its rows in chunks instead (unembed_loss.CPU_VOCAB_CHUNK).
    vocab_chunked_logits: bool
    # An optimization barrier ties a decode step's layer slice to the layer's input, so the slice
    # is not hoisted out of the decode loop as a copy (transformer._layer_slice); XLA:CPU needs no
    # barrier: its inference programs run without loop-invariant code motion.
    layer_slice_barrier: bool
    # Decoding slices the stacked layer weights once before the loop (inference/loop.py): XLA:CPU
    # otherwise copies each layer's slice inside the loop, every step.
    slice_layers_before_decoding: bool
    # Compiler options of the inference programs (CPU_INFERENCE_OPTIONS on CPU,
    # NO_LOOP_INVARIANT_CODE_MOTION on TPU, none on GPU).
    inference_options: dict[str, str] | None


PLANS: dict[str, PlatformPlan] = {
    "cpu": PlatformPlan("cpu", tpu_kernels_native=False, triton_kernels_native=False,
                        grouped_matmul_kernel="megablox", float32_transposed_products=True,
                        rows_as_bits=True, vocab_chunked_logits=True, layer_slice_barrier=False,
                        slice_layers_before_decoding=True,
                        inference_options=CPU_INFERENCE_OPTIONS),
    "gpu": PlatformPlan("gpu", tpu_kernels_native=False, triton_kernels_native=True,
                        grouped_matmul_kernel="triton", float32_transposed_products=False,
                        rows_as_bits=False, vocab_chunked_logits=False, layer_slice_barrier=True,
                        slice_layers_before_decoding=False, inference_options=None),
    "tpu": PlatformPlan("tpu", tpu_kernels_native=True, triton_kernels_native=False,
                        grouped_matmul_kernel="megablox", float32_transposed_products=False,
                        rows_as_bits=False, vocab_chunked_logits=False, layer_slice_barrier=True,
                        slice_layers_before_decoding=False,
                        inference_options=NO_LOOP_INVARIANT_CODE_MOTION),
}


def plan() -> PlatformPlan:
    """The plan of the platform being traced for (`backend()`); an unknown platform (a plugin)
    gets the GPU row: native XLA kernels, no CPU workaround."""
    return PLANS.get(backend(), PLANS["gpu"])


def backend() -> str:
    """The platform the program being traced will run on: `jax.default_backend()`, or the
    target of an enclosing `compiling_for` (a TPU topology compiled from a CPU host)."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace for `platform` ('tpu', 'gpu', 'cpu'): `auto` picks that backend's kernels."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


class InferenceJit:
    """`jax.jit(fn, **jit_kwargs)` compiled with the inference options of the platform being
    traced for (`plan()`, so an ahead-of-time compile for TPU gets TPU's): one jitted function
    per platform, made on first use. Called, or `.lower(...)`, like a jitted one."""

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any):
        self.fn, self.jit_kwargs = fn, jit_kwargs
        self.jitted: dict[str, Any] = {}

    def for_platform(self) -> Any:
        target = plan()
        if target.platform not in self.jitted:
            self.jitted[target.platform] = jax.jit(
                self.fn, compiler_options=target.inference_options, **self.jit_kwargs)
        return self.jitted[target.platform]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.for_platform()(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self.for_platform().lower(*args, **kwargs)
