"""Data: text sources (local files, TFDS, ArrayRecord shards), the BPE tokenizer, and the
streaming Grain pipeline that packs documents into rows (docs/training.md, "Data").

The trainer calls `make_datasets(cfg.data, workdir=..., vocab_size=..., global_batch_size=...)`.
"""

from llm_jax.data.config import DataConfig
from llm_jax.data.pipeline import Data, make_datasets
from llm_jax.data.tokenizer import Tokenizer, utf8_len

__all__ = ["Data", "DataConfig", "Tokenizer", "make_datasets", "utf8_len"]
