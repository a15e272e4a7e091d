"""A compiled step's roofline: which kernels it holds, its FLOPs and bytes, and the step time and
MFU they bound on a chip's published peak FLOP/s and HBM bandwidth.

The roofline step time is max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) per chip: no program
runs faster, and communication, latency and imperfect overlap make real steps slower. The MFU
bound is the model FLOPs of the step (describe's 6 N + attention formula) over peak x that time.
FLOPs and bytes come from `compiled.cost_analysis()` of the per-chip (SPMD-partitioned) program;
XLA counts a Pallas call by the kernel's own `CostEstimate` (megablox has one, splash none: its
attention FLOPs are then missing, so the FLOP term uses max(compiled, model FLOPs per chip)).
"""

from __future__ import annotations

import re
from typing import Any

# jax device_kind -> (peak dense bf16 FLOP/s, HBM bytes/s) per jax device: a chip, except on
# TPU7x, whose chip (2,307 TFLOP/s, 7,380 GB/s) is two devices; sources in docs/scaling.md.
CHIP_PEAKS: dict[str, tuple[float, float]] = {
    "TPU v4": (275e12, 1200e9),
    "TPU v5 lite": (197e12, 819e9),
    "TPU v5": (459e12, 2765e9),
    "TPU v6 lite": (918e12, 1638e9),
    "TPU7x": (2307e12 / 2, 7380e9 / 2),
}

# Substrings of Pallas kernel names (pallas_call `name=`) -> the kernel family they belong to.
KERNEL_FAMILIES = (("splash", "splash_attention"), ("gmm", "megablox_gmm"),
                   ("tgmm", "megablox_tgmm"))


def kernels_in(hlo_text: str) -> dict[str, int]:
    """Counts of Pallas TPU custom calls in compiled HLO text, by kernel name: the instruction
    is named after the kernel (`%splash_mha_fwd_residuals.1 = ... custom-call(...)`)."""
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%([A-Za-z_][\w-]*?)(?:\.\d+)?\s*=", line)
        name = m.group(1) if m else "tpu_custom_call"
        counts[name] = counts.get(name, 0) + 1
    return counts


def triton_kernels(stablehlo_text: str) -> dict[str, int]:
    """Counts of Pallas-Triton kernels in lowered (StableHLO) text, by kernel name."""
    counts: dict[str, int] = {}
    for line in stablehlo_text.splitlines():
        if "@__gpu$xla.gpu.triton" in line:
            m = re.search(r'\bname = "([^"]+)"', re.sub(r'\bir = "[^"]*"', "", line))
            name = m.group(1) if m else "triton"
            counts[name] = counts.get(name, 0) + 1
    return counts


CUDA_TARGET = "NVIDIA H100"  # the GPU `triton_kernels_for_cuda` lowers for


def triton_kernels_for_cuda(fn: Any, *args: Any) -> dict[str, int]:
    """The Triton kernels `fn(*args)` runs on an NVIDIA GPU, found on any host: Pallas emits the
    Triton IR itself when lowering for CUDA; only compiling it to PTX needs the device."""
    import jax

    # The target GPU is named by an abstract device: jax >= 0.11's Triton lowering reads the
    # compute capability from it when no GPU is attached (any Hopper-class kind would do).
    gpu = jax.sharding.AbstractDevice(device_kind=CUDA_TARGET, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return triton_kernels(lowered.as_text())


def kernel_families(counts: dict[str, int]) -> list[str]:
    """['splash_attention', 'megablox_gmm', ...] present in `kernels_in`'s counts."""
    found = []
    for name in counts:
        low = name.lower()
        fam = next((f for key, f in KERNEL_FAMILIES[::-1] if key in low), name)
        if fam not in found:
            found.append(fam)
    return sorted(found)


def cost(compiled: Any) -> dict[str, float]:
    """FLOPs and bytes accessed of one step on one chip (cost_analysis of the compiled program)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"flops": float(ca.get("flops", 0.0)),
            "bytes": float(ca.get("bytes accessed", 0.0)),
            "transcendentals": float(ca.get("transcendentals", 0.0))}


def roofline(device_kind: str, flops: float, bytes_: float,
             model_flops_per_chip: float) -> dict[str, Any] | None:
    """Roofline step time (s), which term binds, and the MFU bound; None for an unknown chip."""
    if device_kind not in CHIP_PEAKS:
        return None
    peak, bw = CHIP_PEAKS[device_kind]
    t_flops = max(flops, model_flops_per_chip) / peak
    t_bytes = bytes_ / bw
    t = max(t_flops, t_bytes)
    return {"peak_flops": peak, "hbm_bandwidth": bw, "flops_seconds": t_flops,
            "bytes_seconds": t_bytes, "step_seconds": t,
            "bound": "compute" if t_flops >= t_bytes else "memory",
            "mfu_bound": model_flops_per_chip / (peak * t) if t > 0 else 0.0}
