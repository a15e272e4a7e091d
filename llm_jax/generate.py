"""Command line for text generation: `python -m llm_jax.generate --checkpoint PATH ...`.

    python -m llm_jax.generate --checkpoint PATH --prompt "def fib(" [--prompt_file F]
        [--prompt_ids 1,2,3] --max_new_tokens N [--temperature T --top_k K --top_p P --seed S]
        [--adapters DIR] [--output_json FILE]

The checkpoint is any directory `llm_jax.load_pretrained` reads; the work is `llm_jax.sample`
(llm_jax/inference/). `--adapters` loads LoRA adapters (`python -m llm_jax.export --adapters`)
onto it without merging (`llm_jax.weights.adapters.load_adapters`): over gpt-oss's packed MXFP4
experts they stay packed. Decode speed: `python -m llm_jax.bench decode`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from llm_jax.runtime.malloc import use_preferred_malloc

if __name__ == "__main__":  # first: a restart under the preferred malloc re-imports nothing heavy
    use_preferred_malloc()

from llm_jax.inference.loop import MAX_STOPS
from llm_jax.inference.sampler import sample
from llm_jax.inference.text import TextStream, text_decoder
from llm_jax.runtime.cli import ArgumentParser, float_dtype


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m llm_jax.generate", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="llm_jax workdir/checkpoint, Hugging Face directory or "
                   "OpenAI original/ directory")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt_file", action="append", default=[],
                   help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--prompt_ids", action="append", default=[],
                   help="comma-separated token ids, e.g. 1,2,3 (repeatable; no tokenizer needed)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos_id", type=int, default=None,
                   help="stop token (default: the tokenizer's stop tokens; -1 = never stop "
                   "early)")
    p.add_argument("--adapters", default=None,
                   help="LoRA adapters directory to load onto the checkpoint (not merged)")
    p.add_argument("--dtype", type=float_dtype, default=None,
                   help="load weights and compute in this dtype")
    p.add_argument("--cache_dtype", type=float_dtype, default=None,
                   help="KV-cache dtype (default: compute dtype)")
    p.add_argument("--max_len", type=int, default=None, help="KV-cache slots")
    p.add_argument("--output_json", default=None, help="write ids and text of every sequence")
    p.add_argument("--no_stream", action="store_true", help="print only when done")
    return p.parse_args(argv)


def _read_prompt(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt_file={path!r} cannot be read: "
                         f"{getattr(e, 'strerror', None) or e}") from e


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        if not args.checkpoint:
            raise ValueError("--checkpoint is required")
        if args.output_json and not Path(args.output_json).resolve().parent.is_dir():
            raise ValueError(f"--output_json={args.output_json!r}: its directory does not exist")
        from llm_jax.weights.readers import load_pretrained  # after the flags: start-up cost

        model = load_pretrained(args.checkpoint, dtype=args.dtype)
        if args.adapters:
            from llm_jax.weights.adapters import load_adapters  # after the flags: start-up cost

            load_adapters(model, args.adapters)
        from llm_jax.inference.tokenizer import load_tokenizer  # after the flags: start-up cost

        tok = load_tokenizer(args.checkpoint)
        texts = list(args.prompt) + [_read_prompt(f) for f in args.prompt_file]
        if texts and tok is None:
            raise ValueError(f"--prompt/--prompt_file need a tokenizer, and there is none in "
                             f"{args.checkpoint} (tokenizer.json, or tokenizer.model there or in "
                             f"its parent); pass --prompt_ids instead")
        prompts = [tok.encode(t) for t in texts]
        for s in args.prompt_ids:
            try:
                prompts.append([int(x) for x in s.replace(" ", "").split(",") if x])
            except ValueError:
                raise ValueError(f"--prompt_ids={s!r} is invalid: expected comma-separated "
                                 f"integers like 1,2,3") from None
        if not prompts:
            raise ValueError("give at least one --prompt, --prompt_file or --prompt_ids")
        if args.eos_id is not None:
            eos = None if args.eos_id < 0 else args.eos_id
        else:  # every stop token of the checkpoint (gpt-oss: <|return|>, <|call|>, ...) that
            # the model can produce (a tokenizer may hold ids past the embedding table)
            eos = sorted(i for i in (tok.stop_ids if tok else ()) if i < model.cfg.vocab_size)
            if len(eos) > MAX_STOPS:
                raise ValueError(f"the checkpoint's tokenizer has {len(eos)} stop tokens "
                                 f"({eos[:MAX_STOPS + 1]}...), more than the {MAX_STOPS} "
                                 "generation takes: pass --eos_id N to stop at one")
            eos = eos or None
        decode = text_decoder(tok)  # ids past the tokenizer's vocabulary show as <id:N>
        stream = None
        if len(prompts) == 1 and not args.no_stream:
            stream = TextStream(decode, prefix=texts[0] if texts else args.prompt_ids[0])
        ids = sample(model, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_id=eos, max_len=args.max_len,
                       cache_dtype=args.cache_dtype, stream=stream)
    except ValueError as e:
        print(f"llm_jax.generate: error: {e}", file=sys.stderr)
        return 2
    if stream is not None:
        stream.finish()
        print()
    else:
        for i, (p, out) in enumerate(zip(prompts, ids)):
            head = texts[i] if i < len(texts) else ",".join(map(str, p))
            print(f"--- [{i}]\n{head}{decode(out)}")
    if args.output_json:
        try:
            Path(args.output_json).write_text(json.dumps([
                {"prompt_ids": p, "ids": out, "text": decode(out)}
                for p, out in zip(prompts, ids)], indent=2))
        except OSError as e:
            print(f"llm_jax.generate: error: --output_json={args.output_json!r} cannot be "
                  f"written: {e.strerror or e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
