"""Benchmarks: every subcommand's --quick run writes the JSON it promises (blockwise attention's
own tests are in tests/model/test_blockwise_attention.py)."""

import json
import sys

import numpy as np
import pytest

from llm_jax.bench.__main__ import main

# ------------------------------------------------------------------ the CLI, --quick

EXPECTED = {
    "peak": lambda r: r["flops"]["float32"]["peak"] == max(r["flops"]["float32"]["xla"],
                                                           r["flops"]["float32"]["blas"])
    and r["flops"]["bfloat16"]["peak"] == r["flops"]["bfloat16"]["xla"] > 0,
    "attention": lambda r: all(row["direct"]["time_s"] > 0 and row["blockwise"]["temp_bytes"] > 0
                               and row["max_abs_grad_diff"] < 1e-4 for row in r["rows"])
    and all([row["window"] for row in r[part]] == [128, 0] and row["current"]["time_s"] > 0
            for part in ("layers", "model") for row in r[part]),
    "moe": lambda r: {row["num_experts"] for row in r["rows"]} == {4, 8}
    and all(row[p]["time_s"] > 0 for row in r["rows"] for p in ("dense", "ragged", "capacity"))
    and set(r["growth"]) >= {"dense", "ragged", "capacity"},
    "norm": lambda r: r["rms"]["step_s"] > 0 and r["layer"]["step_s"] > 0
    and r["layer_over_rms"] > 0,
    "malloc": lambda r: {"system", "glibc"} <= {row["name"] for row in r["rows"]}
    and all(row["step_s"] > 0 and row["minor_faults_per_step"] >= 0 for row in r["rows"])
    and next(row for row in r["rows"] if row["name"] == "glibc")["malloc"] == "glibc (tuned)",
    "train": lambda r: set(r["peak_source"]) == set(r["peak_flops"])
    and all(row["llm_jax"]["tokens_per_s"] > 0 and 0 < row["llm_jax"]["mfu"]
                           and row["transformers"]["tokens_per_s"] > 0 and row["speedup"] > 0
                           and np.isfinite(row["llm_jax"]["last_loss"]) for row in r["rows"]),
    "decode": lambda r: all(row["llm_jax"]["decode_tokens_per_s"] > 0
                            and row["llm_jax mxfp4"]["decode_tokens_per_s"] > 0
                            and row["mxfp4_decode_ratio"] > 0 for row in r["decode"]),
    "prefill": lambda r: all(row["prefill_s"] > 0 and row["peak_rss_bytes"] > 2**20
                             for row in r["rows"]),
    "finetune": lambda r: [row["mode"] for row in r["rows"]] == ["full", "lora"]
    and all(row["tokens_per_sec"] > 0 for row in r["rows"])
    and r["rows"][1]["optimizer_state_bytes"] < r["rows"][0]["optimizer_state_bytes"],
    "stacks": lambda r: [s["python"] for s in r["stacks"]] == [sys.executable]
    and all("jax " in s["versions"] and s["step_s"] > 0 and s["decode_tokens_per_s"] > 0
            for s in r["stacks"]),
    "serve": lambda r: r["server"]["tokens_per_s"] > 0 and r["sample"]["tokens_per_s"] > 0
    and r["latency"]["alone_s"] > 0 and r["latency"]["busy_s"] > 0
    and len(r["prompt_lengths"]) == r["requests"] and r["server_runs"][0]["tokens"] == r[
        "requests"] * r["new_tokens"],
    "serve_harmony": lambda r: r["parsed_tokens_per_s"] > 0 and r["raw_tokens_per_s"] > 0
    and len(r["runs_tokens_per_s"]["parsed"]) == r["repeats"],
    "mxfp4": lambda r: r["llm_jax"]["load"]["expert_format"] == "mxfp4"
    and r["llm_jax"]["prefill"]["finite"] and r["llm_jax"]["qlora"]["step_s"] > 0
    and np.isfinite(r["llm_jax"]["qlora"]["loss"])
    and all(r["llm_jax"][f"decode_b{b}"]["tokens_per_s"] > 0 for b in (1, 4))
    and all(r["llm_jax"][p]["peak_rss_bytes"] >= 0 for p in ("load", "prefill", "qlora"))
    and r["llm_jax"]["load"]["param_bytes"] == r["param_bytes_predicted"],
    # Replayed, the trainer's experts are the rollout's own, wherever the gap came from.
    "rl": lambda r: r["replay"]["with_replay"]["topk_mismatch"] == 0
    and all(np.isfinite(r["replay"][c]["logp_gap"]) for c in ("with_replay", "without_replay"))
    and r["replay"]["completion_tokens"] == r["prompts"] * r["group"] * r["new_tokens"]
    and r["speed"]["rollout"]["tokens_per_s"] > 0 and r["speed"]["engine"]["tokens_per_s"] > 0
    and len(r["rl_steps"]["steps"]) == 2 and r["rl_steps"]["handover_s"] > 0
    and 0 < r["rl_steps"]["handover_share"] < 1,
}
# malloc: the two contenders the checks name (each is a process); the preloaded ones' environment
# is checked below without one, and a preload's effect in a child in tests/runtime/test_malloc.py.
EXTRA_ARGS = {"train": ["--dtypes", "float32"], "decode": ["--no_hf", "--mxfp4"],
              "malloc": ["--mallocs", "system,glibc"]}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(EXPECTED))
def test_bench_quick_writes_json_with_expected_keys(command, tmp_path, capsys):
    out = tmp_path / f"{command}.json"
    assert main([command, "--quick", "--json_out", str(out), *EXTRA_ARGS.get(command, [])]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == command
    assert {"date", "cpu_model", "cpu_count", "python", "jax", "load_average", "malloc"} <= set(
        r["machine"])
    assert EXPECTED[command](r), r
    assert "|" in capsys.readouterr().out  # printed its table


def test_isolated_contender_runs_in_its_own_process_and_reports_a_failed_start():
    import functools
    import os

    from llm_jax.bench.common import Isolated

    with Isolated(functools.partial(functools.partial, os.getpid)) as worker:
        worker()  # builds os.getpid in the child and calls it there
        assert worker.loss is None
    with pytest.raises(RuntimeError, match="failed to start"):
        Isolated(functools.partial(int, "not a number"))


def test_malloc_contenders_environments_name_the_malloc_each_child_gets():
    from llm_jax.bench.malloc import child_env
    from llm_jax.runtime import malloc

    base = {"PATH": "/bin", "LD_PRELOAD": "/lib/other.so", malloc.ENV: "auto"}
    assert child_env("system", base) == {"PATH": "/bin", malloc.ENV: "system"}
    assert child_env("glibc", base) == {"PATH": "/bin"}  # the child tunes glibc itself
    for name, path in (("mimalloc", malloc.find_mimalloc()), ("tcmalloc", malloc.find_tcmalloc())):
        env = child_env(name, base)
        if path is None:
            assert env is None, name  # not installed here: no contender
        else:
            assert env["LD_PRELOAD"] == path and env[malloc.ENV] == path, (name, env)
