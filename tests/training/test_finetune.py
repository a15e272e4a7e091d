"""Fine-tuning on a small HF gpt-oss checkpoint the tests write (transformers save_pretrained),
with a BPE tokenizer.json trained here and a tiny chat template: SFT lowers the assistant loss,
masked targets get no gradient, LoRA at step 0 is the base exactly, the merged export loads in
transformers with the same logits, and bad inputs are refused by name."""

from __future__ import annotations

import json
import os
import runpy
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from flax import nnx  # noqa: E402
from helpers import stop_after_step  # noqa: E402

from llm_jax import load_pretrained  # noqa: E402
from llm_jax.data.hf_tokenizer import HFTokenizer, run_tokenizer  # noqa: E402
from llm_jax.data.sft import (  # noqa: E402
    make_sft_data,
    split_conversations,
    tokenize_conversation,
)
from llm_jax.execution import ExecutionConfig  # noqa: E402
from llm_jax.export import export, run_tokenizer_files  # noqa: E402
from llm_jax.model.lora import LoRAParam, add_lora  # noqa: E402
from llm_jax.training.finetune import restore_finetuned  # noqa: E402
from llm_jax.training.loop import train  # noqa: E402
from llm_jax.training.metrics import read_metrics  # noqa: E402
from llm_jax.training.preemption import Interrupted  # noqa: E402
from llm_jax.training.step import eval_step, loss_fn, target_mask  # noqa: E402
from llm_jax.weights.adapters import load_adapters, merge_lora, save_adapters  # noqa: E402
from llm_jax.weights.writers import save_hf  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SPECIAL = ["<|start|>", "<|message|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}")
VOCAB = 320
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _conversations() -> list[dict]:
    out = []
    for i in range(24):
        a, b = i % 10, (3 * i + 1) % 10
        out.append({"messages": [{"role": "user", "content": f"spell {a} {b}"},
                                 {"role": "assistant", "content": f"{NUMBERS[a]} {NUMBERS[b]}"}]})
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An HF gpt-oss directory: 2 layers, hidden 32, 4 experts; tokenizer + chat template."""
    d = tmp_path_factory.mktemp("hf_ckpt")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    text = [json.dumps(c) for c in _conversations()] + ["user assistant spell"] * 4
    tok.train_from_iterator(text, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    config = transformers.GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        hidden_size=32, intermediate_size=32, head_dim=8, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # non-trivial biases and sinks, so the export is really checked
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(0.1 * torch.randn(p.shape))
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("sft") / "train.jsonl"
    p.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    return p


def _config(name: str, ckpt: Path, jsonl: Path, **train_kw):
    cfg = runpy.run_path(str(CONFIGS / f"{name}.py"))["get_config"]()
    cfg.train.init_from = str(ckpt)
    cfg.sft.files = str(jsonl)
    cfg.data.seq_len = 64
    cfg.train.batch_size = 2
    cfg.train.warmup_steps = 0
    cfg.train.log_every_steps = 1
    cfg.checkpoint.async_save = False
    cfg.checkpoint.checksums = False
    for k, v in train_kw.items():
        cfg.train[k] = v
    return cfg


def _losses(workdir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(workdir / "metrics.jsonl"))]


def _assistant_loss(model: nnx.Module, ckpt: Path, jsonl: Path) -> float:
    """Mean loss over every assistant target of the held-out conversations (the same
    batches)."""
    data = make_sft_data(_config("finetune_full", ckpt, jsonl).sft, tokenizer_path=str(ckpt),
                         seq_len=64, batch_size=2, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    step = jax.jit(lambda p, b: eval_step(p, b, graphdef=graphdef))
    nll = tokens = 0.0
    for batch in data.make_eval_iter():
        out = step(params, batch)
        nll, tokens = nll + float(out["nll"]), tokens + float(out["tokens"])
    return nll / tokens


@pytest.fixture(scope="module")
def base_loss(ckpt, jsonl) -> float:
    """The base checkpoint's assistant loss on the held-out conversations (what both SFT runs
    must lower)."""
    return _assistant_loss(load_pretrained(ckpt), ckpt, jsonl)


def test_assistant_spans_and_packing(ckpt, jsonl):
    tok = HFTokenizer(ckpt)
    msgs = _conversations()[3]["messages"]
    ids, mask = tokenize_conversation(tok, msgs)
    assert tok.decode(ids[mask == 1]) == "three zero<|end|>"
    data = make_sft_data(_config("finetune_full", ckpt, jsonl).sft, tokenizer_path=str(ckpt),
                         seq_len=64, batch_size=2, seed=0)
    rows = data.rows
    assert rows["segment_ids"].max() > 1  # several examples per row
    seg, pos = rows["segment_ids"][0], rows["positions"][0]
    starts = np.flatnonzero(np.diff(seg, prepend=0) != 0)
    assert all(pos[s] == 0 for s in starts if seg[s])  # each example's positions start at 0
    assert np.all(rows["loss_mask"][rows["segment_ids"] == 0] == 0)


def test_sft_holds_out_conversations_by_hash_and_shards_each_split_across_processes(ckpt, jsonl):
    sft = _config("finetune_full", ckpt, jsonl).sft
    convs = [c["messages"] for c in _conversations()]
    train, held = split_conversations(convs, 0.2)
    # By content, not position: the same split in any order; none held out at 0.
    train_r, held_r = split_conversations(convs[::-1], 0.2)
    assert sorted(map(str, held)) == sorted(map(str, held_r)) and 1 <= len(held) < len(convs)
    assert split_conversations(convs, 0.0) == (convs, [])
    with pytest.raises(ValueError, match="sft.validation_fraction=1.0 is invalid"):
        split_conversations(convs, 1.0)

    sft.validation_fraction = 0.2
    one = make_sft_data(sft, tokenizer_path=str(ckpt), seq_len=64, batch_size=4, seed=0,
                        process_index=0, process_count=1)
    two = [make_sft_data(sft, tokenizer_path=str(ckpt), seq_len=64, batch_size=4, seed=0,
                         process_index=i, process_count=2) for i in range(2)]
    # Each process packs its own share: together they hold exactly the single process's
    # assistant targets, train and held out apart; each serves half the global batch.
    for rows in ("rows", "eval_rows"):
        total = sum(float(getattr(d, rows)["loss_mask"].sum()) for d in two)
        assert total == float(getattr(one, rows)["loss_mask"].sum()) > 0
    assert [d.batch_size for d in two] == [2, 2] and one.batch_size == 4
    assert next(two[1].train_iter)["inputs"].shape == (2, 64)
    assert two[0].train_iter.identity != two[1].train_iter.identity
    # Every process runs the asked number of eval batches, padded with empty ones.
    batches = list(two[0].make_eval_iter(5))
    assert len(batches) == 5 and batches[-1]["segment_ids"].max() == 0
    with pytest.raises(ValueError, match="pass num_batches"):
        list(two[0].make_eval_iter())
    # Fewer held-out conversations than processes: a process that holds none runs as many
    # eval batches as the others (an eval step is collective), padding only.
    count = len(held) + 1
    few = [make_sft_data(sft, tokenizer_path=str(ckpt), seq_len=64, batch_size=count, seed=0,
                         process_index=i, process_count=count) for i in (0, count - 1)]
    assert not few[0].eval_rows and few[1].eval_rows
    evals = [list(d.make_eval_iter(2)) for d in few]
    assert [[{k: v.shape for k, v in b.items()} for b in e] for e in evals] == \
        [[{k: v.shape for k, v in b.items()} for b in evals[1]]] * 2
    assert all(b["loss_mask"].sum() == 0 for b in evals[0]) and evals[1][0]["loss_mask"].sum()
    with pytest.raises(ValueError, match="train.batch_size=3 is not divisible by the process"):
        make_sft_data(sft, tokenizer_path=str(ckpt), seq_len=64, batch_size=3, seed=0,
                      process_index=0, process_count=2)


def test_masked_targets_get_no_gradient(ckpt, jsonl):
    model = load_pretrained(ckpt)
    data = make_sft_data(_config("finetune_full", ckpt, jsonl).sft, tokenizer_path=str(ckpt),
                         seq_len=64, batch_size=2, seed=0)
    batch = {k: jnp.asarray(v) for k, v in next(iter(data.make_eval_iter(1))).items()}
    graphdef, params = nnx.split(model, nnx.Param)
    train_cfg = _config("finetune_full", ckpt, jsonl).train
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, graphdef, b, train_cfg,
                                                 target_mask(b).sum())[0]))
    perturbed = dict(batch, targets=jnp.where(batch["loss_mask"] > 0, batch["targets"],
                                              (batch["targets"] + 7) % VOCAB))
    assert not np.array_equal(perturbed["targets"], batch["targets"])
    g0, g1 = grad(params, batch), grad(params, perturbed)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_array_equal(a, b)


def test_lora_step0_is_base_and_merged_export_matches_transformers(ckpt, tmp_path):
    base = load_pretrained(ckpt)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 24)), jnp.int32)
    want = np.asarray(base(tokens))
    lora = add_lora(load_pretrained(ckpt), rank=4, alpha=8.0,
                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
                    seed=0)
    np.testing.assert_array_equal(np.asarray(lora(tokens)), want)  # B = 0: exactly the base
    for path, v in nnx.to_flat_state(nnx.state(lora, LoRAParam)):  # now a real update
        if path[-1].endswith("_lora_b"):
            v.set_value(0.05 * jax.random.normal(jax.random.key(len(path[-1])), v.shape))
    adapted = np.asarray(lora(tokens))
    assert np.abs(adapted - want).max() > 1e-3
    merged = merge_lora(lora)
    np.testing.assert_allclose(np.asarray(merged(tokens)), adapted, atol=1e-5)
    save_hf(merged, tmp_path / "hf")
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        got = hf.eval()(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()
    assert np.abs(got - adapted).max() < 1e-4
    save_adapters(lora, tmp_path / "adapters", rank=4, alpha=8.0)
    meta = json.loads((tmp_path / "adapters" / "adapters.json").read_text())
    assert meta["rank"] == 4 and len(meta["targets"]) == 6
    # adapters.json as written before ExecutionConfig: its base_model also holds the execution
    # fields, which never identified the base.
    meta["base_model"] = {**meta["base_model"], **ExecutionConfig(remat=True).to_dict()}
    (tmp_path / "adapters" / "adapters.json").write_text(json.dumps(meta))
    again = load_adapters(load_pretrained(ckpt), tmp_path / "adapters")
    np.testing.assert_array_equal(np.asarray(again(tokens)), adapted)


def test_full_sft_lowers_assistant_loss(ckpt, jsonl, base_loss, tmp_path):
    cfg = _config("finetune_full", ckpt, jsonl, num_steps=12, learning_rate=3e-3)
    train(cfg, str(tmp_path))
    before = base_loss
    after = _assistant_loss(restore_finetuned(str(tmp_path))[0], ckpt, jsonl)
    losses = _losses(tmp_path)
    print(f"full SFT assistant loss on the test set: {before:.4f} -> {after:.4f} "
          f"(train batches {losses[0]:.4f} -> {losses[-1]:.4f})")
    assert after < before - 0.5


@pytest.mark.slow
def test_lora_sft_trains_only_adapters_and_resumes_without_init_from(ckpt, jsonl, base_loss,
                                                                    tmp_path, monkeypatch):
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    cfg = _config("finetune_lora", src, jsonl, num_steps=14, learning_rate=3e-2)
    stop_after_step(monkeypatch, 12)  # then resumed: one compiled step for both
    with pytest.raises(Interrupted, match="after step 12"):
        train(cfg, str(tmp_path / "run"))
    monkeypatch.undo()
    # The base the run started from is gone from here on: the export and the resume read the
    # workdir alone (its checkpoint, and the copy of the tokenizer its first start made).
    shutil.rmtree(src)
    model, run = restore_finetuned(str(tmp_path / "run"))
    base = load_pretrained(ckpt)
    before, after = base_loss, _assistant_loss(model, ckpt, jsonl)
    print(f"LoRA SFT assistant loss on the test set: {before:.4f} -> {after:.4f}")
    assert after < before - 0.1  # the adapters cannot move the embeddings: slower than full
    np.testing.assert_array_equal(np.asarray(model.layers.attn.q_proj[...]),
                                  np.asarray(base.layers.attn.q_proj[...]))  # frozen
    assert np.abs(np.asarray(model.layers.mlp.down_proj_lora_b[...])).max() > 0
    # The trained run exported: merged HF checkpoint (+ tokenizer) and the adapters alone.
    exported = export(str(tmp_path / "run"), hf=str(tmp_path / "hf"),
                      adapters=str(tmp_path / "ad"))
    assert exported.warnings == ()
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 20))
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        got = hf.eval()(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(got - np.asarray(model(jnp.asarray(tokens, jnp.int32)))).max() < 1e-4
    assert HFTokenizer(tmp_path / "hf").vocab_size == HFTokenizer(ckpt).vocab_size
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == TEMPLATE
    assert (tmp_path / "ad" / "adapters.safetensors").is_file()
    train(cfg, str(tmp_path / "run"))
    assert [r["step"] for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))] == list(
        range(1, 15))


def test_init_from_shape_override_is_refused(ckpt, jsonl, tmp_path):
    cfg = _config("finetune_full", ckpt, jsonl)
    cfg.model.hidden_size = 64
    cfg.model.dtype = "bfloat16"  # a conversion of the weights may differ
    with pytest.raises(ValueError, match=r"model\.hidden_size=64 \(checkpoint: 32\)"):
        train(cfg, str(tmp_path))


def test_export_takes_the_runs_tokenizer_copy_else_the_source_its_config_names(ckpt, tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    run = {"train": {"init_from": str(tmp_path / "gone")},
           "dpo": {"files": "pairs.jsonl", "tokenizer": str(ckpt)}}
    assert run_tokenizer_files(str(work), run) == ckpt  # a run from before copies were kept
    run_tokenizer(work, str(ckpt), "dpo.tokenizer", fresh=True, write=True)
    assert run_tokenizer_files(str(work), run) == work / "tokenizer"
    shutil.rmtree(work / "tokenizer")
    assert run_tokenizer_files(str(work), {"train": {"init_from": ""}}) is None


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_bad_tokenizer_file_is_refused(ckpt, tmp_path, damage):
    d = tmp_path / "tok"
    shutil.copytree(ckpt, d)
    if damage == "missing":
        (d / "tokenizer.json").unlink()
    else:
        (d / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(ValueError, match=f"tokenizer file {d / 'tokenizer.json'} "
                                         f"({'does not exist' if damage == 'missing' else 'is corrupt'})"):
        HFTokenizer(d)


def test_malformed_jsonl_is_named_and_skipped_or_refused(ckpt, jsonl, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = jsonl.read_text().splitlines()
    lines[2] = '{"messages": [{"role": "user"'
    lines[5] = '{"prompt": "no completion"}'
    bad.write_text("\n".join(lines) + "\n")
    sft = _config("finetune_full", ckpt, bad).sft
    data = make_sft_data(sft, tokenizer_path=str(ckpt), seq_len=64, batch_size=2, seed=0)
    assert data.bad_lines.count == 2 and data.bad_lines.first[0].startswith(f"{bad}:3:")
    sft.on_bad_line = "stop"
    with pytest.raises(ValueError, match=f"malformed SFT line {bad}:3:"):
        make_sft_data(sft, tokenizer_path=str(ckpt), seq_len=64, batch_size=2, seed=0)


def test_describe_lora_memory_is_adapters_only():
    from llm_jax.model.lora_costs import finetune_memory_per_device

    cfg = runpy.run_path(str(CONFIGS / "gpt_oss_20b.py"))["get_config"]()
    from llm_jax.training.run_config import model_config

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    m = finetune_memory_per_device(model_config(cfg), batch=8, seq_len=4096,
                                   mesh={"data": 1, "fsdp": 8, "tensor": 1, "expert": 1},
                                   rank=16, targets=targets)
    full, lora = m["full"], m["lora"]
    # Adapters only: their B halves carry no embed axis, so fsdp leaves them whole (RULES).
    assert lora["adam_m_v"] == 2 * lora["grads"] < full["adam_m_v"] / 10
    assert full["params"] < lora["params"] < 1.1 * full["params"]
    # 20b: 24 layers x (q, k, v, o and 32 experts x (gate_up + down)) x r x (in + out)
    assert m["adapter_params"] == 24 * 16 * (
        (2880 + 64 * 64) + 2 * (2880 + 8 * 64) + (64 * 64 + 2880)
        + 32 * ((2880 + 2 * 2880) + (2880 + 2880)))
