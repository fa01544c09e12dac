"""The common no-op workload: thinker → talker → code2wav.

thinker emits 4 text chunks, talker turns each text chunk into a code chunk, code2wav
emits one audio chunk. The work itself is negligible on purpose: the benchmark
measures orchestration (queueing, hand-off, acknowledgement), not compute.
Standard library only (the Celery virtualenv imports it too).
"""
from __future__ import annotations

TEXT_CHUNKS = 4
AUDIO_BYTES = 64

# Names of the Redis keys every Redis-based peer uses for the measurement itself
# (not part of any system under test).
DONE_STREAM = "bench:done"     # completing stage: XADD wf=<id> ts=<submit time> td=<done time>
READY_KEY = "bench:ready"      # each worker process INCRs it once it is ready to consume


def thinker(prompt: str) -> list[str]:
    return [f"{prompt}:{i}" for i in range(TEXT_CHUNKS)]


def talker(texts: list[str]) -> list[list[int]]:
    return [[len(t), i] for i, t in enumerate(texts)]


def code2wav(codes: list[list[int]]) -> bytes:
    return bytes(AUDIO_BYTES)
