"""RL rollouts (training/rollouts.py) and the engine's weight hand-over: the batch's sampler
log-probs are what the trainer computes for the same rows with the recorded routing replayed
(float32, 2e-5), the same seed reproduces a rollout, and an engine given new weights decodes
with them, weights laid out on a mesh as an RL run's are included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL
from jax.sharding import NamedSharding, PartitionSpec

from llm_jax.inference.engine import Engine
from llm_jax.inference.requests import EngineConfig, SamplingParams, Sequence
from llm_jax.inference.sampler import sample
from llm_jax.model import init_model
from llm_jax.parallel.sharding import make_mesh
from llm_jax.training.rl_step import completion_logprobs
from llm_jax.training.rollouts import rl_batch, rollout

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.9, stop_ids=frozenset({3, 4}))
ENGINE = EngineConfig(slots=4, max_len=32, max_queue=8, max_prefill=4, record=True)


@pytest.fixture(scope="module")
def model():
    return init_model(SMALL_MODEL, seed=0)


def test_the_batch_holds_what_the_trainer_computes_for_the_same_rows(model):
    engine = Engine(model, ENGINE)
    groups = rollout(engine, PROMPTS, 3, PARAMS, seed=7)
    assert [len(g) for g in groups] == [3, 3]
    assert len({tuple(c.tokens) for g in groups for c in g}) > 2  # the samples differ
    batch = rl_batch(groups, np.zeros((2, 3)), length=24)
    _, logp = completion_logprobs(model, {k: jnp.asarray(v) for k, v in batch.items()},
                                  temperature=PARAMS.temperature, train=False)
    mask = batch["completion_mask"]
    assert mask.sum() == sum(len(c.tokens) for g in groups for c in g)
    np.testing.assert_allclose(np.asarray(logp) * mask, batch["sampler_logp"], atol=2e-5)
    again = rollout(engine, PROMPTS, 3, PARAMS, seed=7)
    assert [[c.tokens for c in g] for g in again] == [[c.tokens for c in g] for g in groups]
    with pytest.raises(ValueError, match="length=8"):
        rl_batch(groups, np.zeros((2, 3)), length=8)
    with pytest.raises(ValueError, match="record=True"):
        rollout(Engine(model, EngineConfig(slots=2, max_len=32)), PROMPTS, 2, PARAMS, seed=0)


def test_an_engine_given_new_weights_decodes_with_them(model):
    engine = Engine(model, ENGINE)  # the programs the rollouts above compiled
    other = init_model(SMALL_MODEL, seed=1)
    engine.set_weights(other)
    greedy = SamplingParams(max_new_tokens=6)
    got = rollout(Engine(other, ENGINE), PROMPTS[:1], 1, greedy, seed=0)[0][0].tokens
    seq = engine.submit(Sequence(PROMPTS[0], greedy))
    engine.run_until_idle()
    assert seq.tokens == sample(other, PROMPTS[0], max_new_tokens=6) == got
    with pytest.raises(ValueError, match="structure"):
        engine.set_weights(init_model(SMALL_MODEL.replace(num_hidden_layers=1)))


def test_weights_on_a_mesh_decode_alike_and_each_program_compiles_once(model):
    """An RL run's weights are laid out on its mesh: the engine decodes under it, its pool laid
    out on it in and out of every program, so neither a second request nor new weights compile
    a program again (a pool made off the mesh came back on it: one more prefill compile)."""
    mesh = make_mesh(devices=jax.devices()[:1])
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.append(event) if event.endswith(
            "backend_compile_duration") else None)

    def on_mesh(m):
        graphdef, state = nnx.split(m)
        return nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))

    greedy = SamplingParams(max_new_tokens=6)
    engine = Engine(on_mesh(model), ENGINE)
    first = engine.submit(Sequence(PROMPTS[0], greedy))
    engine.run_until_idle()
    other = on_mesh(init_model(SMALL_MODEL, seed=1))
    before = len(compiles)
    engine.set_weights(other)
    second = engine.submit(Sequence(PROMPTS[0], greedy))
    engine.run_until_idle()
    assert len(compiles) == before
    assert first.tokens == sample(model, PROMPTS[0], max_new_tokens=6)
    assert second.tokens == sample(other, PROMPTS[0], max_new_tokens=6)
    assert {a.sharding.mesh for a in jax.tree.leaves(engine.cache)} == {mesh}
