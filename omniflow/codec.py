"""Payload encoding across Redis: msgpack, with numpy arrays as an extension type.

Never pickle. Arrays travel as (dtype, shape, raw bytes), so a consumer can
rebuild them without trusting any code in the payload.
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_NDARRAY = 1


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb((arr.dtype.str, list(arr.shape), arr.tobytes())))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} for Redis (use numpy arrays, bytes, str, numbers)")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _NDARRAY:
        dtype, shape, raw = msgpack.unpackb(data)
        if np.dtype(dtype).hasobject:
            raise ValueError("object arrays are not accepted")
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    return msgpack.ExtType(code, data)


def dumps(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def loads(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
