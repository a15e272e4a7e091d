"""A tiny llm_jax checkpoint with a byte-level BPE tokenizer.json and a chat template, for the
serving, evaluation and chat tests (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from llm_jax.config import ModelConfig
from llm_jax.model import init_model
from llm_jax.weights.formats import save_llm_jax

SPECIAL = ["<|start|>", "<|message|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}")
CFG = ModelConfig(
    num_hidden_layers=2, num_experts=4, experts_per_token=2, vocab_size=320, hidden_size=32,
    intermediate_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=8, initializer_range=0.3,  # logits that spread, so the argmax is clear
)
WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang over green trees "
         "near blue water one two three four five six seven eight nine ten yes no maybe").split()


def make_checkpoint(d: Path, seed: int = 0) -> Path:
    """Writes config.json + params.safetensors + tokenizer.json + chat_template.jinja into d."""
    d.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))],
                            trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    save_llm_jax(init_model(CFG, seed=seed), d)
    return d
