"""`python -m llm_jax.bench SUBCOMMAND`: print a table, write JSON (--json_out).

Subcommands: peak, train, malloc, decode, prefill, moe, norm, attention, data, finetune, stacks,
serve, serve_harmony, mxfp4, rl (one module each in llm_jax/bench/). Every one takes
--repeats N, --quick (tiny sizes and few repeats, for tests) and --json_out FILE (default
runs/bench/SUBCOMMAND.json). Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from llm_jax.runtime.cli import ArgumentParser
from llm_jax.runtime.malloc import use_preferred_malloc

SUBCOMMANDS = ("peak", "train", "malloc", "decode", "prefill", "moe", "norm", "attention", "data",
               "finetune", "stacks", "serve", "serve_harmony", "mxfp4", "rl")


def main(argv: Sequence[str] | None = None) -> int:
    from llm_jax.bench.common import DEFAULT_DIR, write_json

    parser = ArgumentParser(prog="python -m llm_jax.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"llm_jax.bench.{name}")
        modules[name] = module
        p = sub.add_parser(name, help=(module.__doc__ or "").splitlines()[0],
                           description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--repeats", type=int, default=5, help="timed calls per contender")
        p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (tests)")
        p.add_argument("--json_out", default=None, help="JSON file (default runs/bench/NAME.json)")
        module.add_arguments(p)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} is invalid: expected a positive integer")
    module = modules[args.command]
    result = module.from_args(args)
    print(module.format_result(result))
    path = write_json(result, args.json_out or DEFAULT_DIR / f"{args.command}.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    use_preferred_malloc()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
