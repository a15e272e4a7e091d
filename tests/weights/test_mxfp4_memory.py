"""Loading an MXFP4 checkpoint never holds the dense expert stack: a child process
loads a checkpoint whose expert stacks would take DENSE_BYTES dense (bfloat16) and ~3.8x less
packed, and its peak resident memory during the load must stay below what the dense stacks
alone would take; the same load asked for expert_format="dense" exceeds it (the control: the
cap is one the dense model cannot meet). The peak is the kernel's high-water mark (VmHWM),
reset after the child's imports and a warm-up load (/proc/self/clear_refs) and after free heap
memory went back to the system (malloc_trim: pages freed but still resident would otherwise
be reused unseen), so the figure is the load's own.

One child process measures every load in turn (LOADS), settling memory before each. Run as a
script (`python tests/weights/test_mxfp4_memory.py DIR`) it is that child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# 2 layers x 16 experts x (1024 x 2048 + 1024 x 1024) = 101M expert values.
SHAPE = dict(num_hidden_layers=2, num_experts=16, experts_per_token=4, vocab_size=128,
             hidden_size=1024, intermediate_size=1024, head_dim=64, num_attention_heads=8,
             num_key_value_heads=2, sliding_window=8, rope_theta=10000.0)
EXPERT_VALUES = 2 * 16 * 1024 * 3 * 1024
DENSE_BYTES = 2 * EXPERT_VALUES  # bfloat16
PACKED_BYTES = EXPERT_VALUES // 2 + EXPERT_VALUES // 32  # 4-bit codes + a scale per 32


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


# The loads one child process measures, in this order: the control (dense) last, so that any
# memory an earlier load left resident could only lower its figure, never pass it.
LOADS = (("openai", "stored"), ("hf", "stored"), ("openai", "dense"))


def child(root: Path) -> None:
    """For each of LOADS: loads `root / layout / "big"` (experts as stored, or dense) after a
    warm-up load of `root / layout / "warm"`; prints the load's peak RSS growth and the expert
    format it got, as one JSON line per load."""
    import ctypes
    import gc

    from llm_jax import load_pretrained

    def settle() -> None:  # free memory back to the system, then VmHWM := VmRSS
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")

    for layout, expert_format in LOADS:
        overrides = {"expert_format": expert_format} if expert_format != "stored" else {}
        warm = load_pretrained(root / layout / "warm", **overrides)
        del warm
        settle()
        before = _kib("VmRSS")
        model = load_pretrained(root / layout / "big", **overrides)
        peak = _kib("VmHWM")
        print(json.dumps({"layout": layout, "load": expert_format,
                          "peak_growth": (peak - before) * 1024,
                          "expert_format": model.cfg.expert_format}), flush=True)
        del model
        settle()


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


needs_peak_reset = pytest.mark.skipif(
    not _can_reset_peak(), reason="needs Linux /proc/self/clear_refs (peak RSS reset) to "
                                  "measure one load's peak")


@pytest.fixture(scope="module")
def peak_growth(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """{(layout, "stored" or "dense"): the child's figures}, from one child process for all
    LOADS (one interpreter start and import rather than one per load)."""
    from helpers import ROOT, write_mxfp4_checkpoint

    from llm_jax import ModelConfig

    root = tmp_path_factory.mktemp("mxfp4_memory")
    small = {**SHAPE, "hidden_size": 32, "intermediate_size": 32, "num_experts": 4}
    for layout in sorted({layout for layout, _ in LOADS}):
        write_mxfp4_checkpoint(root / layout / "big", ModelConfig(**SHAPE), layout)
        write_mxfp4_checkpoint(root / layout / "warm", ModelConfig(**small), layout)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, __file__, str(root)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.strip().splitlines():
        row = json.loads(line)
        out[row["layout"], row["load"]] = row
        print(f"\n{row['layout']} {row['load']}: peak RSS growth of the load "
              f"{row['peak_growth'] / 2**20:.0f} MiB; experts {PACKED_BYTES / 2**20:.0f} MiB "
              f"packed, {DENSE_BYTES / 2**20:.0f} MiB dense")
    assert set(out) == set(LOADS)
    return out


@needs_peak_reset
@pytest.mark.parametrize("layout", ["openai", "hf"])
def test_loading_mxfp4_never_holds_the_dense_expert_stacks(layout, peak_growth):
    out = peak_growth[layout, "stored"]
    assert out["expert_format"] == "mxfp4"
    assert out["peak_growth"] >= PACKED_BYTES  # the measure sees the load: it holds the bytes
    assert out["peak_growth"] < DENSE_BYTES


@needs_peak_reset
def test_the_memory_cap_is_one_a_dense_load_exceeds(peak_growth):
    out = peak_growth["openai", "dense"]
    assert out["expert_format"] == "dense"
    assert out["peak_growth"] >= DENSE_BYTES


if __name__ == "__main__":
    child(Path(sys.argv[1]))
