"""gpt-oss-20b: 24 layers, 32 experts (top-4), 201,088 vocab, sliding window 128 on even layers."""

import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.training.run_config import default_run_config


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        num_hidden_layers=24,
        num_experts=32,
        experts_per_token=4,
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        sliding_window=128,
        initial_context_length=4096,
        rope_theta=150000.0,
        rope_scaling_factor=32.0,
        rope_ntk_alpha=1.0,
        rope_ntk_beta=32.0,
        swiglu_limit=7.0,
        dtype="bfloat16",
        param_dtype="bfloat16",
        moe_dispatch="auto",  # dropless: the megablox gmm kernel on TPU, ragged_dot on GPU
        # The fused loss: logits 1,024 tokens per device at a time (0.77 GiB of float32), their
        # gradients into dh and dW once per 8 chunks (a 3.1 GiB bf16 buffer): at 8k tokens per
        # chip one reduce-scatter of the unembedding's gradient instead of 8; compiled choice
        # (2-layer unit on v5p-32: 3.33e11 -> 3.00e11 bytes, for 1.6 GiB more peak memory;
        # loss_chunk_tokens=2048, loss_group_chunks=1 is the memory-first choice) in
        # docs/scaling.md
        loss_chunk_tokens=1024,
        loss_group_chunks=8,
    )
    return default_run_config("gpt_oss_20b", model)
