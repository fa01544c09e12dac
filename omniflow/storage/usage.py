"""Usage per tenant, as stored: hourly counters that the sessions finishing in an hour add to.

Every finished session adds, in its finish (`finish_session` in `_lib.lua`, the same atomic call
that closes it, so once however often the finish is retried and never for a fenced one), to the
hash `<cell>:usage:<epoch hour>` (`Keys.usage`) of its workflow's cell, fields
`<pipeline>|<stage>|<metric>|<tenant>` (the tenant last: it may hold any character):

| metric | what a session adds |
|---|---|
| `sessions` | 1, for a session that finished `done` |
| `compute_ms` | its compute time (claim to finish, less its waits for upstream chunks and downstream room) |
| `failed_compute_ms` | the same, for an attempt that failed (a retry, or the workflow's failure) |
| `audio_ms` | the audio it produced (final audio stages: samples / sample rate) |
| `prompt_tokens`, `completion_tokens` | what its executor's usage reported under those names |

Each hash expires `usage_retention_days` after its hour ends (each worker sets it with its first
finish of the hour in that cell). Readers sum the hours of a window over every cell
(`omniflow.ops.usage`). The cost on the hot path: 2 to 4 HINCRBY in the finish script per session,
no extra round trip.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BUCKET_S = 3600
METRICS = ("sessions", "compute_ms", "failed_compute_ms", "audio_ms", "prompt_tokens", "completion_tokens")
TOKEN_FIELDS = ("prompt_tokens", "completion_tokens")


def bucket_of(ms: int) -> int:
    """The hour (epoch hours) that epoch-ms `ms` falls in."""
    return ms // (BUCKET_S * 1000)


def bucket_start_s(bucket: int) -> int:
    return bucket * BUCKET_S


def parse_field(field: str) -> tuple[str, str, str, str] | None:
    """`<pipeline>|<stage>|<metric>|<tenant>` -> its parts; None for a field that is not one."""
    parts = field.split("|", 3)
    if len(parts) != 4 or parts[2] not in METRICS:
        return None
    pipeline, stage, metric, tenant = parts
    return pipeline, stage, metric, tenant


def _count(value: Any) -> int:
    """A token count from an executor's usage: a non-negative number, else 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return max(0, int(value))


@dataclass(frozen=True, slots=True)
class Meter:
    """What a session's finish adds to its hour's usage (besides what the script reads itself: the
    tenant, the pipeline, the audio the stage stored)."""

    key: str                 # the hour's usage hash in the workflow's cell (`Keys.usage`)
    expire_at_s: int         # when that hash expires (epoch s); 0: leave its expiry as it is
    compute_ms: int
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, key: str, *, bucket: int, retention_days: int, compute_s: float,
           usage: Mapping[str, Any] | None, set_expiry: bool = True) -> Meter:
        """`set_expiry`: also set the hour's expiry (a worker asks once per hour's key: an EXPIREAT
        per session would cost a command per session for nothing)."""
        # (a dict by its exact type first: `isinstance` of an ABC is two Python calls, once per session)
        tokens = usage if type(usage) is dict or isinstance(usage, Mapping) else {}
        expire_at_s = bucket_start_s(bucket + 1) + retention_days * 86_400 if set_expiry else 0
        return cls(key=key, expire_at_s=expire_at_s,
                   compute_ms=max(0, round(compute_s * 1000)),
                   prompt_tokens=_count(tokens.get("prompt_tokens")),
                   completion_tokens=_count(tokens.get("completion_tokens")))

    def fields(self) -> list[Any]:
        """The finish's meter (msgpack array, see `valid_finish` in `_lib.lua`)."""
        return [self.key, self.expire_at_s, self.compute_ms, self.prompt_tokens, self.completion_tokens]
