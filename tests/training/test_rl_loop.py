"""The RL loop (training/rl_loop.py) through `loop.train`: a tiny model from scratch with LoRA
adapters and a KL term to its base, on the arithmetic task, rewarded by a stand-in reward that
varies between completions (a random model never answers, so the task's own rewards would give
every group the same zero). Checked: the run logs its metrics and plots its rewards, trains the
adapters and leaves the base; a run stopped by SIGTERM and resumed ends with the same metrics and
bitwise the same params as an uninterrupted one (the same programs on the same inputs: XLA:CPU
is deterministic); a changed task or rewards on resume, a failing reward, a prompt too long and
a dropping MoE dispatch are refused by name, nothing saved lost; groups whose rewards are all
equal are counted, and under dynamic sampling (here with full fine-tuning) skip the update."""

import importlib.util
import math
import os
import shutil
import signal

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, SMALL_MODEL, read_records

from llm_jax.data.tasks import make_task, write_task_tokenizer
from llm_jax.model import Transformer
from llm_jax.model.lora import LoRAParam
from llm_jax.training import rewards
from llm_jax.training.finetune import restore_finetuned
from llm_jax.training.loop import train
from llm_jax.training.preemption import Interrupted
from llm_jax.training.run_config import default_run_config, rl_enabled, validate_run_config

NUM_STEPS = 2
# Metrics that time the run rather than compute it: they differ between any two runs.
TIMINGS = ("rollout_tokens_per_sec", "rollout_time", "update_to_first_token", "step_time",
           "rollout_share")


class StandIn:
    """A reward that varies between completions: whether the reply's text has an even number
    of characters. `stop_after`: after that many calls, send this process SIGTERM (a
    preemption in mid-run); `fail`: return NaN."""

    def __init__(self):
        self.calls, self.stop_after, self.fail = 0, None, False

    def __call__(self, example, reply) -> float:
        self.calls += 1
        if self.calls == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return math.nan if self.fail else float(len(reply.text) % 2 == 0)


@pytest.fixture
def even(monkeypatch):
    fn = StandIn()
    monkeypatch.setitem(rewards.REWARDS, "even", fn)
    return fn


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("task_tokenizer")
    write_task_tokenizer(make_task(rl_config("").task), d, SMALL_MODEL.vocab_size)
    return str(d)


def rl_config(tokenizer: str, lora: bool = True, **rl):
    """LoRA adapters on q and v, with a KL term to the base (the adapters zeroed)."""
    cfg = default_run_config("rl", SMALL_MODEL)
    if lora:
        cfg.lora.update(rank=4, targets="q_proj,v_proj")
    cfg.task.update(name="arithmetic", eval_size=4, max_operand=9)
    cfg.rl.update({**dict(rewards="even:1,format:0.5", tokenizer=tokenizer, group_size=4,
                          prompts_per_step=2, max_prompt_tokens=80, max_new_tokens=8,
                          eval_examples=2, eval_every_steps=2, updates_per_rollout=2,
                          beta=0.1), **rl})
    cfg.train.update(num_steps=NUM_STEPS, log_every_steps=1, warmup_steps=1, learning_rate=1e-2)
    cfg.checkpoint.update(every_steps=1, async_save=False, max_to_keep=10)
    return cfg


def computed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tokenizer_dir):
    """One uninterrupted run, shared: (workdir, its records, its final params)."""
    d = tmp_path_factory.mktemp("rl_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rewards.REWARDS, "even", StandIn())
        train(rl_config(tokenizer_dir), str(d))
    return d, read_records(d), final_params(d)


@pytest.mark.slow
def test_an_rl_run_logs_rewards_and_updates_its_params(uninterrupted, tokenizer_dir):
    d, records, params = uninterrupted
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the evaluation before RL
    assert "eval_pass_rate" in records[0] and "eval_pass_rate" in records[2]
    last = records[-1]
    for key in ("reward_mean", "reward_std", "reward_even", "reward_format", "pass_rate",
                "entropy", "response_length", "clip_fraction", "sampler_logp_gap",
                "informative_groups", "rollout_tokens_per_sec", "rollout_share",
                "update_to_first_token", "grad_norm", "loss"):
        assert np.isfinite(last[key]), key
    assert sum(r["informative_groups"] for r in records[1:]) > 0  # the stand-in varies
    assert 0 < last["entropy"] and 0 < last["rollout_share"] < 1
    # On a batch's first update the ratio is exactly 1 (the trainer's own old log-probs);
    # the second one's ratios move, and the trainer matches the sampler closely (float32).
    assert last["sampler_logp_gap"] < 1e-4
    assert (d / "rewards.png").stat().st_size > 0
    # The adapters moved, the policy with them away from the reference; the base is frozen.
    assert last["kl"] > 0
    model, _ = restore_finetuned(str(d))
    adapters, base = nnx.state(model, nnx.Param).split(LoRAParam, ...)
    assert all(np.abs(np.asarray(b)).max() > 0 for path, b in adapters.flat_state()
               if path[-1].endswith("lora_b"))  # LoRA's B starts at 0
    for a, b in zip(jax.tree.leaves(base), initial_params()):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-6)


def final_params(workdir) -> list[np.ndarray]:
    """The params (adapters included) of the workdir's newest checkpoint."""
    model, _ = restore_finetuned(str(workdir))
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def initial_params() -> list[np.ndarray]:
    """The params a run from scratch starts from (the seed's initialisation); computed outside
    jit, they round differently from the run's (1 ulp), where an update moves weights by about
    the learning rate (1e-2)."""
    model = Transformer(SMALL_MODEL, rngs=nnx.Rngs(params=0))
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_a_run_stopped_and_resumed_ends_as_the_uninterrupted_one(uninterrupted, tokenizer_dir,
                                                                  tmp_path, even):
    _, records, params = uninterrupted
    # Scored in order: the step-0 evaluation's 2 completions, then 2 prompts x 4 a step: the
    # 4th call is inside step 1, which finishes and saves before the run stops.
    even.stop_after = 2 + 2
    with pytest.raises(Interrupted, match="after RL step 1"):
        train(rl_config(tokenizer_dir), str(tmp_path))
    even.stop_after = None
    train(rl_config(tokenizer_dir), str(tmp_path))
    assert computed(read_records(tmp_path)) == computed(records)
    for a, b in zip(final_params(tmp_path), params):
        np.testing.assert_array_equal(a, b)


def test_resuming_with_another_task_or_rewards_is_refused_by_name(uninterrupted, tokenizer_dir,
                                                                   even):
    d, _, _ = uninterrupted
    cfg = rl_config(tokenizer_dir)
    cfg.task.seed = 1
    with pytest.raises(ValueError, match="task seed: saved 0 vs requested 1"):
        train(cfg, str(d))
    with pytest.raises(ValueError, match="rl.rewards: saved"):
        train(rl_config(tokenizer_dir, rewards="even:1"), str(d))


def test_a_failing_reward_stops_the_run_by_name_and_keeps_the_checkpoints(
        uninterrupted, tokenizer_dir, tmp_path, even):
    d, _, params = uninterrupted
    work = tmp_path / "w"
    shutil.copytree(d, work)
    before = sorted(os.listdir(work / "checkpoints"))
    even.fail = True
    cfg = rl_config(tokenizer_dir)
    cfg.train.num_steps = NUM_STEPS + 1
    with pytest.raises(rewards.RewardError, match="reward 'even' returned nan on example "
                                                  "'arithmetic:train:4'"):
        train(cfg, str(work))
    assert sorted(os.listdir(work / "checkpoints")) == before
    for a, b in zip(final_params(work), params):
        np.testing.assert_array_equal(a, b)


def test_bad_settings_are_refused_by_name(tokenizer_dir, tmp_path, even):
    with pytest.raises(ValueError, match=r"eval example 'arithmetic:eval:0': its rendered "
                                         r"prompt has \d+ tokens, more than "
                                         r"rl.max_prompt_tokens=16"):
        train(rl_config(tokenizer_dir, max_prompt_tokens=16), str(tmp_path / "a"))
    cfg = rl_config(tokenizer_dir)
    cfg.execution.moe_dispatch = "capacity"
    with pytest.raises(ValueError, match="execution.moe_dispatch='capacity' drops tokens"):
        train(cfg, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="rl.epsilon_low"):
        train(rl_config(tokenizer_dir, epsilon_low=1.0), str(tmp_path / "c"))
    with pytest.raises(ValueError, match="rl.group_size=1 is invalid"):
        train(rl_config(tokenizer_dir, group_size=1), str(tmp_path / "d"))
    cfg = rl_config(tokenizer_dir)
    cfg.train.grad_accum_steps = 3
    with pytest.raises(ValueError, match="= 8 rows and train.grad_accum_steps=3 conflict"):
        train(cfg, str(tmp_path / "e"))


def test_all_equal_groups_are_counted_and_dynamic_sampling_skips_their_update(
        tokenizer_dir, tmp_path):
    # A random model never closes a final message: "format" is 0 for every completion.
    cfg = rl_config(tokenizer_dir, lora=False, rewards="format:1", dynamic_sampling=True,
                    eval_examples=0)
    cfg.train.num_steps = 1
    train(cfg, str(tmp_path))
    (record,) = read_records(tmp_path)
    assert record["uninformative_groups"] == 2 and record["informative_groups"] == 0
    assert record["skipped_updates"] == 1 and "loss" not in record
    for a, b in zip(final_params(tmp_path), initial_params()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def load_config(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_the_readme_rl_configs_validate_and_share_their_task():
    sft, grpo = load_config("sft_task_tiny"), load_config("grpo_tiny")
    for cfg in (sft, grpo):
        validate_run_config(cfg)
    assert not rl_enabled(sft) and rl_enabled(grpo)
    assert make_task(sft.task).identity() == make_task(grpo.task).identity()
    assert grpo.train.init_from == f"runs/{sft.name}"  # the SFT run's default workdir
