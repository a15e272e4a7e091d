"""Multi-process runs: start JAX's distributed runtime, and build global batches from local data.

One process per host (TPU VM worker, GPU node or SLURM task); each sees its local devices, and
`jax.devices()` lists every process's. Where the coordinator comes from, first match wins:

1. the run config's `distributed` section (coordinator_address, num_processes, process_id);
2. the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (what
   `launch/local.py` sets for N processes on 127.0.0.1);
3. a cluster JAX detects by itself: a Cloud TPU VM (TPU_WORKER_HOSTNAMES, MEGASCALE_* or,
   on a GCE TPU VM, the metadata server, asked through JAX's own check) or a SLURM job with
   more than one task;
4. none of these: a single process; nothing to initialise.

JAX_NUM_CPU_DEVICES (a JAX config variable) gives each CPU process that many devices.
Data: each process loads its own 1/P of every global batch (`make_datasets` takes
process_index / process_count); `global_batch` assembles the global jax.Array from those local
rows without any copy between processes. Logs and metrics come from process 0 (`is_main`);
checkpoints are written by every process through Orbax, each writing its own shards.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _setting(cfg: Any, name: str, env: str, default: Any) -> Any:
    value = cfg.get(name, default) if cfg is not None else default
    if value in ("", -1, None):
        value = os.environ.get(env, default)
    return value


def detected_cluster() -> str | None:
    """The multi-process environment JAX would detect by itself, if any.

    A Cloud TPU VM made with `gcloud compute tpus tpu-vm create` sets none of these variables:
    JAX finds its workers from the metadata server, which only JAX's own check asks (it runs
    only where JAX found TPU chips at import, so elsewhere it costs nothing). A single-worker
    TPU VM counts too: initialising one process there is harmless.
    """
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return "slurm"
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    if _gce_tpu_vm():
        return "tpu"
    return None


def _gce_tpu_vm() -> bool:
    """JAX's check for a GCE TPU VM (TPU chips, and a worker number in the metadata server), the
    one `jax.distributed.initialize()` runs; JAX exports no public name for it."""
    try:
        from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster
    except ImportError:  # a JAX that moved it: the variables above still decide
        return False
    return bool(GceTpuCluster.is_env_present())


def initialize(cfg: Any = None) -> dict[str, Any]:
    """Starts the distributed runtime if this is a multi-process run; returns what was used.

    Must run before anything touches a JAX backend (jax.devices(), an array). Raises
    ValueError naming the field when a coordinator is given without the process count or id.
    """
    address = _setting(cfg, "coordinator_address", ENV_COORDINATOR, "")
    num = int(_setting(cfg, "num_processes", ENV_NUM_PROCESSES, -1))
    pid = int(_setting(cfg, "process_id", ENV_PROCESS_ID, -1))
    timeout = int(cfg.get("initialization_timeout", 300)) if cfg is not None else 300
    if address:
        if num < 1 or not 0 <= pid < num:
            raise ValueError(
                f"distributed: coordinator_address={address!r} needs num_processes >= 1 and "
                f"0 <= process_id < num_processes; got num_processes={num}, process_id={pid} "
                f"(config.distributed or ${ENV_NUM_PROCESSES} / ${ENV_PROCESS_ID})")
        if num == 1:
            return {"mode": "single", "num_processes": 1, "process_id": 0}
        jax.distributed.initialize(coordinator_address=address, num_processes=num,
                                   process_id=pid, initialization_timeout=timeout)
        compile_fresh_on_cpu()
        return {"mode": "explicit", "coordinator_address": address, "num_processes": num,
                "process_id": pid}
    cluster = detected_cluster()
    if cluster is not None:
        jax.distributed.initialize(initialization_timeout=timeout)
        compile_fresh_on_cpu()
        return {"mode": cluster, "num_processes": jax.process_count(),
                "process_id": jax.process_index()}
    return {"mode": "single", "num_processes": 1, "process_id": 0}


def compile_fresh_on_cpu() -> None:
    """A multi-process run on CPU compiles its programs instead of loading them from the
    persistent compilation cache. With jaxlib 0.12.1, a program that process 0 loads from the
    cache never finishes its first collective between processes: every process waits in Gloo
    for the others (jaxlib 0.12.0.1 and 0.10.2 run the same cached programs). CPU programs
    compile in seconds, so
    the cache is off for every jaxlib rather than only for the one found broken; TPU and GPU
    runs keep it. Called once the distributed runtime is up, before anything compiles (JAX
    decides whether to use the cache at the first compile)."""
    if jax.default_backend() == "cpu" and jax.config.jax_enable_compilation_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        log.info("multi-process CPU run: the persistent compilation cache is off (a program "
                 "that process 0 loads from it can hang in its collectives)")


def is_main() -> bool:
    """True on the process that logs, writes metrics and draws plots."""
    return jax.process_index() == 0


def global_batch(local: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding
                 ) -> dict[str, jax.Array]:
    """The global batch from this process's rows (its 1/P of the batch, any P, including 1).

    Process p's rows become the rows of the global array held by p's devices. Which sequences
    those are is the data pipeline's choice: each process streams its own share of the shards,
    so the data order depends on the process count (docs/training.md, "Data").
    """
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local.items()}


def local_rows(sharding: jax.sharding.NamedSharding, global_rows: int) -> np.ndarray:
    """Indices of the global batch rows this process's devices hold, in order: what this
    process must load so that `global_batch` gives the same array as one process would."""
    idx = sharding.addressable_devices_indices_map((global_rows,))
    rows = sorted({r for sl in idx.values() for r in range(*sl[0].indices(global_rows))})
    return np.asarray(rows, np.int64)


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_allgather_int(value: int) -> list[int]:
    """`value` from every process, in process order (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    return [int(v) for v in multihost_utils.process_allgather(np.asarray(value, np.int32))]
