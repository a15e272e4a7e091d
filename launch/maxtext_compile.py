"""MaxText's train step compiled ahead of time, reported like `python -m llm_jax.compile --json`.

Runs in MaxText's own venv (MaxText is not an llm_jax dependency; see launch/compare_maxtext.py,
which runs this and llm_jax side by side):

    DECOUPLE_GCLOUD=TRUE /tmp/vmaxtext/bin/python launch/maxtext_compile.py [--hlo_out F] \\
        model_name=gpt-oss-20b compile_topology=v5p-32 ... (MaxText config overrides)

It follows maxtext/trainers/pre_train/train_compile.py's `main` (its shaped state and batch,
shardings, donation and compiler options), and prints one JSON object: memory_analysis and
cost_analysis of the compiled step, lower/compile seconds, the libtpu version.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time


def compile_maxtext(argv: list[str]) -> tuple[dict, str]:
    import jax
    from flax.core.spmd import logical_axis_rules as axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile as tc
    from maxtext.utils import max_utils, maxtext_utils, sharding

    config = pyconfig.initialize(argv)
    tc.validate_config(config)
    mesh = tc.get_topology_mesh(config)
    args, kwargs, state_shardings, _, model = tc.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings)
    in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings,
                                                               params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    fn, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, in_state, model, config, params_shardings)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
        lowered = jax.jit(fn, in_shardings=in_shard, out_shardings=out_shard,
                          static_argnums=static, donate_argnums=donate).lower(*args, **kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile(
        compiler_options=max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags))
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = (ca[0] if isinstance(ca, (list, tuple)) else ca) or {}
    b = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
         "aliased": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes,
         "code": ma.generated_code_size_in_bytes}
    b["total"] = b["arguments"] + b["outputs"] - b["aliased"] + b["temp"] + b["code"]
    result = {
        "side": "maxtext", "maxtext": importlib.metadata.version("maxtext"),
        "jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu"),
        "device_kind": mesh.devices.flat[0].device_kind, "devices": mesh.devices.size,
        "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
        "per_device_batch": config.per_device_batch_size, "seq_len": config.max_target_length,
        "layers": config.num_decoder_layers, "scan_layers": config.scan_layers,
        "remat_policy": config.remat_policy, "attention": config.attention,
        "megablox": config.megablox, "sparse_matmul": config.sparse_matmul,
        "weight_dtype": str(config.weight_dtype), "dtype": str(config.dtype),
        "lower_seconds": t1 - t0, "compile_seconds": t2 - t1, "bytes": b,
        "cost": {"flops": float(ca.get("flops", 0.0)),
                 "bytes": float(ca.get("bytes accessed", 0.0)),
                 "transcendentals": float(ca.get("transcendentals", 0.0))},
    }
    return result, compiled.as_text()


def main() -> None:
    argv = sys.argv[1:]
    hlo_out = None
    if argv and argv[0].startswith("--hlo_out="):
        hlo_out, argv = argv[0].partition("=")[2], argv[1:]
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import maxtext

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    result, hlo = compile_maxtext(["maxtext_compile", base, *argv])
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(hlo)
    print("MAXTEXT_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
