"""Exports a fine-tuning workdir: the merged model as Hugging Face, and/or the adapters alone.

    python -m llm_jax.export --workdir runs/lora --hf out/merged --adapters out/adapters
        [--dtype bfloat16] [--expert_format dense|mxfp4]

`--hf` merges LoRA adapters into the base (`w + (alpha/r) A B`) and writes a checkpoint that
`GptOssForCausalLM.from_pretrained` loads, weights in `--dtype` (default: the base's param_dtype),
the experts dense (packed MXFP4 experts are unpacked exactly before the merge) or, with
`--expert_format mxfp4`, the merged experts quantized again to MXFP4 as gpt-oss ships them
(lossy: the relative RMS error of each re-quantized stack is printed and returned). Beside them go
the run's tokenizer files: its own copy in WORKDIR/tokenizer/, or, for a run made before runs
kept one, those of its section's `tokenizer` (sft, dpo or rl), else of `train.init_from`; when
no tokenizer.json is found, a warning says that the output has none. `--adapters` writes
`adapters.safetensors` + `adapters.json`, which `python -m llm_jax.generate --adapters` loads onto
the base unmerged.
Each output is written to a temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from llm_jax.config import DTYPES, EXPERT_FORMATS
from llm_jax.convert import check_destination
from llm_jax.data.hf_tokenizer import TOKENIZER_FILE, TOKENIZER_FILES, tokenizer_dir
from llm_jax.runtime.cli import ArgumentParser
from llm_jax.runtime.files import write_atomically
from llm_jax.training.finetune import restore_finetuned
from llm_jax.training.run_config import tokenizer_source
from llm_jax.weights.adapters import merge_lora, merge_lora_mxfp4, save_adapters
from llm_jax.weights.writers import save_hf


class Exported(NamedTuple):
    paths: list[Path]  # the outputs written
    # Relative RMS error of each expert stack re-quantized to MXFP4 (expert_format="mxfp4").
    quantization_error: dict[str, float]
    warnings: tuple[str, ...] = ()  # what the outputs lack (a model exported without tokenizer)


def export(workdir: str, *, hf: str | None = None, adapters: str | None = None,
           step: int | None = None, overwrite: bool = False, dtype: str | None = None,
           expert_format: str = "dense") -> Exported:
    """Writes the requested outputs; returns their paths, the re-quantization errors and what
    the outputs lack (`Exported.warnings`)."""
    if not hf and not adapters:
        raise ValueError("nothing to export: pass --hf and/or --adapters")
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"--expert_format={expert_format!r} is invalid: expected one of "
                         f"{list(EXPERT_FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is invalid: expected one of {list(DTYPES)}")
    for flag, dst in (("--hf", hf), ("--adapters", adapters)):
        if dst:
            check_destination(dst, overwrite, flag)
    model, run = restore_finetuned(workdir, step)
    lora = run.get("lora", {})
    out, errors, warnings = [], {}, ()
    if adapters:
        if not lora.get("rank"):
            raise ValueError(f"{workdir} is a full fine-tuning run (lora.rank=0): no adapters")
        out.append(write_atomically(adapters, lambda tmp: save_adapters(
            model, tmp, rank=lora["rank"], alpha=lora["alpha"])))
    if hf:
        if expert_format == "mxfp4":
            merged, errors = merge_lora_mxfp4(model, dtype=dtype)
        else:
            merged = merge_lora(model, dtype=dtype)
        tokenizer = run_tokenizer_files(workdir, run)
        if tokenizer is None:
            source, field = tokenizer_source(run)
            warnings = (f"no {TOKENIZER_FILE} in {workdir} nor in {field}={source!r}: {hf} holds "
                        "the model without its tokenizer; copy the base's tokenizer files "
                        "there",)

        def write(tmp: Path) -> None:
            save_hf(merged, tmp)
            for name in TOKENIZER_FILES if tokenizer is not None else ():
                if (tokenizer / name).is_file():
                    shutil.copyfile(tokenizer / name, tmp / name)

        out.append(write_atomically(hf, write))
    return Exported(out, errors, warnings)


def run_tokenizer_files(workdir: str, run: dict) -> Path | None:
    """The directory holding a fine-tuning run's tokenizer files: its copy in WORKDIR/tokenizer/
    (or the task tokenizer a run from scratch wrote into WORKDIR), else, for a run made before
    copies were kept, the source its config names (`tokenizer_source`); None if none has
    tokenizer.json."""
    for path in (workdir, tokenizer_source(run)[0]):
        if path and (tokenizer_dir(path) / TOKENIZER_FILE).is_file():
            return tokenizer_dir(path)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m llm_jax.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the fine-tuning run's --workdir")
    parser.add_argument("--hf", help="write the (merged) model here, Hugging Face format")
    parser.add_argument("--adapters", help="write the LoRA adapters alone here")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the merged weights (default: the base's param_dtype)")
    parser.add_argument("--expert_format", choices=EXPERT_FORMATS, default="dense",
                        help="mxfp4: the merged experts quantized again to MXFP4 (lossy; the "
                        "error is printed)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--overwrite", action="store_true", help="replace non-empty outputs")
    args = parser.parse_args(argv)
    try:
        result = export(args.workdir, hf=args.hf, adapters=args.adapters, step=args.step,
                        overwrite=args.overwrite, dtype=args.dtype,
                        expert_format=args.expert_format)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, err in result.quantization_error.items():
        print(f"{name}: merged experts re-quantized to MXFP4, relative RMS error {err:.4f}")
    for p in result.paths:
        print(f"wrote {p}")
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
