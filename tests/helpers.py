"""What several test files share, in one module: the suite's small model and run config, the
command-line overrides that give the same run, readers of a run's checkpoints and metrics, the
sharding tests' tiny model, batches and XLA flags, and a tiny checkpoint with a tokenizer and a
chat template for the serving, evaluation and chat tests. Test files import this module (tests/ is
on sys.path: conftest.py lives there; a test run as a script puts it there itself), never each
other."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
import tokenizers
from xla_flags import EIGHT_DEVICES, FAST_XLA_FLAGS  # noqa: F401  (the suite's XLA:CPU flags)

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model import init_model
from llm_jax.training.run_config import default_run_config
from llm_jax.weights.checkpointing import restore_params
from llm_jax.weights.writers import save_llm_jax

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------- the suite's small run

NUM_STEPS, EVERY = 24, 4  # the CLI runs' steps, and their checkpoint interval
# 16 rows of 32: the default 1M-token buffer would tokenize this corpus ~100 times per start.
SHUFFLE_BUFFER_TOKENS = 16 * 32
# The suite's small model: in process as a ModelConfig, on the command line as the overrides of
# configs/tiny.py below (the fields where the two differ).
SMALL_MODEL = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=384,
                          hidden_size=32, intermediate_size=32, head_dim=8, num_attention_heads=4,
                          num_key_value_heads=2, sliding_window=8)
SMALL_MODEL_OVERRIDES = {f"model.{k}": getattr(SMALL_MODEL, k) for k in (
    "num_hidden_layers", "num_experts", "hidden_size", "intermediate_size", "head_dim",
    "vocab_size")}
OVERRIDES = {
    **SMALL_MODEL_OVERRIDES, "data.seq_len": 32, "data.validation_fraction": 0.2,
    "data.shuffle_buffer_tokens": SHUFFLE_BUFFER_TOKENS, "train.batch_size": 4,
    "train.num_steps": NUM_STEPS, "train.warmup_steps": 2, "train.log_every_steps": 1,
    "train.eval_every_steps": 0, "train.num_samples": 0, "train.peak_flops": 1e11,
    "checkpoint.every_steps": EVERY, "checkpoint.max_to_keep": 10,
}


def small_cfg(corpus_dir: str, num_steps: int = 8, checkpoint_every: int = EVERY,
              **train) -> ml_collections.ConfigDict:
    """The run config of SMALL_MODEL on `corpus_dir`, synchronous checkpoints; `train` overrides
    the train section."""
    cfg = default_run_config("small", SMALL_MODEL)
    cfg.data.files = os.path.join(corpus_dir, "*")
    cfg.data.validation_fraction = 0.2
    cfg.data.seq_len = 32
    cfg.data.shuffle_buffer_tokens = SHUFFLE_BUFFER_TOKENS
    cfg.train.update({**dict(num_steps=num_steps, batch_size=4, warmup_steps=2, learning_rate=1e-2,
                             log_every_steps=1, eval_every_steps=0, num_samples=0,
                             peak_flops=1e11), **train})
    cfg.checkpoint.update(every_steps=checkpoint_every, async_save=False)
    return cfg


def complete_steps(workdir: Path) -> list[int]:
    """The steps with a checkpoint folder in `workdir`."""
    d = workdir / "checkpoints"
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if d.exists() else []


def saved_params(workdir: Path) -> list[np.ndarray]:
    """The params of the newest restorable checkpoint, as numpy leaves."""
    return [np.asarray(x) for x in jax.tree.leaves(restore_params(str(workdir))[1])]


def read_records(workdir: Path) -> list[dict]:
    """metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------- TPU ahead-of-time compiles

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
# CI's TPU leg sets LLM_JAX_REQUIRE_LIBTPU=1: there a missing libtpu fails these tests instead of
# skipping them, so the TPU compiles cannot silently stop running.
NEEDS_LIBTPU = pytest.mark.skipif(
    not HAVE_LIBTPU and os.environ.get("LLM_JAX_REQUIRE_LIBTPU") != "1",
    reason="libtpu is not installed (pip install 'llm_jax[tpu]'): no TPU topology descriptions "
           "to compile for")


# ----------------------------------------------------------------- sharding and many devices

def tiny_model(**changes) -> ModelConfig:
    base = dict(num_hidden_layers=2, num_experts=8, experts_per_token=2, vocab_size=128,
                hidden_size=32, intermediate_size=32, head_dim=16, num_attention_heads=4,
                num_key_value_heads=2, sliding_window=8, rope_scaling_factor=1.0)
    return ModelConfig(**{**base, **changes})


def tiny_execution(**changes) -> ExecutionConfig:
    """How the sharding tests run `tiny_model`: fixed expert slots, 8.0 so nothing is dropped."""
    return ExecutionConfig(**{"moe_dispatch": "capacity", "moe_capacity_factor": 8.0, **changes})


def tiny_train(**changes) -> ml_collections.ConfigDict:
    tc = default_run_config("t", tiny_model()).train
    tc.update({**dict(batch_size=16, num_steps=10, warmup_steps=1, learning_rate=1e-2), **changes})
    return tc


def batches(n, batch=16, seq=16, vocab=128, seed=0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)
        out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    return out


# ------------------------------------------- a checkpoint with a tokenizer and a chat template

CHAT_SPECIAL_TOKENS = ["<|start|>", "<|message|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|message|>"
                 "{% endif %}")
CHECKPOINT_MODEL = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=320, hidden_size=32,
    intermediate_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=8, initializer_range=0.3,  # logits that spread, so the argmax is clear
)
TOKENIZER_WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang over green "
                   "trees near blue water one two three four five six seven eight nine ten yes "
                   "no maybe").split()


def make_checkpoint(d: Path, seed: int = 0) -> Path:
    """Writes config.json + params.safetensors + tokenizer.json (byte-level BPE trained on
    TOKENIZER_WORDS) + chat_template.jinja into d: a checkpoint the server, the harness and the
    chat CLI read as text (nothing downloaded)."""
    d.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=CHAT_SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    words = TOKENIZER_WORDS
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))],
                            trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    save_llm_jax(init_model(CHECKPOINT_MODEL, seed=seed), d)
    return d


# ----------------------------------------------------------------- MXFP4 checkpoints on disk

def write_mxfp4_checkpoint(root: Path, cfg: ModelConfig, layout: str, seed: int = 0,
                           dtype: str = "bfloat16", std: float = 0.5) -> dict[str, np.ndarray]:
    """A gpt-oss checkpoint of random weights in `layout` ("hf" or "openai") with MXFP4 experts,
    written with numpy + safetensors (no model is built): random bytes for the experts' blocks,
    scales 2^-9 to 2^-4, plain tensors normal(0, `std`) in `dtype`. Returns what was written, by
    name."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from llm_jax.weights import configs, layouts

    rng = np.random.default_rng(seed)
    top, layer = (layouts.hf_specs if layout == "hf" else layouts.openai_specs)(cfg)
    tensors: dict[str, np.ndarray] = {}
    plain = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for spec, name in [(s, s.src) for s in top] + [
            (s, s.src.format(n=n)) for n in range(cfg.num_hidden_layers) for s in layer]:
        if spec.mxfp4 is None:  # OpenAI's fused qkv appears three times: written once
            tensors[name] = (std * rng.standard_normal(spec.src_shape)).astype(plain)
            continue
        blocks_shape, scales_shape = layouts.packed_shapes(spec)
        tensors[name + spec.mxfp4[0]] = rng.integers(0, 256, blocks_shape, dtype=np.uint8)
        tensors[name + spec.mxfp4[1]] = rng.integers(118, 124, scales_shape, dtype=np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    if layout == "hf":
        config = configs.model_config_to_hf_config(
            cfg.replace(expert_format="mxfp4", dtype=dtype, param_dtype=dtype))
        save_file(tensors, str(root / layouts.HF_WEIGHTS))
    else:
        config = configs.model_config_to_openai_config(cfg)
        save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


# ------------------------------------------- a checkpoint that speaks harmony (gpt-oss's format)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the current weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "The city"}}}}}
# What the harmony checkpoint learned: each conversation's last assistant message is what
# greedy decoding reproduces after the conversation before it.
HARMONY_CHATS = [
    ({}, [{"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "reasoning_content": "Simple sum: two and two.",
           "content": "2 + 2 = 4."}]),
    ({"tools": [WEATHER_TOOL]}, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the weather tool.",
         "tool_calls": [{"id": "call_0", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]),
    ({"tools": [WEATHER_TOOL]}, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the weather tool.",
         "tool_calls": [{"id": "call_0", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "It is 20 degrees in Paris. ☀"}]),
    ({"reasoning_effort": "low"}, [{"role": "user", "content": "Say hi."},
                                   {"role": "assistant", "reasoning_content": "Greet.",
                                    "content": "Hi! 👋"}]),
]
HARMONY_MODEL = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=512, hidden_size=64,
    intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=0)


def harmony_texts() -> list[str]:
    """HARMONY_CHATS rendered as training text (each ends with its reply's stop token)."""
    from llm_jax.data import harmony

    return [harmony.render_conversation(m, add_generation_prompt=False, **o)
            for o, m in HARMONY_CHATS]


def make_harmony_tokenizer(d: Path) -> tokenizers.Tokenizer:
    """Writes d/tokenizer.json: a byte-level BPE trained on harmony_texts(), holding harmony's
    special tokens, no chat template (it renders with llm_jax.data.harmony)."""
    from llm_jax.data import harmony

    d.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=HARMONY_MODEL.vocab_size, special_tokens=list(harmony.SPECIAL_TOKENS.values()),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(harmony_texts(), trainer)
    tok.save(str(d / "tokenizer.json"))
    return tok


def make_harmony_checkpoint(d: Path, steps: int = 80) -> Path:
    """A tiny model trained on HARMONY_CHATS until greedy decoding reproduces each reply
    (reasoning, answer, tool call), with make_harmony_tokenizer's tokenizer. Nothing
    downloaded. Warmup then cosine decay: at a constant 1e-2 the same replies take ~90 steps to
    come out and 150 to lead every other token by the margin 80 steps reach here (3 logits)."""
    import optax
    from flax import nnx

    tok = make_harmony_tokenizer(d)
    seqs = [tok.encode(t, add_special_tokens=False).ids for t in harmony_texts()]
    length = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length - 1), np.float32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s) - 1] = 1
    model = init_model(HARMONY_MODEL, seed=0)
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, steps, 1e-3))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def train(params, rest, ids, mask):
        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(ids[:, :-1]).astype(jax.numpy.float32)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
            return (nll * mask).sum() / mask.sum()

        def step(carry, _):
            p, s = carry
            updates, s = tx.update(jax.grad(loss)(p), s, p)
            return (optax.apply_updates(p, updates), s), None

        return jax.lax.scan(step, (params, tx.init(params)), None, length=steps)[0][0]

    # Every step in one program, compiled with LLVM's optimisations: the suite's cheap code
    # generation (tests/xla_flags.py) runs these 80 steps 4x slower than it saves compiling.
    compiled = jax.jit(train).lower(params, rest, ids, mask).compile(
        {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False})
    nnx.update(model, compiled(params, rest, ids, mask))
    save_llm_jax(model, d)
    return d


# ------------------------------------------- a toy vocabulary for harmony's parser and replies

def _toy_harmony():
    from llm_jax.data import harmony

    specials = list(harmony.SPECIAL_TOKENS.values())
    return specials, harmony.HarmonyTokens.find(
        lambda s: specials.index(s) if s in specials else None)


# Byte-level: the special tokens are ids 0-6, byte b is id 16 + b, so a character of several
# UTF-8 bytes spans several tokens (as byte-level BPE can split one).
HARMONY_SPECIALS, TOY_HARMONY_TOKENS = _toy_harmony()


def toy_encode(text: str) -> list[int]:
    import re

    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, HARMONY_SPECIALS)) + ")", text):
        ids += ([HARMONY_SPECIALS.index(piece)] if piece in HARMONY_SPECIALS
                else [16 + b for b in piece.encode()])
    return ids


def toy_decode(ids: list[int]) -> str:
    out, run = [], b""
    for i in ids:
        if i < 16:
            out.append(run.decode("utf-8", "replace") + HARMONY_SPECIALS[i])
            run = b""
        else:
            run += bytes([i - 16])
    return "".join(out) + run.decode("utf-8", "replace")


# ------------------------------------------- `python -m llm_jax.serve` in a process of its own

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log: Path):
    """Starts `python -m llm_jax.serve ARGS --port P` (output in `log`) and waits for its
    /health; a generator yielding the base URL, stopping the server when it resumes (drive it
    from a pytest fixture: `yield from start_server(...)`)."""
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    out = log.open("w")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "llm_jax.serve", *args, "--port", str(port)],
                            env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start:\n{log.read_text()}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    out.close()


# ------------------------------------------- grouped_matmul's contract in plain JAX (model tests)

def ragged_dot_grouped_matmul(x_MK, w_EKN, sizes_E, *, kernel=None, interpret=False, tile=None,
                              group_offset=None):
    """What `kernels.grouped_matmul.grouped_matmul` computes, by `lax.ragged_dot`: with a
    `group_offset` o, `w_EKN` holds groups o .. o + n - 1 and every other row is zero. The
    kernels are held to this in interpret mode by tests/kernels/test_grouped_matmul.py; model
    tests that check what surrounds a kernel (column layouts, unpacking a group of experts at a
    time) monkeypatch it in for the kernel, which one wiring test per dispatch still runs
    (tests/model/test_moe.py)."""
    import jax.numpy as jnp

    if group_offset is not None:
        full = jnp.zeros((sizes_E.shape[0], *w_EKN.shape[1:]), w_EKN.dtype)
        w_EKN = jax.lax.dynamic_update_slice_in_dim(full, w_EKN, group_offset, 0)
    return jax.lax.ragged_dot(x_MK, w_EKN, sizes_E)


# ------------------------------------------- a run stopped as if preempted, after a given step

def stop_after_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Makes the next `loop.train` of this process stop as a preemption does, once the metrics
    of `step` are written (its log_every_steps must log that step): SIGTERM to this process, so
    the run saves that step and raises `Interrupted`. Undo with `monkeypatch.undo()`. A run
    stopped and then resumed with one config compiles one train step; a run extended to more
    steps would compile a second (num_steps sets its learning-rate schedule)."""
    import signal

    from llm_jax.training.metrics import MetricsWriter

    write = MetricsWriter.write

    def write_then_stop(self, done, record):
        write(self, done, record)
        if done == step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(MetricsWriter, "write", write_then_stop)
