"""Roofline arithmetic and kernel detection in compiled HLO text; an ahead-of-time TPU compile
of splash and gmm where libtpu is installed."""

import jax
import jax.numpy as jnp
import pytest
from helpers import NEEDS_LIBTPU

from llm_jax.parallel.roofline import kernel_families, kernels_in, roofline

HLO = """  %splash_mha_fwd_residuals.1 = (f32[2]) custom-call(%a), custom_call_target="tpu_custom_call"
  ROOT %gmm.1 = bf16[512,512]{1,0} custom-call(%b), custom_call_target="tpu_custom_call", x
  %tgmm = bf16[5] custom-call(%b), custom_call_target="tpu_custom_call", y
  %dot.3 = f32[2] dot(%a, %b)"""


def test_kernels_are_found_by_instruction_name():
    counts = kernels_in(HLO)
    assert counts == {"splash_mha_fwd_residuals": 1, "gmm": 1, "tgmm": 1}
    assert kernel_families(counts) == ["megablox_gmm", "megablox_tgmm", "splash_attention"]


def test_roofline_takes_the_slower_term():
    r = roofline("TPU v5", flops=459e12, bytes_=2765e9 * 2, model_flops_per_chip=229.5e12)
    assert r["bound"] == "memory" and r["step_seconds"] == pytest.approx(2.0)
    assert r["mfu_bound"] == pytest.approx(0.25)
    # a kernel whose FLOPs XLA cannot see: the model's FLOPs bound the compute term
    assert roofline("TPU v5", 0.0, 0.0, 459e12)["flops_seconds"] == pytest.approx(1.0)
    assert roofline("TPU v9", 1.0, 1.0, 1.0) is None


@NEEDS_LIBTPU
def test_splash_and_gmm_compile_for_tpu_under_a_mesh():
    import os

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    from llm_jax.kernels.grouped_matmul import grouped_matmul
    from llm_jax.kernels.splash_attention import splash_attend
    from llm_jax.parallel.sharding import make_mesh

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, list(devices))
    ns = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16, sharding=ns("fsdp", None, "tensor"))
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16, sharding=ns("fsdp", None, "tensor"))
    s = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=ns("tensor"))
    w = jax.ShapeDtypeStruct((), jnp.int32, sharding=ns())

    def loss(q, k, v, s, w):
        pos = jnp.broadcast_to(jnp.arange(256), (2, 256))
        return splash_attend(q, k, v, s, pos, pos, w, windows=(0, 128)).astype(jnp.float32).sum()

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 3))).lower(q, kv, kv, s, w).compile().as_text()
    names = kernels_in(text)
    assert any("splash" in n and "fwd" in n for n in names), names
    assert any("dq" in n for n in names) and any("dkv" in n for n in names), names

    one = jax.sharding.SingleDeviceSharding(devices[0])
    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=one)
    wt = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16, sharding=one)
    g = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=one)
    text = jax.jit(lambda x, w, g: grouped_matmul(x, w, g, kernel="megablox")).lower(
        x, wt, g).compile().as_text()
    assert kernels_in(text) == {"gmm": 1}
