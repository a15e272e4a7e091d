"""XLA:CPU's cheapest code generation, for the suite and the processes it starts.

The tests compile hundreds of small programs and run each a few times, so compiling dominates
the suite's CPU time. These flags skip LLVM's optimisation of the
generated loops, which halves a compile. jaxlib 0.10's XLA:CPU also still has its elemental IR
emitters beside the newer fusion emitters: they compile the suite's programs about 3x faster
and run them about as fast, with the same results (a train step's loss to the last bit). Later
XLA removed that choice, and an unknown flag in XLA_FLAGS aborts, so it is only set there.
No jax import here: XLA_FLAGS must be set before JAX starts its backend.
"""

from importlib.metadata import version


def _jaxlib_version() -> tuple[int, int]:
    major, minor = version("jaxlib").split(".")[:2]
    return int(major), int(minor)


FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if _jaxlib_version() < (0, 11):
    FAST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"

# Eight CPU devices for the sharding tests' processes, with the same code generation.
EIGHT_DEVICES = f"--xla_force_host_platform_device_count=8 {FAST_XLA_FLAGS}"
