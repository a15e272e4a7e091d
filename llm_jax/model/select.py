"""Which attention and MoE implementation a run uses: one table per backend, `auto` by default.
The one place that picks implementations: `attention_impl` for the layer's attention, `auto_moe`
for the MoE dispatch's `auto` (`moe_dispatch.select_dispatch` runs it, or the configured one or
its exact fallback; `moe_impl` names the choice in reports, `kernels_line`). How a chosen
implementation runs on the platform (kernels native or interpreted, the CPU-only workarounds) is
`runtime.backend.plan`'s, the one table of those.

`ExecutionConfig.attention_impl` and `ExecutionConfig.moe_dispatch` override it. The table is by
backend because a kernel is only fast (or only runs) where it was written for: splash attention
and megablox are Pallas TPU kernels (on CPU they would run in the slow interpret mode), and
XLA:CPU lowers `ragged_dot` densely.

| backend | attention                               | MoE (many tokens)  |
|---------|-----------------------------------------|--------------------|
| any     |                                         | gather if T k <= E |
| cpu     | direct, blockwise for long S (by shape) | blocked            |
| gpu     | direct, blockwise for long S (by shape) | ragged             |
| tpu     | splash (self-attention, T % 128 == 0)   | gmm (megablox)     |

TPU's MoE is `gmm` because the compiler makes it better than XLA's own `ragged_dot` lowering
(docs/scaling.md, "Why each default"): on the tiny config for v5p-8, 7.6 % fewer bytes
accessed and a 1.0 min compile against 1.7; gpt-oss-20b on v5p-32 with `ragged` does not
compile in 24 GiB of host memory, with `gmm` it compiles in 11.8 GiB.

On GPU, `flash` (kernels/flash_attention_gpu.py) and `gmm` (kernels/gmm_gpu.py through
model/moe_parallel.py), Pallas with the Triton lowering, are opt-in (`attention_impl="flash"`,
`moe_dispatch="gmm"`) until they have run on one (launch/gpu_check.sh times them against this
table); they are tested in interpret mode and lowered for CUDA on CPU hosts.
Decoding (T = 1) and shapes a kernel cannot take fall back to the shape rule on every backend.
"""

from __future__ import annotations

# Imported with the model, never first during a trace: importing Pallas' TPU module adds a value
# to JAX's trace context (jax 0.12), so a first import inside the first step's trace made every
# jitted step miss its cache on the second call and compile again (tests/training/test_compile_cache.py).
import jax.experimental.pallas.tpu  # noqa: F401

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.kernels.flash_attention_gpu import flash_applies
from llm_jax.kernels.splash_attention import splash_applies
from llm_jax.model.blockwise_attention import use_blockwise
from llm_jax.runtime.backend import backend

# backend -> {"attention": name or "shape" (direct / blockwise by use_blockwise), "moe": name}
AUTO: dict[str, dict[str, str]] = {
    "cpu": {"attention": "shape", "moe": "blocked"},
    "gpu": {"attention": "shape", "moe": "ragged"},
    "tpu": {"attention": "splash", "moe": "gmm"},
}


def _row(platform: str | None) -> dict[str, str]:
    return AUTO.get(platform or backend(), AUTO["gpu"])


def attention_impl(cfg: ModelConfig, execution: ExecutionConfig, batch: int, q_len: int,
                   kv_len: int, platform: str | None = None) -> str:
    """'direct', 'blockwise', 'splash' or 'flash' for a self-attention call of this shape."""
    name = execution.attention_impl
    if name == "auto":
        name = _row(platform)["attention"]
    if name == "splash" and not (q_len > 1 and splash_applies(q_len, kv_len)):
        name = "shape"
    if name == "flash" and not (q_len > 1 and flash_applies(q_len, kv_len)):
        name = "shape"
    if name == "shape":
        return "blockwise" if use_blockwise(batch, q_len, kv_len, cfg.num_attention_heads) \
            else "direct"
    return name


def auto_moe(cfg: ModelConfig, num_tokens: int | None = None,
             platform: str | None = None) -> str:
    """`auto`'s dropless MoE dispatch: `gather` when T k <= E (decoding a small batch reads only
    the chosen experts), else the backend's row of `AUTO` (also when `num_tokens` is None)."""
    if num_tokens is not None and num_tokens * cfg.experts_per_token <= cfg.num_experts:
        return "gather"
    return _row(platform)["moe"]


def moe_impl(cfg: ModelConfig, execution: ExecutionConfig, platform: str | None = None) -> str:
    """The MoE dispatch a run names for many tokens (T k > E) on `platform`."""
    if execution.moe_dispatch != "auto":
        return execution.moe_dispatch
    return auto_moe(cfg, None, platform)


def kernels_line(cfg: ModelConfig, execution: ExecutionConfig, batch: int, seq_len: int,
                 platform: str | None = None) -> str:
    """'attention=splash moe=gmm (tpu)': what a training step of this shape runs."""
    p = platform or backend()
    return (f"attention={attention_impl(cfg, execution, batch, seq_len, seq_len, p)} "
            f"moe={moe_impl(cfg, execution, p)} ({p})")
