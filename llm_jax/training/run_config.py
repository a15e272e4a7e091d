"""The run config: its sections (model, execution, data, train, sft, dpo, lora, rl, mesh,
distributed, checkpoint, task) in one ml_collections ConfigDict.

`configs/*.py` return it from `get_config()`; the CLI loads it with `--config` and overrides any
field as `--config.train.num_steps=10`. The `model` section holds exactly the fields of
`ModelConfig` (what the model is) and is turned into one with `model_config(cfg)`; the `execution`
section those of `ExecutionConfig` (how it runs: `--config.execution.moe_dispatch=gmm`), turned
into one with `execution_config(cfg)`. The model's `expert_format` is None unless a config asks
for one: the checkpoint's format when fine-tuning (`train.init_from`: a gpt-oss MXFP4 checkpoint
stays packed, and LoRA over it is QLoRA), else "dense".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from llm_jax.config import ModelConfig, field_doc
from llm_jax.data.config import ON_BAD_FILE, ON_BAD_LINE
from llm_jax.data.sft import DEFAULT_LOSS_CHANNELS, loss_channels
from llm_jax.data.tasks import TaskConfig
from llm_jax.execution import ExecutionConfig
from llm_jax.training.policy_loss import AGGREGATIONS, RATIOS, PolicyLossConfig
from llm_jax.training.preference import LOSSES, PreferenceConfig


def default_run_config(name: str, model: ModelConfig,
                       execution: ExecutionConfig = ExecutionConfig()) -> ml_collections.ConfigDict:
    """Defaults shared by every config file; a config changes what differs."""
    cfg = ml_collections.ConfigDict()
    cfg.name = name
    cfg.seed = 0
    cfg.model = _model(model)
    cfg.execution = ml_collections.ConfigDict(execution.to_dict())
    for section, fields in _SECTIONS.items():
        cfg[section] = ml_collections.ConfigDict({k: v for k, (v, _) in fields.items()})
    # A verifiable task (data/tasks.py): the prompts and reference answers RL is rewarded on;
    # with no sft.files / sft.tfds_name, SFT trains on its reference replies (RL's warm-up).
    cfg.task = ml_collections.ConfigDict(TaskConfig().to_dict())
    return cfg


def field_docs() -> dict[str, str]:
    """What each field of the run config controls, by its dotted name (`data.seq_len`): the
    tables below, and the doc metadata of the dataclasses behind `model`, `execution` and
    `task` (what describe prints)."""
    docs = {"name": "name of the run (logs, checkpoints; runs/NAME by default)",
            "seed": "seed of the parameter initialisation"}
    for section, cls in (("model", ModelConfig), ("execution", ExecutionConfig),
                         ("task", TaskConfig)):
        docs.update({f"{section}.{f.name}": field_doc(cls, f.name)
                     for f in dataclasses.fields(cls)})
    for section, fields in _SECTIONS.items():
        docs.update({f"{section}.{k}": doc for k, (_, doc) in fields.items()})
    return docs


def _model(model: ModelConfig) -> ml_collections.ConfigDict:
    d = model.to_dict()
    if model.expert_format == "dense":  # the default: None = the checkpoint's, else dense
        d["expert_format"] = ml_collections.config_dict.placeholder(str)
    return ml_collections.ConfigDict(d)


# Each section: field -> (default, what it controls). The doc is describe's line for the field.
_DATA = {
    "tfds_name": ("", "TFDS text dataset by name, e.g. 'lm1b' (needs internet); '' = local text "
                      "files or array_record_train"),
    "text_key": ("text", "feature holding the text in a TFDS dataset"),
    "tfds_train_split": ("train", "TFDS split to train on"),
    "tfds_eval_split": ("", "TFDS split to evaluate on ('' = validation if it exists, else test)"),
    "files": ("", "glob of local text files ('' = the Python standard library's .py files)"),
    "array_record_train": ("", "glob of ArrayRecord shards of UTF-8 documents (one a record)"),
    "array_record_eval": ("", "the evaluation shards (needed with array_record_train)"),
    "data_dir": ("", "where TFDS datasets are built ('' = WORKDIR/tfds)"),
    "validation_fraction": (0.02, "local text: share of files held out (by path hash)"),
    "document_bytes": (1 << 20, "local text: longer files are cut into documents near this size "
                                "(0 = one per file)"),
    "on_bad_file": ("skip", "local text: skip (named in a warning) or stop at an empty, "
                            "unreadable or non-UTF-8 file"),
    "seq_len": (256, "training sequence length T: attention cost and activations grow with it"),
    "shuffle_seed": (0, "seed of the data order"),
    "shuffle_buffer_tokens": (1 << 20, "packed rows shuffled together, in tokens (0 = off)"),
    "worker_count": (0, "Grain worker processes (0 = load in the main process)"),
    "prefetch": (2, "batches read ahead by a background thread (0 = none)"),
    "tokenizer_train_bytes": (20_000_000, "text used to train the BPE tokenizer"),
}

_TRAIN = {
    "num_steps": (1000, "optimizer steps"),
    "batch_size": (8, "global batch in sequences of seq_len tokens (dpo: in pairs; rl: unread)"),
    "grad_accum_steps": (1, "micro-batches per step: the same batch, 1/n the activations"),
    "learning_rate": (3e-3, "peak learning rate"),
    "warmup_steps": (100, "linear warm-up steps"),
    "min_lr_ratio": (0.1, "cosine decay ends at learning_rate x this"),
    "weight_decay": (0.1, "AdamW weight decay"),
    "b1": (0.9, "Adam first-moment decay"),
    "b2": (0.95, "Adam second-moment decay"),
    "grad_clip_norm": (1.0, "global gradient-norm clip"),
    "load_balancing_loss_weight": (0.01, "weight of the Switch load-balancing loss"),
    "router_z_loss_weight": (1e-3, "weight of the ST-MoE router z-loss"),
    "log_every_steps": (10, "steps between log lines"),
    "eval_every_steps": (200, "steps between evaluations"),
    "eval_batches": (8, "batches per evaluation"),
    "num_samples": (3, "samples generated and logged at the end of the run"),
    "peak_flops": (0.0, "MFU denominator in FLOP/s (0 = the machine's matmul peak, cached; "
                       "measured at start-up if none is)"),
    # A step whose loss or gradient norm is not finite stops the run, naming the step and the
    # last good checkpoint, unless this is set (docs/reliability.md).
    "skip_nonfinite_updates": (False, "skip a non-finite step's update (params and moments "
                                      "kept, counted as skipped_updates) instead of stopping"),
    "inject_nan_at_step": (-1, "fault injection (training/faults.py): a NaN loss at this step"),
    # A resumed run restores its own checkpoint instead (docs/finetuning.md).
    "init_from": ("", "fine-tuning: the params and model config of any directory "
                      "load_pretrained reads (HF, OpenAI original/, llm_jax, a workdir)"),
}

# A fine-tuning run's tokenizer; a run's first start copies it into WORKDIR/tokenizer/ and a
# resumed run reads the copy.
_TOKENIZER = ("", "directory with tokenizer.json and a chat template ('' = train.init_from)")

# Used when files or tfds_name (or task.name) is set, else `data` is (data/sft.py).
_SFT = {
    "files": ("", "SFT: glob of JSONL files of {messages} or {prompt, completion}"),
    "tfds_name": ("", "SFT: or a TFDS dataset with such features"),
    "tfds_split": ("train", "the TFDS split"),
    "data_dir": ("", "TFDS data_dir ('' = TFDS's default)"),
    "tokenizer": _TOKENIZER,
    "on_bad_line": ("skip", "skip (counted, logged by file:line) or stop at a bad line"),
    "validation_fraction": (0.05, "conversations held out (by hash) for val_loss (0 = none)"),
    # Reasoning in the data is there to be learned: without it the answers are trained after
    # reasoning the model never learns to write (docs/finetuning.md).
    "loss_channels": (DEFAULT_LOSS_CHANNELS, "harmony channels of the assistant's messages in "
                      "the loss, comma-separated: analysis, commentary, final"),
}

# Preference optimisation (training/preference.py, docs/posttraining.md); used when files is set.
_DPO = {
    "files": ("", "preference pairs: glob of JSONL files of {prompt, chosen, rejected}"),
    "tokenizer": _TOKENIZER,
    "loss": ("dpo", "dpo (against a reference policy) or simpo (reference-free)"),
    "beta": (0.1, "DPO: the KL penalty's weight (and the reward's scale); SimPO: reward scale"),
    "label_smoothing": (0.0, "DPO: the chance a pair's label is wrong (conservative DPO)"),
    "gamma": (0.5, "SimPO: the target reward margin"),
    "validation_fraction": (0.1, "prompts held out (by hash) for the held-out accuracy"),
    "on_bad_line": ("skip", "skip (counted, logged by file:line) or stop at a bad line"),
}

_LORA = {  # model/lora.py
    "rank": (0, "LoRA rank (0 = full fine-tuning)"),
    "alpha": (16.0, "LoRA scale: an adapted projection reads w + (alpha / rank) A B"),
    "targets": ("q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj",
                "the projections that get adapters, comma-separated"),
}

# RL with verifiable rewards (training/rl_loop.py, docs/posttraining.md): with `rewards` set a
# run samples completions of the task's prompts and trains on their rewards. train.num_steps,
# warmup_steps, log_every_steps and checkpoint.every_steps count RL steps (one rollout batch
# each); the batch is prompts_per_step x group_size completions (train.batch_size is unread).
_LOSS = PolicyLossConfig()


def _loss_field(name: str) -> tuple[Any, str]:  # a policy-loss field, as PolicyLossConfig has it
    return getattr(_LOSS, name), field_doc(PolicyLossConfig, name)


_RL = {
    "rewards": ("", "RL: 'name:weight,...' from training.rewards.REWARDS ('' = no RL)"),
    "pass_threshold": (1.0, "a completion passes when its weighted reward is at least this"),
    "group_size": (8, "completions per prompt; each one's advantage is against its group's"),
    "prompts_per_step": (8, "prompts a step, in order from the task's train split"),
    "max_prompt_tokens": (256, "a longer rendered prompt is refused, naming its example"),
    "max_new_tokens": (128, "tokens sampled per completion at most"),
    "temperature": (1.0, "sampling temperature, and the trainer's log-probs' (logits / it)"),
    "top_p": (1.0, "nucleus sampling's mass (1 = off)"),
    "updates_per_rollout": (1, "optimizer steps on each rollout batch"),
    "aggregation": _loss_field("aggregation"),
    "ratio": _loss_field("ratio"),
    "epsilon_low": _loss_field("epsilon_low"),
    "epsilon_high": _loss_field("epsilon_high"),
    "beta": (_LOSS.beta, field_doc(PolicyLossConfig, "beta") + "; LoRA's reference is the "
             "adapters off, else the initial params"),
    "importance_cap": (0.0, "truncated importance sampling's cap (>= 1; 0 = off)"),
    "scale_by_std": _loss_field("scale_by_std"),
    "dynamic_sampling": (False, "drop groups whose rewards are all equal (counted either way)"),
    "replay": (True, "replay the rollout's MoE routing in the trainer's forwards"),
    "allow_dropping_dispatch": (False, "permit a capacity or expert_parallel MoE dispatch"),
    "eval_every_steps": (10, "steps between greedy pass-rate evaluations on the task's eval "
                             "split (0 = start and end only)"),
    "eval_examples": (64, "eval-split examples each evaluation decodes"),
    "engine_slots": (0, "sequences the rollout engine decodes together (0 = the whole batch)"),
    "engine_max_prefill": (8, "prompts prefilled in one call"),
    "tokenizer": _TOKENIZER,
}

# Sizes within a slice or node; dcn_* multiply them across TPU slices or GPU nodes (the
# data-center network). docs/scaling.md says how to choose.
_MESH = {
    "data": (-1, "devices the batch is split over (-1 = the devices the other axes leave)"),
    "fsdp": (1, "devices the batch and the params' embed dimension (so their gradients and "
                "Adam moments) are split over"),
    "tensor": (1, "devices the heads, the MLP's hidden units and the vocabulary are split over"),
    "expert": (1, "devices the experts are split over (the batch and embed dimension too)"),
    "dcn_data": (1, "data's multiple across slices or nodes"),
    "dcn_fsdp": (1, "fsdp's multiple across slices or nodes"),
    "dcn_tensor": (1, "tensor's multiple across slices or nodes"),
    "dcn_expert": (1, "expert's multiple across slices or nodes"),
}

# Multi-process runs (parallel/distributed.py): '' and -1 read the environment
# (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; or TPU VM / SLURM detection).
_DISTRIBUTED = {
    "coordinator_address": ("", "host:port of process 0 ('' = from the environment)"),
    "num_processes": (-1, "processes in the run (-1 = from the environment, else 1)"),
    "process_id": (-1, "this process's index (-1 = from the environment)"),
    "initialization_timeout": (300, "seconds to wait for every process to join"),
}

_CHECKPOINT = {
    "every_steps": (250, "steps between checkpoints"),
    "max_to_keep": (3, "checkpoints kept on disk"),
    "async_save": (True, "write checkpoints in the background"),
    # About 0.4 GB/s per core here: off for checkpoints too big to hash.
    "checksums": (True, "sha256 of every file of a save, hashed in the background and checked "
                        "before a restore"),
    # A refused start keeps what was saved from being trained over from step 0.
    "allow_fresh_start": (False, "start from scratch in a workdir whose steps were all moved to "
                                 "corrupt_checkpoints/ (they stay there)"),
    "inject_kill_during_save_at_step": (-1, "fault injection: kill -9 mid-save at this step"),
}

_SECTIONS = {"data": _DATA, "train": _TRAIN, "sft": _SFT, "dpo": _DPO, "lora": _LORA,
             "rl": _RL, "mesh": _MESH, "distributed": _DISTRIBUTED, "checkpoint": _CHECKPOINT}


_CHOICES = {  # (section, field): the values allowed
    ("sft", "on_bad_line"): ON_BAD_LINE,
    ("dpo", "on_bad_line"): ON_BAD_LINE,
    ("dpo", "loss"): LOSSES,
    ("data", "on_bad_file"): ON_BAD_FILE,
    ("rl", "aggregation"): AGGREGATIONS,
    ("rl", "ratio"): RATIOS,
}

_MIN = {  # (section, field): smallest allowed value
    ("train", "num_steps"): 0, ("train", "batch_size"): 1, ("train", "grad_accum_steps"): 1,
    ("train", "warmup_steps"): 0, ("train", "log_every_steps"): 1, ("train", "eval_every_steps"): 0,
    ("train", "eval_batches"): 1, ("train", "num_samples"): 0, ("train", "peak_flops"): 0,
    ("train", "inject_nan_at_step"): -1, ("train", "grad_clip_norm"): 0,
    ("train", "weight_decay"): 0, ("train", "min_lr_ratio"): 0,
    ("checkpoint", "every_steps"): 1, ("checkpoint", "max_to_keep"): 1,
    ("checkpoint", "inject_kill_during_save_at_step"): -1, ("lora", "rank"): 0,
    ("rl", "group_size"): 2, ("rl", "prompts_per_step"): 1, ("rl", "max_prompt_tokens"): 1,
    ("rl", "max_new_tokens"): 1, ("rl", "updates_per_rollout"): 1, ("rl", "epsilon_low"): 0,
    ("rl", "epsilon_high"): 0, ("rl", "beta"): 0, ("rl", "importance_cap"): 0,
    ("rl", "eval_every_steps"): 0, ("rl", "eval_examples"): 0, ("rl", "engine_slots"): 0,
    ("rl", "engine_max_prefill"): 1,
}


def _type_ok(value, default) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(default)) and not (isinstance(value, bool)
                                                    and not isinstance(default, bool))


def validate_run_config(cfg: ml_collections.ConfigDict) -> None:
    """Refuses unknown sections or fields, wrong types and out-of-range or conflicting values,
    naming the field; `execution` is also checked by ExecutionConfig here. `model` is left to
    ModelConfig (`model_config`), and `data` is checked again by DataConfig where pre-training
    data is opened."""
    reference = default_run_config(str(cfg.get("name", "")), ModelConfig())
    unknown = sorted(set(cfg.keys()) - set(reference.keys()))
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; known: {sorted(reference.keys())}")
    moved = sorted(set(cfg.get("model", {}).keys()) & set(reference.execution.keys()))
    if moved:
        raise ValueError(f"config field model.{moved[0]} is an execution setting, not part of the "
                         f"model: set config.execution.{moved[0]} instead")
    for section, defaults in reference.items():
        if section == "model" or not isinstance(defaults, ml_collections.ConfigDict):
            continue
        if section not in cfg:
            raise ValueError(f"config has no {section!r} section")
        given = cfg[section]
        unknown = sorted(set(given.keys()) - set(defaults.keys()))
        if unknown:
            raise ValueError(f"unknown config field(s) {[f'{section}.{k}' for k in unknown]}; "
                             f"known in {section}: {sorted(defaults.keys())}")
        for key, default in defaults.items():
            if key in given and not _type_ok(given[key], default):
                raise ValueError(f"config field {section}.{key}={given[key]!r} has type "
                                 f"{type(given[key]).__name__}: expected "
                                 f"{type(default).__name__} (default {default!r})")
    for (section, key), low in _MIN.items():
        if cfg[section][key] < low:
            raise ValueError(f"config field {section}.{key}={cfg[section][key]!r} is invalid: "
                             f"expected >= {low}")
    for (section, key), allowed in _CHOICES.items():
        if cfg[section][key] not in allowed:
            raise ValueError(f"config field {section}.{key}={cfg[section][key]!r} is invalid: "
                             f"expected one of {list(allowed)}")
    loss_channels(cfg.sft.get("loss_channels", DEFAULT_LOSS_CHANNELS))
    TaskConfig.from_section(cfg.task)
    _validate_dpo(cfg)
    tc = cfg.train
    if not tc.learning_rate > 0 or tc.learning_rate == float("inf"):
        raise ValueError(f"config field train.learning_rate={tc.learning_rate!r} is invalid: "
                         "expected a finite number > 0")
    if tc.batch_size % tc.grad_accum_steps and not cfg.rl.rewards:  # RL's: checked below
        raise ValueError(f"train.batch_size={tc.batch_size} and train.grad_accum_steps="
                         f"{tc.grad_accum_steps} conflict: the batch must split into equal "
                         "microbatches")
    execution_config(cfg)
    if cfg.rl.rewards:
        rl_loss_config(cfg.rl)
        for section, key in (("sft", "files"), ("sft", "tfds_name"), ("dpo", "files")):
            if cfg[section][key]:
                raise ValueError(f"config fields rl.rewards={cfg.rl.rewards!r} and {section}."
                                 f"{key}={cfg[section][key]!r} conflict: an RL run trains on its "
                                 "task's prompts and their rewards, not on SFT conversations or "
                                 "preference pairs")
        rows = cfg.rl.prompts_per_step * cfg.rl.group_size
        if rows % tc.grad_accum_steps:
            raise ValueError(f"rl.prompts_per_step={cfg.rl.prompts_per_step} x rl.group_size="
                             f"{cfg.rl.group_size} = {rows} rows and train.grad_accum_steps="
                             f"{tc.grad_accum_steps} conflict: the RL batch must split into "
                             "equal microbatches")


def rl_enabled(cfg: ml_collections.ConfigDict) -> bool:
    """Whether the run is RL (`rl.rewards` set) rather than language-model training."""
    return bool(cfg.rl.rewards)


def tokenizer_source(cfg: ml_collections.ConfigDict | dict) -> tuple[str, str]:
    """(the directory a fine-tuning run's tokenizer comes from, the field that names it): the
    `tokenizer` of the run's section (rl with rl.rewards set, dpo with dpo.files, else sft),
    else train.init_from. Also reads a saved run config (a dict; older ones lack sections)."""
    section = ("rl" if cfg.get("rl", {}).get("rewards") else
               "dpo" if cfg.get("dpo", {}).get("files") else "sft")
    if own := cfg.get(section, {}).get("tokenizer"):
        return own, f"{section}.tokenizer"
    return cfg["train"].get("init_from") or "", "train.init_from"


def rl_loss_config(rl: ml_collections.ConfigDict) -> PolicyLossConfig:
    """The `rl` section's loss fields as a PolicyLossConfig, a bad value named as rl.<field>."""
    if not 0 < rl.temperature < float("inf"):
        raise ValueError(f"config field rl.temperature={rl.temperature!r} is invalid: expected "
                         "a finite number > 0 (RL samples; the trainer divides logits by it)")
    if not 0 < rl.top_p <= 1:
        raise ValueError(f"config field rl.top_p={rl.top_p!r} is invalid: expected a number "
                         "in (0, 1]")
    if rl.importance_cap and not rl.importance_cap >= 1:
        raise ValueError(f"config field rl.importance_cap={rl.importance_cap!r} is invalid: "
                         "expected 0 (off) or >= 1")
    fields = {k: rl[k] for k in ("aggregation", "ratio", "epsilon_low", "epsilon_high", "beta",
                                 "scale_by_std")}
    try:
        return PolicyLossConfig(**fields, importance_cap=rl.importance_cap or None,
                                max_tokens=rl.max_new_tokens)
    except ValueError as e:
        raise ValueError(f"config field rl.{e}") from e


def _validate_dpo(cfg: ml_collections.ConfigDict) -> None:
    PreferenceConfig.from_section(cfg.dpo)
    if not 0.0 <= cfg.dpo.validation_fraction < 1.0:
        raise ValueError(f"config field dpo.validation_fraction={cfg.dpo.validation_fraction!r}"
                         " is invalid: expected a fraction in [0, 1)")
    if cfg.dpo.files and (cfg.sft.files or cfg.sft.tfds_name):
        raise ValueError(f"config fields dpo.files={cfg.dpo.files!r} and sft.files / "
                         "sft.tfds_name conflict: a run trains on preference pairs or on SFT "
                         "conversations, not both")
    if cfg.dpo.files and cfg.task.name:
        raise ValueError(f"config fields dpo.files={cfg.dpo.files!r} and task.name="
                         f"{cfg.task.name!r} conflict: a run trains on preference pairs or on a "
                         "task, not both")


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The `model` section as a validated ModelConfig (unknown fields are refused by name); an
    unset expert_format (no checkpoint to take it from) is dense."""
    d = cfg.model.to_dict()
    if d.get("expert_format", "") is None:
        del d["expert_format"]
    return ModelConfig.from_dict(d)


def execution_config(cfg: ml_collections.ConfigDict) -> ExecutionConfig:
    """The `execution` section as a validated ExecutionConfig."""
    return ExecutionConfig.from_dict(cfg.execution.to_dict())
