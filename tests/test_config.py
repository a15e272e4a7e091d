"""ModelConfig: validation names the bad field, JSON round trip, usable as a static jit argument."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from llm_jax.config import ModelConfig, yarn_correction_range
from llm_jax.training.run_config import model_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_are_the_books_sixteen_numbers():
    cfg = ModelConfig()
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.experts_per_token, cfg.vocab_size) == (4, 16, 2, 8000)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) == (256, 256, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.sliding_window) == (4, 2, 0)
    assert (cfg.initial_context_length, cfg.rope_theta, cfg.rope_scaling_factor) == (4096, 10000.0, 32.0)
    assert (cfg.rope_ntk_alpha, cfg.rope_ntk_beta, cfg.swiglu_limit) == (1.0, 32.0, 7.0)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads"),
        ({"experts_per_token": 17}, "experts_per_token"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"head_dim": 63}, "head_dim"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"rope_scaling_factor": 0.5}, "rope_scaling_factor"),
        ({"rope_ntk_beta": 0.5}, "YaRN range"),  # low > high
        ({"initial_context_length": 8}, "YaRN range"),  # low < 0
        ({"moe_dispatch": "sparse"}, "moe_dispatch"),
        ({"dtype": "float64"}, "dtype"),
        ({"prms_fraction": 1.5}, "prms_fraction"),
        ({"vocab_size": 8000.0}, "vocab_size"),
        ({"swiglu_limit": 0.0}, "swiglu_limit"),
        ({"loss_chunk_tokens": 0}, "loss_chunk_tokens"),
        ({"loss_group_chunks": 0}, "loss_group_chunks"),
        ({"gmm_tile_m": 500}, "gmm_tile_m"),
        ({"gmm_tile_k": 0}, "gmm_tile_k"),
        ({"gmm_tile_n": -128}, "gmm_tile_n"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**changes)


def test_yarn_low_high_worked_values():
    low, high = yarn_correction_range(ModelConfig())
    assert low == pytest.approx(10.47, abs=0.005)
    assert high == pytest.approx(22.51, abs=0.005)


def test_json_round_trip_and_unknown_field_refused():
    cfg = ModelConfig(sliding_window=128, moe_dispatch="ragged", dtype="bfloat16")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig.from_dict({**cfg.to_dict(), "num_layers": 3})


def test_config_is_hashable_static_pytree():
    cfg = ModelConfig()
    assert hash(cfg) == hash(ModelConfig())
    assert jax.tree.leaves({"cfg": cfg, "x": 1}) == [1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3  # type: ignore[misc]

    @jax.jit
    def f(c: ModelConfig, x):
        return x * c.hidden_size

    assert float(f(cfg, jnp.ones(()))) == 256.0


def test_sliding_layers_are_the_even_ones():
    assert ModelConfig(sliding_window=128).layer_windows == (128, 0, 128, 0)
    assert ModelConfig().layer_windows == (0, 0, 0, 0)


@pytest.mark.parametrize("name", ["tiny", "gpt_oss_20b", "gpt_oss_120b"])
def test_config_files_build_valid_model_configs(name, monkeypatch):
    monkeypatch.syspath_prepend(str(CONFIGS))
    mod = __import__(name)
    cfg = model_config(mod.get_config())
    assert isinstance(cfg, ModelConfig)
    sys.modules.pop(name, None)
