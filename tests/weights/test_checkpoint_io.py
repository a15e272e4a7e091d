"""Checkpoint I/O without torch: bitwise round trips through every format, config mapping, the
errors bad inputs raise (each naming the bad thing), and the convert CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from llm_jax import ExecutionConfig, ModelConfig, Transformer, load_pretrained
from llm_jax.convert import main as convert_main
from llm_jax.weights import configs, flat, layouts, readers, tensor_store, writers

CFG = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=128, hidden_size=64,
    intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=8, rope_theta=10000.0,
)


def random_model(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    _, targets = flat.abstract_targets(cfg)
    rng = np.random.default_rng(seed)
    return flat.model_from_params(
        cfg, {k: rng.normal(size=t.shape).astype(t.dtype) for k, t in targets.items()})


def assert_same_params(a, b) -> None:
    pa, pb = flat.flat_params(a), flat.flat_params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k].view(np.uint8), pb[k].view(np.uint8), err_msg=k)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return random_model()


@pytest.fixture
def hf_dir(model, tmp_path) -> Path:
    return writers.save_hf(model, tmp_path / "hf")


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_llm_jax_checkpoint_round_trip_is_bitwise(param_dtype, tmp_path):
    cfg = CFG.replace(param_dtype=param_dtype, dtype=param_dtype)
    m = random_model(cfg)
    m.execution = ExecutionConfig(moe_dispatch="dense")
    writers.save_llm_jax(m, tmp_path)
    saved = json.loads((tmp_path / layouts.LLM_JAX_CONFIG).read_text())
    assert saved["model"] == cfg.to_dict()  # what the model is; how it ran is not stored
    back = load_pretrained(tmp_path)
    assert back.cfg == cfg and back.execution == ExecutionConfig()
    assert_same_params(m, back)


def test_an_llm_jax_checkpoint_whose_model_config_holds_the_execution_fields_loads(model,
                                                                                   tmp_path):
    """config.json as llm_jax wrote it before ExecutionConfig: the execution fields (here not
    the defaults) beside the model's, read past."""
    writers.save_llm_jax(model, tmp_path)
    path = tmp_path / layouts.LLM_JAX_CONFIG
    meta = json.loads(path.read_text())
    older = ExecutionConfig(moe_dispatch="capacity", remat=True, gmm_tile_m=256)
    meta["model"] = {**meta["model"], **older.to_dict()}
    path.write_text(json.dumps(meta))
    back = load_pretrained(tmp_path, execution=ExecutionConfig(moe_dispatch="dense"))
    assert back.cfg == model.cfg and back.execution == ExecutionConfig(moe_dispatch="dense")
    assert_same_params(model, back)


def test_an_execution_field_asked_as_a_load_conversion_names_the_execution_argument(hf_dir):
    with pytest.raises(ValueError, match=r"pass execution=ExecutionConfig\(moe_dispatch=\.\.\.\)"):
        load_pretrained(hf_dir, moe_dispatch="dense")


@pytest.mark.parametrize("writer", ["hf", "hf_sharded", "openai"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_hf_and_openai_round_trips_are_bitwise(writer, param_dtype, tmp_path):
    cfg = CFG.replace(param_dtype=param_dtype, dtype=param_dtype)
    m = random_model(cfg)
    if writer == "openai":
        writers.save_openai(m, tmp_path)
    else:
        writers.save_hf(m, tmp_path, max_shard_bytes=20_000 if writer == "hf_sharded" else 2**40)
    if writer == "hf_sharded":
        assert (tmp_path / layouts.HF_INDEX).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    back = load_pretrained(tmp_path)
    assert back.cfg == cfg
    assert_same_params(m, back)


def test_openai_dir_under_original_is_found(model, tmp_path):
    writers.save_openai(model, tmp_path / "original")
    assert readers.detect_format(tmp_path) == ("openai", tmp_path / "original")
    assert_same_params(model, load_pretrained(tmp_path))


def test_dtype_argument_casts_weights_and_compute(hf_dir):
    m = load_pretrained(hf_dir, dtype="bfloat16", execution=ExecutionConfig(moe_dispatch="dense"))
    assert (m.cfg.dtype, m.cfg.param_dtype) == ("bfloat16", "bfloat16")
    assert m.execution.moe_dispatch == "dense"
    assert m.layers.attn.q_proj[...].dtype == np.dtype("bfloat16")
    assert m.layers.attn.sinks[...].dtype == np.float32  # kept float32 by the model


# ---------------------------------------------------------------------- config mapping
def test_hf_config_round_trip_preserves_the_architecture():
    for cfg in (CFG, CFG.replace(sliding_window=0, rope_scaling_factor=1.0)):
        hf = configs.model_config_to_hf_config(cfg)
        assert hf["num_local_experts"] == cfg.num_experts
        assert configs.hf_config_to_model_config(hf) == cfg


def test_hf_config_accepts_legacy_rope_scaling_and_top_level_rope_theta():
    hf = configs.model_config_to_hf_config(CFG)
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = rope
    assert configs.hf_config_to_model_config(hf) == CFG


@pytest.mark.parametrize("key, value, expect", [
    ("rope_parameters.rope_type", "linear", "rope_type='linear'"),
    ("rope_parameters.truncate", True, "truncate=True"),
    ("rope_parameters.mscale", 0.7, "mscale=0.7"),
    ("rms_norm_eps", 1e-6, "rms_norm_eps=1e-06"),
    ("swiglu_alpha", 1.0, "swiglu_alpha=1.0"),
    ("tie_word_embeddings", True, "tie_word_embeddings=True"),
    ("attention_bias", False, "attention_bias=False"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types="),
    ("quantization_config", {"quant_method": "gptq"}, "quant_method='gptq'"),
])
def test_unsupported_hf_config_is_refused_by_name(key, value, expect):
    hf = configs.model_config_to_hf_config(CFG)
    if key.startswith("rope_parameters."):
        hf["rope_parameters"][key.split(".")[1]] = value
    else:
        hf[key] = value
    with pytest.raises(ValueError, match="unsupported Hugging Face") as e:
        configs.hf_config_to_model_config(hf)
    assert expect in str(e.value)


def test_hf_yarn_without_truncate_key_is_refused_because_hf_would_truncate():
    hf = configs.model_config_to_hf_config(CFG)
    del hf["rope_parameters"]["truncate"]
    with pytest.raises(ValueError, match="truncate=True"):
        configs.hf_config_to_model_config(hf)


def test_export_refuses_a_norm_gpt_oss_does_not_have():
    with pytest.raises(ValueError, match="prms_fraction"):
        configs.model_config_to_hf_config(CFG.replace(prms_fraction=0.25))


# ---------------------------------------------------------------------- bad inputs
def test_directory_without_checkpoint_says_what_was_expected(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError) as e:
        load_pretrained(tmp_path)
    msg = str(e.value)
    for name in ("config.json", "params.safetensors", "model.safetensors",
                 "model.safetensors.index.json", "original/", "notes.txt"):
        assert name in msg


def test_path_that_is_no_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_pretrained(tmp_path / "nope")


def test_pickle_only_directory_is_refused_without_unpickling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(configs.model_config_to_hf_config(CFG)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    with pytest.raises(ValueError, match="never unpickles") as e:
        load_pretrained(tmp_path)
    assert "pytorch_model.bin" in str(e.value)


def _rewrite(path: Path, edit) -> None:
    store = tensor_store.TensorStore([path])
    tensors = {k: np.array(store.get(k)) for k in store.names()}
    del store
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_named(hf_dir):
    name = "model.layers.1.self_attn.sinks"
    _rewrite(hf_dir / layouts.HF_WEIGHTS, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing tensor") as e:
        load_pretrained(hf_dir)
    assert repr(name) in str(e.value)


def test_misshapen_tensor_is_named_with_expected_and_actual_shape(hf_dir):
    name = "model.layers.0.mlp.experts.down_proj"

    def edit(t):
        t[name] = t[name][:, :-1]
    _rewrite(hf_dir / layouts.HF_WEIGHTS, edit)
    with pytest.raises(ValueError) as e:
        load_pretrained(hf_dir)
    msg = str(e.value)
    assert repr(name) in msg and "(4, 31, 64)" in msg and "expected (4, 32, 64)" in msg


def test_unexpected_tensor_is_named(hf_dir):
    def edit(t):
        t["lm_head.bias"] = np.zeros(CFG.vocab_size, np.float32)
    _rewrite(hf_dir / layouts.HF_WEIGHTS, edit)
    with pytest.raises(ValueError, match="lm_head.bias"):
        load_pretrained(hf_dir)


def test_misshapen_llm_jax_param_is_named(model, tmp_path):
    writers.save_llm_jax(model, tmp_path)

    def edit(t):
        t["layers.attn.q_bias"] = t["layers.attn.q_bias"][:1]
    _rewrite(tmp_path / layouts.LLM_JAX_PARAMS, edit)
    want = r"'layers.attn.q_bias'.*\(1, 4, 16\).*expected \(2, 4, 16\)"
    with pytest.raises(ValueError, match=want):
        load_pretrained(tmp_path)


def test_unsupported_rope_type_in_checkpoint_is_refused(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "dynamic"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        load_pretrained(hf_dir)


def test_architecture_fields_cannot_be_overridden_at_load(hf_dir):
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_pretrained(hf_dir, num_hidden_layers=3)


@pytest.mark.parametrize("blocks_dtype, groups, want", [
    (np.uint8, 3, r"'block.0.mlp.mlp1_weight.scales'.*\(4, 64, 3\)"),  # G should be 64 / 32 = 2
    (np.float32, 2, r"'block.0.mlp.mlp1_weight.blocks'.*float32, expected uint8"),
])
def test_malformed_mxfp4_is_named(blocks_dtype, groups, want, tmp_path, model):
    writers.save_openai(model, tmp_path)
    name = "block.0.mlp.mlp1_weight"

    def edit(t):
        w = t.pop(name)
        t[name + ".blocks"] = np.zeros((*w.shape[:2], 2, 16), blocks_dtype)
        t[name + ".scales"] = np.zeros((*w.shape[:2], groups), np.uint8)
    _rewrite(tmp_path / "model.safetensors", edit)
    with pytest.raises(ValueError, match=want):
        load_pretrained(tmp_path)


# ---------------------------------------------------------------------- convert CLI
def test_convert_to_hf_and_back_is_bitwise(model, tmp_path):
    src = writers.save_llm_jax(model, tmp_path / "src")
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert readers.detect_format(tmp_path / "hf")[0] == "hf"
    assert convert_main(["--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "back"),
                         "--to", "llm_jax"]) == 0
    back = load_pretrained(tmp_path / "back")
    assert back.cfg == model.cfg
    assert_same_params(model, back)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "src"]  # no temp dirs left


def test_convert_refuses_non_empty_dst_unless_overwrite(model, tmp_path, capsys):
    src = writers.save_llm_jax(model, tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    assert convert_main(["--src", str(src), "--dst", str(dst), "--to", "hf"]) == 1
    assert "not empty" in capsys.readouterr().err and (dst / "keep.txt").read_text() == "precious"
    assert convert_main(["--src", str(src), "--dst", str(dst), "--to", "hf", "--overwrite"]) == 0
    assert not (dst / "keep.txt").exists() and readers.detect_format(dst)[0] == "hf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_failed_convert_leaves_dst_untouched(tmp_path):
    (tmp_path / "src").mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    assert convert_main(["--src", str(tmp_path / "src"), "--dst", str(dst), "--to", "hf",
                         "--overwrite"]) == 1
    assert (dst / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_convert_to_openai_casts_to_the_dtype_asked(model, tmp_path):
    # `python -m llm_jax.convert` as a process: tests/weights/test_mxfp4_export.py.
    src = writers.save_llm_jax(model, tmp_path / "src")
    assert convert_main(["--src", str(src), "--dst", str(tmp_path / "oa"), "--to", "openai",
                         "--dtype", "bfloat16"]) == 0
    back = load_pretrained(tmp_path / "oa")
    assert back.cfg.param_dtype == "bfloat16"
    assert back.layers.mlp.gate_up_proj[...].dtype == np.dtype("bfloat16")


def test_convert_that_fails_while_writing_loses_nothing(model, tmp_path, monkeypatch):
    import llm_jax.convert as convert_mod

    def broken_writer(m, directory):
        (Path(directory) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setitem(convert_mod.WRITERS, "hf", broken_writer)
    src = writers.save_llm_jax(model, tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(RuntimeError, match="disk full"):
        convert_mod.convert(src, dst, "hf", overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_other_hf_model_types_are_refused_by_name(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type='llama'"):
        load_pretrained(hf_dir)


# ---------------------------------------------------------------------- hostile files
def _raw(path: Path) -> tuple[dict, bytes]:
    """(header, data) of a safetensors file, as written."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _write_raw(path: Path, header, data: bytes, *, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)


def _edit_header(edit):
    def apply(root: Path) -> Path:
        path = root / layouts.HF_WEIGHTS
        header, data = _raw(path)
        out = edit(header, data)
        _write_raw(path, *(out if isinstance(out, tuple) else (header, data)))
        return path
    return apply


def _edit_config(edit):
    def apply(root: Path) -> Path:
        path = root / "config.json"
        cfg = json.loads(path.read_text())
        out = edit(cfg)
        path.write_text(json.dumps(cfg if out is None else out))
        return path
    return apply


def _first(header) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


EMBED = "model.embed_tokens.weight"
HOSTILE = {  # name: (edit of an HF dir -> the file it broke, what the error must say)
    "entry without dtype": (_edit_header(lambda h, d: h[EMBED].pop("dtype")),
                            f"tensor '{EMBED}' in .*: header entry has no 'dtype'"),
    "header is a JSON list": (_edit_header(lambda h, d: ([h], d)),
                              "header is a JSON list, expected an object"),
    "unknown dtype": (_edit_header(lambda h, d: h[EMBED].update(dtype="F7")),
                      "dtype 'F7' is not one llm_jax reads"),
    "shape not a list": (_edit_header(lambda h, d: h[EMBED].update(shape="128x64")),
                         r"shape '128x64' is invalid: expected a list of integers >= 0"),
    "negative dim": (_edit_header(lambda h, d: h[EMBED].update(shape=[-128, -64])),
                     r"shape \[-128, -64\] is invalid"),
    "bool dim": (_edit_header(lambda h, d: h[EMBED].update(shape=[True, 64])),
                 r"shape \[True, 64\] is invalid"),
    "offsets not a pair": (_edit_header(lambda h, d: h[EMBED].update(data_offsets=[0])),
                           r"data_offsets \[0\] is invalid: expected \[begin, end\]"),
    "offsets past the file": (_edit_header(
        lambda h, d: h[EMBED].update(data_offsets=[len(d), len(d) + 128 * 64 * 4])),
        "outside the file's .* bytes of data"),
    "offsets inconsistent with dtype x shape": (_edit_header(
        lambda h, d: h[EMBED].update(shape=[128, 32])), "needs 16384"),
    "overlapping tensors": (_edit_header(lambda h, d: h[_first(h)].update(
        data_offsets=h[EMBED]["data_offsets"], shape=h[EMBED]["shape"], dtype="F32")),
        "overlap"),
    "header length past the file": (lambda root: (_write_raw(
        root / layouts.HF_WEIGHTS, *_raw(root / layouts.HF_WEIGHTS), length=2**40),
        root / layouts.HF_WEIGHTS)[1], "header length 1099511627776 is invalid"),
    "shorter than 8 bytes": (lambda root: ((root / layouts.HF_WEIGHTS).write_bytes(b"\x01\x02"),
                                           root / layouts.HF_WEIGHTS)[1], "shorter than the 8-byte"),
    "header not JSON": (_edit_header(lambda h, d: (b"{not json" + b" " * 40, d)),
                        "header is not JSON"),
    "duplicate tensor name": (_edit_header(lambda h, d: (json.dumps(h).replace(
        "{", '{"%s": %s, ' % (EMBED, json.dumps(h[EMBED])), 1).encode(), d)),
        f"key '{EMBED}' appears twice"),
    "metadata not strings": (_edit_header(lambda h, d: h.update(__metadata__={"x": 1})),
                             "__metadata__ .* expected an object of strings"),
    "truncated data": (_edit_header(lambda h, d: (h, d[:-100])), "outside the file's|tile"),
    "integer weights": (_edit_header(lambda h, d: h[EMBED].update(dtype="I32")),
                        f"'{EMBED}' .* has dtype int32, expected a floating-point dtype"),
    "10^9 experts in config.json": (_edit_config(
        lambda c: c.update(num_local_experts=10**9)),
        r"'model.layers.0.mlp.router.weight' .* shape \(4, 64\), expected \(1000000000, 64\) "
        r"from .*config.json \(axis 0 = num_local_experts = 1000000000\)"),
    "vocab_size 'big'": (_edit_config(lambda c: c.update(vocab_size="big")),
                         r"field vocab_size='big' is invalid: expected an integer in \[1, "),
    "hidden_size true": (_edit_config(lambda c: c.update(hidden_size=True)),
                         "field hidden_size=True is invalid"),
    "zero layers": (_edit_config(lambda c: c.update(num_hidden_layers=0)),
                    "field num_hidden_layers=0 is invalid"),
    "10^12 layers": (_edit_config(lambda c: c.update(num_hidden_layers=10**12)),
                     "field num_hidden_layers=1000000000000 is invalid"),
    "one layer too many": (_edit_config(lambda c: c.update(num_hidden_layers=3, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"])),
                           r"missing tensor 'model.layers.2\..*layer 2 of num_hidden_layers=3"),
    "a layer-0 tensor missing": (_edit_header(lambda h, d: h.update(
        {"model.layers.0.post_attention_layernorm.scale": h.pop(
            "model.layers.0.post_attention_layernorm.weight")})),
        r"missing tensor 'model.layers.0\..*layer 0 of num_hidden_layers=2"),
    "one layer too few": (_edit_config(lambda c: c.update(num_hidden_layers=1, layer_types=[
        "sliding_attention"])), r"tensor\(s\) that .*config.json does not imply"),
    "rope_parameters a string": (_edit_config(lambda c: c.update(rope_parameters="yarn")),
                                 "field rope_parameters='yarn' is invalid: expected a JSON obj"),
    "rope factor NaN": (_edit_config(lambda c: c["rope_parameters"].update(factor=float("nan"),
                                                                            rope_type="yarn")),
                        "factor=nan is invalid: expected a finite number"),
    "config.json a list": (_edit_config(lambda c: [c]), "holds a JSON list: expected an object"),
    "layer_types a number": (_edit_config(lambda c: c.update(layer_types=5)),
                             "field layer_types=5 is invalid: expected a list of strings"),
    "quantization_config a list": (_edit_config(lambda c: c.update(quantization_config=[])),
                                   r"field quantization_config=\[\] is invalid"),
    "negative swiglu_limit": (_edit_config(lambda c: c.update(swiglu_limit=-1)),
                              "field swiglu_limit=-1 is invalid: expected a number > 0.0"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_hf_directory_is_refused_naming_file_and_field(case, model, tmp_path):
    import tracemalloc

    root = writers.save_hf(model, tmp_path / "hf")
    edit, want = HOSTILE[case]
    broken = edit(root)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=want) as e:
            load_pretrained(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(broken) in str(e.value)
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB allocated before refusing"


def _sharded(model, root: Path) -> Path:
    return writers.save_hf(model, root, max_shard_bytes=20_000)


@pytest.mark.parametrize("edit, want", [
    (lambda m: m.update(weight_map={k: "../" + v for k, v in m["weight_map"].items()}),
     r"weight_map\[.*\] = '\.\./model-00001.* is invalid: expected the file name"),
    (lambda m: m.update(weight_map=["model-00001-of-00009.safetensors"]),
     "field weight_map=.* is invalid: expected a JSON object"),
    (lambda m: m["weight_map"].update({EMBED: sorted(set(m["weight_map"].values()))[-1]}),
     rf"puts tensor '{EMBED}' in model-\d+-of-\d+.safetensors, but "),
])
def test_hostile_shard_index_is_refused_by_name(edit, want, model, tmp_path):
    root = _sharded(model, tmp_path / "hf")
    index = json.loads((root / layouts.HF_INDEX).read_text())
    edit(index)
    (root / layouts.HF_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=want) as e:
        load_pretrained(root)
    assert str(root / layouts.HF_INDEX) in str(e.value)


def test_hostile_openai_and_llm_jax_configs_are_refused_by_name(model, tmp_path):
    writers.save_openai(model, tmp_path / "oa" / "original")
    path = tmp_path / "oa" / "original" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "num_experts": "8"}))
    with pytest.raises(ValueError, match=f"{path}: field num_experts='8' is invalid"):
        load_pretrained(tmp_path / "oa")
    writers.save_llm_jax(model, tmp_path / "lj")
    path = tmp_path / "lj" / layouts.LLM_JAX_CONFIG
    meta = json.loads(path.read_text())
    for model_field, want in [({**meta["model"], "vocab_size": -1}, "field vocab_size=-1"),
                              ({**meta["model"], "num_hidden_layers": 10**6},
                               "num_hidden_layers=1000000, but the stacked layer tensors"),
                              ([1], "field model=.* expected a JSON object")]:
        path.write_text(json.dumps({**meta, "model": model_field}))
        with pytest.raises(ValueError, match=want) as e:
            load_pretrained(tmp_path / "lj")
        assert str(path) in str(e.value)
