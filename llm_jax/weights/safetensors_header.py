"""A safetensors header read without trusting it: every field checked against the file.

Format: 8 bytes little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the data; offsets are relative
to the end of the header and the tensors tile the data exactly (no overlap, no gap). This reads
only the 8 bytes and the JSON (at most MAX_HEADER_BYTES, the safetensors library's own limit), so
a hostile file costs no more memory than its header; the data is read later by the `safetensors`
library. Every problem is a ValueError naming the file, the tensor and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

MAX_HEADER_BYTES = 100_000_000
# The real and integer dtypes `safetensors.safe_open(framework="numpy")` reads (it has no float8;
# its complex C64 is left out: no model weight is complex).
DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}.items()}
FLOAT_DTYPES = frozenset(DTYPES[k] for k in ("F64", "F32", "F16", "BF16"))


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # byte range in the data section (after the header)
    end: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_json(path: Path, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON "
                         f"({type(e).__name__}: {str(e)[:200]})") from None


def _entry(path: Path, name: str, entry: Any, data_size: int) -> TensorInfo:
    where = f"tensor {name!r} in {path}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: header entry is a {type(entry).__name__}, expected an object "
                         "with dtype, shape and data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise ValueError(f"{where}: header entry has no {key!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one llm_jax reads; expected one of "
                         f"{sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is invalid: expected a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise ValueError(f"{where}: data_offsets {offsets!r} is invalid: expected [begin, end], "
                         "two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"{where}: data_offsets {offsets} are outside the file's {data_size} "
                         "bytes of data (truncated?): expected 0 <= begin <= end <= "
                         f"{data_size}")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, but dtype "
                         f"{dtype} x shape {shape} needs {nbytes}")
    return TensorInfo(path, DTYPES[dtype], tuple(shape), begin, end)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """{tensor name: TensorInfo} of a safetensors file; ValueError for any malformed field."""
    path = Path(path)
    if not path.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"{path} is not a regular file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, shorter than the "
                             "8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, MAX_HEADER_BYTES) or n < 2:
            raise ValueError(f"{path} is not a safetensors file: header length {n} is invalid: "
                             f"expected 2 to {min(size - 8, MAX_HEADER_BYTES)} (the file has "
                             f"{size} bytes; at most {MAX_HEADER_BYTES})")
        raw = f.read(n)
    header = _load_json(path, raw)
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is a JSON "
                         f"{type(header).__name__}, expected an object")
    if not raw.startswith(b"{"):  # the safetensors library refuses anything else
        raise ValueError(f"{path} is not a safetensors file: its header does not start with '{{'")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: header field __metadata__ {str(meta)[:100]!r} is invalid: "
                         "expected an object of strings")
    data_size = size - 8 - n
    out = {name: _entry(path, name, entry, data_size) for name, entry in header.items()}
    tiles = sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end))
    for (a, x), (b, y) in zip(tiles, tiles[1:]):
        if y.begin < x.end:
            raise ValueError(f"{path}: tensors {a!r} and {b!r} overlap (data bytes "
                             f"[{x.begin}, {x.end}) and [{y.begin}, {y.end}))")
    pos = 0
    for name, info in tiles:
        if info.begin > pos:
            raise ValueError(f"{path}: data bytes [{pos}, {info.begin}) belong to no tensor "
                             "(expected the tensors to tile the data)")
        pos = info.end
    if pos != data_size:
        raise ValueError(f"{path}: the tensors end at data byte {pos}, the file's data at "
                         f"{data_size}: expected them to tile the data exactly")
    return out
