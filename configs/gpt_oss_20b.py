"""gpt-oss-20b: 24 layers, 32 experts (top-4), 201,088 vocab, sliding window 128 on even layers."""

import ml_collections

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
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
    )
    execution = ExecutionConfig(
        moe_dispatch="auto",  # dropless: the megablox gmm kernel on TPU, ragged_dot on GPU
        # The fused loss: 1,024 tokens per device a chunk (0.8 GB of float32 logits), 8 chunks
        # at 8k tokens per chip, unrolled (so the compiled cost counts them all). On a mesh with
        # fsdp or expert axes that, times tensor, divide the vocabulary the loss splits by
        # vocabulary (unembed_loss.vocab_split); elsewhere 4 chunks share each product into dh
        # and dW.
        # Compiled choices in docs/scaling.md (2,048-token chunks read 0.5 % fewer bytes; with
        # 1,024 the 20b dropless and 120b steps hold 1.3-3 GiB less, under MaxText's).
        loss_chunk_tokens=1024,
        loss_group_chunks=4,
    )
    return default_run_config("gpt_oss_20b", model, execution)
