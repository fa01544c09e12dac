"""torch tensors in payloads, without importing torch unless one is seen.

A tensor travels as a numpy array of its bytes plus its torch dtype name: float32, float16,
float64, int64, int32, int16, int8, uint8, bool, and bfloat16 — numpy has no bfloat16, so those
travel as raw 2-byte words (`<u2`) under the name "bfloat16" and come back bit-exact.

- **Encoding** needs no import: a process that holds a tensor imported torch already, so
  `is_tensor` looks torch up in `sys.modules` and never loads it.
- **Decoding** imports torch when the payload holds a tensor. A consumer without torch gets
  numpy arrays instead (bfloat16 widened to float32, which is exact).
- **Device staging.** `to_device(payload, "cuda:0")` moves a payload's CPU tensors to a GPU
  through pinned host memory (`pin_memory()`, then an asynchronous copy), when torch has CUDA.
  Extension points, documented in docs/architecture.md: registering a shared-memory segment
  itself as pinned memory (`cudaHostRegister`, saving the staging copy), and CUDA IPC
  (`torch.multiprocessing` handles) between stages that share a GPU.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# torch dtype name -> the numpy dtype its bytes travel as
TORCH_DTYPES: dict[str, str] = {
    "float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "float64": "<f8",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "|i1", "uint8": "|u1", "bool": "|b1",
}


def _torch() -> Any | None:
    return sys.modules.get("torch")


def is_tensor(obj: Any) -> bool:
    """True for a torch tensor; never imports torch (no tensor exists without it)."""
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def to_array(tensor: Any) -> tuple[str, np.ndarray]:
    """(torch dtype name, a numpy array sharing the tensor's bytes when it is a contiguous CPU tensor).

    A GPU tensor is copied to host memory (the one copy that cannot be avoided); a non-contiguous one
    is made contiguous."""
    torch = _torch()
    assert torch is not None
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TypeError(f"cannot encode a {tensor.dtype} tensor (supported: {', '.join(TORCH_DTYPES)})")
    if sys.byteorder != "little":
        raise TypeError("tensors travel little-endian; this host is big-endian")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().resolve_conj().resolve_neg()
    if name == "bfloat16":
        return name, t.view(torch.int16).numpy().view("<u2")
    return name, t.numpy()


def preload() -> bool:
    """Import torch now, if it is installed (True when it is): a stage whose inputs carry tensors calls
    it in `setup`, so decoding its first chunk does not import torch (seconds) on a request's time."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def from_array(name: str, arr: np.ndarray) -> Any:
    """The tensor `to_array` took apart (sharing `arr`'s memory); a numpy array if torch is missing."""
    try:
        import torch
    except ImportError:
        if name == "bfloat16":      # the top 16 bits of a float32: widening is exact
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr
    if name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    if is_tensor(obj):
        return fn(obj)
    return obj


def to_device(payload: Any, device: str) -> Any:
    """`payload` with its CPU tensors moved to `device` ("cpu": unchanged).

    For a CUDA device each tensor is staged through pinned (page-locked) host memory and copied
    asynchronously on the current stream; torch's pinned-memory allocator keeps the staging buffer
    until that copy is done. Raises `RuntimeError` when torch has no CUDA."""
    if device == "cpu" or _torch() is None:
        return payload
    import torch

    target = torch.device(device)
    if target.type == "cpu":
        return payload
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"a stage wants its inputs on {device}, but this torch has no CUDA")

    def move(t: Any) -> Any:
        if t.device.type != "cpu":
            return t.to(target, non_blocking=True)
        staged = t if t.is_pinned() else t.pin_memory()
        return staged.to(target, non_blocking=True)

    return _map_tensors(payload, move)
