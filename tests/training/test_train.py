"""Training: the step (accumulation, decay mask, schedule), exact resume, the CLI end to end, and
bad input that loses nothing already saved."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, SHUFFLE_BUFFER_TOKENS, SMALL_MODEL, SMALL_MODEL_OVERRIDES, small_cfg

from llm_jax.training.loop import train
from llm_jax.training.run_config import execution_config
from llm_jax.training.step import decay_mask, learning_rate_schedule
from llm_jax.weights.checkpointing import Checkpointer, restore_params


def small_run_config(corpus_dir: str, num_steps: int = 6):
    return small_cfg(corpus_dir, num_steps, checkpoint_every=3, eval_every_steps=3,
                      eval_batches=2)


def _random_batch(rng, b, t, v):
    return {"inputs": rng.integers(0, v, (b, t)).astype(np.int32),
            "targets": rng.integers(0, v, (b, t)).astype(np.int32)}


def test_weight_decay_skips_norms_biases_and_sinks():
    params = nnx.state(nnx.eval_shape(lambda: __import__("llm_jax.model", fromlist=["x"])
                                      .Transformer(SMALL_MODEL, rngs=nnx.Rngs(0))), nnx.Param)
    flat = dict(jax.tree_util.tree_flatten_with_path(decay_mask(params))[0])
    by_name = {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in flat.items()}
    decayed = {n for n, v in by_name.items() if v}
    assert any("q_proj" in n for n in decayed) and any("gate_up_proj" in n for n in decayed)
    assert any(n.startswith("embedding") for n in decayed)
    for n in by_name:
        if any(s in n for s in ("scale", "bias", "sinks")):
            assert n not in decayed, n


def test_learning_rate_schedule_warms_up_then_decays_to_floor():
    cfg = small_run_config("unused", num_steps=100)
    cfg.train.warmup_steps = 10
    lr = learning_rate_schedule(cfg.train)
    assert float(lr(0)) == 0.0
    assert float(lr(10)) == pytest.approx(cfg.train.learning_rate)
    assert float(lr(100)) == pytest.approx(cfg.train.learning_rate * cfg.train.min_lr_ratio)
    assert float(lr(5)) == pytest.approx(cfg.train.learning_rate / 2)


def _losses(workdir: str) -> list[tuple[int, float]]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def _as_written_before_execution_config(workdir: str) -> None:
    """Rewrites every checkpoint's saved run config into the layout checkpoints had before the
    execution settings left ModelConfig (its `model` section holding them, no `execution`
    section), and their checksum manifests to match: a workdir as the older code wrote it."""
    from llm_jax.weights.manifest import write_manifest

    for step_dir in glob.glob(os.path.join(workdir, "checkpoints", "[0-9]*")):
        files = [f for f in glob.glob(os.path.join(step_dir, "config", "*"))
                 if "execution" in open(f, errors="ignore").read()]
        assert len(files) == 1, files
        run = json.loads(open(files[0]).read())
        run["model"] = {**run["model"], **run.pop("execution")}
        with open(files[0], "w") as f:
            json.dump(run, f)
        write_manifest(step_dir)


@pytest.fixture(scope="module")
def straight(corpus_dir, tmp_path_factory) -> str:
    """A workdir of small_run_config's 6 steps in one run, checkpointed at steps 3 and 6."""
    workdir = str(tmp_path_factory.mktemp("straight") / "run")
    train(small_run_config(corpus_dir, num_steps=6), workdir)
    return workdir


@pytest.fixture(scope="module")
def three_steps(straight, tmp_path_factory) -> str:
    """The straight run as it stood after step 3 (copy it): its checkpoint of step 6 removed,
    as if the run had stopped there (a resume drops the metrics logged after its step)."""
    workdir = str(tmp_path_factory.mktemp("three_steps") / "run")
    shutil.copytree(straight, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
    return workdir


@pytest.mark.slow
def test_resume_is_exact_with_any_execution_and_from_older_checkpoints(corpus_dir, straight,
                                                                       three_steps, tmp_path):
    """2N steps in one run == N steps, restart, N more: bitwise equal losses and params.

    How the model runs is no part of what it is. Resumed from checkpoints whose saved model
    config still holds the execution fields (as written before ExecutionConfig), with other
    tiles, loss chunks and groups, attention implementation and unpack budget, a run continues
    bitwise as the straight run goes. With remat and the layers unrolled it computes the same
    function in another program: at the suite's optimization level 0 (tests/xla_flags.py)
    XLA:CPU's code for it rounds differently, so the params differ in the last bits (measured:
    4.2e-7 after 3 steps), never more. At the default level this case is bitwise on jax 0.10
    (docs/training.md says where it is not)."""
    n = 3
    _, p_straight, _ = restore_params(straight)
    bitwise = small_run_config(corpus_dir, num_steps=2 * n)
    bitwise.execution.update(gmm_tile_m=256, gmm_tile_k=256, gmm_tile_n=256,
                             loss_chunk_tokens=512, loss_group_chunks=2, attention_impl="direct",
                             mxfp4_unpack_mib=0)
    reordered = small_run_config(corpus_dir, num_steps=2 * n)
    reordered.execution.update(remat=True, scan_layers=False)
    # Compared by its training losses and params only: no evaluation, one program fewer to
    # compile (the evaluation never touches the training state or its batches).
    reordered.train.eval_every_steps = 0
    first_half = three_steps  # the same N steps for both: run once, copied
    assert Checkpointer(first_half).latest_step() == n
    for name, second_half in (("bitwise", bitwise), ("reordered", reordered)):
        resumed = str(tmp_path / name)
        shutil.copytree(first_half, resumed)
        if name == "bitwise":
            _as_written_before_execution_config(resumed)
            assert "execution" not in Checkpointer(resumed).restore_config(n)
        train(second_half, resumed)
        (want_steps, want), (got_steps, got) = zip(*_losses(straight)), zip(*_losses(resumed))
        assert got_steps == want_steps, name
        _, p_resumed, _ = restore_params(resumed)
        for a, b in zip(jax.tree.leaves(p_straight), jax.tree.leaves(p_resumed)):
            if name == "bitwise":
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5)
        if name == "bitwise":
            assert got == want
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5)
        saved = Checkpointer(resumed, create=False).restore_config(2 * n)
        assert saved["execution"] == execution_config(second_half).to_dict()
        assert not set(saved["model"]) & set(saved["execution"])  # stored apart


@pytest.mark.slow
def test_train_cli_end_to_end(corpus_dir, tmp_path):
    workdir = tmp_path / "run"
    overrides = {
        **SMALL_MODEL_OVERRIDES, "data.files": os.path.join(corpus_dir, "*"), "data.validation_fraction": 0.2,
        "data.seq_len": 32, "data.shuffle_buffer_tokens": SHUFFLE_BUFFER_TOKENS,
        "train.batch_size": 8, "train.num_steps": 16,
        "train.warmup_steps": 4, "train.learning_rate": 1e-2, "train.log_every_steps": 4,
        "train.eval_every_steps": 6, "train.eval_batches": 2, "checkpoint.every_steps": 8,
    }
    cmd = [sys.executable, "-m", "llm_jax.train", "--config", str(ROOT / "configs/tiny.py"),
           f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    # every eval_every_steps and at the end, whether or not a step is one of log_every_steps'
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12, 16]
    last = records[-1]
    for key in ("val_loss", "val_bpb", "lr", "grad_norm", "tokens_per_sec", "mfu", "expert_load"):
        assert key in last, key
    assert np.asarray(last["expert_load"]).shape == (2, 4)
    assert (workdir / "loss.png").stat().st_size > 1000
    assert (workdir / "expert_load.png").stat().st_size > 1000
    assert glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*"))
    assert "---- sample ----" in proc.stdout
    # The command line chose its malloc itself (importing llm_jax no longer tunes any).
    host_malloc = re.search(r"host malloc: (.*)", proc.stderr).group(1)
    assert host_malloc != "system", host_malloc  # a preloaded library or "glibc (tuned)"

    ckpt = Checkpointer(str(workdir), create=False)
    assert ckpt.all_steps() == [8, 16]
    saved = ckpt.restore_config(16)
    assert saved["model"]["hidden_size"] == 32 and saved["train"]["num_steps"] == 16
    assert ckpt.restore_tokenizer_proto(16) == (workdir / "tokenizer.model").read_bytes()
    assert (workdir / "checkpoints" / "16" / "data").is_dir()
    ckpt.close()

    # The workdir loads as a pretrained model, with the trained config.
    import llm_jax

    model = llm_jax.load_pretrained(str(workdir))
    assert model.cfg.hidden_size == 32
    logits = model(jnp.zeros((1, 5), jnp.int32))
    assert logits.shape == (1, 5, 384)


def test_changed_model_config_is_refused_and_checkpoints_kept(corpus_dir, three_steps,
                                                              tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(three_steps, workdir)
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    cfg = small_run_config(corpus_dir, num_steps=6)
    cfg.model.hidden_size = 64
    with pytest.raises(ValueError, match="hidden_size: saved 32 vs requested 64"):
        train(cfg, workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before


def test_resume_refuses_a_changed_model_field_by_name_and_reads_older_model_sections():
    from llm_jax.config import ModelConfig
    from llm_jax.execution import ExecutionConfig
    from llm_jax.weights.checkpointing import check_same_model

    check_same_model({"model": ModelConfig().to_dict()}, ModelConfig(), "ckpts")
    with pytest.raises(ValueError, match="dtype: saved 'float32' vs requested 'bfloat16'"):
        check_same_model({"model": ModelConfig().to_dict()}, ModelConfig(dtype="bfloat16"),
                         "ckpts")
    # The model section as checkpoints stored it before ExecutionConfig: execution fields mixed
    # in, whatever their values, never compared.
    legacy = {"model": {**ModelConfig().to_dict(),
                        **ExecutionConfig(remat=True, moe_capacity_factor=2.0).to_dict()}}
    check_same_model(legacy, ModelConfig(), "ckpts")
    with pytest.raises(ValueError, match="num_experts: saved 16 vs requested 8"):
        check_same_model(legacy, ModelConfig(num_experts=8), "ckpts")


def test_unwritable_workdir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot be written"):
        train(small_run_config(str(tmp_path)), str(blocker / "run"))


def test_the_step_keeps_frozen_params_apart_and_accumulates_as_one_big_batch():
    # A LoRA step over a packed, frozen base. On CPU the loader's weights are zero-copy views of
    # host memory, which donation cannot alias: a step that returned its frozen params wrote a
    # copy of every one (QLoRA of gpt-oss-20b: 12.8 GiB more). The step gets them as an
    # argument it neither donates nor returns, gives back the very same arrays, and computes
    # what `train_step` computes. Two microbatches of the batch give its loss and gradient
    # (a dropless dispatch: each token meets the same experts); compared by the gradient's
    # norm, as the first step's learning rate is 0 (warmup) and leaves the params as they were.
    import functools

    from llm_jax.config import ModelConfig
    from llm_jax.execution import ExecutionConfig
    from llm_jax.model import Transformer
    from llm_jax.model.lora import TARGETS, LoRAParam, add_lora
    from llm_jax.training.run_config import default_run_config
    from llm_jax.training.step import TrainState, jit_train_step, make_optimizer, train_step

    cfg = ModelConfig(num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=128,
                      hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                      num_key_value_heads=2, expert_format="mxfp4")
    model = Transformer(cfg, rngs=nnx.Rngs(params=0),
                        execution=ExecutionConfig(moe_dispatch="gather"))
    add_lora(model, rank=4, alpha=8.0, targets=tuple(TARGETS), seed=1)
    # B not zero, so every adapter (A too) has a gradient.
    for path, v in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        if path[-1].endswith("_lora_b"):
            v.set_value(0.05 * jax.random.normal(jax.random.key(len(path[-1])), v.shape))
    # No load-balancing loss: a product of the batch's expert fractions, it is not the mean of
    # its microbatches' (the cross-entropy and the z-loss are), nor is its gradient.
    train = default_run_config("lora", cfg).train
    train.load_balancing_loss_weight = 0.0
    graphdef, params = nnx.graphdef(model), nnx.state(model, nnx.Param)
    tx = make_optimizer(train)

    def fresh():
        p = jax.tree.map(jnp.copy, params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                          opt_state=tx.init(nnx.filter_state(p, LoRAParam)))

    batch = _random_batch(np.random.default_rng(0), 2, 16, cfg.vocab_size)
    want, want_metrics = jax.jit(functools.partial(
        train_step, graphdef=graphdef, tx=tx, train=train, trainable=LoRAParam))(fresh(), batch)
    state = fresh()
    frozen = jax.tree.leaves(state.params.split(LoRAParam, ...)[1])
    step = jit_train_step(graphdef, tx, train, LoRAParam)
    for run in (step, step.compile(state, batch)):  # jitted, and compiled ahead of time
        got, metrics = run(fresh() if run is not step else state, batch)
        assert float(metrics["loss"]) == float(want_metrics["loss"])
        # The same gradient, to float32 rounding: with the frozen params an argument of their
        # own XLA may fuse the backward pass differently (1 ulp of the norm on jax 0.10).
        assert float(metrics["grad_norm"]) == pytest.approx(float(want_metrics["grad_norm"]),
                                                            rel=1e-6)
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
            np.testing.assert_array_equal(a, b)
        assert jax.tree.structure(got) == jax.tree.structure(want)
    kept = jax.tree.leaves(step(state := fresh(), batch)[0].params.split(LoRAParam, ...)[1])
    given = jax.tree.leaves(state.params.split(LoRAParam, ...)[1])
    assert len(kept) == len(given) > 0 and all(a is b for a, b in zip(kept, given))
    assert not any(a.is_deleted() for a in given)
    assert any(a.dtype == np.uint8 for a in frozen)  # the packed blocks are among them

    micro = train.copy_and_resolve_references()
    micro.grad_accum_steps = 2
    assert train.grad_accum_steps == 1
    accumulated, metrics = jax.jit(functools.partial(
        train_step, graphdef=graphdef, tx=tx, train=micro, trainable=LoRAParam))(fresh(), batch)
    for key in ("loss", "grad_norm"):
        assert float(metrics[key]) == pytest.approx(float(want_metrics[key]), rel=1e-5), key
    for a, b in zip(jax.tree.leaves(accumulated.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
