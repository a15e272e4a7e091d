"""gpt-oss-120b: gpt-oss-20b with 36 layers and 128 experts (top-4); everything else is shared."""

import os
import runpy

import ml_collections

_GPT_OSS_20B = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           "gpt_oss_20b.py"))


def get_config() -> ml_collections.ConfigDict:
    cfg = _GPT_OSS_20B["get_config"]()
    cfg.name = "gpt_oss_120b"
    cfg.model.num_hidden_layers = 36
    cfg.model.num_experts = 128
    return cfg
