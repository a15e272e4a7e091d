"""How the command lines read their flags and fail: a bad flag ends in one line that names it
(`llm_jax.train: error: --config.train.num_stpes: ...`), exit status 2, no traceback.

The command lines with a run config (`train`, `describe`, `compile`) parse with absl and
ml_collections' `--config` file flag, through `parse_flags(prog)`, and report a bad value
through `fail`; the others (`generate`, `convert`, `export`, `serve`, `chat`, `bench`) parse
with this module's `ArgumentParser`, argparse's with the same one-line errors (`eval` keeps
lm_eval's own). A bad value found after parsing is one line too: `generate`, `serve` and `chat`
print `llm_jax.<name>: error: ...` and exit 2, `convert` and `export` print `error: ...` and
exit 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from typing import NoReturn

import ml_collections
from absl import flags


def fail(prog: str, error: object) -> NoReturn:
    """Prints `prog: error: ...` on one line to stderr and exits with status 2."""
    message = " ".join(str(error).split())
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a bad flag or value is one line naming it (`fail`), not the usage
    text and then the error."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog.removeprefix("python -m "), message)


def float_dtype(name: str) -> str:
    """An argparse `type` for a floating-point dtype flag (`--dtype`, `--cache_dtype`): the name,
    once checked, so a typo is the flag's one-line error and not a traceback from the loader."""
    import jax.numpy as jnp  # only when the flag is given: the import is a second of start-up

    try:
        floating = jnp.issubdtype(jnp.dtype(name), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise argparse.ArgumentTypeError(f"{name!r} is not a floating-point dtype: expected "
                                         "e.g. float32, bfloat16 or float16")
    return name


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of a configs/*.py file."""
    spec = importlib.util.spec_from_file_location("_llm_jax_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def check_overrides(run_cfg: ml_collections.ConfigDict, argv: list[str]) -> None:
    """Raises ValueError naming the first `--config.A.B=V` whose field `run_cfg` lacks."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].partition("=")[0].split(".")
        node, done = run_cfg, []
        for key in path:
            if not isinstance(node, ml_collections.ConfigDict) or key not in node:
                where = ".".join(["config", *done])
                known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                # A field that lives in another section (an execution setting asked of `model`).
                moved = [f"config.{s}.{key}" for s, section in run_cfg.items()
                         if len(done) == 1 and isinstance(section, ml_collections.ConfigDict)
                         and key in section]
                if moved:
                    raise ValueError(f"--config.{'.'.join(path)}: {where} has no field {key!r}; "
                                     f"it is {moved[0]}: use --{moved[0]}=...")
                raise ValueError(f"--config.{'.'.join(path)}: {where} has no field {key!r}; "
                                 f"known fields are {known}")
            node, done = node[key], [*done, key]


def refuse_repeated_overrides(argv: list[str]) -> None:
    """absl keeps the last of `--config.x=1 --config.x=2` silently; refuse the conflict."""
    seen: dict[str, str] = {}
    for arg in argv:
        if arg.startswith("--config.") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            if key in seen and seen[key] != value:
                raise ValueError(f"--{key} is given twice, as {seen[key]!r} and {value!r}")
            seen[key] = value


def parse_flags(prog: str) -> Callable[[list[str]], list[str]]:
    """An `app.run(main, flags_parser=...)` parser: absl's, but a bad flag, an unknown
    `--config.FIELD` or a repeated override ends in `fail`, not in usage text or a traceback."""

    def parse(argv: list[str]) -> list[str]:
        try:
            refuse_repeated_overrides(argv[1:])
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(prog, e)
        except ValueError as e:
            fail(prog, e)
        except (KeyError, AttributeError) as e:  # config_flags met an override of a missing field
            message = f"a --config.FIELD override names no field of the config ({e})"
            paths = [a.partition("=")[2] or b for a, b in zip(argv, argv[1:] + [""])
                     if a == "--config" or a.startswith("--config=")]
            try:
                if paths:
                    check_overrides(load_config_file(paths[0]), argv)
            except ValueError as bad:
                message = str(bad)
            fail(prog, message)

    return parse
