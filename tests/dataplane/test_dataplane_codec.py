"""The payload codec on its own: inline and frame forms, every dtype, tensors, refusals."""
from __future__ import annotations

import sys

import msgpack
import numpy as np
import pytest

from omniflow.dataplane import codec as engine_codec
from omniflow.config import DataPlaneMode
from omniflow.dataplane import codec
from omniflow.dataplane.base import (
    ChecksumMismatch, PayloadMissing, Ref, SizeMismatch, TransportKind, UndecodablePayload,
)
from omniflow.dataplane.policy import choose_transport

from dataplane_forge import ext, forge_frame

NUMPY_DTYPES = ["<f4", "<f2", "<f8", "<i8", "<i4", "<i2", "|i1", "|u1", "|b1", "<c8", ">f4"]
TENSOR_DTYPES = ["float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool", "float64"]


def sample(dtype: str, shape: tuple[int, ...] = (3, 5)) -> np.ndarray:
    rng = np.random.default_rng(7)
    return (rng.standard_normal(shape) * 100).astype(np.dtype(dtype))


def same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("form", ["inline", "frame"])
def test_numpy_arrays_round_trip_with_dtype_and_shape(dtype: str, form: str) -> None:
    payload = {"x": sample(dtype), "empty": np.zeros((0, 4), dtype=dtype), "scalar": np.array(3, dtype=dtype)}
    if form == "inline":
        out = codec.loads(codec.dumps(payload))
    else:
        frame = codec.encode_frame(payload)
        out = codec.decode_frame(frame.tobytes(), nbytes=frame.nbytes, checksum=frame.checksum)
    for key in payload:
        same(out[key], payload[key])


def test_frame_keeps_structure_bytes_and_non_contiguous_arrays() -> None:
    strided = np.arange(40, dtype=np.int32).reshape(5, 8)[:, ::2]
    payload = {"tokens": [1, 2, 3], "text": "hé", "small": b"ab", "big": bytes(range(256)) * 20,
               "nested": [{"a": strided}], "n": None, "f": 1.5, "np_scalar": np.float32(2.5)}
    frame = codec.encode_frame(payload)
    out = codec.decode_frame(frame.tobytes(), nbytes=frame.nbytes, checksum=frame.checksum)
    assert out["tokens"] == [1, 2, 3] and out["text"] == "hé" and out["small"] == b"ab"
    assert out["big"] == payload["big"] and out["n"] is None and out["f"] == 1.5 and out["np_scalar"] == 2.5
    same(out["nested"][0]["a"], np.ascontiguousarray(strided))
    assert all(off % codec.ALIGN == 0 for off in frame.offsets)


def test_inline_reads_what_the_engine_codec_writes() -> None:
    payload = {"h": sample("<f4"), "seq": 3, "words": ["a", "b"]}
    out = codec.loads(engine_codec.dumps(payload))
    same(out["h"], payload["h"])
    assert out["seq"] == 3 and out["words"] == ["a", "b"]
    assert codec.dumps({"a": 1, "b": [1.5, "x"]}) == engine_codec.dumps({"a": 1, "b": [1.5, "x"]})


@pytest.mark.parametrize("name", TENSOR_DTYPES)
def test_inline_reads_the_engine_codecs_tensors_and_the_other_way(name: str) -> None:
    torch = pytest.importorskip("torch")
    t = (torch.randn(3, 5) * 50).to(getattr(torch, name))
    for out in (codec.loads(engine_codec.dumps({"t": t}))["t"], engine_codec.loads(codec.dumps({"t": t}))["t"]):
        assert out.dtype == t.dtype and torch.equal(out, t)


@pytest.mark.parametrize("name", TENSOR_DTYPES)
@pytest.mark.parametrize("form", ["inline", "frame"])
def test_torch_tensors_keep_dtype_and_shape(name: str, form: str) -> None:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name)
    t = (torch.randn(4, 6) * 50).to(dtype)
    if form == "inline":
        out = codec.loads(codec.dumps({"t": t}))["t"]
    else:
        frame = codec.encode_frame({"t": t})
        out = codec.decode_frame(bytearray(frame.tobytes()), nbytes=frame.nbytes, checksum=frame.checksum)["t"]
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and tuple(out.shape) == (4, 6)
    assert torch.equal(out, t)
    out += 1 if name != "bool" else True        # writable: a tensor over immutable memory would not be


def test_bfloat16_without_torch_decodes_as_exact_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    words = (values.view(np.uint32) >> 16).astype("<u2")     # bfloat16 = the top half of a float32
    data = msgpack.packb(ext(2, "bfloat16", [2, 2], words.tobytes()))
    monkeypatch.setitem(sys.modules, "torch", None)            # `import torch` fails from here on
    out = codec.loads(data)
    assert out.dtype == np.float32 and out.shape == (2, 2)
    assert out.ravel().tolist() == values.tolist()


@pytest.mark.parametrize(("structure", "buffers", "match"), [
    (ext(10, "|O", [2], 0), [bytes(16)], "not accepted"),
    (ext(10, "V8", [2], 0), [bytes(16)], "not accepted"),
    (ext(10, "<M8[s]", [2], 0), [bytes(16)], "not accepted"),
    (ext(10, "not-a-dtype", [2], 0), [bytes(16)], "undecodable dtype"),
    (ext(10, 17, [2], 0), [bytes(16)], "undecodable dtype"),
    (ext(10, "<f4", [1000], 0), [bytes(16)], "needs 4000 bytes"),
    (ext(10, "<f4", [-4], 0), [bytes(16)], "bad shape"),
    (ext(10, "<f4", [4], 3), [bytes(16)], "structure does not decode"),
    (ext(11, "complex32", [4], 0), [bytes(16)], "undecodable tensor dtype"),
    (ext(99, 0), [bytes(16)], "unknown extension"),
])
def test_frames_with_unsound_headers_are_refused(structure: object, buffers: list[bytes], match: str) -> None:
    raw, crc = forge_frame({"x": structure}, buffers)
    with pytest.raises(UndecodablePayload, match=match):
        codec.decode_frame(raw, nbytes=len(raw), checksum=crc)


def test_frame_buffer_outside_the_data_is_refused() -> None:
    raw, crc = forge_frame(ext(10, "<f4", [4], 0), [bytes(16)], spans=[[0, 4096]])
    raw = raw[:len(raw) - 4096 + 16]
    with pytest.raises((UndecodablePayload, SizeMismatch)):
        codec.decode_frame(raw, nbytes=len(raw), checksum=crc)


def test_frame_size_and_checksum_are_checked() -> None:
    frame = codec.encode_frame({"x": sample("<f4")})
    raw = frame.tobytes()
    with pytest.raises(SizeMismatch):
        codec.decode_frame(raw + b"\0", nbytes=frame.nbytes + 1, checksum=frame.checksum)
    with pytest.raises(SizeMismatch):
        codec.decode_frame(raw, nbytes=frame.nbytes + 1, checksum=frame.checksum)
    with pytest.raises(ChecksumMismatch):
        codec.decode_frame(raw, nbytes=frame.nbytes, checksum=frame.checksum ^ 1)
    tampered = bytearray(raw)
    tampered[codec.PRELUDE.size + 2] ^= 0xFF            # inside the header
    with pytest.raises(ChecksumMismatch):
        codec.decode_frame(bytes(tampered), nbytes=frame.nbytes, checksum=frame.checksum)
    with pytest.raises(UndecodablePayload, match="not an omniflow payload frame"):
        codec.decode_frame(b"X" * frame.nbytes, nbytes=frame.nbytes, checksum=frame.checksum)


def test_full_checksum_catches_a_changed_data_byte() -> None:
    frame = codec.encode_frame({"x": sample("<f4", (64,))}, full_checksum=True)
    tampered = bytearray(frame.tobytes())
    tampered[-1] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="data checksum"):
        codec.decode_frame(bytes(tampered), nbytes=frame.nbytes, checksum=frame.checksum)
    out = codec.decode_frame(frame.tobytes(), nbytes=frame.nbytes, checksum=frame.checksum)
    assert out["x"].shape == (64,)


def test_objects_that_do_not_travel_are_refused_at_the_producer() -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        codec.dumps({"f": object()})
    with pytest.raises(TypeError, match="cannot encode"):
        codec.encode_frame({"f": object()})
    with pytest.raises(UndecodablePayload):
        codec.loads(msgpack.packb(ext(1, "|O", [1], b"12345678")))


def test_reference_packing_refuses_garbage() -> None:
    ref = Ref(TransportKind.SHM, "of-p-w-wf-a.b-1.1", 4096, 123, "host")
    assert Ref.unpack(ref.pack()) == ref
    for raw in (b"\xc1", msgpack.packb([9, "x", 1, 2, "h"]), msgpack.packb([0, "x", 1, 2, "h"]),
                msgpack.packb([1, 5, 1, 2, "h"]), msgpack.packb([1, "x", -1, 2, "h"]), msgpack.packb("s")):
        with pytest.raises(UndecodablePayload):
            Ref.unpack(raw)
    assert PayloadMissing("x").retryable and not ChecksumMismatch("x").retryable


def test_payload_size_estimate_stops_at_the_limit() -> None:
    big = [np.zeros(1 << 20, np.uint8)] * 100
    assert codec.payload_nbytes(big, limit=1 << 20) < 3 << 20
    assert codec.payload_nbytes({"a": "xyz", "b": np.zeros(10, np.float64)}) == 1 + 3 + 1 + 80
    # each kind, exact and subclassed (the exact types take a shorter path)
    assert [codec.payload_nbytes(x) for x in ("ab", b"abc", bytearray(4), 1, 2.5, True, None, [1, "xy"], (1, 2),
                                              memoryview(b"12345"), {"k": [b"v"]})] == [2, 3, 4, 8, 8, 8, 8, 10, 16, 5, 2]

    class Text(str):
        pass

    class Table(dict):  # type: ignore[type-arg]
        pass

    assert codec.payload_nbytes(Table(a=Text("xyz"))) == 4
    assert codec.payload_nbytes([b"x" * 10] * 10, limit=25) == 30


@pytest.mark.parametrize(("nbytes", "mode", "same_host", "shm", "expected"), [
    (100, DataPlaneMode.AUTO, True, True, TransportKind.INLINE),
    (1 << 20, DataPlaneMode.AUTO, True, True, TransportKind.SHM),
    (1 << 20, DataPlaneMode.AUTO, False, True, TransportKind.REDIS),
    (1 << 20, DataPlaneMode.AUTO, True, False, TransportKind.REDIS),
    (100 << 10, DataPlaneMode.AUTO, True, True, TransportKind.REDIS),     # under shm_min: Redis
    (1 << 20, DataPlaneMode.INLINE, True, True, TransportKind.INLINE),
    (100, DataPlaneMode.REDIS, True, True, TransportKind.REDIS),
    (100, DataPlaneMode.SHM, True, True, TransportKind.SHM),
    (100, DataPlaneMode.SHM, False, True, TransportKind.REDIS),            # cannot reach it: Redis
])
def test_policy(nbytes: int, mode: DataPlaneMode, same_host: bool, shm: bool, expected: TransportKind) -> None:
    assert choose_transport(nbytes, mode=mode, inline_max_bytes=64 << 10, shm_min_bytes=256 << 10,
                            same_host=same_host, shm_available=shm) is expected


def test_to_device_leaves_cpu_payloads_and_refuses_cuda_without_it() -> None:
    torch = pytest.importorskip("torch")
    from omniflow.dataplane.tensors import to_device

    payload = {"h": torch.ones(2, 3), "n": [np.zeros(2), "x"]}
    assert to_device(payload, "cpu") is payload
    if torch.cuda.is_available():
        moved = to_device(payload, "cuda:0")
        assert moved["h"].device.type == "cuda" and moved["n"][1] == "x"
        assert torch.equal(moved["h"].cpu(), payload["h"])
    else:
        with pytest.raises(RuntimeError, match="no CUDA"):
            to_device(payload, "cuda:0")
