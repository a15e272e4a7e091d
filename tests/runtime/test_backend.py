"""Inference programs compile with their platform's options: `InferenceJit` hands each platform
(the one traced for, so an ahead-of-time compile for TPU gets TPU's) its own jitted function."""

import jax
import jax.numpy as jnp

from llm_jax.runtime import backend as backend_module
from llm_jax.runtime.backend import INFERENCE_OPTIONS, InferenceJit, compiling_for

LICM = "while-loop-invariant-code-motion"


def test_cpu_and_tpu_inference_compile_without_loop_invariant_code_motion():
    # Hoisting a decode loop's constant-index layer slices copies the weights (docs/scaling.md).
    for platform in ("cpu", "tpu"):
        assert LICM in INFERENCE_OPTIONS[platform]["xla_disable_hlo_passes"].split(",")
    assert "gpu" not in INFERENCE_OPTIONS


def test_each_platform_gets_its_own_options(monkeypatch):
    seen = []
    real_jit = jax.jit

    def recording_jit(fn, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fn, **kwargs)

    monkeypatch.setattr(backend_module.jax, "jit", recording_jit)
    fn = InferenceJit(lambda x: x * 2)
    for platform in ("tpu", "gpu", "tpu"):
        with compiling_for(platform):
            fn.for_platform()
    assert seen == [INFERENCE_OPTIONS["tpu"], None]  # made once per platform, then reused
    with compiling_for("cpu"):
        assert float(fn(jnp.float32(3))) == 6.0
    assert seen[-1] == INFERENCE_OPTIONS["cpu"]
