"""The per-backend kernel table: defaults unchanged on CPU, splash and the target's MoE on TPU,
config overrides, and clear errors naming the field."""

import pytest

from llm_jax.config import ModelConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.model.select import attention_impl, auto_moe, kernels_line, moe_impl
from llm_jax.runtime.backend import backend, compiling_for

CFG = ModelConfig()
AUTO = ExecutionConfig()


def test_cpu_keeps_the_shape_rule():
    from llm_jax.model.blockwise_attention import BLOCKWISE_MIN_KEYS

    short = BLOCKWISE_MIN_KEYS // 2
    assert attention_impl(CFG, AUTO, 8, short, short, "cpu") == "direct"
    assert attention_impl(CFG, AUTO, 1, 4096, 4096, "cpu") == "blockwise"
    assert moe_impl(CFG, AUTO, "cpu") == "blocked"


def test_tpu_picks_splash_where_it_applies():
    assert attention_impl(CFG, AUTO, 8, 256, 256, "tpu") == "splash"
    assert attention_impl(CFG, AUTO, 8, 100, 100, "tpu") == "direct"  # not a multiple of 128
    assert attention_impl(CFG, AUTO, 8, 1, 256, "tpu") == "direct"  # decoding
    assert kernels_line(CFG, AUTO, 8, 256, "tpu") == "attention=splash moe=gmm (tpu)"


def test_config_overrides_the_table():
    ex = ExecutionConfig(attention_impl="direct", moe_dispatch="gmm")
    assert attention_impl(CFG, ex, 8, 256, 256, "tpu") == "direct"
    assert moe_impl(CFG, ex, "cpu") == "gmm"
    splash = ExecutionConfig(attention_impl="splash")
    assert attention_impl(CFG, splash, 1, 256, 256, "cpu") == "splash"


def test_compiling_for_sets_the_target_backend():
    host = backend()
    with compiling_for("tpu"):
        assert backend() == "tpu"
        assert auto_moe(CFG, 1000) == "gmm"
    assert backend() == host


def test_bad_attention_impl_names_the_field():
    with pytest.raises(ValueError, match="ExecutionConfig.attention_impl='cudnn'"):
        ExecutionConfig(attention_impl="cudnn")
