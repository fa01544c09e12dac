"""workers/vad.py's Endpointer: where a stream of speech probabilities is cut into utterances
(pure logic; the Silero model itself is tested in tests/models/test_asr.py)."""
from __future__ import annotations

import numpy as np
import pytest

from omniflow.workers.vad import WINDOW, EndpointConfig, Endpointer

W_S = WINDOW / 16000          # one window: 32 ms


def windows(*spans: tuple[float, float]) -> np.ndarray:
    """Probabilities for consecutive spans of (seconds, probability)."""
    return np.concatenate([np.full(round(s / W_S), p) for s, p in spans])


def cuts_of(probs: np.ndarray, config: EndpointConfig, sizes: list[int]) -> tuple[list[tuple[int, int]], int]:
    cutter, cuts, i, k = Endpointer(config), [], 0, 0
    while i < probs.size:
        size = sizes[k % len(sizes)]
        cuts += cutter.feed(probs[i:i + size])
        i, k = i + size, k + 1
    return cuts, cutter.start


CONFIG = EndpointConfig(min_utterance_s=2.0, max_utterance_s=6.0, pause_s=0.2, lead_s=0.3)


def test_silence_before_speech_is_dropped_but_for_the_lead() -> None:
    cutter = Endpointer(CONFIG)
    assert cutter.feed(windows((3.0, 0.01))) == []
    assert not cutter.has_speech
    assert cutter.start == round(3.0 / W_S) * WINDOW - int(0.3 * 16000)     # 0.3 s kept before what comes next
    cutter.feed(windows((1.0, 0.9)))
    assert cutter.has_speech


def test_a_pause_cuts_in_its_middle_once_the_utterance_is_long_enough() -> None:
    probs = windows((1.0, 0.9), (0.4, 0.05), (1.5, 0.9), (0.4, 0.05), (1.0, 0.9))
    cuts, _ = cuts_of(probs, CONFIG, [probs.size])
    # the first pause comes at 1.0 s: too early (min 2 s); the second, at 2.9 s, is cut in the
    # middle of its first 0.2 s (7 windows: the first whole number of windows that long)
    pause_from = (round(1.0 / W_S) + round(0.4 / W_S) + round(1.5 / W_S)) * WINDOW
    assert cuts == [(0, pause_from + 7 * WINDOW // 2)]


def test_between_the_thresholds_a_pause_goes_on() -> None:
    probs = windows((2.5, 0.9), (0.1, 0.1), (0.2, 0.4), (1.0, 0.9))     # 0.4: neither speech nor silence
    cuts, _ = cuts_of(probs, CONFIG, [probs.size])
    assert len(cuts) == 1
    assert cuts_of(windows((2.5, 0.9), (0.1, 0.1), (0.2, 0.6), (1.0, 0.9)), CONFIG, [1000])[0] == []


def test_a_long_utterance_is_cut_at_its_quietest_window_in_the_second_half() -> None:
    probs = windows((4.0, 0.9), (0.064, 0.4), (3.0, 0.9))        # never a pause below neg_threshold
    cuts, start = cuts_of(probs, CONFIG, [probs.size])
    quiet = round(4.0 / W_S)
    assert cuts == [(0, quiet * WINDOW + WINDOW // 2)]
    assert start == cuts[0][1]


@pytest.mark.parametrize("sizes", [[1], [3, 1, 7], [50]])
def test_the_cuts_do_not_depend_on_how_the_probabilities_arrive(sizes: list[int]) -> None:
    rng = np.random.default_rng(3)
    probs = np.clip(rng.normal(0.6, 0.35, 2000), 0, 1)        # 64 s of speech with pauses here and there
    whole = cuts_of(probs, CONFIG, [probs.size])
    assert len(whole[0]) >= 8
    assert cuts_of(probs, CONFIG, sizes) == whole
    for (a, b), (c, _) in zip(whole[0], whole[0][1:]):
        assert a < b == c and b - a <= CONFIG.max_utterance_s * 16000      # contiguous, none too long


def test_params_are_checked() -> None:
    assert EndpointConfig.from_params({"pause_s": "0.5", "vad_threshold": 0.6, "other": 1}) == EndpointConfig(
        pause_s=0.5, threshold=0.6)
    for bad in ({"vad_threshold": 0.2}, {"min_utterance_s": 10, "max_utterance_s": 5}, {"pause_s": 0},
                {"max_utterance_s": 31}, {"lead_s": -1}):
        with pytest.raises(ValueError):
            EndpointConfig.from_params(bad)
    with pytest.raises(ValueError):
        EndpointConfig.from_params({"pause_s": "soon"})
