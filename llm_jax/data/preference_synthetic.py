"""A synthetic preference set that needs nothing downloaded: which kind of thing is a word.

    python -m llm_jax.data.preference_synthetic --out runs/dpo_data

The user asks, in one of several phrasings, what kind of thing a word is (cat, apple, red, ...);
the chosen reply names its category ("cat is an animal."), the rejected one a wrong category
("cat is a colour."). Held out by prompt (data/preference.py), validation asks about words
in phrasings the training pairs never combine them with, so a policy that learned the facts
ranks them, one that learned the phrasings does not. Writes `pairs.jsonl` and a checkpoint-style
tokenizer directory beside it: `tokenizer.json` (byte-level BPE trained on the pairs),
`chat_template.jinja` and `tokenizer_config.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import tokenizers

CATEGORIES = {
    "animal": ["cat", "dog", "horse", "cow", "fish", "bird"],
    "fruit": ["apple", "pear", "plum", "grape", "lemon", "peach"],
    "colour": ["red", "blue", "green", "yellow", "purple", "brown"],
}
PHRASINGS = ["what kind of thing is {w}?", "{w}: which category?", "tell me what {w} is.",
             "classify the word {w}.", "is {w} an animal, a fruit or a colour?"]
SPECIAL_TOKENS = ["<|start|>", "<|message|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|message|>"
                 "{% endif %}")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def reply(word: str, category: str) -> str:
    return f"{word} is {_article(category)} {category}."


def synthetic_pairs(seed: int = 0) -> list[dict[str, str]]:
    """Every (word, phrasing, wrong category) as a {"prompt", "chosen", "rejected"} record,
    shuffled by `seed`."""
    pairs = []
    for category, words in CATEGORIES.items():
        wrong = [c for c in CATEGORIES if c != category]
        for word, phrasing, other in itertools.product(words, PHRASINGS, wrong):
            pairs.append({"prompt": phrasing.format(w=word), "chosen": reply(word, category),
                          "rejected": reply(word, other)})
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[i] for i in order]


def write_tokenizer(out: Path, texts: list[str], vocab_size: int = 300) -> None:
    """tokenizer.json (byte-level BPE over `texts`, the chat's special tokens added),
    chat_template.jinja and tokenizer_config.json in `out`."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts + ["user assistant"], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))


def write_synthetic_preferences(out: str | Path, seed: int = 0) -> Path:
    """Writes OUT/pairs.jsonl and the tokenizer files (module doc); returns the JSONL path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = synthetic_pairs(seed)
    path = out / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    write_tokenizer(out, [" ".join(p.values()) for p in pairs])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write into")
    parser.add_argument("--seed", type=int, default=0, help="the order of the pairs")
    args = parser.parse_args()
    path = write_synthetic_preferences(args.out, args.seed)
    print(f"wrote {sum(1 for _ in open(path))} pairs to {path} and the tokenizer to {args.out}")


if __name__ == "__main__":
    main()
