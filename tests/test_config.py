"""ModelConfig (what a model is) and ExecutionConfig (how it runs): validation names the bad
field, JSON round trip, usable as static jit arguments, one place for each field and its doc;
the run config's helpers (where a fine-tuning run's tokenizer comes from)."""

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from llm_jax.config import LEGACY_EXECUTION_FIELDS, ModelConfig, field_doc, yarn_correction_range
from llm_jax.execution import ExecutionConfig
from llm_jax.runtime.cli import check_overrides
from llm_jax.training.run_config import (
    default_run_config,
    execution_config,
    model_config,
    tokenizer_source,
    validate_run_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_are_the_books_sixteen_numbers():
    cfg = ModelConfig()
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.experts_per_token, cfg.vocab_size) == (4, 16, 2, 8000)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) == (256, 256, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.sliding_window) == (4, 2, 0)
    assert (cfg.initial_context_length, cfg.rope_theta, cfg.rope_scaling_factor) == (4096, 10000.0, 32.0)
    assert (cfg.rope_ntk_alpha, cfg.rope_ntk_beta, cfg.swiglu_limit) == (1.0, 32.0, 7.0)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads"),
        ({"experts_per_token": 17}, "experts_per_token"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"head_dim": 63}, "head_dim"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"rope_scaling_factor": 0.5}, "rope_scaling_factor"),
        ({"rope_ntk_beta": 0.5}, "YaRN range"),  # low > high
        ({"initial_context_length": 8}, "YaRN range"),  # low < 0
        ({"dtype": "float64"}, "dtype"),
        ({"prms_fraction": 1.5}, "prms_fraction"),
        ({"vocab_size": 8000.0}, "vocab_size"),
        ({"swiglu_limit": 0.0}, "swiglu_limit"),
        ({"expert_format": "int4"}, "expert_format"),
        ({"norm_type": "batch"}, "norm_type"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=f"ModelConfig.*{field}"):
        ModelConfig(**changes)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"moe_dispatch": "sparse"}, "moe_dispatch"),
        ({"moe_capacity_factor": 0.0}, "moe_capacity_factor"),
        ({"attention_impl": "fast"}, "attention_impl"),
        ({"mxfp4_unpack_mib": -1}, "mxfp4_unpack_mib"),
        ({"loss_chunk_tokens": 0}, "loss_chunk_tokens"),
        ({"loss_group_chunks": 0}, "loss_group_chunks"),
        ({"gmm_tile_m": 500}, "gmm_tile_m"),
        ({"gmm_tile_k": 0}, "gmm_tile_k"),
        ({"gmm_tile_n": -128}, "gmm_tile_n"),
        ({"remat": 1}, "remat"),
        ({"scan_layers": "yes"}, "scan_layers"),
    ],
)
def test_invalid_execution_raises_value_error_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=re.escape(f"ExecutionConfig.{field}=")):
        ExecutionConfig(**changes)


def test_yarn_low_high_worked_values():
    low, high = yarn_correction_range(ModelConfig())
    assert low == pytest.approx(10.47, abs=0.005)
    assert high == pytest.approx(22.51, abs=0.005)


def test_json_round_trip_and_unknown_field_refused():
    cfg = ModelConfig(sliding_window=128, dtype="bfloat16")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig.from_dict({**cfg.to_dict(), "num_layers": 3})
    ex = ExecutionConfig(moe_dispatch="ragged", remat=True, moe_capacity_factor=2)
    assert ExecutionConfig.from_json(ex.to_json()) == ex
    assert isinstance(ExecutionConfig.from_json(ex.to_json()).moe_capacity_factor, float)
    with pytest.raises(ValueError, match="ExecutionConfig: unknown field.*'hidden_size'"):
        ExecutionConfig.from_dict({"hidden_size": 3})


def test_an_execution_field_given_to_the_model_config_names_its_place():
    with pytest.raises(ValueError, match=re.escape("config.execution.moe_dispatch")):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "moe_dispatch": "dense"})


def test_a_saved_model_section_with_the_execution_fields_of_older_checkpoints_reads():
    """The model section as checkpoints written before ExecutionConfig stored it: the execution
    fields beside the model's, read past (they never identified the model)."""
    cfg = ModelConfig(sliding_window=128, dtype="bfloat16")
    legacy = {**cfg.to_dict(), **ExecutionConfig(moe_dispatch="capacity", remat=True).to_dict()}
    assert ModelConfig.from_saved(legacy) == cfg
    with pytest.raises(ValueError, match="num_layers"):  # anything else is still refused
        ModelConfig.from_saved({**legacy, "num_layers": 3})


def test_the_legacy_execution_fields_are_execution_fields():
    execution = {f.name for f in dataclasses.fields(ExecutionConfig)}
    model = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(LEGACY_EXECUTION_FIELDS) <= execution
    assert not model & execution  # each field has one home


@pytest.mark.parametrize("cls", [ModelConfig, ExecutionConfig])
def test_configs_are_hashable_static_pytrees(cls):
    cfg = cls()
    assert hash(cfg) == hash(cls())
    assert jax.tree.leaves({"cfg": cfg, "x": 1}) == [1]
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, name, 3)

    @jax.jit
    def f(c, x):
        return x * len(c.to_dict())

    assert float(f(cfg, jnp.ones(()))) == len(dataclasses.fields(cls))


def test_every_field_has_its_doc_and_docs_config_md_lists_it():
    """One source of field documentation: the dataclass metadata, which `describe` prints and
    docs/config.md's field tables repeat word for word."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    for cls in (ModelConfig, ExecutionConfig):
        for f in dataclasses.fields(cls):
            doc = field_doc(cls, f.name)
            assert doc and doc == f.metadata["doc"]
            row = f"| `{f.name}` | `{f.default!r}` | {doc} |"
            assert row in text, f"docs/config.md lacks the {cls.__name__} row:\n{row}"


def test_run_config_refuses_an_execution_field_in_the_model_section_by_its_new_place():
    cfg = default_run_config("t", ModelConfig())
    cfg.model.moe_dispatch = "dense"  # where it was before it moved
    with pytest.raises(ValueError, match=re.escape("set config.execution.moe_dispatch")):
        validate_run_config(cfg)


def test_an_old_model_override_of_an_execution_field_names_its_new_flag():
    cfg = default_run_config("t", ModelConfig())
    with pytest.raises(ValueError, match=re.escape("use --config.execution.remat=")):
        check_overrides(cfg, ["--config.model.remat=True"])
    with pytest.raises(ValueError, match="known fields are"):  # a plain typo: the known list
        check_overrides(cfg, ["--config.model.num_layerz=3"])


def test_run_config_execution_section_is_validated_by_execution_config():
    cfg = default_run_config("t", ModelConfig(), ExecutionConfig(moe_dispatch="capacity"))
    assert execution_config(cfg) == ExecutionConfig(moe_dispatch="capacity")
    cfg.execution.gmm_tile_m = 100
    with pytest.raises(ValueError, match=re.escape("ExecutionConfig.gmm_tile_m=100")):
        validate_run_config(cfg)


def test_sliding_layers_are_the_even_ones():
    assert ModelConfig(sliding_window=128).layer_windows == (128, 0, 128, 0)
    assert ModelConfig().layer_windows == (0, 0, 0, 0)


@pytest.mark.parametrize("name", ["tiny", "gpt_oss_20b", "gpt_oss_120b"])
def test_config_files_build_valid_model_configs(name, monkeypatch):
    monkeypatch.syspath_prepend(str(CONFIGS))
    mod = __import__(name)
    cfg = model_config(mod.get_config())
    assert isinstance(cfg, ModelConfig)
    assert isinstance(execution_config(mod.get_config()), ExecutionConfig)
    sys.modules.pop(name, None)


def test_the_tokenizer_source_is_the_run_sections_field_else_init_from():
    cfg = default_run_config("t", ModelConfig())
    cfg.train.init_from = "base"
    assert tokenizer_source(cfg) == ("base", "train.init_from")
    cfg.sft.tokenizer = "sft_tok"
    assert tokenizer_source(cfg) == ("sft_tok", "sft.tokenizer")
    cfg.dpo.files, cfg.dpo.tokenizer = "pairs.jsonl", "dpo_tok"
    assert tokenizer_source(cfg) == ("dpo_tok", "dpo.tokenizer")
    cfg.rl.rewards = "correct:1"
    assert tokenizer_source(cfg) == ("base", "train.init_from")
    # A saved run config (JSON) from before the rl section existed.
    saved = {"train": {"init_from": "base"}, "sft": {"tokenizer": ""}}
    assert tokenizer_source(saved) == ("base", "train.init_from")
