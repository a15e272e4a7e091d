"""QLoRA end to end: fine-tuning from a checkpoint with packed MXFP4 experts keeps them packed
and frozen (a full fine-tune of them is refused by name), a few steps lower the loss, the
Orbax checkpoint restores and resumes, and the exports agree: adapters saved and loaded back
onto the packed base give the merged dense export's logits within 1e-4, `generate --adapters`
the merged model's tokens, and the re-quantized MXFP4 export reports its error."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_MODEL, read_records, small_cfg, stop_after_step

from llm_jax import generate
from llm_jax.export import export
from llm_jax.inference.sampler import sample
from llm_jax.model import init_model
from llm_jax.training.finetune import restore_finetuned
from llm_jax.training.loop import train
from llm_jax.training.preemption import Interrupted
from llm_jax.weights.adapters import load_adapters
from llm_jax.weights.flat import flat_params
from llm_jax.weights.readers import load_pretrained
from llm_jax.weights.writers import save_hf

PACKED = SMALL_MODEL.replace(expert_format="mxfp4", initializer_range=0.1)
RANK, ALPHA = 4, 8.0


def _cfg(corpus_dir: str, ckpt, num_steps: int, rank: int = RANK):
    cfg = small_cfg(corpus_dir, num_steps, checkpoint_every=3, learning_rate=3e-2)
    cfg.train.init_from = str(ckpt)
    cfg.model.initializer_range = PACKED.initializer_range
    cfg.lora.rank, cfg.lora.alpha = rank, ALPHA
    cfg.checkpoint.checksums = False
    return cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Hugging Face gpt-oss directory whose experts are MXFP4, as gpt-oss is released."""
    return save_hf(init_model(PACKED, seed=0), tmp_path_factory.mktemp("mxfp4_hf"))


@pytest.fixture(scope="module")
def run(corpus_dir, ckpt, tmp_path_factory):
    """A QLoRA run of 8 steps from `ckpt` stopped after step 6 (checkpoints at steps 3 and 6),
    as a preemption stops it; test_qlora_run_resumes_from_its_orbax_checkpoint resumes it."""
    workdir = tmp_path_factory.mktemp("qlora")
    with pytest.MonkeyPatch.context() as mp:
        stop_after_step(mp, 6)
        with pytest.raises(Interrupted, match="after step 6"):
            train(_cfg(corpus_dir, ckpt, 8), str(workdir))
    return workdir


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    result = export(str(run), hf=str(out / "merged"), adapters=str(out / "adapters"))
    assert result.quantization_error == {}
    return out


def test_qlora_trains_adapters_over_the_packed_experts_and_lowers_the_loss(ckpt, run):
    model, saved = restore_finetuned(str(run))
    assert saved["model"]["expert_format"] == "mxfp4" and model.cfg.expert_format == "mxfp4"
    got, base = flat_params(model), flat_params(load_pretrained(ckpt))
    for key in [k for k in base if k.endswith(("_blocks", "_scales"))]:  # frozen, bitwise
        assert got[key].dtype == np.uint8
        np.testing.assert_array_equal(got[key], base[key])
    np.testing.assert_array_equal(got["layers.attn.q_proj"], base["layers.attn.q_proj"])
    assert np.abs(got["layers.mlp.down_proj_lora_b"]).max() > 0
    losses = [r["loss"] for r in read_records(run)]
    print(f"QLoRA train loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05


def test_adapters_loaded_onto_the_packed_base_give_the_merged_export_logits(ckpt, exported):
    merged = load_pretrained(exported / "merged")
    assert merged.cfg.expert_format == "dense"
    model = load_adapters(load_pretrained(ckpt), exported / "adapters")
    assert model.cfg.expert_format == "mxfp4"  # nothing merged, nothing unpacked outside
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, PACKED.vocab_size, (2, 20)))
    want = np.asarray(merged(tokens))
    base = np.asarray(load_pretrained(ckpt)(tokens))
    assert np.abs(want - base).max() > 1e-3  # the adapters changed the function
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=0, atol=1e-4)
    # ... and onto the dequantized base (expert_format may differ; the architecture may not).
    dense = load_adapters(load_pretrained(ckpt, expert_format="dense"), exported / "adapters")
    np.testing.assert_allclose(np.asarray(dense(tokens)), want, rtol=0, atol=1e-4)


def test_generate_with_adapters_decodes_as_the_merged_model(ckpt, exported, tmp_path):
    out = tmp_path / "out.json"
    assert generate.main(["--checkpoint", str(ckpt), "--adapters", str(exported / "adapters"),
                          "--prompt_ids", "5,9,2,7", "--max_new_tokens", "6", "--eos_id", "-1",
                          "--no_stream", "--output_json", str(out)]) == 0
    want = sample(load_pretrained(exported / "merged"), [[5, 9, 2, 7]], max_new_tokens=6)
    assert json.loads(out.read_text())[0]["ids"] == want[0]


def test_adapters_onto_another_base_are_refused_by_name(exported, tmp_path):
    other = init_model(PACKED.replace(num_hidden_layers=3), seed=0)
    with pytest.raises(ValueError, match=r"another base model: num_hidden_layers=2 \(this "
                                         r"model: 3\)"):
        load_adapters(other, exported / "adapters")
    with pytest.raises(ValueError, match="holds no adapters.json"):
        load_adapters(init_model(PACKED, seed=0), tmp_path)


def test_requantized_mxfp4_export_reports_its_error(ckpt, run, exported, tmp_path):
    result = export(str(run), hf=str(tmp_path / "q"), expert_format="mxfp4")
    errors = result.quantization_error
    print("re-quantization relative RMS error:", errors)
    assert set(errors) == {"gate_up_proj", "down_proj"}
    assert all(0 < e < 0.2 for e in errors.values())  # E2M1 keeps ~1 mantissa bit
    q = load_pretrained(tmp_path / "q")
    assert q.cfg.expert_format == "mxfp4"
    # The reported error is that of the written bytes against the merged dense experts.
    merged = flat_params(load_pretrained(exported / "merged"))
    written = flat_params(load_pretrained(tmp_path / "q", expert_format="dense"))
    for name, err in errors.items():
        w, qw = merged[f"layers.mlp.{name}"], written[f"layers.mlp.{name}"]
        rel = float(np.sqrt(np.sum((qw - w) ** 2) / np.sum(w ** 2)))
        np.testing.assert_allclose(err, rel, rtol=1e-4)
    np.testing.assert_array_equal(written["layers.attn.q_proj"], merged["layers.attn.q_proj"])


def test_full_finetune_of_packed_experts_is_refused_by_name(corpus_dir, ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"model.expert_format='mxfp4'.*lora.rank > 0.*"
                                         r"model.expert_format='dense'"):
        train(_cfg(corpus_dir, ckpt, 2, rank=0), str(tmp_path))


def test_qlora_run_resumes_from_its_orbax_checkpoint(corpus_dir, ckpt, run):
    # Restores step 6 (packed params, adapters, Adam) and runs the same compiled step on.
    train(_cfg(corpus_dir, ckpt, 8), str(run))
    assert [r["step"] for r in read_records(run)][-2:] == [7, 8]
    assert restore_finetuned(str(run))[0].cfg.expert_format == "mxfp4"
