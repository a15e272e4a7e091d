"""The run config: model, execution, data, train and checkpoint sections in one ml_collections
ConfigDict.

`configs/*.py` return it from `get_config()`; the CLI loads it with `--config` and overrides any
field as `--config.train.num_steps=10`. The `model` section holds exactly the fields of
`ModelConfig` (what the model is) and is turned into one with `model_config(cfg)`; the `execution`
section those of `ExecutionConfig` (how it runs: `--config.execution.moe_dispatch=gmm`), turned
into one with `execution_config(cfg)`. The model's `expert_format` is None unless a config asks
for one: the checkpoint's format when fine-tuning (`train.init_from`: a gpt-oss MXFP4 checkpoint
stays packed, and LoRA over it is QLoRA), else "dense".
"""

from __future__ import annotations

import ml_collections

from llm_jax.config import ModelConfig
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
    cfg.data = _data()
    cfg.train = _train()
    cfg.sft = _sft()
    cfg.dpo = _dpo()
    cfg.lora = _lora()
    cfg.rl = _rl()
    cfg.mesh = _mesh()
    cfg.distributed = _distributed()
    cfg.checkpoint = _checkpoint()
    cfg.task = _task()
    return cfg


def _model(model: ModelConfig) -> ml_collections.ConfigDict:
    d = model.to_dict()
    if model.expert_format == "dense":  # the default: None = the checkpoint's, else dense
        d["expert_format"] = ml_collections.config_dict.placeholder(str)
    return ml_collections.ConfigDict(d)


def _data() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.tfds_name = ""  # any TFDS text dataset by name (needs internet), e.g. "lm1b"
    c.text_key = "text"  # feature holding the text in a TFDS dataset
    c.tfds_train_split = "train"
    c.tfds_eval_split = ""  # "" = "validation" if the dataset has it, else "test"
    c.files = ""  # a glob of local text files; "" = the Python standard library's .py files
    c.array_record_train = ""  # glob of ArrayRecord shards of UTF-8 documents (records)
    c.array_record_eval = ""  # the evaluation shards (needed with array_record_train)
    c.data_dir = ""  # where TFDS datasets are built; "" = WORKDIR/tfds
    c.validation_fraction = 0.02  # local text: share of files (by path hash) held out
    c.document_bytes = 1 << 20  # local text: longer files are cut into documents near this size
    c.on_bad_file = "skip"  # local text: "skip" (named in a warning) or "stop"
    c.seq_len = 256
    c.shuffle_seed = 0
    c.shuffle_buffer_tokens = 1 << 20  # packed rows shuffled together; 0 = off
    c.worker_count = 0  # Grain worker processes; 0 = load in the main process
    c.prefetch = 2  # batches read ahead by a background thread; 0 = none
    c.tokenizer_train_bytes = 20_000_000  # text used to train the BPE tokenizer
    return c


def _train() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.num_steps = 1000
    c.batch_size = 8  # global batch, in sequences
    c.grad_accum_steps = 1
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.min_lr_ratio = 0.1  # cosine decay ends at learning_rate * min_lr_ratio
    c.weight_decay = 0.1
    c.b1 = 0.9
    c.b2 = 0.95
    c.grad_clip_norm = 1.0
    c.load_balancing_loss_weight = 0.01
    c.router_z_loss_weight = 1e-3
    c.log_every_steps = 10
    c.eval_every_steps = 200
    c.eval_batches = 8
    c.num_samples = 3  # lines of text sampled at the end of the run
    c.peak_flops = 0.0  # MFU denominator in FLOP/s; 0 = measure a matmul at start-up
    # A step whose loss or gradient norm is not finite stops the run, naming the step and the
    # last good checkpoint; True instead skips that update (params and moments kept) and counts
    # it in the metrics as skipped_updates (docs/reliability.md).
    c.skip_nonfinite_updates = False
    c.inject_nan_at_step = -1  # fault injection (llm_jax.training.faults): NaN loss at step N
    # Fine-tuning (docs/finetuning.md): any directory load_pretrained reads (HF, OpenAI original/,
    # llm_jax, a training workdir). Params and model config come from it; a resumed run restores
    # its own checkpoint instead.
    c.init_from = ""
    return c


def _sft() -> ml_collections.ConfigDict:
    # SFT data (llm_jax/data/sft.py); used when files or tfds_name (or task.name) is set, else
    # `data` is.
    c = ml_collections.ConfigDict()
    c.files = ""  # glob of JSONL files of {"messages": [...]} or {"prompt", "completion"}
    c.tfds_name = ""  # or a TFDS dataset with such features
    c.tfds_split = "train"
    c.data_dir = ""  # TFDS data_dir; "" = TFDS's default
    # A directory with tokenizer.json + chat template ("" = train.init_from), copied into
    # WORKDIR/tokenizer/ on the run's first start: a resumed run reads the copy.
    c.tokenizer = ""
    c.on_bad_line = "skip"  # skip (counted and logged, named by file:line) | stop
    c.validation_fraction = 0.05  # conversations held out (by hash) for val_loss; 0 = none
    # Harmony (gpt-oss) conversations: the channels of the assistant's messages in the loss,
    # comma-separated from analysis (reasoning), commentary (tool calls, preambles) and final
    # (answers). All by default: reasoning in the data is there to be learned; without it the
    # answers are trained after reasoning the model never learns to write (docs/finetuning.md).
    c.loss_channels = DEFAULT_LOSS_CHANNELS
    return c


def _task() -> ml_collections.ConfigDict:
    # A verifiable task (llm_jax/data/tasks.py; each field is described on TaskConfig): the
    # prompts and reference answers RL is rewarded on; with no sft.files / sft.tfds_name, SFT
    # trains on its reference replies (the warm-up before RL). name "" = none.
    return ml_collections.ConfigDict(TaskConfig().to_dict())


def _dpo() -> ml_collections.ConfigDict:
    # Preference optimisation (llm_jax/training/preference.py, docs/posttraining.md); used when
    # files is set: pairs of responses instead of `data` or `sft`.
    c = ml_collections.ConfigDict()
    c.files = ""  # glob of JSONL files of {"prompt", "chosen", "rejected"}
    # A directory with tokenizer.json + chat template ("" = train.init_from), copied into
    # WORKDIR/tokenizer/ on the run's first start: a resumed run reads the copy.
    c.tokenizer = ""
    c.loss = "dpo"  # dpo (against a reference policy) | simpo (reference-free)
    c.beta = 0.1  # DPO: the KL penalty's weight (and the reward's scale); SimPO: reward scale
    c.label_smoothing = 0.0  # DPO: the chance a pair's label is wrong (conservative DPO)
    c.gamma = 0.5  # SimPO: the target reward margin
    c.validation_fraction = 0.1  # prompts held out (by hash) for the held-out accuracy
    c.on_bad_line = "skip"  # skip (counted and logged, named by file:line) | stop
    return c


def _lora() -> ml_collections.ConfigDict:
    # LoRA (llm_jax/model/lora.py): rank 0 = full fine-tuning.
    c = ml_collections.ConfigDict()
    c.rank = 0
    c.alpha = 16.0
    c.targets = "q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj"
    return c


def _rl() -> ml_collections.ConfigDict:
    # RL with verifiable rewards (llm_jax/training/rl_loop.py, docs/posttraining.md): a run with
    # `rewards` set samples completions of the `task`'s prompts and trains on their rewards
    # instead of running the language-model loop. train.num_steps, warmup_steps, log_every_steps
    # and checkpoint.every_steps count RL steps (one rollout batch each); the batch is
    # prompts_per_step * group_size completions (train.batch_size is not read).
    c = ml_collections.ConfigDict()
    c.rewards = ""  # "name:weight,..." (llm_jax.training.rewards.REWARDS); "" = no RL
    c.pass_threshold = 1.0  # a completion passes when its weighted reward is at least this
    c.group_size = 8  # G completions per prompt: each one's advantage is against its group's
    c.prompts_per_step = 8  # P prompts a step, taken in order from the task's train split
    c.max_prompt_tokens = 256  # a longer rendered prompt is refused, naming its example
    c.max_new_tokens = 128
    c.temperature = 1.0  # sampling, and the trainer's log-probs (logits / temperature)
    c.top_p = 1.0
    c.updates_per_rollout = 1  # optimizer steps on each rollout batch (ratios vs the rollout)
    loss = PolicyLossConfig()  # its fields, by their names (llm_jax/training/policy_loss.py)
    c.aggregation = loss.aggregation
    c.ratio = loss.ratio
    c.epsilon_low = loss.epsilon_low
    c.epsilon_high = loss.epsilon_high
    c.beta = loss.beta  # > 0: KL to the reference (LoRA: adapters off; else the initial params)
    c.importance_cap = 0.0  # truncated importance sampling cap (>= 1); 0 = off
    c.scale_by_std = loss.scale_by_std
    c.dynamic_sampling = False  # drop groups whose rewards are all equal (counted either way)
    c.replay = True  # replay the rollout's MoE routing in the trainer's forwards
    c.allow_dropping_dispatch = False  # permit a capacity / expert_parallel MoE dispatch
    c.eval_every_steps = 10  # greedy pass rate on the task's eval split; 0 = start and end only
    c.eval_examples = 64
    c.engine_slots = 0  # sequences the rollout engine decodes together; 0 = the whole batch
    c.engine_max_prefill = 8  # prompts prefilled in one call
    # A directory with tokenizer.json + chat template ("" = train.init_from), copied into
    # WORKDIR/tokenizer/ on the run's first start: a resumed run reads the copy.
    c.tokenizer = ""
    return c


def _mesh() -> ml_collections.ConfigDict:
    # Device mesh (llm_jax.parallel.sharding): sizes within a slice / node; one may be -1 (the rest).
    # dcn_* multiply them across TPU slices or GPU nodes (the data-center network). See
    # docs/scaling.md for how to choose.
    c = ml_collections.ConfigDict()
    c.data = -1
    c.fsdp = 1
    c.tensor = 1
    c.expert = 1
    c.dcn_data = 1
    c.dcn_fsdp = 1
    c.dcn_tensor = 1
    c.dcn_expert = 1
    return c


def _distributed() -> ml_collections.ConfigDict:
    # Multi-process runs (llm_jax.parallel.distributed): "" / -1 = from the environment (JAX_COORDINATOR_
    # ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; or TPU VM / SLURM detection); none = 1 process.
    c = ml_collections.ConfigDict()
    c.coordinator_address = ""  # host:port of process 0
    c.num_processes = -1
    c.process_id = -1
    c.initialization_timeout = 300  # seconds to wait for every process
    return c


def _checkpoint() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.every_steps = 250
    c.max_to_keep = 3
    c.async_save = True
    # sha256 of every file of a finished save, hashed in a background thread (about 0.4 GB/s
    # per core here) and checked before a restore; off for checkpoints too big to hash.
    c.checksums = True
    # A workdir with no restorable checkpoint but steps moved to WORKDIR/corrupt_checkpoints/ is
    # refused rather than trained again from step 0; True starts from scratch there anyway (the
    # moved steps stay where they are). docs/reliability.md.
    c.allow_fresh_start = False
    c.inject_kill_during_save_at_step = -1  # fault injection: kill -9 mid-save
    return c


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
    naming the field (`model` is checked by ModelConfig, `execution` also by ExecutionConfig,
    `data` also by DataConfig)."""
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
