"""The training loop (`python -m llm_jax.train` is its command line, llm_jax/train.py).

The loop is the only impure part: it feeds batches to the jitted step, logs every
`train.log_every_steps` (one host sync there), evaluates, checkpoints, and at the end draws the
curves and samples a few lines. Rerunning with the same --workdir resumes from the latest
checkpoint, exactly: params, optimizer, step and data iterator are restored.

Faults (docs/reliability.md): SIGTERM / SIGINT finish the step, save and exit (128 + signal);
a second one exits at once. Interrupted saves are removed at start-up and corrupt checkpoints
skipped (llm_jax.weights.checkpointing). Each step returns an `isfinite` flag that the loop reads one
step late, so the host stays a step ahead of the device, and before every save: a non-finite
loss or gradient stops the run naming the step, or with `train.skip_nonfinite_updates` the step
left params and moments as they were and is counted.
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import time
from typing import Any

import jax
import ml_collections
from absl import logging

from llm_jax.config import ModelConfig
from llm_jax.model import costs as describe
from llm_jax.model.select import kernels_line
from llm_jax.parallel import distributed
from llm_jax.parallel.sharding import mesh_from_config
from llm_jax.runtime.malloc import active_malloc
from llm_jax.runtime.peak import peak_flops
from llm_jax.training import faults, finetune
from llm_jax.training.metrics import MetricsWriter, read_metrics
from llm_jax.training.preemption import Interrupted, StopRequest
from llm_jax.training.run_config import model_config, validate_run_config
from llm_jax.training.step import Steps, compile_steps, make_optimizer
from llm_jax.training.workdir_lock import hold_workdir
from llm_jax.weights.checkpointing import Checkpointer, check_same_model


def ensure_writable(workdir: str) -> None:
    """Creates the workdir and writes a file in it (a name of its own per process: every
    process of a multi-process run probes the same folder at once)."""
    try:
        os.makedirs(workdir, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=workdir, prefix=".write_test.") as f:
            f.write("ok")
    except OSError as e:
        raise ValueError(f"--workdir={workdir!r} cannot be written: {e.strerror}") from e


def evaluate(steps: Steps, params: Any, data: Any, num_batches: int) -> dict[str, float]:
    """Validation loss (nats/token), perplexity and bits per byte over `num_batches` batches."""
    totals: dict[str, float] = {}
    for batch in data.make_eval_iter(num_batches):
        out = steps.eval(params, distributed.global_batch(batch, steps.batch_sharding))
        for k, v in jax.device_get(out).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    if not totals:
        return {}
    loss = totals["nll"] / totals["tokens"]
    result = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}
    if totals.get("bytes"):
        result["val_bpb"] = totals["nll"] / (math.log(2) * totals["bytes"])
    return result


def sample_text(params: Any, cfg: ModelConfig, tokenizer: Any, *, seed: int,
                num_samples: int = 3, max_new_tokens: int = 64,
                model_fn: Any = None) -> list[str]:
    """A few continuations of short code prompts, to see what the model learned."""
    from flax import nnx

    from llm_jax.inference import sample
    from llm_jax.model import abstract_model

    abstract = abstract_model(cfg) if model_fn is None else \
        nnx.eval_shape(lambda: model_fn(rngs=nnx.Rngs(params=0)))
    model = nnx.merge(nnx.graphdef(abstract), jax.device_get(params))
    prompts = (["def ", "import ", "class ", "for ", "    return "] * num_samples)[:num_samples]
    ids = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in prompts]  # documents start so
    out = sample(model, ids, max_new_tokens=max_new_tokens, temperature=0.8, top_k=40,
                   seed=seed, eos_id=tokenizer.eos_id)
    return [p + tokenizer.decode(list(o)) for p, o in zip(prompts, out)]


def train(cfg: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) training; returns the last logged metrics. Raises `Interrupted` after
    saving when a stop signal arrives, FloatingPointError on a non-finite step, WorkdirInUse
    if another run holds the workdir."""
    validate_run_config(cfg)  # before the workdir is touched
    ensure_writable(workdir)
    with StopRequest() as stop, hold_workdir(workdir):
        return _train(cfg, workdir, stop)


def _train(cfg: ml_collections.ConfigDict, workdir: str, stop: StopRequest) -> dict[str, Any]:
    from tqdm import tqdm

    from llm_jax.data import make_datasets
    from llm_jax.data.sft import make_sft_data

    tc = cfg.train
    is_main = jax.process_index() == 0
    mesh = mesh_from_config(cfg.mesh)
    logging.info("mesh %s over %d devices in %d process(es); host malloc: %s", dict(mesh.shape),
                 mesh.size, jax.process_count(), active_malloc())
    ckpt = Checkpointer(workdir, max_to_keep=cfg.checkpoint.max_to_keep,
                        async_save=cfg.checkpoint.async_save, cleanup_tmp=True,
                        checksums=cfg.checkpoint.checksums)
    # The newest checkpoint that passes its checksums and whose config reads; the corrupt ones
    # are reported and moved to WORKDIR/corrupt_checkpoints. Refuse a changed model before any
    # expensive work.
    latest, saved_config = ckpt.first_restorable(ckpt.restore_config, move_bad=True)
    if tc.init_from:  # a resumed run keeps its own weights and config: init_from is not read
        base = (ModelConfig.from_dict(saved_config["model"]) if latest is not None
                else finetune.pretrained_config(tc.init_from))
        mcfg = finetune.resolve_model_config(cfg.model, base, tc.init_from)
    else:
        mcfg = model_config(cfg)
    if latest is not None:
        check_same_model(saved_config, mcfg, ckpt.directory)
    else:
        ckpt.check_fresh_start(cfg.checkpoint.allow_fresh_start)

    # The MFU denominator, measured (if not cached) before the data pipeline's threads and the
    # compiler start, so that they do not share the cores with it (runtime/peak.py).
    peak, peak_source = ((tc.peak_flops, "train.peak_flops") if tc.peak_flops
                         else peak_flops(mcfg.dtype))
    # Process 0 builds the tokenizer (and a named TFDS dataset) in the workdir; the others read them.
    if not is_main:
        distributed.barrier("data")
    sft = bool(cfg.sft.files or cfg.sft.tfds_name)
    if sft:
        data = make_sft_data(cfg.sft, tokenizer_path=cfg.sft.tokenizer or tc.init_from,
                             seq_len=cfg.data.seq_len, batch_size=tc.batch_size, seed=cfg.seed)
    else:
        data = make_datasets(cfg.data, workdir=workdir, vocab_size=mcfg.vocab_size,
                             global_batch_size=tc.batch_size)
    if is_main:
        distributed.barrier("data")
    if sft and data.tokenizer.vocab_size > mcfg.vocab_size:
        raise ValueError(f"tokenizer {data.tokenizer.path} has {data.tokenizer.vocab_size} "
                         f"tokens, more than the model's vocab_size={mcfg.vocab_size}")
    if not sft and data.tokenizer.vocab_size != mcfg.vocab_size:
        raise ValueError(f"tokenizer in {workdir} has vocab {data.tokenizer.vocab_size}, "
                         f"model.vocab_size is {mcfg.vocab_size}")
    if latest is not None:  # refused here: Orbax failing on it would quarantine the checkpoint
        data.check_checkpoint(ckpt.step_dir(latest))
    if stop.signum:  # a signal during start-up: nothing new to save
        raise Interrupted(f"stopped by signal {stop.signum} before training", -1, stop.signum)
    build = finetune.model_fn(mcfg, cfg.lora, cfg.seed)
    steps = compile_steps(mcfg, tc, mesh, cfg.seed, build, finetune.trainable(cfg.lora))
    progress: dict[str, Any] = {}
    fresh_data = data.train_iter.get_state()  # a failed restore may have moved the iterator
    if latest is not None:
        latest, restored = ckpt.first_restorable(
            lambda s: (ckpt.restore(s, steps.abstract_state, data.train_iter),
                       ckpt.restore_progress(s)), move_bad=True)
    if latest is None:
        ckpt.check_fresh_start(cfg.checkpoint.allow_fresh_start)
        data.train_iter.set_state(fresh_data)
        if tc.init_from:
            state = finetune.initial_state(steps, make_optimizer(tc), tc.init_from, mcfg,
                                           cfg.lora, cfg.seed)
            logging.info("initialised from %s (optimizer fresh)", tc.init_from)
        else:
            state = steps.init()
    else:
        state, progress = restored
        logging.info("resumed from step %d in %s", latest, ckpt.directory)
    start = int(jax.device_get(state.step))
    last_saved = start
    skipped = int(progress.get("skipped_updates", 0))

    writer = MetricsWriter(workdir, enabled=is_main)
    writer.truncate_after(start)
    seq_len = cfg.data.seq_len
    tokens_per_step = tc.batch_size * seq_len
    flops_per_token = describe.flops_per_token(mcfg, seq_len, training=True)
    logging.info("model: %s params (%s active); %.3g train FLOPs/token; MFU peak %.3g FLOP/s "
                 "(%s; %s)", f"{describe.total_params(mcfg):,}",
                 f"{describe.active_params(mcfg):,}", flops_per_token, peak, mcfg.dtype,
                 peak_source)
    logging.info("kernels: %s", kernels_line(mcfg, tc.batch_size, seq_len))
    config_json = cfg.to_dict() | {"model": mcfg.to_dict()}  # init_from's config resolved
    # The first shuffle window (data.shuffle_buffer_tokens) fills in the pipeline's thread while
    # the train step compiles here, instead of one after the other before step 1.
    data.train_iter.start_prefetch()
    steps.train.lower(state, {k: jax.ShapeDtypeStruct((tc.batch_size, seq_len), dtype,
                                                      sharding=steps.batch_sharding)
                              for k, dtype in data.batch_dtypes.items()}).compile()
    proto = getattr(data.tokenizer, "_proto", None)

    def check_finite(step: int, finite: Any) -> None:
        """Stops (or counts a skip) if `step` was not finite; never lets it reach a save."""
        nonlocal skipped
        if bool(finite):
            return
        if tc.skip_nonfinite_updates:
            skipped += 1
            logging.warning("step %d: non-finite loss or gradients; update skipped (%d so far)",
                            step, skipped)
            return
        ckpt.wait()  # an earlier, finite save in flight completes
        raise FloatingPointError(
            f"non-finite loss or gradients at step {step}: training stopped and nothing after "
            f"step {last_saved} was saved. Last good checkpoint: step {ckpt.latest_step()} in "
            f"{ckpt.directory}. Lower train.learning_rate or raise train.warmup_steps, or set "
            "train.skip_nonfinite_updates=True to skip such updates")

    def save(step: int) -> None:
        nonlocal last_saved
        ckpt.save(step, state, config=config_json, data_iter=data.train_iter,
                  tokenizer_proto=proto, progress={"skipped_updates": skipped})
        last_saved = step
        faults.maybe_kill_during_save(step, cfg.checkpoint.inject_kill_during_save_at_step)

    bar = tqdm(total=tc.num_steps, initial=start, disable=not is_main, dynamic_ncols=True,
               desc="train")
    last: dict[str, Any] = {}
    t_log, steps_since_log = time.perf_counter(), 0
    unchecked = None  # (step, its isfinite flag), read after the next step is dispatched

    def check_pending() -> None:
        nonlocal unchecked
        if unchecked is not None:
            check_finite(*unchecked)
            unchecked = None
    try:
        for step in range(start, tc.num_steps):
            if stop.should_stop(step, agree=step % tc.log_every_steps == 0):
                break
            batch = distributed.global_batch(next(data.train_iter), steps.batch_sharding)
            state, metrics = steps.train(state, batch)
            check_pending()
            steps_since_log += 1
            done = step + 1
            unchecked = (done, metrics.pop("finite"))
            if done % tc.log_every_steps == 0 or done == tc.num_steps or done == start + 1:
                m = jax.device_get(metrics)
                now = time.perf_counter()
                record = {k: (v if k == "expert_load" else float(v)) for k, v in m.items()}
                if done > start + 1:  # the first step includes compilation
                    tps = steps_since_log * tokens_per_step / (now - t_log)
                    record |= {"tokens_per_sec": tps,
                               "step_time": (now - t_log) / steps_since_log,
                               "mfu": tps * flops_per_token / peak}
                t_log, steps_since_log = now, 0
                if tc.eval_every_steps and (done % tc.eval_every_steps == 0
                                            or done == tc.num_steps):
                    record |= evaluate(steps, state.params, data, tc.eval_batches)
                    t_log = time.perf_counter()  # evaluation time is not training throughput
                if tc.skip_nonfinite_updates:
                    check_pending()
                    record["skipped_updates"] = float(skipped)
                writer.write(done, record)  # a non-finite step is logged, then stops the run
                last = record
                check_pending()
                bar.set_postfix({k: f"{record[k]:.4g}" for k in
                                 ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "val_bpb")
                                 if k in record}, refresh=False)
            bar.update(1)
            ckpt.poll()
            if done % cfg.checkpoint.every_steps == 0 or done == tc.num_steps:
                check_pending()
                save(done)
        check_pending()
        if stop.signum is not None:
            completed = int(jax.device_get(state.step))
            if completed != last_saved:
                save(completed)
            ckpt.wait()
            name = "preemption" if stop.preempted else signal.Signals(stop.signum).name
            raise Interrupted(
                f"stopped by {name} after step {completed}: checkpoint step {completed} saved in "
                f"{ckpt.directory}; rerun the same command to resume", completed, stop.signum)
    finally:
        bar.close()
        ckpt.close()
        data.train_iter.close()  # stops its prefetch thread and worker processes

    if is_main and os.path.exists(writer.path):
        from llm_jax.training.plots import plot_expert_load, plot_losses

        records = read_metrics(writer.path)
        plot_losses(records, os.path.join(workdir, "loss.png"))
        plot_expert_load(records, os.path.join(workdir, "expert_load.png"))
        samples = []
        if tc.num_samples and jax.process_count() == 1:  # multi-host params are not all here
            samples = sample_text(state.params, mcfg, data.tokenizer, seed=cfg.seed,
                                  num_samples=tc.num_samples, model_fn=build)
        with open(os.path.join(workdir, "samples.txt"), "w") as f:
            f.write("\n\n".join(samples))
        for s in samples:
            print("---- sample ----\n" + s)
    writer.close()
    return last
