"""RMSNorm: the book's hand example, scale invariance, pRMSNorm at p = 1, float32 internals."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm_jax.config import ModelConfig
from llm_jax.model.norm import RMSNorm, layer_norm, rms_norm


def test_rmsnorm_book_hand_example():
    y = rms_norm(jnp.array([2.0, 0.0, 4.0, 0.0]), jnp.ones(4))
    # rms = sqrt((4 + 16) / 4) = sqrt(5); 2/sqrt5 = 0.894, 4/sqrt5 = 1.789
    np.testing.assert_allclose(y, [0.894, 0.0, 1.789, 0.0], atol=5e-4)


class RMSNormScaleInvarianceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_rmsnorm_is_invariant_to_input_scale(self):
        x = jax.random.normal(jax.random.key(0), (3, 5, 64)) * 3.0
        scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(1), (64,))
        f = self.variant(rms_norm)
        for a in (0.5, 2.0, 1000.0):  # mean(x^2) >> eps, so eps is negligible
            np.testing.assert_allclose(f(a * x, scale), f(x, scale), rtol=1e-4, atol=1e-4)


def test_rmsnorm_matches_numpy_formula():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 32)).astype(np.float32)
    scale = rng.normal(size=(32,)).astype(np.float32)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(scale)), ref, rtol=1e-5, atol=1e-6)


def test_prmsnorm_equals_rmsnorm_at_p_one_and_uses_leading_features():
    x = jax.random.normal(jax.random.key(2), (7, 64))
    s = jnp.ones(64)
    np.testing.assert_array_equal(rms_norm(x, s, prms_fraction=1.0), rms_norm(x, s))
    xn = np.asarray(x, np.float64)
    k = int(0.0625 * 64)
    ref = xn / np.sqrt(np.mean(xn[:, :k] ** 2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rms_norm(x, s, prms_fraction=0.0625), ref, rtol=1e-5, atol=1e-5)


def test_rmsnorm_module_keeps_float32_scale_and_input_dtype():
    norm = RMSNorm(ModelConfig(), rngs=nnx.Rngs(0))
    assert norm.scale[...].dtype == jnp.float32
    np.testing.assert_array_equal(norm.scale[...], np.ones(256))
    x = jax.random.normal(jax.random.key(3), (2, 256)).astype(jnp.bfloat16)
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(rms_norm(x.astype(jnp.float32), norm.scale[...])),
                               rtol=1e-2, atol=1e-2)


def test_layer_norm_subtracts_the_mean():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    y = layer_norm(x, jnp.ones(4), jnp.zeros(4))
    assert float(jnp.abs(y.mean())) < 1e-6
    assert float(y.var()) == pytest.approx(1.0, rel=1e-4)
