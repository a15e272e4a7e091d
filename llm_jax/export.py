"""Exports a fine-tuning workdir: the merged model as Hugging Face, and/or the adapters alone.

    python -m llm_jax.export --workdir runs/lora --hf out/merged --adapters out/adapters

`--hf` merges LoRA adapters into the base (`w + (alpha/r) A B`) and writes a checkpoint that
`GptOssForCausalLM.from_pretrained` loads, with the tokenizer files of `train.init_from` (or
`sft.tokenizer`) copied beside it. `--adapters` writes `adapters.safetensors` + `adapters.json`.
Each output is written to a temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from llm_jax.convert import check_destination, write_atomically
from llm_jax.data.hf_tokenizer import TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_FILE, tokenizer_dir
from llm_jax.runtime.cli import ArgumentParser
from llm_jax.training.finetune import restore_finetuned
from llm_jax.weights.adapters import merge_lora, save_adapters
from llm_jax.weights.writers import save_hf

TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, TEMPLATE_FILE, "special_tokens_map.json",
                   "generation_config.json")


def export(workdir: str, *, hf: str | None = None, adapters: str | None = None,
           step: int | None = None, overwrite: bool = False) -> list[Path]:
    """Writes the requested outputs; returns their paths."""
    if not hf and not adapters:
        raise ValueError("nothing to export: pass --hf and/or --adapters")
    for flag, dst in (("--hf", hf), ("--adapters", adapters)):
        if dst:
            check_destination(dst, overwrite, flag)
    model, run = restore_finetuned(workdir, step)
    lora = run.get("lora", {})
    out = []
    if adapters:
        if not lora.get("rank"):
            raise ValueError(f"{workdir} is a full fine-tuning run (lora.rank=0): no adapters")
        out.append(write_atomically(adapters, lambda tmp: save_adapters(
            model, tmp, rank=lora["rank"], alpha=lora["alpha"])))
    if hf:
        merged = merge_lora(model) if lora.get("rank") else model
        source = run.get("sft", {}).get("tokenizer") or run["train"].get("init_from", "")

        def write(tmp: Path) -> None:
            save_hf(merged, tmp)
            src = tokenizer_dir(source) if source else None
            for name in TOKENIZER_FILES if src else ():
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)

        out.append(write_atomically(hf, write))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m llm_jax.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the fine-tuning run's --workdir")
    parser.add_argument("--hf", help="write the (merged) model here, Hugging Face format")
    parser.add_argument("--adapters", help="write the LoRA adapters alone here")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--overwrite", action="store_true", help="replace non-empty outputs")
    args = parser.parse_args(argv)
    try:
        paths = export(args.workdir, hf=args.hf, adapters=args.adapters, step=args.step,
                       overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
