"""Text to phonemes (G2P) with eSpeak NG, punctuation put back.

eSpeak NG is GPL-3, so omniflow never depends on it. Two backends, tried in this order:

- `library`: `libespeak-ng.so` from the optional `speech` extra (`espeakng-loader`), called
  in process through ctypes (the user opts in to the GPL library by installing the extra);
- `command`: Debian's `espeak-ng` program in a subprocess (out of process).

eSpeak drops punctuation when it returns phonemes; a VITS voice needs it back (without the
"!" in "Hello!" the voice hears a different word and loses the sentence melody), so the
text is split at clause punctuation first and each mark is appended after its clause's
phonemes, as Piper's own phonemiser does.
"""
from __future__ import annotations

import ctypes
import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Sequence
from typing import Protocol

from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_VOICE = "en-us"
CLAUSE_PUNCTUATION = ".,;:!?"
ESPEAK_AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_CHARS_AUTO = 0
ESPEAK_PHONEMES_IPA = 0x02
COMMAND_TIMEOUT_S = 30.0

# a clause mark followed by space or the end ("3.50" and "e.g" stay whole)
_CLAUSE_END = re.compile(r"([" + re.escape(CLAUSE_PUNCTUATION) + r"]+)(?=\s|$)")


class G2PUnavailable(ConfigError):
    """Raised when no eSpeak NG backend can be loaded."""


class Phonemizer(Protocol):
    def phonemes(self, text: str) -> str:
        """IPA phonemes of one punctuation-free piece of text (words separated by spaces)."""
        ...


def split_clauses(text: str) -> list[tuple[str, str]]:
    """`"Hi, you!"` -> `[("Hi", ","), (" you", "!")]`: each piece with the marks that end it."""
    pieces: list[tuple[str, str]] = []
    pos = 0
    for match in _CLAUSE_END.finditer(text):
        pieces.append((text[pos:match.start()], match.group(1)))
        pos = match.end()
    if text[pos:].strip():
        pieces.append((text[pos:], ""))
    return pieces


def phonemize(backend: Phonemizer, text: str) -> str:
    """IPA for `text` with its clause punctuation restored, in Piper's format (for "Hello, world!" the
    phonemes of each word, then the comma or the exclamation mark after its clause)."""
    out: list[str] = []
    for piece, marks in split_clauses(text):
        ipa = backend.phonemes(piece).strip() if piece.strip() else ""
        if ipa or marks:
            out.append(ipa + marks)
    return " ".join(p for p in out if p).strip()


class EspeakLibrary:
    """eSpeak NG in process via ctypes (`speech` extra). eSpeak keeps global state: one lock."""

    _lock = threading.Lock()
    _lib: ctypes.CDLL | None = None

    def __init__(self, voice: str = DEFAULT_VOICE) -> None:
        try:
            import espeakng_loader
        except ImportError as exc:
            raise G2PUnavailable("eSpeak NG library not installed (pip install 'omniflow[speech]')") from exc
        with self._lock:
            if EspeakLibrary._lib is None:
                lib = ctypes.cdll.LoadLibrary(espeakng_loader.get_library_path())
                lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
                lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
                lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
                rate = lib.espeak_Initialize(ESPEAK_AUDIO_OUTPUT_SYNCHRONOUS, 0,
                                             espeakng_loader.get_data_path().encode(), 0)
                if rate <= 0:
                    raise G2PUnavailable(f"espeak_Initialize failed ({rate})")
                EspeakLibrary._lib = lib
            self.voice = voice
            self._set_voice()

    def _set_voice(self) -> None:
        assert self._lib is not None
        if self._lib.espeak_SetVoiceByName(self.voice.encode()) != 0:
            raise G2PUnavailable(f"eSpeak NG has no voice {self.voice!r}")

    def phonemes(self, text: str) -> str:
        assert self._lib is not None
        with self._lock:
            self._set_voice()
            buf = ctypes.c_char_p(text.encode())
            ptr = ctypes.pointer(buf)
            parts: list[str] = []
            while buf.value:       # eSpeak returns one clause per call and advances the pointer
                result = self._lib.espeak_TextToPhonemes(ptr, ESPEAK_CHARS_AUTO, ESPEAK_PHONEMES_IPA)
                if result:
                    parts.append(result.decode())
            return " ".join(parts)


class EspeakCommand:
    """eSpeak NG out of process: `espeak-ng -q --ipa --sep= -v VOICE TEXT` (Debian's `espeak-ng`)."""

    def __init__(self, voice: str = DEFAULT_VOICE, executable: str = "espeak-ng") -> None:
        path = shutil.which(executable)
        if path is None:
            raise G2PUnavailable(f"{executable!r} not found on PATH (apt-get install espeak-ng)")
        self.argv = [path, "-q", "--ipa", "--sep=", "-v", voice]

    def phonemes(self, text: str) -> str:
        result = subprocess.run([*self.argv, text], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                                check=True)
        return " ".join(result.stdout.split())


def load_phonemizer(voice: str = DEFAULT_VOICE, backends: Sequence[str] = ("library", "command")) -> Phonemizer:
    """The first eSpeak NG backend that loads; `G2PUnavailable` with both reasons when none does."""
    reasons: list[str] = []
    for name in backends:
        try:
            if name == "library":
                return EspeakLibrary(voice)
            if name == "command":
                return EspeakCommand(voice)
            reasons.append(f"unknown backend {name!r}")
        except (G2PUnavailable, OSError) as exc:
            reasons.append(f"{name}: {exc}")
    raise G2PUnavailable("no eSpeak NG for phonemes: " + "; ".join(reasons))
