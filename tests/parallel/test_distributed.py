"""Multi-host: two processes x four CPU devices on 127.0.0.1 (launch/local.py) train three steps
with the same losses as one process with eight devices, and the checkpoint they write together
restores on one device and on a (2, 1, 2, 2) mesh with the same params; the two-process job's
rerun over its compilation cache finishes too.

The workers are this file run as a script; nothing connects beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # helpers, as a script too

from helpers import (  # noqa: E402
    EIGHT_DEVICES,
    FAST_XLA_FLAGS,
    batches,
    tiny_execution,
    tiny_model,
    tiny_train,
)

# The same (2, 1, 2, 2) layout both ways: one process with data=2 inside it, or two processes
# with data split across them (dcn_data=2, the hybrid mesh) and tensor x expert inside each.
SINGLE = {"mesh": {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}, "dcn": {}}
MULTI = {"mesh": {"data": 1, "fsdp": 1, "tensor": 2, "expert": 2}, "dcn": {"data": 2}}


def _run(cmd, env_extra, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out


def test_a_gce_tpu_vm_is_detected_through_jax_and_starts_the_runtime(monkeypatch):
    """`gcloud compute tpus tpu-vm create` sets no worker variables: the workers come from the
    metadata server, through JAX's own check, and then `initialize` starts JAX's runtime with
    JAX's detected parameters. Elsewhere (this machine) nothing is detected."""
    import jax
    from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster

    from llm_jax.parallel import distributed

    for var in ("SLURM_JOB_ID", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES",
                "MEGASCALE_COORDINATOR_ADDRESS", distributed.ENV_COORDINATOR):
        monkeypatch.delenv(var, raising=False)
    assert distributed.detected_cluster() is None
    assert distributed.initialize()["mode"] == "single"

    calls = []
    monkeypatch.setattr(GceTpuCluster, "is_env_present", classmethod(lambda cls: True))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "compile_fresh_on_cpu", lambda: None)
    assert distributed.detected_cluster() == "tpu"
    assert distributed.initialize()["mode"] == "tpu"
    assert calls == [{"initialization_timeout": 300}]  # everything else JAX detects


@pytest.mark.slow
def test_two_processes_train_like_one_process_and_their_checkpoint_restores_on_other_meshes(
        tmp_path):
    """The two-process run, then one eight-device process that trains the same steps and
    restores the two-process checkpoint on one device and on the (2, 1, 2, 2) mesh; then a
    rerun of the two processes over the first one's compilation cache. (One test: pytest-xdist
    could start a shared fixture's processes twice.)

    The rerun would load its programs from the cache, and with jaxlib 0.12.1 process 0's first
    collective then never completes (`distributed.compile_fresh_on_cpu` keeps multi-process CPU
    runs off the cache): both runs compute a psum across the processes first, and each must
    finish it well within the timeout."""
    single, multi = tmp_path / "single", tmp_path / "multi"
    env = {"XLA_FLAGS": FAST_XLA_FLAGS, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    launch = [sys.executable, str(ROOT / "launch" / "local.py"), "--num_processes", "2",
              "--devices_per_process", "4", "--timeout", "280", "--", sys.executable, __file__]
    runs = [_run(launch + ["train", str(multi), json.dumps(MULTI)], env)]
    _run([sys.executable, __file__, "single", str(single), str(multi)],
         {"XLA_FLAGS": EIGHT_DEVICES})
    runs.append(_run(launch + ["psum"], env))
    for out in runs:
        for i in range(2):  # 4 x 1^2 + 4 x 2^2: four rows on each process
            assert f"[{i}] psum [20.0, 20.0, 20.0, 20.0] cache off" in out.stdout, \
                out.stdout[-3000:]

    s, m = (json.loads((d / "result.json").read_text()) for d in (single, multi))
    assert m["process_count"] == 2 and s["process_count"] == 1
    assert m["devices"] == s["devices"] == 8
    assert m["local_rows"] == [8, 8]  # each process loaded only its half of the batch
    # distributed.compile_fresh_on_cpu: off for processes on CPU, kept for one process
    assert s["compilation_cache"] and not m["compilation_cache"]
    np.testing.assert_allclose(m["losses"], s["losses"], rtol=0, atol=1e-5)

    restores = json.loads((single / "restores.json").read_text())
    assert sorted(restores) == ["mesh_2x1x2x2", "one_device"]
    for target, r in restores.items():
        assert r["step"] == 3, (target, r)
        assert r["max_param_diff"] < 1e-5, (target, r)
        assert r["devices"] == (1 if target == "one_device" else 8), (target, r)
        assert r["placed_on_target"], (target, r)


# --------------------------------------------------------------------------- workers


EXPERT_PARALLEL = tiny_execution(moe_dispatch="expert_parallel")


def _setup(mesh_spec):

    from llm_jax.parallel import sharding as sh

    mesh = sh.make_mesh(mesh_spec["mesh"], dcn_sizes=mesh_spec["dcn"] or None)
    return tiny_model(), tiny_train(), mesh


def worker_train(workdir: str, mesh_json: str, psum: bool = False) -> None:
    from llm_jax.parallel import distributed

    info = distributed.initialize()  # from the launcher's environment
    import jax

    if psum:
        print_psum()

    from llm_jax.training.step import compile_steps
    from llm_jax.weights.checkpointing import Checkpointer

    cfg, tc, mesh = _setup(json.loads(mesh_json))
    steps = compile_steps(cfg, tc, mesh, seed=0, execution=EXPERT_PARALLEL)
    state = steps.init()
    rows = distributed.local_rows(steps.batch_sharding, tc.batch_size)
    losses = []
    for b in batches(3, batch=tc.batch_size):  # every process sees the same global stream...
        local = {k: v[rows] for k, v in b.items()}  # ...and loads only its rows
        state, m = steps.train(state, distributed.global_batch(local, steps.batch_sharding))
        losses.append(float(m["loss"]))
    ckpt = Checkpointer(workdir, async_save=True)
    ckpt.save(3, state, config={"model": cfg.to_dict()}, data_iter=None, tokenizer_proto=None)
    ckpt.wait()
    ckpt.close()
    counts = distributed.process_allgather_int(len(rows))
    if distributed.is_main():
        os.makedirs(workdir, exist_ok=True)
        result = {"losses": losses, "process_count": jax.process_count(),
                  "devices": jax.device_count(), "local_rows": counts, "init": info,
                  "compilation_cache": jax.config.jax_enable_compilation_cache}
        pathlib.Path(workdir, "result.json").write_text(json.dumps(result))
        if jax.process_count() == 1:
            flat = jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))
            np.savez(pathlib.Path(workdir, "params.npz"),
                     **{jax.tree_util.keystr(p): np.asarray(v) for p, v in flat})


def worker_psum() -> None:
    from llm_jax.parallel import distributed

    distributed.initialize()
    print_psum()


def print_psum() -> None:
    """Each process contributes (its index + 1)^2 from each of its devices to a sum across the
    processes: a fused product, then the all-reduce (an all-reduce alone ran from the cache
    with jaxlib 0.12.1; one after a computation did not)."""
    import jax
    import jax.numpy as jnp

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.make_array_from_process_local_data(
        sharding, np.full((jax.local_device_count(), 4), jax.process_index() + 1.0, np.float32))
    total = jax.jit(lambda a: jnp.sum(a * a, axis=0))(x)
    cache = "on" if jax.config.jax_enable_compilation_cache else "off"
    print(f"psum {np.asarray(total.addressable_data(0)).tolist()} cache {cache}", flush=True)


def worker_single(workdir: str, multi_workdir: str) -> None:
    """One process, eight devices: the SINGLE run, then the restores of `multi_workdir`'s
    checkpoint (one device: the first device alone)."""
    worker_train(workdir, json.dumps(SINGLE))
    ref = str(pathlib.Path(workdir, "params.npz"))
    restores = {t: restore(multi_workdir, t, ref) for t in ("one_device", "mesh_2x1x2x2")}
    pathlib.Path(workdir, "restores.json").write_text(json.dumps(restores))


def restore(workdir: str, target: str, ref_npz: str) -> dict:
    import jax

    from llm_jax.parallel import sharding as sh
    from llm_jax.training.step import compile_steps
    from llm_jax.weights.checkpointing import Checkpointer

    spec = {"mesh": {}, "dcn": {}} if target == "one_device" else SINGLE
    cfg, tc = tiny_model(), tiny_train()
    mesh = sh.make_mesh(spec["mesh"] or None, devices=jax.devices()[:1]
                        if target == "one_device" else None)
    steps = compile_steps(cfg, tc, mesh, seed=0, execution=EXPERT_PARALLEL)
    ckpt = Checkpointer(workdir, create=False, async_save=False)
    state = ckpt.restore(ckpt.latest_step(), steps.abstract_state, None)
    ref = np.load(ref_npz)
    flat = jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))
    diff = max(float(np.max(np.abs(np.asarray(v) - ref[jax.tree_util.keystr(p)])))
               for p, v in flat)
    # Every array (params, Adam moments, step) where the train step takes it: the step's
    # in_shardings are these, so the restored state is what it trains from.
    want = jax.tree.leaves(steps.state_sharding)
    got = jax.tree.leaves(state)
    placed = len(got) == len(want) and all(a.sharding == s for a, s in zip(got, want))
    return {"step": int(jax.device_get(state.step)), "max_param_diff": diff,
            "devices": len(mesh.devices.flat), "placed_on_target": placed}


if __name__ == "__main__":
    {"train": lambda *a: worker_train(*a, psum=True), "single": worker_single,
     "psum": worker_psum}[sys.argv[1]](*sys.argv[2:])
