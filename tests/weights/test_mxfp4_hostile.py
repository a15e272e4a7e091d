"""Hostile MXFP4 tensors: wrong block or scale shapes, wrong dtypes, blocks without
scales (and the reverse), truncated data, in the OpenAI, Hugging Face and llm_jax layouts. Each
is a ValueError naming the tensor and the file, raised before any tensor's data is read (so
before anything sized by a hostile header is allocated). A checkpoint packed in some layers only
loads dense, exactly, rather than having the rest quantized behind the caller's back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_mxfp4_checkpoint
from safetensors.numpy import load_file, save_file

from llm_jax import ModelConfig, load_pretrained
from llm_jax.weights import flat, mxfp4, readers, tensor_store, writers

CFG = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=3, vocab_size=64,
                  hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=8, rope_theta=10000.0)
E, F2, D = CFG.num_experts, 2 * CFG.intermediate_size, CFG.hidden_size  # mlp1: (E, 2F, D / 32)
OA = "block.1.mlp.mlp1_weight"
HF = "model.layers.1.mlp.experts.gate_up_proj"


def refuse_reads(monkeypatch) -> None:
    """From here on, any read of tensor data (or building the model's params) fails the test:
    the refusal must come from the headers alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read before the checkpoint was refused")
    monkeypatch.setattr(tensor_store.TensorStore, "get", refuse)
    monkeypatch.setattr(readers, "model_from_params", refuse)


def _edit(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _replace(name: str, array: np.ndarray):
    return lambda t: t.__setitem__(name, array)


CASES = {  # id: (layout, edit of the tensors, what the error says besides tensor and file)
    "blocks of 8 bytes": ("openai", _replace(OA + ".blocks", np.zeros((E, F2, 2, 8), np.uint8)),
                          OA + ".blocks", r"shape \(4, 64, 2, 8\), expected \(4, 64, 2, 16\)"),
    "blocks one group short": ("openai",
                               _replace(OA + ".blocks", np.zeros((E, F2, 1, 16), np.uint8)),
                               OA + ".blocks", r"expected \(4, 64, 2, 16\)"),
    "scales with a group too many": ("hf", _replace(HF + "_scales", np.zeros((E, F2, 3), np.uint8)),
                                     HF + "_scales", r"shape \(4, 64, 3\), expected \(4, 64, 2\)"),
    "scales of another expert count": ("hf",
                                       _replace(HF + "_scales", np.zeros((5, F2, 2), np.uint8)),
                                       HF + "_scales", r"axis 0 = num_local_experts or"),
    "blocks as float32": ("openai", _replace(OA + ".blocks", np.zeros((E, F2, 2, 16), np.float32)),
                          OA + ".blocks", "dtype float32, expected uint8"),
    "blocks as int8": ("hf", _replace(HF + "_blocks", np.zeros((E, F2, 2, 16), np.int8)),
                       HF + "_blocks", "dtype int8, expected uint8"),
    "scales as float16": ("openai",
                           _replace(OA + ".scales", np.zeros((E, F2, 2), np.float16)),
                           OA + ".scales", "dtype float16, expected uint8"),
    "blocks without scales": ("openai", lambda t: t.pop(OA + ".scales"),
                              OA + ".blocks", f"but not '{OA}.scales'"),
    "scales without blocks": ("hf", lambda t: t.pop(HF + "_blocks"),
                              HF + "_scales", f"but not '{HF}_blocks'"),
    "plain and packed both": ("openai",
                              _replace(OA, np.zeros((E, F2, D), np.float32)),
                              OA + ".blocks", "plain or as MXFP4 blocks and scales, not both"),
}


@pytest.mark.parametrize("case", CASES)
def test_hostile_mxfp4_tensor_is_refused_by_name_before_any_read(case, tmp_path, monkeypatch):
    layout, edit, name, want = CASES[case]
    write_mxfp4_checkpoint(tmp_path, CFG, layout)
    path = tmp_path / "model.safetensors"
    _edit(path, edit)
    refuse_reads(monkeypatch)
    with pytest.raises(ValueError, match=want) as e:
        load_pretrained(tmp_path)
    assert repr(name) in str(e.value) or name in str(e.value), e.value
    assert str(path) in str(e.value), e.value


def _move_last(path: Path, name: str) -> int:
    """Rewrites a safetensors file with tensor `name`'s bytes at the end of the data; returns
    the offset of the data section."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: (k == name, k))
    out, pos = b"", 0
    for k in order:
        a, b = header[k]["data_offsets"]
        out += data[a:b]
        header[k]["data_offsets"] = [pos, pos + b - a]
        pos += b - a
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + out)
    return 8 + len(text)


@pytest.mark.parametrize("layout, name", [("openai", OA + ".blocks"), ("hf", HF + "_scales")])
@pytest.mark.parametrize("cut", [1, 100])
def test_truncated_mxfp4_data_is_refused_by_name(layout, name, cut, tmp_path, monkeypatch):
    write_mxfp4_checkpoint(tmp_path, CFG, layout)
    path = tmp_path / "model.safetensors"
    _move_last(path, name)
    path.write_bytes(path.read_bytes()[:-cut])
    refuse_reads(monkeypatch)
    with pytest.raises(ValueError, match="truncated") as e:
        load_pretrained(tmp_path)
    assert repr(name) in str(e.value) and str(path) in str(e.value), e.value


@pytest.mark.parametrize("key, array, want", [
    ("layers.mlp.gate_up_proj_blocks", np.zeros((2, E, 2, 16, F2), np.float32),
     "dtype float32, expected uint8"),
    ("layers.mlp.down_proj_scales", np.zeros((2, E, 2, D), np.uint8),
     r"shape \(2, 4, 2, 64\), expected \(2, 4, 1, 64\)"),
])
def test_hostile_mxfp4_in_an_llm_jax_checkpoint_is_refused_by_name(key, array, want, tmp_path,
                                                                  monkeypatch):
    write_mxfp4_checkpoint(tmp_path / "src", CFG, "hf")
    writers.save_llm_jax(load_pretrained(tmp_path / "src"), tmp_path / "lj")
    path = tmp_path / "lj" / "params.safetensors"
    _edit(path, _replace(key, array))
    refuse_reads(monkeypatch)
    with pytest.raises(ValueError, match=want) as e:
        load_pretrained(tmp_path / "lj")
    assert repr(key) in str(e.value) and str(path) in str(e.value), e.value


def test_checkpoint_packed_in_some_layers_only_loads_dense_exactly(tmp_path):
    tensors = write_mxfp4_checkpoint(tmp_path, CFG, "openai", dtype="float32")
    name = "block.1.mlp.mlp2_weight"
    deq = mxfp4.dequantize_mxfp4(tensors[name + ".blocks"], tensors[name + ".scales"])

    def edit(t):  # layer 1's mlp2 plain (its exact values), everything else packed
        t.pop(name + ".blocks"), t.pop(name + ".scales")
        t[name] = deq
    _edit(tmp_path / "model.safetensors", edit)
    model = load_pretrained(tmp_path)
    assert model.cfg.expert_format == "dense"  # not: layer 1 quantized behind the caller's back
    w = flat.flat_params(model)["layers.mlp.down_proj"]  # [L, E, F, D]
    np.testing.assert_array_equal(w[1], np.swapaxes(deq, -1, -2))
    name0 = "block.0.mlp.mlp2_weight"
    np.testing.assert_array_equal(w[0], np.swapaxes(mxfp4.dequantize_mxfp4(
        tensors[name0 + ".blocks"], tensors[name0 + ".scales"]), -1, -2))


@pytest.mark.parametrize("layout, name", [("openai", "block.0.mlp.mlp1_weight.blocks"),
                                          ("hf", "model.layers.0.mlp.experts.gate_up_proj_blocks")])
def test_packed_checkpoint_of_a_size_mxfp4_cannot_hold_is_refused_by_field(layout, name, tmp_path,
                                                                         monkeypatch):
    write_mxfp4_checkpoint(tmp_path, CFG, layout)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    refuse_reads(monkeypatch)
    with pytest.raises(ValueError, match="hidden_size=48") as e:
        load_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and repr(name) in str(e.value)
