"""Train a model: `python -m llm_jax.train --config configs/tiny.py [--config.train.num_steps=100]`.

The loop is the only impure part: it feeds batches to the jitted step, logs every
`train.log_every_steps` (one host sync there, none in between), evaluates, checkpoints, and at
the end draws the curves and samples a few lines. Rerunning with the same --workdir resumes from
the latest checkpoint, exactly: params, optimizer, step and data iterator are restored.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from llm_jax import describe, distributed
from llm_jax.checkpointing import Checkpointer, check_same_model
from llm_jax.config import ModelConfig
from llm_jax.metrics import MetricsWriter, read_metrics
from llm_jax.peak import measure_matmul_flops
from llm_jax.run_config import model_config
from llm_jax.sharding import mesh_from_config
from llm_jax.train_step import Steps, compile_steps

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file, e.g. configs/tiny.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go "
                               "(default: runs/<config name>).")


def ensure_writable(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
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
                num_samples: int = 3, max_new_tokens: int = 64) -> list[str]:
    """A few continuations of short code prompts, to see what the model learned."""
    from flax import nnx

    from llm_jax.generate import generate
    from llm_jax.model import abstract_model

    model = nnx.merge(nnx.graphdef(abstract_model(cfg)), jax.device_get(params))
    prompts = (["def ", "import ", "class ", "for ", "    return "] * num_samples)[:num_samples]
    ids = [tokenizer.encode(p) for p in prompts]
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=0.8, top_k=40,
                   seed=seed, eos_id=tokenizer.eos_id)
    return [p + tokenizer.decode(list(o)) for p, o in zip(prompts, out)]


def train(cfg: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) training; returns the last logged metrics."""
    from tqdm import tqdm

    from llm_jax.data import make_datasets

    mcfg = model_config(cfg)
    tc = cfg.train
    ensure_writable(workdir)
    is_main = jax.process_index() == 0
    mesh = mesh_from_config(cfg.mesh)
    logging.info("mesh %s over %d devices in %d process(es)", dict(mesh.shape), mesh.size,
                 jax.process_count())
    ckpt = Checkpointer(workdir, max_to_keep=cfg.checkpoint.max_to_keep,
                        async_save=cfg.checkpoint.async_save)
    latest = ckpt.latest_step()
    if latest is not None:  # refuse before any expensive work
        check_same_model(ckpt.restore_config(latest), mcfg, ckpt.directory)

    # Process 0 builds the tokenizer and token caches in the workdir; the others then read them.
    if not is_main:
        distributed.barrier("data")
    data = make_datasets(cfg.data, workdir=workdir, vocab_size=mcfg.vocab_size,
                         global_batch_size=tc.batch_size)
    if is_main:
        distributed.barrier("data")
    if data.tokenizer.vocab_size != mcfg.vocab_size:
        raise ValueError(f"tokenizer in {workdir} has vocab {data.tokenizer.vocab_size}, "
                         f"model.vocab_size is {mcfg.vocab_size}")
    steps = compile_steps(mcfg, tc, mesh, cfg.seed)
    if latest is not None:
        state = ckpt.restore(latest, steps.abstract_state, data.train_iter)
        logging.info("resumed from step %d in %s", latest, ckpt.directory)
    else:
        state = steps.init()
    start = int(jax.device_get(state.step))

    writer = MetricsWriter(workdir, enabled=is_main)
    writer.truncate_after(start)
    seq_len = cfg.data.seq_len
    tokens_per_step = tc.batch_size * seq_len
    flops_per_token = describe.flops_per_token(mcfg, seq_len, training=True)
    peak = tc.peak_flops or measure_matmul_flops(mcfg.dtype)
    logging.info("model: %s params (%s active); %.3g train FLOPs/token; peak %.3g FLOP/s (%s)",
                 f"{describe.total_params(mcfg):,}", f"{describe.active_params(mcfg):,}",
                 flops_per_token, peak, mcfg.dtype)
    config_json = cfg.to_dict()
    proto = getattr(data.tokenizer, "_proto", None)

    bar = tqdm(total=tc.num_steps, initial=start, disable=not is_main, dynamic_ncols=True,
               desc="train")
    last: dict[str, Any] = {}
    t_log, steps_since_log = time.perf_counter(), 0
    for step in range(start, tc.num_steps):
        batch = distributed.global_batch(next(data.train_iter), steps.batch_sharding)
        state, metrics = steps.train(state, batch)
        steps_since_log += 1
        done = step + 1
        if done % tc.log_every_steps == 0 or done == tc.num_steps or done == start + 1:
            m = jax.device_get(metrics)
            now = time.perf_counter()
            record = {k: (v if k == "expert_load" else float(v)) for k, v in m.items()}
            if done > start + 1:  # the first step includes compilation
                tps = steps_since_log * tokens_per_step / (now - t_log)
                record |= {"tokens_per_sec": tps, "step_time": (now - t_log) / steps_since_log,
                           "mfu": tps * flops_per_token / peak}
            t_log, steps_since_log = now, 0
            if tc.eval_every_steps and (done % tc.eval_every_steps == 0 or done == tc.num_steps):
                record |= evaluate(steps, state.params, data, tc.eval_batches)
                t_log = time.perf_counter()  # evaluation time is not training throughput
            if not np.isfinite(record["loss"]):
                raise FloatingPointError(
                    f"non-finite loss {record['loss']} at step {done}; last good checkpoint: "
                    f"step {ckpt.latest_step()}")
            writer.write(done, record)
            last = record
            bar.set_postfix({k: f"{record[k]:.4g}" for k in
                             ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "val_bpb")
                             if k in record}, refresh=False)
        bar.update(1)
        if done % cfg.checkpoint.every_steps == 0 or done == tc.num_steps:
            ckpt.save(done, state, config=config_json, data_iter=data.train_iter,
                      tokenizer_proto=proto)
    bar.close()
    ckpt.wait()
    ckpt.close()

    if is_main and os.path.exists(writer.path):
        from llm_jax.plots import plot_expert_load, plot_losses

        records = read_metrics(writer.path)
        plot_losses(records, os.path.join(workdir, "loss.png"))
        plot_expert_load(records, os.path.join(workdir, "expert_load.png"))
        samples = []
        if tc.num_samples and jax.process_count() == 1:  # multi-host params are not all here
            samples = sample_text(state.params, mcfg, data.tokenizer, seed=cfg.seed,
                                  num_samples=tc.num_samples)
        with open(os.path.join(workdir, "samples.txt"), "w") as f:
            f.write("\n\n".join(samples))
        for s in samples:
            print("---- sample ----\n" + s)
    writer.close()
    return last


def quiet_library_logs() -> None:
    """Orbax logs every file it writes at INFO through absl; keep its warnings, drop the rest."""
    import logging as pylogging

    logging.get_absl_handler().addFilter(
        lambda r: r.levelno >= pylogging.WARNING or "orbax" not in r.pathname)


def main(argv: list[str]) -> None:
    del argv
    quiet_library_logs()
    cfg = _CONFIG.value
    if cfg is None:
        raise app.UsageError("--config is required, e.g. --config configs/tiny.py")
    workdir = _WORKDIR.value or os.path.join("runs", cfg.name)
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "xla_cache"))
    distributed.initialize(cfg.distributed)  # before anything touches a device
    if not distributed.is_main():  # logs and metrics from process 0 only
        logging.set_verbosity(logging.WARNING)
    last = train(cfg, workdir)
    summary = {k: v for k, v in last.items() if k != "expert_load"}
    if distributed.is_main():
        print("final:", " ".join(f"{k}={v:.4g}" for k, v in summary.items()))


if __name__ == "__main__":
    app.run(main)
