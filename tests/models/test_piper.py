"""The Piper voice cut in two: seeded latents replay exactly, and the halves speak."""
from __future__ import annotations

from typing import Any

import numpy as np

from omniflow.workers.g2p import load_phonemizer, phonemize


def test_ids_follow_pipers_layout(real_voice: Any) -> None:
    table = real_voice.config.phoneme_id_map
    ids = real_voice.config.ids("ab?")
    pad = table["_"][0]
    assert ids == [table["^"][0], pad, table["a"][0], pad, table["b"][0], pad, table["?"][0], pad, table["$"][0]]


def test_seeded_latents_replay_exactly_and_seeds_differ(real_voice: Any) -> None:
    ids = real_voice.config.ids(phonemize(load_phonemizer(), "A retry must say the same thing."))
    a = real_voice.latents(ids, seed=(1, 2))
    assert a.shape[0] == 192 and 40 < a.shape[1] < 400 and a.dtype == np.float32
    np.testing.assert_array_equal(a, real_voice.latents(ids, seed=(1, 2)))
    assert not np.array_equal(a, real_voice.latents(ids, seed=(1, 3)))


def test_vocoder_half_gives_256_samples_per_frame_of_speech(real_voice: Any) -> None:
    ids = real_voice.config.ids(phonemize(load_phonemizer(), "Hello there."))
    z = real_voice.latents(ids, seed=0)
    audio = real_voice.vocode(z)
    assert audio.shape == (z.shape[1] * 256,)
    assert 0.3 < audio.size / real_voice.sample_rate < 3.0
    assert float(np.sqrt(np.mean(audio ** 2))) > 0.01 and float(np.abs(audio).max()) <= 1.0
