"""RoPE with YaRN: closed-form frequencies, concentration, relative-position property."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.config import ModelConfig, yarn_correction_range
from llm_jax.model.rope import apply_rope, inv_freq_and_concentration, rope_cos_sin

YARN = ModelConfig()  # theta 1e4, head_dim 64, L0 4096, factor 32, alpha 1, beta 32
PLAIN = ModelConfig(rope_scaling_factor=1.0)


def test_yarn_range_for_theta_1e4_head_dim_64_context_4096():
    low, high = yarn_correction_range(YARN)
    assert (round(low, 2), round(high, 2)) == (10.47, 22.51)


def test_yarn_inv_freq_closed_form_values():
    inv_freq, conc = inv_freq_and_concentration(YARN)
    assert conc == pytest.approx(0.1 * math.log(32) + 1, abs=1e-12)  # 1.3466
    assert conc == pytest.approx(1.3466, abs=1e-4)
    # Below low: pure extrapolation (original frequency).
    assert inv_freq[0] == pytest.approx(1.0)
    assert inv_freq[10] == pytest.approx(1e4 ** (-20 / 64))
    # Above high: pure interpolation, frequency divided by the factor.
    assert inv_freq[31] == pytest.approx(1e4 ** (-62 / 64) / 32)
    assert inv_freq[23] == pytest.approx(1e4 ** (-46 / 64) / 32)
    # In between: linear blend; i = 16 has ramp (16 - 10.4722) / (22.5134 - 10.4722) = 0.4591.
    ramp = (16 - 10.472240810318025) / (22.513440636877274 - 10.472240810318025)
    assert inv_freq[16] == pytest.approx(ramp / (32 * 100.0) + (1 - ramp) / 100.0, rel=1e-12)
    assert inv_freq[16] == pytest.approx(0.0055525, rel=1e-4)


def test_plain_rope_has_unit_concentration_and_original_frequencies():
    inv_freq, conc = inv_freq_and_concentration(PLAIN)
    assert conc == 1.0
    np.testing.assert_allclose(inv_freq, 1e4 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)


def test_rope_rotation_values_at_one_position():
    x = jnp.arange(1.0, 65.0).reshape(1, 1, 1, 64)
    cos, sin = rope_cos_sin(jnp.array([[3]]), PLAIN)
    y = np.asarray(apply_rope(x, cos, sin))[0, 0, 0]
    inv = 1e4 ** (-np.arange(0, 64, 2) / 64)
    x1, x2 = np.arange(1.0, 33.0), np.arange(33.0, 65.0)
    ref = np.concatenate([x1 * np.cos(3 * inv) - x2 * np.sin(3 * inv),
                          x2 * np.cos(3 * inv) + x1 * np.sin(3 * inv)])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cfg", [PLAIN, YARN], ids=["plain", "yarn"])
def test_rope_scores_depend_only_on_relative_position(cfg):
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 64))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 64))

    def score(m, n):
        cq, sq = rope_cos_sin(jnp.array([[m]]), cfg)
        ck, sk = rope_cos_sin(jnp.array([[n]]), cfg)
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
    assert score(0, 0) == pytest.approx(score(50, 50), rel=1e-4)


def test_rope_scales_norm_by_concentration():
    x = jax.random.normal(jax.random.key(2), (2, 5, 3, 64))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5)) * 37
    cos, sin = rope_cos_sin(pos, YARN)
    _, conc = inv_freq_and_concentration(YARN)
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(x, cos, sin), axis=-1),
                               conc * jnp.linalg.norm(x, axis=-1), rtol=1e-5)
