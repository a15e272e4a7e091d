"""The jitted train and eval steps and generation compile once, then reuse the program.

Run in a fresh interpreter: whether a call misses the cache depends on what the process had
imported before the first trace (in jax 0.12 a first import of Pallas' TPU module inside a
trace changed the trace context, and every step compiled again on its second call), and this
test process has imported everything long before.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from llm_jax.bench.train import quick_model_config, random_batch, tiny_run_config
    from llm_jax.parallel.sharding import make_mesh
    from llm_jax.training.step import compile_steps
    import llm_jax

    cfg = quick_model_config()
    tc = tiny_run_config().train.copy_and_resolve_references()
    tc.batch_size, tc.grad_accum_steps = 2, 1
    steps = compile_steps(cfg, tc, make_mesh(devices=jax.devices()[:1]), 0)
    state = steps.init()
    batch = jax.device_put({k: jnp.asarray(v) for k, v in random_batch(cfg.vocab_size, 2, 32).items()},
                           steps.batch_sharding)
    # The trainer compiles the step ahead (training/loop.py) while the data pipeline fills its
    # first window: the calls must then reuse that program, not compile their own.
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None)
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
    steps.train.lower(state, spec).compile()
    ahead = len(compiles)
    for _ in range(3):
        state, metrics = steps.train(state, batch)
        out = steps.eval(state.params, batch)
    jax.block_until_ready((state, metrics, out))
    print("ahead", ahead, "after", len(compiles))
    print("train", steps.train._cache_size(), "eval", steps.eval._cache_size())
""")


def test_train_and_eval_steps_compile_once_across_calls_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "train 1 eval 1", done.stdout
    ahead, after = (int(x) for x in lines[-2].split()[1::2])
    assert ahead >= 1 and after - ahead == 1, done.stdout  # only the eval step compiled again
