"""The tensors of safetensors files: `TensorStore` reads them (every header validated first, by
`safetensors_header`), `save_safetensors` writes them. Only safetensors are read; never pickles."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file  # handles bfloat16 through ml_dtypes

from llm_jax.weights.safetensors_header import TensorInfo, read_header


class TensorStore:
    """Read-only view of the tensors in one or more safetensors files, headers validated."""

    def __init__(self, files: Iterable[Path]):
        self.files = [Path(f) for f in files]
        self._info: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_header(f).items():
                if name in self._info:
                    raise ValueError(
                        f"tensor {name!r} appears in both {self._info[name].file} and {f}")
                self._info[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        return sorted(self._info)

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name].shape

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name` (read by `safetensors`); checks its shape when `shape` is given."""
        if name not in self._info:
            where = ", ".join(str(f) for f in self.files)
            raise ValueError(f"checkpoint is missing tensor {name!r} (looked in {where})")
        info = self._info[name]
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} in {info.file} has shape {info.shape}, expected {tuple(shape)}"
            )
        try:
            with safe_open(str(info.file), framework="numpy") as f:
                return f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"tensor {name!r} in {info.file} does not read: {e}") from None


def save_safetensors(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
