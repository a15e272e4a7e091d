"""Logit parity with Hugging Face `GptOssForCausalLM` (float32, eager attention) through every
checkpoint path: HF safetensors, OpenAI `original/` layout, MXFP4-packed MoE weights (both
layouts), and HF export. Every parameter is random and non-trivial (norm gains, biases, sinks),
and the MoE weights are large enough that the SwiGLU clamp at +-7 is active on both sides.

Tolerance: max |logit diff| <= 1e-4 (float32 on both sides). Never relax it; find the bug.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from llm_jax import load_pretrained  # noqa: E402
from llm_jax.execution import ExecutionConfig  # noqa: E402
from llm_jax.weights.configs import hf_config_to_model_config, model_config_to_hf_config  # noqa: E402
from llm_jax.weights.mxfp4 import dequantize_mxfp4  # noqa: E402
from llm_jax.weights.writers import save_hf  # noqa: E402

TOL = 1e-4
LIMIT = 7.0
# "capacity" keeps its default factor 1.25, which drops assignments in training: outside
# training the loaded model must still be exact. "auto", what a user gets with no arguments:
# the OpenAI checkpoint's test (the model read is the same).
DISPATCHES = ("dense", "ragged", "blocked", "capacity")

_COMMON = dict(
    num_local_experts=8, num_experts_per_tok=2, vocab_size=256, hidden_size=64,
    intermediate_size=32, head_dim=16, num_attention_heads=6, num_key_value_heads=2,
    swiglu_limit=LIMIT, tie_word_embeddings=False,
)
VARIANTS = {
    # (a) tiny-like, plain RoPE, full attention everywhere; N*H = 96 != D = 64.
    "plain": dict(
        _COMMON, num_hidden_layers=2, sliding_window=4096, layer_types=["full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096, seq_len=40,
    ),
    # (b) gpt-oss pattern: even layers slide (window 16 < T = 96) + YaRN factor 32.
    "sliding_yarn": dict(
        _COMMON, num_hidden_layers=4, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        max_position_embeddings=4096 * 32, seq_len=96,
    ),
    # (c) top-3 of 8 experts (as gpt-oss's top-4): fixed slots would drop here.
    "top3": dict(
        _COMMON, num_experts_per_tok=3, num_hidden_layers=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096, seq_len=48,
    ),
}


# ---------------------------------------------------------------------- HF reference
def _hf_model(hf_kwargs: dict, seed: int) -> "transformers.GptOssForCausalLM":
    config = transformers.GptOssConfig(**hf_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * randn(p.shape))
            elif name.endswith("sinks"):
                p.copy_(randn(p.shape))
            elif name.endswith("bias"):
                p.copy_(0.1 * randn(p.shape))
            elif name.endswith("experts.gate_up_proj"):  # big enough to reach the +-7 clamp
                p.copy_(0.6 * randn(p.shape))
            elif name.endswith("experts.down_proj"):
                p.copy_(0.05 * randn(p.shape))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(randn(p.shape))
            else:  # nn.Linear (out, in) weights, router included
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
    return model


def _tokens(variant: dict, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, variant["vocab_size"], (2, variant["seq_len"]), dtype=np.int64)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def _swiglu_input_range(model, tokens: np.ndarray) -> tuple[float, float, float]:
    """(max gate input, min and max linear input) over the routed (token, expert) pairs,
    recomputed from what each layer's experts receive."""
    seen = []

    def hook(module, args):
        x, idx = args[0], args[1]
        w, b = module.gate_up_proj[idx], module.gate_up_proj_bias[idx]  # [T, k, D, 2F]
        seen.append(torch.einsum("td,tkdf->tkf", x, w) + b)

    handles = [layer.mlp.experts.register_forward_pre_hook(hook) for layer in model.model.layers]
    try:
        _hf_logits(model, tokens)
    finally:
        for h in handles:
            h.remove()
    h = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen])
    glu, lin = h[:, 0::2], h[:, 1::2]
    return float(glu.max()), float(lin.min()), float(lin.max())


class Reference:
    def __init__(self, name: str, tmp_path_factory, seed: int = 0):
        v = VARIANTS[name]
        self.name = name
        self.hf_kwargs = {k: x for k, x in v.items() if k != "seq_len"}
        self.model = _hf_model(self.hf_kwargs, seed)
        self.tokens = _tokens(v, seed + 1)
        self.logits = _hf_logits(self.model, self.tokens)
        self.hf_dir = tmp_path_factory.mktemp(f"hf_{name}")
        self.model.save_pretrained(self.hf_dir)
        self.state = {k: t.detach().numpy().copy() for k, t in self.model.state_dict().items()}


@pytest.fixture(scope="module", params=list(VARIANTS))
def ref(request, tmp_path_factory) -> Reference:
    return Reference(request.param, tmp_path_factory)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def _ours(path, tokens: np.ndarray, **kw) -> np.ndarray:
    """Our logits from the checkpoint at `path`, through one jitted forward: models loaded from
    different layouts with the same config and dispatch share its compiled program."""
    model = load_pretrained(path, **kw)
    return np.asarray(_forward(*nnx.split(model), jnp.asarray(tokens, jnp.int32)))


def _check(label: str, ours: np.ndarray, want: np.ndarray) -> float:
    assert ours.shape == want.shape
    diff = float(np.max(np.abs(ours - want)))
    print(f"\nparity[{label}] max|diff| = {diff:.3e} (logit scale {np.abs(want).max():.2f})")
    assert diff <= TOL, f"{label}: max |logit diff| {diff:.3e} > {TOL}"
    return diff


def _dispatch_kw(ref: Reference, dispatch: str) -> dict:
    return {} if dispatch == "auto" else {"execution": ExecutionConfig(moe_dispatch=dispatch)}


# ---------------------------------------------------------------------- the tests
def test_reference_exercises_the_swiglu_clamp_on_both_sides(ref):
    glu_max, lin_min, lin_max = _swiglu_input_range(ref.model, ref.tokens)
    print(f"\n[{ref.name}] routed SwiGLU inputs: glu max {glu_max:.1f}, "
          f"lin in [{lin_min:.1f}, {lin_max:.1f}]")
    assert glu_max > LIMIT and lin_max > LIMIT and lin_min < -LIMIT


def test_reference_sequence_is_longer_than_the_window(ref):
    if "sliding_attention" in ref.hf_kwargs["layer_types"]:
        assert ref.tokens.shape[1] > 2 * ref.hf_kwargs["sliding_window"]


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_hf_checkpoint_logits_match_transformers(ref, dispatch):
    ours = _ours(ref.hf_dir, ref.tokens, **_dispatch_kw(ref, dispatch))
    _check(f"hf/{ref.name}/{dispatch}", ours, ref.logits)


def _openai_tensors(s: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """HF weights `s` rewritten in OpenAI's layout (fused qkv, MoE weights (E, out, in))."""
    out = {}
    out["embedding.weight"] = s["model.embed_tokens.weight"]
    out["norm.scale"] = s["model.norm.weight"]
    out["unembedding.weight"] = s["lm_head.weight"]
    for n in range(num_layers):
        p, b = f"model.layers.{n}.", f"block.{n}."
        out[b + "attn.norm.scale"] = s[p + "input_layernorm.weight"]
        out[b + "attn.qkv.weight"] = np.concatenate(
            [s[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], axis=0)
        out[b + "attn.qkv.bias"] = np.concatenate(
            [s[p + f"self_attn.{x}_proj.bias"] for x in "qkv"], axis=0)
        out[b + "attn.sinks"] = s[p + "self_attn.sinks"]
        out[b + "attn.out.weight"] = s[p + "self_attn.o_proj.weight"]
        out[b + "attn.out.bias"] = s[p + "self_attn.o_proj.bias"]
        out[b + "mlp.norm.scale"] = s[p + "post_attention_layernorm.weight"]
        out[b + "mlp.gate.weight"] = s[p + "mlp.router.weight"]
        out[b + "mlp.gate.bias"] = s[p + "mlp.router.bias"]
        out[b + "mlp.mlp1_weight"] = s[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)
        out[b + "mlp.mlp1_bias"] = s[p + "mlp.experts.gate_up_proj_bias"]
        out[b + "mlp.mlp2_weight"] = s[p + "mlp.experts.down_proj"].transpose(0, 2, 1)
        out[b + "mlp.mlp2_bias"] = s[p + "mlp.experts.down_proj_bias"]
    return out


def _openai_config(ref: Reference) -> dict:
    k, rope = ref.hf_kwargs, ref.hf_kwargs["rope_parameters"]
    yarn = rope["rope_type"] == "yarn"
    return {
        "num_hidden_layers": k["num_hidden_layers"], "num_experts": k["num_local_experts"],
        "experts_per_token": k["num_experts_per_tok"], "vocab_size": k["vocab_size"],
        "hidden_size": k["hidden_size"], "intermediate_size": k["intermediate_size"],
        "swiglu_limit": k["swiglu_limit"], "head_dim": k["head_dim"],
        "num_attention_heads": k["num_attention_heads"],
        "num_key_value_heads": k["num_key_value_heads"], "sliding_window": k["sliding_window"] or 0,
        "initial_context_length": rope["original_max_position_embeddings"] if yarn else 4096,
        "rope_theta": rope["rope_theta"], "rope_scaling_factor": rope["factor"] if yarn else 1.0,
        "rope_ntk_alpha": rope.get("beta_slow", 1.0), "rope_ntk_beta": rope.get("beta_fast", 32.0),
    }


def _write_openai(root, tensors: dict[str, np.ndarray], config: dict) -> None:
    orig = root / "original"
    orig.mkdir(parents=True)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
              str(orig / "model.safetensors"))
    (orig / "config.json").write_text(json.dumps(config))


def test_openai_checkpoint_logits_match_transformers(ref, tmp_path):
    """The OpenAI reader, with the default dispatch (each dispatch: the HF checkpoint above;
    the model read is the same whichever dispatch runs it)."""
    tensors = _openai_tensors(ref.state, ref.hf_kwargs["num_hidden_layers"])
    _write_openai(tmp_path, tensors, _openai_config(ref))
    ours = _ours(tmp_path, ref.tokens)
    _check(f"openai/{ref.name}/auto", ours, ref.logits)


# ---------------------------------------------------------------------- MXFP4
FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest MXFP4 along the last axis: (blocks (..., G, 16), scales (..., G), the
    dequantized weights computed here as code value * 2^exponent)."""
    *lead, d_in = w.shape
    x = w.reshape(*lead, d_in // 32, 32).astype(np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0))  # largest |value| maps to <= 6
    exp = np.clip(exp, -127, 127)
    codes = np.abs((x / 2.0 ** exp)[..., None] - FP4).argmin(axis=-1).astype(np.uint8)
    deq = (FP4[codes] * 2.0 ** exp).reshape(w.shape)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp[..., 0] + 127).astype(np.uint8)
    return blocks, scales, deq


def test_dequantize_mxfp4_matches_hand_computed_values():
    blocks = np.zeros((2, 16), np.uint8)
    blocks[0, 0] = 0x21  # low nibble 1 -> 0.5, high nibble 2 -> 1.0
    blocks[0, 1] = 0xF8  # 8 -> -0.0, 15 -> -6
    blocks[0, 15] = 0x7A  # 10 -> -1, 7 -> 6
    blocks[1, 0] = 0x53  # 3 -> 1.5, 5 -> 3
    scales = np.array([128, 125], np.uint8)  # x2, x1/4
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (64,)
    want = np.zeros(64, np.float32)
    want[[0, 1, 2, 3, 30, 31]] = [1.0, 2.0, -0.0, -12.0, -2.0, 12.0]
    want[[32, 33]] = [0.375, 0.75]
    np.testing.assert_array_equal(out, want)
    assert np.signbit(out[2])
    # Leading axes are kept: (E, out, G, 16) -> (E, out, G * 32).
    assert dequantize_mxfp4(np.zeros((3, 5, 2, 16), np.uint8), np.full((3, 5, 2), 127, np.uint8)
                            ).shape == (3, 5, 64)


def test_quantizer_round_trips_through_dequantize_mxfp4():
    w = np.random.default_rng(0).normal(size=(4, 8, 64)).astype(np.float32)
    blocks, scales, deq = quantize_mxfp4(w)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), deq)
    assert np.max(np.abs(deq - w)) < 0.5 * np.abs(w).max()


def _quantized_reference(ref: Reference) -> tuple[dict, dict, np.ndarray]:
    """(packed MoE tensors per (layer, name), the HF state with dequantized MoE weights, logits of
    transformers run on those dequantized weights)."""
    state = dict(ref.state)
    packed = {}
    for n in range(ref.hf_kwargs["num_hidden_layers"]):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{n}.mlp.experts.{name}"
            blocks, scales, deq = quantize_mxfp4(state[key].transpose(0, 2, 1))  # (E, out, in)
            packed[n, name] = (blocks, scales)
            state[key] = np.ascontiguousarray(deq.transpose(0, 2, 1))
    model = _hf_model(ref.hf_kwargs, 0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return packed, state, _hf_logits(model, ref.tokens)


@pytest.fixture(scope="module")
def quantized(ref):
    return _quantized_reference(ref)


def test_mxfp4_openai_checkpoint_matches_transformers_on_dequantized_weights(
        ref, quantized, tmp_path):
    packed, state, want = quantized
    tensors = _openai_tensors(state, ref.hf_kwargs["num_hidden_layers"])
    for (n, name), (blocks, scales) in packed.items():
        key = f"block.{n}.mlp.{'mlp1' if name == 'gate_up_proj' else 'mlp2'}_weight"
        del tensors[key]
        tensors[key + ".blocks"], tensors[key + ".scales"] = blocks, scales
    _write_openai(tmp_path, tensors, _openai_config(ref))
    ours = _ours(tmp_path, ref.tokens, dtype="float32", **_dispatch_kw(ref, "ragged"))
    _check(f"openai-mxfp4/{ref.name}/ragged", ours, want)


def test_mxfp4_hf_checkpoint_matches_transformers_on_dequantized_weights(ref, quantized, tmp_path):
    packed, state, want = quantized
    tensors = dict(state)
    for (n, name), (blocks, scales) in packed.items():
        key = f"model.layers.{n}.mlp.experts.{name}"
        del tensors[key]
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))
    config = json.loads((ref.hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = _ours(tmp_path, ref.tokens, dtype="float32", **_dispatch_kw(ref, "dense"))
    _check(f"hf-mxfp4/{ref.name}/dense", ours, want)


# ---------------------------------------------------------------------- export
def test_hf_export_loads_in_transformers_and_back_with_the_same_logits(ref, tmp_path):
    model = load_pretrained(ref.hf_dir, execution=ExecutionConfig(moe_dispatch="dense"))
    assert hf_config_to_model_config(model_config_to_hf_config(model.cfg)) == model.cfg
    out = save_hf(model, tmp_path / "export")
    hf = transformers.GptOssForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()
    _check(f"hf-export->transformers/{ref.name}", _hf_logits(hf, ref.tokens), ref.logits)
    _check(f"hf-export->llm_jax/{ref.name}/dense",
           _ours(out, ref.tokens, **_dispatch_kw(ref, "dense")), ref.logits)
    # The exported tensors are the imported ones, bit for bit.
    exported = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for k, v in ref.state.items():
        np.testing.assert_array_equal(exported[k], v, err_msg=k)


def test_bfloat16_checkpoint_saved_by_transformers_loads(ref, tmp_path):
    copy.deepcopy(ref.model).to(torch.bfloat16).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    model = load_pretrained(tmp_path)
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16" == model.cfg.param_dtype
    want = torch.from_numpy(ref.state["model.layers.0.mlp.experts.gate_up_proj"]).to(torch.bfloat16)
    got = np.asarray(model.layers.mlp.gate_up_proj[...][0]).astype(np.float32)
    np.testing.assert_array_equal(got, want.float().numpy())
