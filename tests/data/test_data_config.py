"""DataConfig stays in step with the run config's `data` section."""

import pytest

from llm_jax.config import ModelConfig
from llm_jax.data import DataConfig
from llm_jax.training.run_config import default_run_config


def test_run_config_data_section_converts_to_the_default_data_config():
    cfg = default_run_config("t", ModelConfig())
    assert DataConfig.from_dict(cfg.data) == DataConfig()


def test_data_config_refuses_unknown_and_bad_fields_by_name():
    with pytest.raises(ValueError, match="seq_lenn"):
        DataConfig.from_dict({"seq_lenn": 3})
    with pytest.raises(ValueError, match="validation_fraction=0.0"):
        DataConfig(validation_fraction=0.0)


def test_array_record_globs_come_in_pairs_and_alone():
    with pytest.raises(ValueError, match="array_record_eval"):
        DataConfig(array_record_train="/d/train-*")
    with pytest.raises(ValueError, match="array_record_train"):
        DataConfig(array_record_train="/d/train-*", array_record_eval="/d/eval-*", files="*.txt")
    DataConfig(array_record_train="/d/train-*", array_record_eval="/d/eval-*")
