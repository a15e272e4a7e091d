"""Command line for lm-evaluation-harness with the llm_jax model: `python -m llm_jax.eval`.

    python -m llm_jax.eval --checkpoint DIR --tasks TASK[,TASK] [--include_path TASK_DIR]
        [--output_path OUT] [any other lm_eval flag]

It is lm_eval's own command line (same flags, same results JSON under --output_path) with the
model "llm_jax" registered; `--checkpoint DIR` is short for `--model llm_jax --model_args
checkpoint=DIR` (extra model_args: dtype, max_length, pack, max_gen_toks, slots,
reasoning_effort; see llm_jax/evaluation/harness.py). lm_eval 0.4 has no plugin entry point, so
the bare `lm_eval` command does not know "llm_jax"; this one does. Needs the `eval` extra.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from llm_jax.runtime.malloc import use_preferred_malloc


def lm_eval_argv(argv: Sequence[str]) -> list[str]:
    """lm_eval's arguments for ours: --checkpoint DIR becomes --model llm_jax --model_args
    checkpoint=DIR (joined with any --model_args given)."""
    args, checkpoint, model_args = [], None, None
    it = iter(argv)
    for a in it:
        if a == "--checkpoint" or a.startswith("--checkpoint="):
            checkpoint = a.split("=", 1)[1] if "=" in a else next(it, None)
        elif a == "--model_args" or a.startswith("--model_args="):
            model_args = a.split("=", 1)[1] if a.startswith("--model_args=") else next(it, None)
        else:
            args.append(a)
    parts = [f"checkpoint={checkpoint}"] if checkpoint else []
    parts += [model_args] if model_args else []
    if parts:
        args += ["--model_args", ",".join(parts)]
    if not any(a == "--model" or a.startswith("--model=") for a in args):
        args += ["--model", "llm_jax"]
    if not any(a in ("--batch_size", "-b") or a.startswith("--batch_size=") for a in args):
        args += ["--batch_size", "8"]  # lm_eval's default, 1, scores one request per call
    return ["run", *args] if args and args[0] not in ("run", "ls", "validate") else args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("llm_jax.eval: error: lm_eval is not installed: pip install -e \".[eval]\"",
              file=sys.stderr)
        return 2
    import llm_jax.evaluation.harness  # noqa: F401  (registers the model "llm_jax")

    sys.argv = ["lm_eval", *lm_eval_argv(argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    use_preferred_malloc()
    sys.exit(main())
