"""The platform plan: every backend decision read from one table (`runtime.backend.PLANS`), the
platform traced for choosing the row (so an ahead-of-time compile for TPU gets TPU's), and no
other module of the model asking which platform it runs on. Inference programs compile with
their platform's options: `InferenceJit` hands each platform its own jitted function."""

import ast
import pathlib

import jax
import jax.numpy as jnp

from llm_jax.runtime import backend as backend_module
from llm_jax.runtime.backend import PLANS, InferenceJit, compiling_for, plan

LICM = "while-loop-invariant-code-motion"
PACKAGE = pathlib.Path(backend_module.__file__).resolve().parents[1]


def test_cpu_and_tpu_inference_compile_without_loop_invariant_code_motion():
    # Hoisting a decode loop's constant-index layer slices copies the weights (docs/scaling.md).
    for platform in ("cpu", "tpu"):
        options = PLANS[platform].inference_options
        assert LICM in options["xla_disable_hlo_passes"].split(",")
    assert PLANS["gpu"].inference_options is None


def test_the_plan_follows_the_platform_traced_for():
    for platform in ("cpu", "gpu", "tpu"):
        with compiling_for(platform):
            assert plan() is PLANS[platform]
    with compiling_for("rocm"):  # a plugin: native XLA, no CPU workaround
        assert plan() is PLANS["gpu"]
    cpu, tpu = PLANS["cpu"], PLANS["tpu"]
    # The CPU-only workarounds are off everywhere else; the kernels run natively only on their own
    # platform (interpreted on CPU, as the tests run them).
    for name in ("float32_transposed_products", "rows_as_bits", "vocab_chunked_logits",
                 "slice_layers_before_decoding"):
        assert getattr(cpu, name) and not getattr(PLANS["gpu"], name) and not getattr(tpu, name)
    assert tpu.tpu_kernels_native and not cpu.tpu_kernels_native
    assert PLANS["gpu"].triton_kernels_native and PLANS["gpu"].grouped_matmul_kernel == "triton"


def test_only_the_backend_module_and_the_selection_table_ask_for_the_platform():
    askers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    isinstance(node.func, ast.Name) and node.func.id == "backend"
                    or isinstance(node.func, ast.Attribute) and node.func.attr == "default_backend"):
                askers.append(str(path.relative_to(PACKAGE)))
    # select.py picks implementations by platform (its AUTO table); distributed.py configures
    # the process (the compilation cache) and gpu_check reports the device it ran on.
    assert sorted(set(askers)) == ["bench/gpu_check.py", "model/select.py",
                                   "parallel/distributed.py", "runtime/backend.py"], askers


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
    assert seen == [PLANS["tpu"].inference_options, None]  # made once per platform, then reused
    with compiling_for("cpu"):
        assert float(fn(jnp.float32(3))) == 6.0
    assert seen[-1] == PLANS["cpu"].inference_options
