"""Payload encoding across Redis: msgpack, with numpy arrays and torch tensors as extension types.

Never pickle. Arrays travel as (dtype, shape, raw bytes), so a consumer can
rebuild them without trusting any code in the payload. torch tensors keep their
dtype (float32, float16, bfloat16, int64, ...) and shape; they are moved to the
CPU to be encoded, and decoded as CPU tensors. torch is never imported here: a
tensor can only be encoded by a process that has torch loaded, and a consumer
without torch gets numpy arrays (bfloat16, which numpy lacks, widened to float32).
"""
from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np

_NDARRAY = 1
_TENSOR = 2


def _encode_tensor(tensor: Any) -> msgpack.ExtType:
    torch = sys.modules["torch"]
    t = tensor.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return msgpack.ExtType(_TENSOR, msgpack.packb((name, list(t.shape), raw)))


def _decode_tensor(data: bytes) -> Any:
    name, shape, raw = msgpack.unpackb(data)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"bad tensor dtype {name!r}")
    torch = _torch()
    if torch is None:
        if name == "bfloat16":      # the upper 16 bits of a float32
            words = np.frombuffer(raw, dtype="<u2").astype("<u4") << 16
            return words.view("<f4").reshape(shape)
        return np.frombuffer(raw, dtype=np.dtype(name)).reshape(shape)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError:
        return None
    return torch


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb((arr.dtype.str, list(arr.shape), arr.tobytes())))
    if isinstance(obj, np.generic):
        return obj.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _encode_tensor(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} for Redis (use numpy arrays, torch tensors, bytes, "
                    "str, numbers)")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _NDARRAY:
        dtype, shape, raw = msgpack.unpackb(data)
        if np.dtype(dtype).hasobject:
            raise ValueError("object arrays are not accepted")
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    if code == _TENSOR:
        return _decode_tensor(data)
    return msgpack.ExtType(code, data)


def dumps(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, default=_default, use_bin_type=True)
    return packed


def loads(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
