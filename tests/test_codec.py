"""Payload codec: numpy arrays and torch tensors keep dtype and shape; nothing is pickled."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from conftest import toy_spec
from helpers import request, run_to_end

from omniflow.dataplane import codec
from omniflow.dataplane.base import UndecodablePayload

TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensor_round_trip_keeps_dtype_shape_and_values(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 7) * 50).to(dtype)
    back = codec.loads(codec.dumps({"h": t, "n": 1}))["h"]
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_empty_and_non_contiguous_tensors() -> None:
    assert codec.loads(codec.dumps(torch.zeros(0, 576))).shape == (0, 576)
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).T
    assert torch.equal(codec.loads(codec.dumps(t)), t)


def test_numpy_arrays_and_refused_types() -> None:
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    back = codec.loads(codec.dumps(a))
    assert back.dtype == np.float16 and (back == a).all()
    with pytest.raises(TypeError, match="cannot encode set"):
        codec.dumps({1, 2})


def test_a_tensor_with_a_bogus_dtype_name_is_refused() -> None:
    bad = msgpack.packb(msgpack.ExtType(2, msgpack.packb(("Tensor", [1], b"\0\0\0\0"))))
    with pytest.raises(UndecodablePayload, match="undecodable tensor dtype 'Tensor'"):
        codec.loads(bad)


async def test_tensors_cross_the_engine_with_dtype_and_shape(engine_factory) -> None:
    spec = toy_spec()
    spec["stages"]["thinker"]["executor"] = "workers_fixtures:TensorThinker"
    spec["stages"]["talker"]["executor"] = "workers_fixtures:TensorCheckingTalker"
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("tensors please"), timeout_s=20)
    assert doc["state"] == "completed", doc["error"]
    usage = doc["stages"]["talker"]["usage"]
    assert usage["seen"] == [[str(d).removeprefix("torch."), [2, 5]] for d in TORCH_DTYPES]


def test_the_reused_packer_packs_as_packb_does_per_thread_and_after_an_error() -> None:
    import threading

    from omniflow.storage.schema import ThreadPacker

    packer = ThreadPacker(use_bin_type=False)
    step = [3, "P", "talker", b"\x00raw", ["seq", 3, "d", "text"]]
    assert packer.pack(step) == msgpack.packb(step, use_bin_type=False)
    with pytest.raises(TypeError):
        packer.pack([1, object()])          # fails part-way ...
    assert packer.pack([1, 2]) == msgpack.packb([1, 2])     # ... and nothing of it is left behind
    mine = packer.packer
    theirs: list[object] = []
    thread = threading.Thread(target=lambda: theirs.append((packer.packer, packer.pack({"a": 1}))))
    thread.start()
    thread.join()
    assert theirs[0][0] is not mine and theirs[0][1] == msgpack.packb({"a": 1})     # a Packer of its own
    big = packer.pack(b"x" * (ThreadPacker.KEEP_BYTES + 1))
    assert msgpack.unpackb(big, raw=True) == b"x" * (ThreadPacker.KEEP_BYTES + 1)
    assert packer.packer is not mine        # its buffer grew past the bound: replaced, not kept
    assert codec.loads(codec.dumps({"h": np.arange(3)}))["h"].tolist() == [0, 1, 2]
