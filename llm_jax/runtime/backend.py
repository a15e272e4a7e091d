"""Which platform the program being traced will run on: the one question about the hardware that
the model and the kernels ask (`backend()`), and the way ahead-of-time compilation for other
hardware answers it (`compiling_for`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

# XLA:CPU's default scheduler orders a program for concurrency and ignores memory: with weights
# that only depend on parameters (a layer's slice, packed experts unpacked) it runs every
# layer's weight work first and keeps all of it live. gpt-oss-20b's prefill of 16 tokens with
# packed experts held 12.9 GiB of temporaries that way (74 GiB with the dense dispatch), 2.2
# GiB with the memory-optimized scheduler; the tiny config decodes as fast with it (batch 1
# and 8, docs/benchmarks.md), while its train step was 3-5 % slower, so the inference programs
# use it. The option is XLA's own (DebugOptions); GPU and TPU compiles accept and ignore it.
MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}

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
