"""The training loop (`python -m llm_jax.train` is its command line, llm_jax/train.py).

The loop is the only impure part: it feeds batches to the jitted step, logs every
`train.log_every_steps` (one host sync there), evaluates, checkpoints, and at the end draws the
curves and samples a few lines. Read it in three parts: `setup` builds the run's pieces (`Run`),
`_loop` runs the steps and calls the periodic actions (`check_finite`, `log`, `save`), each a small
function of the run and its mutable `Progress`; `finish` draws and samples. Rerunning with the same
--workdir resumes from the latest checkpoint, exactly: params, optimizer, step and data iterator are
restored.

Faults (docs/reliability.md): SIGTERM / SIGINT finish the step, save and exit (128 + signal); a
second one exits at once. Interrupted saves are removed at start-up and corrupt checkpoints skipped
(llm_jax.weights.checkpointing). Each step returns an `isfinite` flag that the loop reads one step
late, so the host stays a step ahead of the device, and before every save: a non-finite loss or
gradient stops the run naming the step, or with `train.skip_nonfinite_updates` the step left params
and moments as they were and is counted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from contextlib import closing
from typing import Any

import jax
import ml_collections
from absl import logging
from flax import nnx
from tqdm import tqdm

from llm_jax.config import ModelConfig
from llm_jax.data import make_datasets
from llm_jax.data.hf_tokenizer import TOKENIZER_FILE, run_tokenizer
from llm_jax.data.preference import PreferenceData, make_preference_data
from llm_jax.data.sft import make_sft_data
from llm_jax.data.tasks import make_task, write_task_tokenizer
from llm_jax.execution import ExecutionConfig
from llm_jax.inference import sample
from llm_jax.model import abstract_model, costs
from llm_jax.model.select import kernels_line
from llm_jax.parallel import distributed
from llm_jax.parallel.sharding import mesh_from_config
from llm_jax.runtime.malloc import active_malloc
from llm_jax.runtime.peak import peak_flops
from llm_jax.training import faults, finetune, preference
from llm_jax.training.metrics import MetricsWriter, read_metrics
from llm_jax.training.plots import plot_expert_load, plot_losses
from llm_jax.training.preemption import Interrupted, StopRequest, save_and_stop
from llm_jax.training.rl_loop import train_rl
from llm_jax.training.run_config import (
    execution_config,
    rl_enabled,
    tokenizer_source,
    validate_run_config,
)
from llm_jax.training.step import Steps, compile_steps, make_optimizer
from llm_jax.training.workdir_lock import hold_workdir
from llm_jax.weights.checkpointing import Checkpointer


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
    if "pairs" in totals:  # preference pairs: held-out accuracy and reward margin
        return preference.summarise(totals)
    if not totals["tokens"]:  # every batch padding (nothing held out packed into a row)
        return {}
    loss = totals["nll"] / totals["tokens"]
    result = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}
    if totals.get("bytes"):
        result["val_bpb"] = totals["nll"] / (math.log(2) * totals["bytes"])
    return result


def sample_text(params: Any, cfg: ModelConfig, data: Any, *, seed: int,
                num_samples: int = 3, max_new_tokens: int = 64,
                model_fn: Any = None) -> list[str]:
    """A few samples, to see what the model learned: continuations of short code prompts
    (pre-training data), or replies to the data's prompts, held-out ones where there are such
    (SFT and preference data: `sample_prompts`)."""
    abstract = abstract_model(cfg) if model_fn is None else \
        nnx.eval_shape(lambda: model_fn(rngs=nnx.Rngs(params=0)))
    model = nnx.merge(nnx.graphdef(abstract), jax.device_get(params))
    tokenizer = data.tokenizer
    if hasattr(data, "sample_prompts"):
        shown, ids = zip(*data.sample_prompts(num_samples)) if num_samples else ((), ())
        shown = [f"{p}\n->" for p in shown]
    else:
        shown = (["def ", "import ", "class ", "for ", "    return "] * num_samples)[:num_samples]
        ids = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in shown]  # documents start so
    if not ids:
        return []
    tokens = getattr(tokenizer, "harmony", None)  # a harmony reply ends its turn with
    # <|return|>, or with <|call|> for a tool call
    out = sample(model, list(ids), max_new_tokens=max_new_tokens, temperature=0.8, top_k=40,
                 seed=seed, eos_id=tokenizer.eos_id if tokens is None else sorted(tokens.stops))
    return [p + tokenizer.decode(list(o)) for p, o in zip(shown, out)]


def train(cfg: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) training, or RL when the config's `rl.rewards` is set; returns the last
    logged metrics. Raises `Interrupted` after saving when a stop signal arrives,
    FloatingPointError on a non-finite step, WorkdirInUse if another run holds the workdir."""
    validate_run_config(cfg)  # before the workdir is touched
    ensure_writable(workdir)
    with StopRequest() as stop, hold_workdir(workdir):
        if rl_enabled(cfg):  # RL with verifiable rewards: its own steps (training/rl_loop.py)
            return train_rl(cfg, workdir, stop)
        run = setup(cfg, workdir, stop)
        # Closed whether the run ends or fails: finish reads metrics.jsonl, not the writer, and
        # closing the data iterator stops its prefetch thread and worker processes.
        with closing(run.ckpt), closing(run.writer), closing(run.data.train_iter):
            last = _loop(run, stop)
        finish(run)
        return last


# ------------------------------------------------------------------------------ setup


@dataclasses.dataclass
class Run:
    """A run's pieces, built once by `setup`; `progress` is what the loop changes."""

    cfg: ml_collections.ConfigDict
    workdir: str
    mcfg: ModelConfig
    execution: ExecutionConfig
    ckpt: Checkpointer
    data: Any  # Data, SFTData or PreferenceData: train_iter, make_eval_iter, tokenizer
    steps: Steps
    build: Any  # the model builder (a LoRA model when fine-tuning)
    writer: MetricsWriter
    start: int
    flops_per_token: float
    peak: float
    config_json: dict[str, Any]
    progress: Progress


@dataclasses.dataclass
class Progress:
    """What the loop carries from step to step."""

    state: Any  # TrainState
    last_saved: int
    skipped: int  # non-finite updates skipped so far
    unchecked: tuple[int, Any] | None = None  # (step, its isfinite flag), read one step late
    last: dict[str, Any] = dataclasses.field(default_factory=dict)  # the last logged record
    t_log: float = 0.0
    steps_since_log: int = 0


def setup(cfg: ml_collections.ConfigDict, workdir: str, stop: StopRequest) -> Run:
    """The mesh, checkpointer, model config, data, compiled steps and the restored (or new)
    state: everything the loop needs, each refused by name before the expensive parts."""
    tc = cfg.train
    mesh = mesh_from_config(cfg.mesh)
    logging.info("mesh %s over %d devices in %d process(es); host malloc: %s", dict(mesh.shape),
                 mesh.size, jax.process_count(), active_malloc())
    ckpt = Checkpointer(workdir, max_to_keep=cfg.checkpoint.max_to_keep,
                        async_save=cfg.checkpoint.async_save, cleanup_tmp=True,
                        checksums=cfg.checkpoint.checksums)
    latest, mcfg = finetune.run_model_config(cfg, ckpt)
    execution = execution_config(cfg)  # how it runs: never checked against a checkpoint
    # The MFU denominator, measured (if not cached) before the data pipeline's threads and the
    # compiler start, so that they do not share the cores with it (runtime/peak.py).
    peak, peak_source = ((tc.peak_flops, "train.peak_flops") if tc.peak_flops
                         else peak_flops(mcfg.dtype))
    data = _open_data(cfg, workdir, mcfg, fresh=latest is None)
    if latest is not None:  # refused here: Orbax failing on it would quarantine the checkpoint
        data.check_checkpoint(ckpt.step_dir(latest))
    if stop.signum:  # a signal during start-up: nothing new to save
        raise Interrupted(f"stopped by signal {stop.signum} before training", -1, stop.signum)
    build = finetune.model_fn(mcfg, cfg.lora, cfg.seed, execution)
    steps = compile_steps(mcfg, tc, mesh, cfg.seed, build, finetune.trainable(cfg.lora),
                          **_step_functions(cfg))
    state, progress = _initial_state(cfg, mcfg, ckpt, data, steps, latest)
    start = int(jax.device_get(state.step))
    if isinstance(data, PreferenceData) and preference.precomputed_reference(cfg):
        preference.attach_reference(data, steps, state.params, build, mesh, workdir,
                                    fresh=start == 0, source=tc.init_from)
    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    writer.truncate_after(start)
    seq_len = cfg.data.seq_len
    flops_per_token = costs.flops_per_token(mcfg, seq_len, training=True)
    logging.info("model: %s params (%s active); %.3g train FLOPs/token; MFU peak %.3g FLOP/s "
                 "(%s; %s)", f"{costs.total_params(mcfg):,}",
                 f"{costs.active_params(mcfg):,}", flops_per_token, peak, mcfg.dtype,
                 peak_source)
    logging.info("kernels: %s", kernels_line(mcfg, execution, tc.batch_size, seq_len))
    # The first shuffle window (data.shuffle_buffer_tokens) fills in the pipeline's thread while
    # the train step compiles here, instead of one after the other before step 1.
    data.train_iter.start_prefetch()
    shapes = (data.batch_shapes(tc.batch_size) if isinstance(data, PreferenceData) else
              {k: (tc.batch_size, seq_len) for k in data.batch_dtypes})
    steps.train.lower(state, {k: jax.ShapeDtypeStruct(shapes[k], dtype,
                                                      sharding=steps.batch_sharding)
                              for k, dtype in data.batch_dtypes.items()}).compile()
    return Run(cfg=cfg, workdir=workdir, mcfg=mcfg, execution=execution, ckpt=ckpt, data=data,
               steps=steps, build=build, writer=writer, start=start,
               flops_per_token=flops_per_token, peak=peak,
               config_json=cfg.to_dict() | {"model": mcfg.to_dict(),
                                            "execution": execution.to_dict()},
               progress=Progress(state=state, last_saved=start,
                                 skipped=int(progress.get("skipped_updates", 0))))


def _step_functions(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """The objective and evaluation of a preference run (`dpo.files` set); none otherwise
    (the language-model loss and validation loss)."""
    if not cfg.dpo.files:
        return {}
    return preference.step_functions(preference.PreferenceConfig.from_section(cfg.dpo))


def _open_data(cfg: ml_collections.ConfigDict, workdir: str, mcfg: ModelConfig, *,
               fresh: bool) -> Any:
    """The pre-training, SFT or preference data, its tokenizer checked against the model's
    vocabulary. Process 0 builds the tokenizer (and a named TFDS dataset) in the workdir, or
    copies a fine-tuning run's there (`fresh`: no checkpoint yet); the others read them."""
    tc, is_main = cfg.train, jax.process_index() == 0
    if not is_main:
        distributed.barrier("data")
    from_task = bool(cfg.task.name and not (cfg.sft.files or cfg.sft.tfds_name))
    chat = bool(cfg.sft.files or cfg.sft.tfds_name or cfg.dpo.files) or from_task
    if cfg.dpo.files:
        tokenizer = str(run_tokenizer(workdir, *tokenizer_source(cfg), fresh=fresh,
                                      write=is_main))
        data = make_preference_data(cfg.dpo, tokenizer_path=tokenizer,
                                    seq_len=cfg.data.seq_len, batch_size=tc.batch_size,
                                    seed=cfg.seed)
    elif chat:
        if from_task and not (cfg.sft.tokenizer or tc.init_from):
            # A model trained from scratch on the task: its tokenizer is written into the
            # workdir once, and a resumed run reads that file.
            tokenizer = workdir
            if is_main and (fresh or not os.path.exists(os.path.join(workdir, TOKENIZER_FILE))):
                write_task_tokenizer(make_task(cfg.task), workdir, mcfg.vocab_size)
        else:
            tokenizer = str(run_tokenizer(workdir, *tokenizer_source(cfg), fresh=fresh,
                                          write=is_main))
        data = make_sft_data(cfg.sft, tokenizer_path=tokenizer, seq_len=cfg.data.seq_len,
                             batch_size=tc.batch_size, seed=cfg.seed,
                             task=cfg.task if from_task else None)
    else:
        data = make_datasets(cfg.data, workdir=workdir, vocab_size=mcfg.vocab_size,
                             global_batch_size=tc.batch_size)
    if is_main:
        distributed.barrier("data")
    if chat and data.tokenizer.vocab_size > mcfg.vocab_size:
        raise ValueError(f"tokenizer {data.tokenizer.path} has {data.tokenizer.vocab_size} "
                         f"tokens, more than the model's vocab_size={mcfg.vocab_size}")
    if not chat and data.tokenizer.vocab_size != mcfg.vocab_size:
        raise ValueError(f"tokenizer in {workdir} has vocab {data.tokenizer.vocab_size}, "
                         f"model.vocab_size is {mcfg.vocab_size}")
    return data


def _initial_state(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, ckpt: Checkpointer,
                   data: Any, steps: Steps, latest: int | None) -> tuple[Any, dict[str, Any]]:
    """(train state, saved progress): restored from the newest checkpoint that restores, else
    new (from train.init_from when fine-tuning), with the data iterator at its start."""
    tc = cfg.train
    fresh_data = data.train_iter.get_state()  # a failed restore may have moved the iterator
    if latest is not None:
        latest, restored = ckpt.first_restorable(
            lambda s: (ckpt.restore(s, steps.abstract_state, data.train_iter),
                       ckpt.restore_progress(s)), move_bad=True)
    if latest is not None:
        logging.info("resumed from step %d in %s", latest, ckpt.directory)
        return restored
    ckpt.check_fresh_start(cfg.checkpoint.allow_fresh_start)
    data.train_iter.set_state(fresh_data)
    if tc.init_from:
        state = finetune.initial_state(steps, make_optimizer(tc), tc.init_from, mcfg,
                                       cfg.lora, cfg.seed)
        logging.info("initialised from %s (optimizer fresh)", tc.init_from)
        return state, {}
    return steps.init(), {}


# ------------------------------------------------------------------------------ the loop


def _loop(run: Run, stop: StopRequest) -> dict[str, Any]:
    """The steps from `run.start`, with the periodic actions; returns the last logged record.
    Raises `Interrupted` after saving when a stop signal arrived."""
    tc, p = run.cfg.train, run.progress
    bar = tqdm(total=tc.num_steps, initial=run.start, disable=jax.process_index() != 0,
               dynamic_ncols=True, desc="train")
    p.t_log = time.perf_counter()
    try:
        for step in range(run.start, tc.num_steps):
            if stop.should_stop(step, agree=step % tc.log_every_steps == 0):
                break
            batch = distributed.global_batch(next(run.data.train_iter), run.steps.batch_sharding)
            p.state, metrics = run.steps.train(p.state, batch)
            check_pending(run)
            p.steps_since_log += 1
            done = step + 1
            p.unchecked = (done, metrics.pop("finite"))
            eval_due = tc.eval_every_steps and done % tc.eval_every_steps == 0
            if (done % tc.log_every_steps == 0 or done == tc.num_steps or done == run.start + 1
                    or eval_due):  # an evaluation is logged with its step's metrics
                log(run, done, metrics, bar)
            bar.update(1)
            run.ckpt.poll()
            if done % run.cfg.checkpoint.every_steps == 0 or done == tc.num_steps:
                check_pending(run)
                save(run, done)
        check_pending(run)
        if stop.signum is not None:
            completed = int(jax.device_get(run.progress.state.step))
            save_and_stop(stop, completed, run.progress.last_saved, lambda s: save(run, s),
                          run.ckpt)
    finally:
        bar.close()
    return p.last


def check_finite(run: Run, step: int, finite: Any) -> None:
    """Stops (or counts a skip) if `step` was not finite; never lets it reach a save."""
    p = run.progress
    if bool(finite):
        return
    if run.cfg.train.skip_nonfinite_updates:
        p.skipped += 1
        logging.warning("step %d: non-finite loss or gradients; update skipped (%d so far)",
                        step, p.skipped)
        return
    run.ckpt.wait()  # an earlier, finite save in flight completes
    raise FloatingPointError(
        f"non-finite loss or gradients at step {step}: training stopped and nothing after "
        f"step {p.last_saved} was saved. Last good checkpoint: step {run.ckpt.latest_step()} in "
        f"{run.ckpt.directory}. Lower train.learning_rate or raise train.warmup_steps, or set "
        "train.skip_nonfinite_updates=True to skip such updates")


def check_pending(run: Run) -> None:
    """The finite check of the last dispatched step, if not yet done."""
    p = run.progress
    if p.unchecked is not None:
        step, finite = p.unchecked
        p.unchecked = None
        check_finite(run, step, finite)


def log(run: Run, done: int, metrics: dict[str, Any], bar: Any) -> None:
    """Step `done`'s metrics with throughput and MFU (and the evaluation when due), written
    to metrics.jsonl and the progress bar; then the finite check, so a non-finite step is
    logged before it stops the run."""
    tc, p = run.cfg.train, run.progress
    m = jax.device_get(metrics)
    now = time.perf_counter()
    record = {k: (v if k == "expert_load" else float(v)) for k, v in m.items()}
    if done > run.start + 1:  # the first step includes compilation
        rows = 2 if run.cfg.dpo.files else 1  # a preference pair is two sequences
        tps = p.steps_since_log * tc.batch_size * rows * run.cfg.data.seq_len / (now - p.t_log)
        record |= {"tokens_per_sec": tps, "step_time": (now - p.t_log) / p.steps_since_log,
                   "mfu": tps * run.flops_per_token / run.peak}
    p.t_log, p.steps_since_log = now, 0
    if tc.eval_every_steps and (done % tc.eval_every_steps == 0 or done == tc.num_steps):
        record |= evaluate(run.steps, p.state.params, run.data, tc.eval_batches)
        p.t_log = time.perf_counter()  # evaluation time is not training throughput
    if tc.skip_nonfinite_updates:
        check_pending(run)
        record["skipped_updates"] = float(p.skipped)
    run.writer.write(done, record)
    p.last = record
    check_pending(run)
    bar.set_postfix({k: f"{record[k]:.4g}" for k in
                     ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "val_bpb",
                      "val_preference_accuracy")
                     if k in record}, refresh=False)


def save(run: Run, step: int) -> None:
    """A checkpoint of step `step`: state, config, data iterator, tokenizer, progress."""
    p = run.progress
    run.ckpt.save(step, p.state, config=run.config_json, data_iter=run.data.train_iter,
                  tokenizer_proto=getattr(run.data.tokenizer, "_proto", None),
                  progress={"skipped_updates": p.skipped})
    p.last_saved = step
    faults.maybe_kill_during_save(step, run.cfg.checkpoint.inject_kill_during_save_at_step)




def finish(run: Run) -> None:
    """Process 0: the loss and expert-load plots, and a few samples (one process only)."""
    tc = run.cfg.train
    if jax.process_index() == 0 and os.path.exists(run.writer.path):
        records = read_metrics(run.writer.path)
        plot_losses(records, os.path.join(run.workdir, "loss.png"))
        plot_expert_load(records, os.path.join(run.workdir, "expert_load.png"))
        samples = []
        if tc.num_samples and jax.process_count() == 1:  # multi-host params are not all here
            samples = sample_text(run.progress.state.params, run.mcfg, run.data,
                                  seed=run.cfg.seed, num_samples=tc.num_samples,
                                  model_fn=run.build)
        with open(os.path.join(run.workdir, "samples.txt"), "w") as f:
            f.write("\n\n".join(samples))
        for s in samples:
            print("---- sample ----\n" + s)
    run.writer.close()
