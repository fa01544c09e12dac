"""G2P: clause splitting and punctuation restored after eSpeak NG drops it."""
from __future__ import annotations

import pytest

from omniflow.workers.g2p import G2PUnavailable, load_phonemizer, phonemize, split_clauses


class Upper:
    """A stand-in backend that, like eSpeak, returns no punctuation."""

    def phonemes(self, text: str) -> str:
        return " ".join(w.strip(".,;:!?").upper() for w in text.split())


def test_split_keeps_numbers_and_marks() -> None:
    assert split_clauses("Hi, you! It costs 3.50 dollars. Ok") == [
        ("Hi", ","), (" you", "!"), (" It costs 3.50 dollars", "."), (" Ok", "")]
    assert split_clauses("Really?!") == [("Really", "?!")]
    assert split_clauses("") == []


def test_punctuation_is_put_back() -> None:
    assert phonemize(Upper(), "Hello! How are you, friend?") == "HELLO! HOW ARE YOU, FRIEND?"
    assert phonemize(Upper(), "...") == "..."


def test_real_espeak_restores_the_exclamation() -> None:
    g2p = load_phonemizer()
    ipa = phonemize(g2p, "Hello! Nice day, isn't it?")
    assert ipa.endswith("?") and "!" in ipa and "," in ipa
    assert "h" in ipa.split("!")[0]          # "Hello" and not "Below"


def test_unknown_backend_is_refused_with_reasons() -> None:
    with pytest.raises(G2PUnavailable, match="unknown backend 'nope'"):
        load_phonemizer(backends=["nope"])
