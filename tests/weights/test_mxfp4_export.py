"""MXFP4 export: a packed model written in any layout (Hugging Face, OpenAI, llm_jax,
by the writers or by `python -m llm_jax.convert`) holds bitwise the MXFP4 bytes it was read
from; `--expert_format` dequantizes exactly or quantizes with the error reported; and an
OpenAI-layout export is one OpenAI's own loader (`gpt_oss.torch`, PyPI) reads, with the same
logits as llm_jax (float32 on both sides, max |diff| <= 1e-4, the tolerance of the
transformers parity tests).

The source checkpoints are written with numpy + safetensors (random blocks, scales near 2^0),
never through a model, so the bytes compared are the files' own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, write_mxfp4_checkpoint
from safetensors.numpy import load_file, save_file

from llm_jax import ModelConfig, load_pretrained
from llm_jax.convert import main as convert_main
from llm_jax.weights import flat, mxfp4, writers

CONFIGS = {  # experts_per_token 2, 4 and 3; N * H != D in two; GQA groups 2, 2 and 3
    "top2": ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=128,
                        hidden_size=64, intermediate_size=32, head_dim=16,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        rope_theta=10000.0),
    "top4": ModelConfig(num_hidden_layers=3, num_experts=8, experts_per_token=4, vocab_size=96,
                        hidden_size=32, intermediate_size=64, head_dim=16,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                        rope_theta=10000.0, rope_scaling_factor=32.0),
    "top3": ModelConfig(num_hidden_layers=2, num_experts=6, experts_per_token=3, vocab_size=64,
                        hidden_size=96, intermediate_size=32, head_dim=8,
                        num_attention_heads=6, num_key_value_heads=2, sliding_window=0,
                        rope_theta=10000.0),
}
WRITERS = {"hf": writers.save_hf, "openai": writers.save_openai, "llm_jax": writers.save_llm_jax}
OPENAI_NAMES = {"gate_up_proj": "mlp1_weight", "down_proj": "mlp2_weight"}
TOL = 1e-4
FLOAT32_KEPT = ("norm", "sinks", "mlp.router.", "mlp.gate.")  # param_dtype does not apply


def mxfp4_tensors(root: Path, num_layers: int) -> dict[tuple[int, str, str], np.ndarray]:
    """{(layer, "gate_up_proj" | "down_proj", "blocks" | "scales"): bytes} of a checkpoint in
    any of the three layouts, by the names each layout gives them (hard-coded here, not taken
    from llm_jax's tables: OpenAI's loader looks for exactly these)."""
    files = {}
    for f in sorted(root.glob("*.safetensors")):
        files.update(load_file(str(f)))
    out = {}
    for n in range(num_layers):
        for w in OPENAI_NAMES:
            if f"layers.mlp.{w}_blocks" in files:  # llm_jax: stacked over layers, model layout
                out[n, w, "blocks"], out[n, w, "scales"] = mxfp4.to_checkpoint_layout(
                    files[f"layers.mlp.{w}_blocks"][n], files[f"layers.mlp.{w}_scales"][n])
                continue
            for part in ("blocks", "scales"):
                if f"block.{n}.mlp.{OPENAI_NAMES[w]}.{part}" in files:
                    t = files[f"block.{n}.mlp.{OPENAI_NAMES[w]}.{part}"]
                else:
                    t = files[f"model.layers.{n}.mlp.experts.{w}_{part}"]
                out[n, w, part] = t
    return out


def assert_same_mxfp4(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == np.uint8 and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def source(request, tmp_path_factory) -> tuple[ModelConfig, dict[str, Path]]:
    """One config's MXFP4 checkpoint in both published layouts (same random seed)."""
    cfg = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    dirs = {layout: root / layout for layout in ("hf", "openai")}
    for layout, d in dirs.items():
        write_mxfp4_checkpoint(d, cfg, layout, seed=len(request.param))
    return cfg, dirs


# ---------------------------------------------------------------------- bitwise round trips
@pytest.mark.parametrize("src_layout", ["hf", "openai"])
def test_export_of_an_untouched_packed_model_is_bitwise_its_source_mxfp4(source, src_layout,
                                                                          tmp_path):
    cfg, dirs = source
    want = mxfp4_tensors(dirs[src_layout], cfg.num_hidden_layers)
    model = load_pretrained(dirs[src_layout])
    assert model.cfg.expert_format == "mxfp4"
    for to, write in WRITERS.items():
        write(model, tmp_path / to)
        assert_same_mxfp4(mxfp4_tensors(tmp_path / to, cfg.num_hidden_layers), want)
        back = load_pretrained(tmp_path / to)  # and it reads back as the same model
        assert back.cfg == model.cfg
        a, b = flat.flat_params(model), flat.flat_params(back)
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("layout", ["hf", "openai"])
def test_export_in_the_source_layout_rewrites_every_tensor_exactly(source, layout, tmp_path):
    """Every tensor by name: MXFP4 and bfloat16 ones bitwise; those llm_jax keeps in float32
    whatever the param dtype (norm scales, attention sinks, the router) widened exactly."""
    _, dirs = source
    WRITERS[layout](load_pretrained(dirs[layout]), tmp_path)
    want = load_file(str(dirs[layout] / "model.safetensors"))
    got = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        if got[k].dtype != want[k].dtype:
            assert got[k].dtype == np.float32, (k, got[k].dtype)
            assert any(x in k for x in FLOAT32_KEPT), k
            np.testing.assert_array_equal(got[k], want[k].astype(np.float32), err_msg=k)
        else:
            np.testing.assert_array_equal(got[k].view(np.uint8), want[k].view(np.uint8),
                                          err_msg=k)
    assert (json.loads((tmp_path / "config.json").read_text())
            == json.loads((dirs[layout] / "config.json").read_text()))


def test_sharded_hf_export_keeps_the_bytes(source, tmp_path):
    cfg, dirs = source
    model = load_pretrained(dirs["openai"])
    writers.save_hf(model, tmp_path, max_shard_bytes=4096)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert_same_mxfp4(mxfp4_tensors(tmp_path, cfg.num_hidden_layers),
                      mxfp4_tensors(dirs["openai"], cfg.num_hidden_layers))


def test_llm_jax_checkpoint_loads_in_either_expert_format(tmp_path):
    cfg = CONFIGS["top2"]
    write_mxfp4_checkpoint(tmp_path / "src", cfg, "hf")
    packed = load_pretrained(tmp_path / "src")
    dense = flat.flat_params(load_pretrained(tmp_path / "src", expert_format="dense"))
    writers.save_llm_jax(packed, tmp_path / "packed")
    got = flat.flat_params(load_pretrained(tmp_path / "packed", expert_format="dense"))
    assert sorted(got) == sorted(dense)
    for k in dense:
        np.testing.assert_array_equal(got[k], dense[k], err_msg=k)
    writers.save_llm_jax(mxfp4.dequantize_experts(packed), tmp_path / "dense")
    again = load_pretrained(tmp_path / "dense", expert_format="mxfp4")
    assert again.cfg.expert_format == "mxfp4"  # quantized, exactly: these values are MXFP4's
    got = flat.flat_params(mxfp4.dequantize_experts(again))
    for k in dense:
        np.testing.assert_array_equal(got[k], dense[k], err_msg=k)


def test_llm_jax_checkpoint_of_version_1_reads_its_packed_stacks_in_checkpoint_order(tmp_path):
    # Version 1 of the llm_jax format stored packed stacks as the HF checkpoint orders them,
    # (L, E, out, G, 16); the reader converts them to the model's layout, the same codes.
    cfg = CONFIGS["top3"]
    write_mxfp4_checkpoint(tmp_path / "src", cfg, "hf")
    model = load_pretrained(tmp_path / "src")
    writers.save_llm_jax(model, tmp_path / "v1")
    params = load_file(str(tmp_path / "v1" / "params.safetensors"))
    for key in [k for k in params if k.endswith("_blocks")]:
        stack = key.removesuffix("_blocks")
        b, s = mxfp4.to_checkpoint_layout(params[key], params[stack + "_scales"])
        params[key], params[stack + "_scales"] = b, s
    save_file(params, str(tmp_path / "v1" / "params.safetensors"))
    meta = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert meta["version"] == 2
    (tmp_path / "v1" / "config.json").write_text(json.dumps({**meta, "version": 1}))
    got, want = flat.flat_params(load_pretrained(tmp_path / "v1")), flat.flat_params(model)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ---------------------------------------------------------------------- the convert CLI
def test_convert_chain_through_every_layout_keeps_the_bytes(tmp_path):
    """The first conversion runs `python -m llm_jax.convert` as a process, the command line's
    own entry; the rest call its main in this process."""
    cfg = CONFIGS["top4"]
    write_mxfp4_checkpoint(tmp_path / "src" / "original", cfg, "openai")  # as gpt-oss ships
    want = mxfp4_tensors(tmp_path / "src" / "original", cfg.num_hidden_layers)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "llm_jax.convert", "--src", str(tmp_path / "src"),
                        "--dst", str(tmp_path / "hf"), "--to", "hf"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "note" not in r.stderr  # nothing to report: no quantization, MXFP4 kept
    src = tmp_path / "hf"
    for to in ("llm_jax", "openai", "hf"):
        dst = tmp_path / f"{to}_again"
        assert convert_main(["--src", str(src), "--dst", str(dst), "--to", to]) == 0
        assert_same_mxfp4(mxfp4_tensors(dst, cfg.num_hidden_layers), want)
        src = dst


def test_convert_expert_format_dense_dequantizes_exactly(tmp_path, capsys):
    cfg = CONFIGS["top2"]
    tensors = write_mxfp4_checkpoint(tmp_path / "src", cfg, "hf")
    assert convert_main(["--src", str(tmp_path / "src"), "--dst", str(tmp_path / "dense"),
                         "--to", "llm_jax", "--expert_format", "dense",
                         "--dtype", "float32"]) == 0
    model = load_pretrained(tmp_path / "dense")
    assert model.cfg.expert_format == "dense"
    w = flat.flat_params(model)["layers.mlp.gate_up_proj"]  # [L, E, I, O]
    for n in range(cfg.num_hidden_layers):
        name = f"model.layers.{n}.mlp.experts.gate_up_proj"
        deq = mxfp4.dequantize_mxfp4(tensors[name + "_blocks"], tensors[name + "_scales"])
        np.testing.assert_array_equal(w[n], np.swapaxes(deq, -1, -2))
    # MXFP4 values quantize to themselves: back to MXFP4 with a reported error of zero.
    capsys.readouterr()
    assert convert_main(["--src", str(tmp_path / "dense"), "--dst", str(tmp_path / "again"),
                         "--to", "hf", "--expert_format", "mxfp4"]) == 0
    err = capsys.readouterr().err
    assert "relative RMS error" in err and "mlp.gate_up_proj 0.0000" in err, err
    again = load_pretrained(tmp_path / "again")
    assert again.cfg.expert_format == "mxfp4"
    dense_again = flat.flat_params(mxfp4.dequantize_experts(again))
    for k in ("layers.mlp.gate_up_proj", "layers.mlp.down_proj"):
        np.testing.assert_array_equal(dense_again[k], flat.flat_params(model)[k], err_msg=k)


def _dense_model(cfg: ModelConfig, seed: int = 0):
    _, targets = flat.abstract_targets(cfg)
    rng = np.random.default_rng(seed)
    return flat.model_from_params(
        cfg, {k: (0.1 * rng.normal(size=t.shape)).astype(t.dtype) for k, t in targets.items()})


def test_convert_to_openai_of_dense_experts_says_what_openai_needs(tmp_path, capsys):
    src = writers.save_llm_jax(_dense_model(CONFIGS["top2"]), tmp_path / "src")
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "plain"),
                         "--to", "openai"]) == 0
    err = capsys.readouterr().err
    assert "gpt_oss.torch.weights.Checkpoint" in err and "--expert_format mxfp4" in err, err
    assert load_pretrained(tmp_path / "plain").cfg.expert_format == "dense"  # plain, exact
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "packed"),
                         "--to", "openai", "--expert_format", "mxfp4"]) == 0
    err = capsys.readouterr().err
    assert "relative RMS error" in err and "note" not in err, err
    error = float(err.split("mlp.down_proj ")[1].split()[0].rstrip(","))
    assert 0.05 < error < 0.2  # 4-bit values: ~12% on Gaussian weights, and reported as such
    assert load_pretrained(tmp_path / "packed").cfg.expert_format == "mxfp4"


def test_convert_expert_format_errors_name_the_flag(tmp_path, capsys):
    cfg = CONFIGS["top2"].replace(hidden_size=48, head_dim=12)  # 48: no whole MXFP4 blocks
    src = writers.save_llm_jax(_dense_model(cfg), tmp_path / "src")
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "dst"), "--to", "openai",
                         "--expert_format", "mxfp4"]) == 1
    err = capsys.readouterr().err
    assert "--expert_format=mxfp4" in err and "hidden_size" in err, err
    assert not (tmp_path / "dst").exists()
    with pytest.raises(SystemExit) as e:
        convert_main(["--src", str(src), "--dst", str(tmp_path / "dst"), "--to", "hf",
                      "--expert_format", "fp8"])
    assert e.value.code == 2 and "--expert_format" in capsys.readouterr().err


# ---------------------------------------------------------------------- OpenAI's own loader
def _gpt_oss():
    """OpenAI's reference package, or a skip saying how to get it (docs/model.md, "MXFP4")."""
    pytest.importorskip("torch")
    return pytest.importorskip(
        "gpt_oss.torch.model",
        reason="OpenAI's gpt-oss package is not installed; it declares Python >= 3.12 but "
               "gpt_oss.torch runs on 3.11: pip install --no-deps --ignore-requires-python "
               "gpt-oss==0.0.9")


def test_openai_loader_refuses_plain_experts_and_reads_our_mxfp4(tmp_path):
    gpt_oss = _gpt_oss()
    import torch

    src = writers.save_llm_jax(_dense_model(CONFIGS["top2"]), tmp_path / "src")
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "plain"),
                         "--to", "openai"]) == 0
    with pytest.raises(AssertionError, match="Blocks tensor block.0.mlp.mlp1_weight.blocks"):
        gpt_oss.Transformer.from_checkpoint(str(tmp_path / "plain"), device="cpu")
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "packed"),
                         "--to", "openai", "--expert_format", "mxfp4"]) == 0
    model = gpt_oss.Transformer.from_checkpoint(str(tmp_path / "packed"), device="cpu")
    assert model.block[1].mlp.mlp2_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("src_layout", ["hf", "openai"])
def test_openai_export_gives_openai_reference_logits(source, src_layout, tmp_path):
    gpt_oss = _gpt_oss()
    import torch

    cfg, dirs = source
    writers.save_openai(load_pretrained(dirs[src_layout]), tmp_path)
    # Their model holds bfloat16 weights; ours are bfloat16 too (the source's), so upcasting
    # both to float32 compares the same function in the same arithmetic.
    theirs = gpt_oss.Transformer.from_checkpoint(str(tmp_path), device="cpu").float()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 3 * max(cfg.sliding_window, 8) + 5)
    with torch.inference_mode():
        want = theirs(torch.as_tensor(tokens, dtype=torch.int32)).numpy()
    ours = load_pretrained(tmp_path, dtype="float32")
    assert ours.cfg.expert_format == "mxfp4"
    got = np.asarray(ours(jnp.asarray(tokens[None], jnp.int32)))[0]
    diff = float(np.max(np.abs(got - want)))
    print(f"\ngpt_oss.torch parity max|diff| = {diff:.3e} (logit scale {np.abs(want).max():.2f})")
    assert diff <= TOL


def test_llm_jax_checkpoint_of_a_newer_version_is_refused_by_name(tmp_path):
    cfg = CONFIGS["top2"]
    write_mxfp4_checkpoint(tmp_path / "src", cfg, "hf")
    writers.save_llm_jax(load_pretrained(tmp_path / "src"), tmp_path / "lj")
    path = tmp_path / "lj" / "config.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "version": 3}))
    with pytest.raises(ValueError, match=r"config.json: version=3, but this llm_jax reads "
                                         r"versions up to 2"):
        load_pretrained(tmp_path / "lj")
    path.write_text(json.dumps({**meta, "version": "two"}))
    with pytest.raises(ValueError, match="version"):
        load_pretrained(tmp_path / "lj")
