"""workers/voices.py: every OpenAI voice name is accepted and spoken by the one shipped voice."""
from __future__ import annotations

import typing

import pytest

from omniflow.workers.voices import DEFAULT_VOICE, OPENAI_VOICES, UnknownVoice, list_voices, resolve


def test_the_names_are_the_installed_openai_packages_built_in_voices() -> None:
    speech = pytest.importorskip("openai.types.audio.speech_create_params")
    literals = [a for a in typing.get_args(speech.Voice) if typing.get_origin(a) is typing.Literal]
    assert len(literals) == 1
    assert set(typing.get_args(literals[0])) == set(OPENAI_VOICES)


def test_every_name_resolves_to_the_shipped_voice() -> None:
    for name in OPENAI_VOICES:
        assert resolve(name).speaks_as.name == "joe" and resolve(name).id == name
    assert resolve(" Alloy ").id == "alloy" and resolve({"id": "nova"}).id == "nova"
    assert resolve("joe").speaks_as.sample_rate == 22050
    assert resolve(None).id == DEFAULT_VOICE


def test_an_unknown_voice_is_refused_naming_the_known_ones() -> None:
    for bad in ("darth", "", {"id": "voice_1234"}, 7):
        with pytest.raises(UnknownVoice, match="unknown voice .*: the voices are alloy, ash, .*joe"):
            resolve(bad)  # type: ignore[arg-type]


def test_the_listing_has_every_name_once_in_a_stable_order() -> None:
    listed = list_voices()
    assert [v["id"] for v in listed] == [*OPENAI_VOICES, "joe"]
    assert all(v["object"] == "audio.voice" and v["voice"] == "joe" for v in listed)
