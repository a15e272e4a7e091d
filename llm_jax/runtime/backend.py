"""Which platform the program being traced will run on: the one question about the hardware that
the model and the kernels ask (`backend()`), and the way ahead-of-time compilation for other
hardware answers it (`compiling_for`).
"""

from __future__ import annotations

import contextlib
import contextvars
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
INFERENCE_OPTIONS: dict[str, dict[str, str]] = {"cpu": CPU_INFERENCE_OPTIONS,
                                                "tpu": NO_LOOP_INVARIANT_CODE_MOTION}

# The platform being traced for, set only inside `compiling_for` (ahead-of-time compilation for
# other hardware); a context variable, so concurrent threads tracing for different targets
# do not see each other's.
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("llm_jax_target",
                                                                     default=None)


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
    """`jax.jit(fn, **jit_kwargs)` compiled with the INFERENCE_OPTIONS of the platform being
    traced for (`backend()`, so an ahead-of-time compile for TPU gets TPU's): one jitted
    function per platform, made on first use. Called, or `.lower(...)`, like a jitted one."""

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any):
        self.fn, self.jit_kwargs = fn, jit_kwargs
        self.jitted: dict[str, Any] = {}

    def for_platform(self) -> Any:
        platform = backend()
        if platform not in self.jitted:
            self.jitted[platform] = jax.jit(
                self.fn, compiler_options=INFERENCE_OPTIONS.get(platform), **self.jit_kwargs)
        return self.jitted[platform]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.for_platform()(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self.for_platform().lower(*args, **kwargs)
