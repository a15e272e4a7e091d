"""Converts a checkpoint directory between formats (any readable one -> hf | openai | llm_jax).

    python -m llm_jax.convert --src PATH --dst PATH --to hf|openai|llm_jax [--dtype bfloat16]
                              [--expert_format dense|mxfp4]

The MoE experts keep the source's format unless `--expert_format` says otherwise: MXFP4 experts
are written back as the bytes that were read (bitwise), dense ones plain. `--expert_format dense`
dequantizes MXFP4 experts (exact); `--expert_format mxfp4` quantizes dense ones (lossy: the
relative error of each expert stack is printed).

OpenAI's own loader (`gpt_oss.torch.weights.Checkpoint`) reads expert weights only as MXFP4.
`--to openai` of a dense model still writes them plain by default, and says so: a conversion
changes no weight unless asked (a lossy default would alter a fine-tuned model silently, and
llm_jax reads the plain layout exactly); `--expert_format mxfp4` is the explicit choice.

The result is written to a temporary sibling of `--dst` and renamed into place only when complete,
so a failing run leaves `--dst` as it was. A non-empty `--dst` is refused unless `--overwrite`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from llm_jax.runtime.cli import ArgumentParser
from llm_jax.runtime.files import write_atomically
from llm_jax.weights import mxfp4, readers, writers

WRITERS = {
    "hf": writers.save_hf,
    "openai": writers.save_openai,
    "llm_jax": writers.save_llm_jax,
}
EXPERT_FORMATS = ("dense", "mxfp4")


def convert(src: str | Path, dst: str | Path, to: str, *, dtype: str | None = None,
            expert_format: str | None = None, overwrite: bool = False,
            report: Callable[[str], object] = lambda line: None) -> Path:
    """Loads `src` (format detected), writes it to `dst` in format `to` with its experts in
    `expert_format` (default: the source's); returns `dst`. `report` gets what the user should
    know about the result: a quantization's error, a layout OpenAI's loader cannot read."""
    if to not in WRITERS:
        raise ValueError(f"--to={to!r} is invalid: expected one of {sorted(WRITERS)}")
    if expert_format not in (None, *EXPERT_FORMATS):
        raise ValueError(f"--expert_format={expert_format!r} is invalid: expected one of "
                         f"{list(EXPERT_FORMATS)}")
    check_destination(dst, overwrite)
    model = readers.load_pretrained(src, dtype=dtype)
    if expert_format == "dense":
        model = mxfp4.dequantize_experts(model)
    elif expert_format == "mxfp4" and model.cfg.expert_format == "dense":
        try:
            model, errors = mxfp4.quantize_experts(model)
        except ValueError as e:
            raise ValueError(f"--expert_format=mxfp4: {e}") from None
        report("experts quantized to MXFP4 (lossy); relative RMS error per stack: "
               + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))
    out = write_atomically(dst, lambda tmp: WRITERS[to](model, tmp))
    if to == "openai" and model.cfg.expert_format == "dense":
        report(f"note: {out} holds plain (dense) expert weights, which llm_jax reads but OpenAI's "
               "loader (gpt_oss.torch.weights.Checkpoint) does not: it reads them only as MXFP4. "
               "Pass --expert_format mxfp4 to quantize them (lossy; the error is printed).")
    return out


def check_destination(dst: str | Path, overwrite: bool, flag: str = "--dst") -> None:
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise ValueError(f"{flag} {dst} exists and is not empty; pass --overwrite to replace it")


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m llm_jax.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="checkpoint directory (llm_jax, HF or OpenAI)")
    parser.add_argument("--dst", required=True, help="output directory")
    parser.add_argument("--to", required=True, choices=sorted(WRITERS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                        help="weight and compute dtype of the result (default: the source's)")
    parser.add_argument("--expert_format", choices=EXPERT_FORMATS, default=None,
                        help="the MoE experts' format in the result (default: the source's): "
                             "dense dequantizes MXFP4 exactly; mxfp4 quantizes dense experts "
                             "(lossy, error printed), as OpenAI's loader needs")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --dst")
    args = parser.parse_args(argv)
    try:
        out = convert(args.src, args.dst, args.to, dtype=args.dtype,
                      expert_format=args.expert_format, overwrite=args.overwrite,
                      report=lambda line: print(line, file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.to} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
