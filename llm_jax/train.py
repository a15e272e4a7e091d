"""Train a model: `python -m llm_jax.train --config configs/tiny.py [--config.train.num_steps=100]`.

The command line around `llm_jax.training.loop.train`: flags, the workdir, the compilation
cache, multi-host start-up, and the exit code of an interrupted run (128 + signal).
"""

from __future__ import annotations

import os
import sys

from llm_jax.runtime.malloc import use_preferred_malloc

if __name__ == "__main__":  # first: a restart under the preferred malloc re-imports nothing heavy
    use_preferred_malloc()

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from llm_jax.parallel import distributed
from llm_jax.runtime.cli import fail, parse_flags
from llm_jax.training.loop import train
from llm_jax.training.preemption import Interrupted
from llm_jax.training.run_config import model_config, validate_run_config

__all__ = ["main", "train"]
PROG = "llm_jax.train"

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file, e.g. configs/tiny.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go "
                               "(default: runs/<config name>).")




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
        fail(PROG, "--config is required, e.g. --config configs/tiny.py")
    try:  # a bad field or value: one line naming it, before anything starts
        validate_run_config(cfg)
        if not cfg.train.init_from:  # else the pretrained checkpoint's, checked against it
            model_config(cfg)
    except ValueError as e:
        fail(PROG, e)
    workdir = _WORKDIR.value or os.path.join("runs", cfg.name)
    if not jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR wins (tests)
        jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "xla_cache"))
    distributed.initialize(cfg.distributed)  # before anything touches a device
    if not distributed.is_main():  # logs and metrics from process 0 only
        logging.set_verbosity(logging.WARNING)
    try:
        last = train(cfg, workdir)
    except Interrupted as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    summary = {k: v for k, v in last.items() if k != "expert_load"}
    if distributed.is_main():
        print("final:", " ".join(f"{k}={v:.4g}" for k, v in summary.items()))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags(PROG))
