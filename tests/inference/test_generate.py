"""Generation with the KV cache: cached logits equal full recomputation (with and without a
sliding window, past its length), greedy tokens equal transformers' `generate`, a batch equals
each prompt alone, sampling's limits, the cache's bytes equal describe's prediction, bad input
raises a ValueError naming the argument, and the CLI.

Tolerance: max |logit diff| <= 1e-4 (float32). Never relax it; find the bug.
"""

from __future__ import annotations

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
from flax import nnx  # noqa: E402

from llm_jax.config import ModelConfig  # noqa: E402
from llm_jax.execution import ExecutionConfig  # noqa: E402
from llm_jax.generate import main  # noqa: E402
from llm_jax.inference import loop  # noqa: E402
from llm_jax.inference.loop import bucket, generate_jit  # noqa: E402
from llm_jax.inference.sampler import sample as generate  # noqa: E402
from llm_jax.inference.sampling import greedy_tokens  # noqa: E402
from llm_jax.model import init_model  # noqa: E402
from llm_jax.model.costs import kv_cache_bytes, kv_cache_lengths  # noqa: E402
from llm_jax.model.kv_cache import CACHE_AXES, cache_nbytes, cache_shardings, init_cache  # noqa: E402
from llm_jax.parallel.sharding import logical_to_spec, make_mesh  # noqa: E402
from llm_jax.weights import flat, readers, writers  # noqa: E402

TOL = 1e-4
V = 512  # room for the CLI test's tokenizer
CFG = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=V, hidden_size=32,
    intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=8,
)
DENSE = ExecutionConfig(moe_dispatch="dense")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def random_model(cfg: ModelConfig = CFG, seed: int = 0):
    """Weights big enough that logits spread (std-0.02 init gives near-uniform ones), running
    the dense (reference) MoE dispatch."""
    _, targets = flat.abstract_targets(cfg)
    rng = np.random.default_rng(seed)
    scale = {"sinks": 1.0, "embedding": 1.0, "gate_up_proj": 0.6, "down_proj": 0.05,
             "o_proj": 1 / math.sqrt(cfg.num_attention_heads * cfg.head_dim)}
    params = {}
    for key, t in targets.items():
        name = key.split(".")[-1]
        z = rng.normal(size=t.shape)
        if name == "scale":
            v = 1.0 + 0.3 * z
        elif "bias" in name:
            v = 0.1 * z
        else:
            v = scale.get(name, 1 / math.sqrt(cfg.hidden_size)) * z
        params[key] = v.astype(t.dtype)
    model = flat.model_from_params(cfg, params)
    model.execution = DENSE
    return model


def with_config(model, cfg: ModelConfig, execution: ExecutionConfig = DENSE):
    """The same weights under another config (the window), running as `execution` says."""
    out = flat.model_from_params(cfg, flat.flat_params(model))
    out.execution = execution
    return out


@pytest.fixture(scope="module")
def model():
    return random_model()


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def forward(model, tokens: np.ndarray) -> np.ndarray:
    """One uncached forward, jitted: models with the same config share its compiled program."""
    return np.asarray(_forward(*nnx.split(model), jnp.asarray(tokens, jnp.int32)))


def tokens(model, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    """generate's tokens for a batch, from the program that also returns the logits
    (return_logits is static): the tests' batches share it with the cache checks' program."""
    return generate(model, prompts, return_logits=True, **kwargs)[0]


def recomputed_logits(model, prompts: list[list[int]], new: list[list[int]],
                      width: int = 48) -> list[np.ndarray]:
    """Logits that predicted each new token, from running each whole sequence without a cache
    (what recomputing at every step gives, by causality). One call: right-padded to `width`."""
    seqs = np.zeros((len(prompts), width), np.int32)
    for i, (p, n) in enumerate(zip(prompts, new)):
        seqs[i, :len(p) + len(n)] = p + n
    logits = forward(model, seqs)
    return [logits[i, len(p) - 1:len(p) + len(n) - 1] for i, (p, n) in enumerate(zip(prompts, new))]


# Past BLOCKWISE_MIN_KEYS: the prefill runs several query blocks and key blocks, most of them
# out of the sliding window, over rows of different lengths.
LONG_PROMPTS = [np.random.default_rng(3).integers(1, V, n).tolist() for n in (300, 230)]


# ---------------------------------------------------------------------- cache == recompute
# (2, 0) has no window; (2, 8) wraps every ring at least twice while decoding; (3, 8) is an odd
# layer count (sliding, full, sliding) prefilling long prompts block-sparse, through the
# dropping dispatch (outside training it runs `auto`'s exact choice, so the `auto` case lowers
# to the same program and loads it from the compilation cache); (1, 64) is one layer whose
# window is longer than the cache.
@pytest.mark.parametrize("layers, window, dispatch, long", [
    (2, 0, "dense", False), (2, 8, "dense", False), (3, 8, "capacity", True),
    (3, 8, "auto", True), (1, 64, "dense", False)])
def test_cached_decoding_matches_full_recompute(model, layers, window, dispatch, long):
    from llm_jax.model.blockwise_attention import use_blockwise

    cfg = CFG.replace(num_hidden_layers=layers, sliding_window=window)
    weights = model if layers == CFG.num_hidden_layers else random_model(cfg, seed=layers)
    m = with_config(weights, cfg, DENSE.replace(moe_dispatch=dispatch))
    ref = with_config(weights, cfg)
    prompts = LONG_PROMPTS if long else PROMPTS
    ids, logits = generate(m, prompts, max_new_tokens=16, return_logits=True)
    assert all(len(new) == 16 for new in ids)
    if long:
        assert use_blockwise(2, bucket(300), bucket(300), CFG.num_attention_heads)
    elif window == 8:
        assert len(PROMPTS[1]) + 16 > 2 * window  # every ring wraps at least twice
    elif window:
        assert bucket(max(map(len, prompts))) + bucket(16) < window  # the cache's slots
    width = 320 if long else 48
    for lg, want in zip(logits, recomputed_logits(ref, prompts, ids, width)):
        np.testing.assert_allclose(lg, want, atol=TOL, rtol=0)


# ---------------------------------------------------------------------- transformers
@pytest.mark.slow
def test_greedy_tokens_match_transformers_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=V,
        hidden_size=32, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8,  # one sliding and one full layer
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        max_position_embeddings=4096 * 32, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights big enough that greedy paths differ between models
        for name, p in hf.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * z)
            elif name.endswith(("sinks", "embed_tokens.weight")):
                p.copy_(z)
            elif name.endswith("bias"):
                p.copy_(0.1 * z)
            elif name.endswith("gate_up_proj"):
                p.copy_(0.6 * z)
            elif name.endswith("down_proj"):
                p.copy_(0.05 * z)
            else:
                p.copy_(z / math.sqrt(p.shape[-1]))
    hf.save_pretrained(tmp_path)
    prompt = [3, 17, 99, 42, 8, 64]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
    want = want[0, len(prompt):].tolist()
    ours = readers.load_pretrained(tmp_path)
    assert ours.cfg.sliding_window == 8 and ours.cfg.rope_scaling_factor == 32
    assert generate(ours, prompt, max_new_tokens=20) == want
    assert len(set(want)) > 3  # not a degenerate repetition


# ---------------------------------------------------------------------- batching
def test_stacked_layer_weights_a_one_device_mesh_and_streaming_change_no_token(model,
                                                                              monkeypatch):
    # On CPU the loop slices each layer's weights once before it (loop.SLICE_LAYERS_MAX_BYTES);
    # with the limit at 0 every step reads the stacked weights, as on accelerators. The stacked
    # run uses the same weights under an execution config that differs only in a training knob,
    # so it traces a program of its own (the sliced programs other tests share stay compiled;
    # clearing generate_jit's cache would make them all compile again). That one program also
    # runs on a one-device mesh, its cache sharded by the logical rules, and streams: it gives
    # the sliced, unsharded tokens and logits, and the callback sees each step's tokens in order.
    mesh = make_mesh({"data": 1})
    layer = cache_shardings(jax.eval_shape(lambda: init_cache(CFG, 4, 16)), mesh)[1]
    assert layer.k.spec == logical_to_spec(CACHE_AXES.k)
    assert layer.v.spec == logical_to_spec(CACHE_AXES.v)
    for spec in (layer.k.spec, layer.v.spec):
        assert spec[0] == logical_to_spec(("batch",))[0] and spec[1] == "tensor"
    assert loop.slice_layers_once(model)
    ids, logits = generate(model, PROMPTS, max_new_tokens=9, return_logits=True)
    monkeypatch.setattr(loop, "SLICE_LAYERS_MAX_BYTES", 0)
    stacked = with_config(model, CFG, DENSE.replace(loss_chunk_tokens=DENSE.loss_chunk_tokens + 1))
    assert not loop.slice_layers_once(stacked)
    seen = []

    def sink(step, drawn, active):
        seen.append((step, drawn.tolist(), active.tolist()))

    before = generate_jit.for_platform()._cache_size()
    stacked_ids, stacked_logits = generate(stacked, PROMPTS, max_new_tokens=9, return_logits=True,
                                           mesh=mesh, stream=sink)
    assert generate_jit.for_platform()._cache_size() == before + 1  # traced afresh, stacked
    assert stacked_ids == ids
    for a, b in zip(stacked_logits, logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert [s for s, _, _ in seen] == list(range(9))
    assert [[t[b] for _, t, _ in seen] for b in range(3)] == ids


def test_batch_of_different_lengths_equals_each_prompt_alone(model):
    batch = tokens(model, PROMPTS, max_new_tokens=10)
    assert batch == [generate(model, p, max_new_tokens=10) for p in PROMPTS]


def test_sampled_sequence_does_not_depend_on_the_rest_of_the_batch(model):
    # Row b draws from fold_in(fold_in(seed, step), b): the same row and seed give the same
    # tokens whatever the other prompts are (their lengths, their contents, or none at all).
    kw = dict(max_new_tokens=10, temperature=1.0, seed=3)
    batch = tokens(model, PROMPTS, **kw)
    other = tokens(model, [PROMPTS[0], PROMPTS[2][:5], [1]], **kw)
    assert other[0] == batch[0] == generate(model, PROMPTS[0], **kw)
    assert batch[1] != batch[0]


def test_generation_stops_at_eos_and_includes_it(model):
    full = tokens(model, PROMPTS, max_new_tokens=12)
    eos = full[0][4]
    out = tokens(model, PROMPTS, max_new_tokens=12, eos_id=eos)
    for f, o in zip(full, out):
        stop = f.index(eos) + 1 if eos in f else len(f)
        assert o == f[:stop]
    # Several stop ids (a checkpoint's stop tokens): each row stops at the first of any, and a
    # single id or several run the same compiled program.
    before = generate_jit.for_platform()._cache_size()
    stops = {full[1][6], full[2][3]}
    out = tokens(model, PROMPTS, max_new_tokens=12, eos_id=stops)
    for f, o in zip(full, out):
        stop = min([f.index(t) + 1 for t in stops if t in f] or [len(f)])
        assert o == f[:stop]
    assert generate_jit.for_platform()._cache_size() == before


def test_new_prompts_and_settings_in_one_bucket_reuse_the_compiled_program(model):
    generate(model, [[1, 2, 3], [4, 5], [6]], max_new_tokens=9, temperature=0.7, top_p=0.9,
             seed=1)
    before = generate_jit.for_platform()._cache_size()
    generate(model, [[1, 2, 3, 4, 5, 6], [7], [8, 9]], max_new_tokens=14, temperature=1.3,
             top_k=5, top_p=0.5, seed=2, eos_id=4)
    assert generate_jit.for_platform()._cache_size() == before
    assert bucket(1) == bucket(16) == 16 and bucket(17) == 32 and bucket(1500) == 2048


# ---------------------------------------------------------------------- sampling
def test_greedy_tokens_equal_argmax_with_ties_and_nans():
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 5, (64, 300)).astype(np.float32)  # many ties: the first one wins
    logits[3, [7, 40]] = np.nan
    logits[5] = -np.inf
    logits[9, 299] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens)(jnp.asarray(logits))),
                                  np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
    greedy = tokens(model, PROMPTS, max_new_tokens=8)
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_k=1, seed=5) == greedy
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5) == greedy


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    kw = dict(max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.95)
    a = generate(model, PROMPTS, seed=7, **kw)
    assert generate(model, PROMPTS, seed=7, **kw) == a
    assert generate(model, PROMPTS, seed=8, **kw) != a


# ---------------------------------------------------------------------- the cache
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_equal_the_size_of_a_real_cache(window, dtype):
    cfg = CFG.replace(sliding_window=window)
    for length in (3, 8, 100, 1000):
        cache = init_cache(cfg, 2, length, dtype)
        assert cache_nbytes(cache) == kv_cache_bytes(cfg, length, batch=2, dtype=dtype)
        # Sliding layers are capped at min(len, W), full layers hold every position.
        assert [c.slots for c in cache] == list(kv_cache_lengths(cfg, length))
        kh = (2, cfg.num_key_value_heads)
        assert all(c.k.shape == (*kh, cfg.head_dim, c.slots)
                   and c.v.shape == (*kh, c.slots, cfg.head_dim) for c in cache)
    assert cache_nbytes(init_cache(cfg, 2, 1000)) < 2 * cache_nbytes(init_cache(cfg, 2, 500)) + 1


def test_bfloat16_cache_stays_close_to_float32(model):
    ids, a = generate(model, PROMPTS, max_new_tokens=16, return_logits=True)
    ids_b, b = generate(model, PROMPTS, max_new_tokens=16, return_logits=True,
                        cache_dtype="bfloat16")
    n = 4  # compare while the tokens agree
    assert [i[:n] for i in ids] == [i[:n] for i in ids_b]
    err = max(np.abs(x[:n] - y[:n]).max() for x, y in zip(a, b))
    assert 0 < err < 0.05 * max(np.abs(x).max() for x in a)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, names", [
    (dict(prompt_ids=[list(range(40))], max_new_tokens=5, max_len=32), "max_len"),
    (dict(prompt_ids=[[1, 2], []]), r"prompt_ids\[1\]"),
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(prompt_ids=[1, 2], temperature=-0.5), "temperature"),
    (dict(prompt_ids=[1, 2], top_p=0.0), "top_p"),
    (dict(prompt_ids=[1, 2], top_p=1.5), "top_p"),
    (dict(prompt_ids=[[1, V]]), r"prompt_ids\[0\].*vocabulary"),
    (dict(prompt_ids=[[-1, 2]]), r"prompt_ids\[0\].*vocabulary"),
    (dict(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1, 2], top_k=-1), "top_k"),
    (dict(prompt_ids=[1, 2], eos_id=V), "eos_id"),
    (dict(prompt_ids=[1, 2], eos_id=[1, V]), "eos_id"),
    (dict(prompt_ids=[1, 2], eos_id=list(range(9))), "eos_id"),
    (dict(prompt_ids=[1, 2], eos_id=[]), "eos_id"),
    (dict(prompt_ids=[1, 2], eos_id=True), "eos_id"),
    (dict(prompt_ids="def fib("), "prompt_ids"),
])
def test_bad_input_raises_value_error_naming_the_argument(model, kwargs, names):
    with pytest.raises(ValueError, match=names):
        generate(model, **kwargs)


# ---------------------------------------------------------------------- CLI
def test_cli_generates_from_an_llm_jax_checkpoint_with_its_tokenizer(model, tmp_path, capsys):
    import inspect

    from llm_jax.data.tokenizer import Tokenizer

    tok = Tokenizer.train([inspect.getsource(json.decoder)], vocab_size=400)
    tok.save(str(tmp_path / "tokenizer.model"))
    ckpt = writers.save_llm_jax(model, tmp_path / "ckpt")
    out_json = tmp_path / "out.json"
    assert main(["--checkpoint", str(ckpt), "--prompt", "def fib(", "--max_new_tokens", "8",
                 "--output_json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())
    assert row["prompt_ids"] == tok.encode("def fib(")
    assert printed == "def fib(" + row["text"] + "\n"
    assert row["ids"] == generate(model, row["prompt_ids"], max_new_tokens=8, eos_id=tok.eos_id)


def test_cli_encodes_text_with_a_hugging_face_checkpoints_tokenizer_json(tmp_path, capsys):
    """A Hugging Face / gpt-oss directory has tokenizer.json, no tokenizer.model: --prompt is
    encoded with it and generation stops at its tokenizer_config.json eos_token. An
    --output_json whose directory is missing is refused before anything is generated."""
    import tokenizers
    from helpers import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "hf")
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompt = "the cat sat on"
    out_json = tmp_path / "out.json"
    assert main(["--checkpoint", str(ckpt), "--prompt", prompt, "--max_new_tokens", "6",
                 "--no_stream", "--output_json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())
    assert row["prompt_ids"] == tok.encode(prompt, add_special_tokens=False).ids
    model = readers.load_pretrained(str(ckpt))
    assert row["ids"] == generate(model, row["prompt_ids"], max_new_tokens=6,
                                  eos_id=tok.token_to_id("<|end|>"))
    # the model's rows past the tokenizer's vocabulary show as <id:N>, as with tokenizer.model
    text, run = "", []
    for i in row["ids"] + [None]:
        if i is not None and i < tok.get_vocab_size():
            run.append(i)
            continue
        text += tok.decode(run, skip_special_tokens=False) + (f"<id:{i}>" if i is not None else "")
        run = []
    assert row["text"] == text
    assert row["text"] in capsys.readouterr().out
    # A stop id past the model's vocabulary can never be produced: left out, same reply.
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [10_000]}))
    assert main(["--checkpoint", str(ckpt), "--prompt", prompt, "--max_new_tokens", "6",
                 "--no_stream", "--output_json", str(out_json)]) == 0
    assert json.loads(out_json.read_text()) == [row]
    # More stop tokens than the program takes: refused, pointing at --eos_id.
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(9))}))
    assert main(["--checkpoint", str(ckpt), "--prompt", prompt]) == 2
    assert "pass --eos_id" in capsys.readouterr().err
    missing = tmp_path / "no_such_dir" / "out.json"
    assert main(["--checkpoint", str(ckpt), "--prompt", prompt, "--output_json",
                 str(missing)]) == 2
    assert "--output_json" in capsys.readouterr().err and not missing.parent.exists()


def test_cli_takes_prompt_ids_without_a_tokenizer_and_names_bad_flags(model, tmp_path, capsys):
    ckpt = writers.save_llm_jax(model, tmp_path / "ckpt")  # (HF loading: the transformers test)
    out_json = tmp_path / "out.json"
    assert main(["--checkpoint", str(ckpt), "--max_new_tokens", "4", "--output_json",
                 str(out_json), *sum((["--prompt_ids", ",".join(map(str, p))] for p in PROMPTS),
                                     [])]) == 0
    rows = json.loads(out_json.read_text())
    assert [r["ids"] for r in rows] == tokens(model, PROMPTS, max_new_tokens=4)
    assert main(["--checkpoint", str(ckpt), "--prompt", "hi"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["--checkpoint", str(ckpt), "--prompt_ids", "1,x"]) == 2
    assert "--prompt_ids" in capsys.readouterr().err


def test_package_level_sample_is_the_api_even_after_the_cli_module_is_imported(model):
    import llm_jax
    import llm_jax.generate  # noqa: F401  (the CLI module must not shadow the API)

    assert llm_jax.sample is generate
    assert llm_jax.sample(model, [1, 2, 3], max_new_tokens=4) == \
        generate(model, [1, 2, 3], max_new_tokens=4)


def test_prefill_unpacks_one_layer_of_packed_experts_at_a_time():
    # XLA:CPU's default (concurrency) scheduler runs every layer's weight-only work first: the
    # prefill of an 8-layer packed model held 8.4 layers' unpacked experts at once (gpt-oss-20b:
    # 12.9 GiB of temporaries, 74 GiB with the dense dispatch, 2.2 GiB with the memory-optimized
    # scheduler). The inference programs compile with runtime.backend.CPU_INFERENCE_OPTIONS.
    from llm_jax.inference.engine import prefill_jit

    # Three layers are enough to tell one layer's temporaries from all of them (>= 3 layers').
    cfg = ModelConfig(num_hidden_layers=3, num_experts=8, experts_per_token=2, vocab_size=512,
                      hidden_size=256, intermediate_size=256, head_dim=32, num_attention_heads=4,
                      num_key_value_heads=2, expert_format="mxfp4",
                      dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: init_model(cfg, 0, execution=DENSE)))
    spec = jax.ShapeDtypeStruct
    pool = jax.eval_shape(lambda: init_cache(cfg, 2, 32))
    n, i32, f32 = 1, jnp.int32, jnp.float32
    compiled = prefill_jit.lower(
        graphdef, state, pool, spec((n, 16), i32), spec((n,), i32), spec((n,), i32),
        spec((n,), i32), spec((n,), f32), spec((n,), i32), spec((n,), f32), mode=0, max_len=32,
        cache_dtype="bfloat16").compile()
    one_layer = cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size * 4  # float32
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 1.5 * one_layer, f"temporaries {temp / one_layer:.2f} layers of unpacked experts"


def test_decode_loop_keeps_no_copy_of_a_16bit_vocabulary_table():
    # XLA:CPU gathers and slices a bfloat16 table through a 16-bit (or float32) copy of all of
    # it. Inside the decode loop that copy is loop-invariant, so while-loop invariant code
    # motion hoisted it and it lived for the whole loop: 2.57 tables of temporaries here, and
    # 2.3 GB for gpt-oss-20b's embedding and unembedding (with the float32 copies of every
    # layer's attention weights, 20.7 GiB peak decoding; 14.9 GiB without). The inference
    # programs compile without that pass on CPU (runtime.backend.CPU_INFERENCE_OPTIONS).
    from llm_jax.parallel.sharding import make_mesh
    from llm_jax.training.aot import compile_generate

    cfg = ModelConfig(num_hidden_layers=1, num_experts=4, experts_per_token=2, vocab_size=65536,
                      hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=2,
                      num_key_value_heads=1, dtype="bfloat16", param_dtype="bfloat16")
    compiled = compile_generate(cfg, make_mesh({"data": 1}, jax.devices()[:1]), batch=1,
                                prompt_len=8, new_tokens=8)
    table = cfg.vocab_size * cfg.hidden_size * 2
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < table, f"temporaries {temp / table:.2f} of the bfloat16 vocabulary table"

