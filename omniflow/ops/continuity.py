"""How continuous a stream of audio chunks is, as a client playing it as it arrives would hear it.

The definition is the one vLLM-Omni's benchmarks use (`max_playback_underrun_s` and the continuity
pass rates c50/c100/c200, threshold 100 ms by default): playback starts when the first chunk
arrives and plays the chunks back to back. Chunk k, arriving at `t_k` with `d_k` seconds of audio,
*underruns* when it arrives after everything before it has finished playing (the client's queue
ran dry): the stall is `u_k = t_k - deadline_k`, and playback resumes with that chunk, so
`deadline_{k+1} = max(deadline_k, t_k) + d_k` (`deadline_1 = t_0 + d_0`). The inter-chunk gap is
`t_k - t_{k-1}`; a gap longer than the audio the client still had queued is exactly an underrun.

omniflow measures arrival where clients read it: the time Redis appended the chunk's `audio` entry
to the workflow's log (its entry id, server clock, ms), which is what SSE, long-poll and the OpenAI
stream deliver. Network and client buffering come on top.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Continuity:
    """One audio stream's continuity."""

    chunks: int = 0
    audio_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)   # between consecutive arrivals
    underruns: int = 0                                  # chunks that arrived after the queue ran dry
    underrun_s: float = 0.0                             # their stalls, summed
    max_underrun_s: float = 0.0                         # the longest stall (0.0 for a continuous stream)


def continuity(chunks: Sequence[tuple[float, float]]) -> Continuity:
    """`chunks`: (arrival time s, audio duration s) of each chunk, in arrival order (durations < 0
    count as 0)."""
    if not chunks:
        return Continuity()
    first_at, first_s = chunks[0]
    deadline = first_at + max(0.0, first_s)
    audio_s = max(0.0, first_s)
    gaps: list[float] = []
    underruns, underrun_s, longest = 0, 0.0, 0.0
    previous = first_at
    for arrived, duration in chunks[1:]:
        duration = max(0.0, duration)
        gaps.append(max(0.0, arrived - previous))
        previous = arrived
        stall = arrived - deadline
        if stall > 0:
            underruns += 1
            underrun_s += stall
            longest = max(longest, stall)
        deadline = max(deadline, arrived) + duration
        audio_s += duration
    return Continuity(chunks=len(chunks), audio_s=audio_s, gaps_s=gaps, underruns=underruns,
                      underrun_s=underrun_s, max_underrun_s=longest)
