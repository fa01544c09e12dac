"""One stage's work on one workflow: the engine's implementation of the executor contract's
`Session` Protocol (`omniflow.executor.base`, the members an executor may use), with Redis behind it.

An executor reads `inputs()` (first the catch-up the claim returned, then the
chunks forwarded to the worker's inbox; de-duplicated on `(stage, seq)`, ending
at every upstream's end-of-stream) and calls `emit()` for each output step. A producer's emits
declare the inboxes of the replicas its worker knows consume its downstream stages (`consumers`):
a call refused because the consumer is bound elsewhere wrote nothing and is sent again, declaring it.
Emits are queued on the worker's group-commit batcher as one lazily built
`emit.lua` call: steps emitted while the previous write is on the wire join the
next call, and the session's finish (`close()`) rides on its last one. `emit()`
returns without waiting for the round trip unless too many writes are in flight;
the first failed or refused write is sticky (no step is ever written past a hole).

Resume: a retried session starts with `resume_seq` = how many steps earlier
attempts already wrote. Steps up to it are suppressed without touching Redis,
so a deterministic executor that starts over produces no duplicate; an
autoregressive one calls `fast_forward()` and continues from the text it gets
back (prefill prompt + emitted tokens), or from `checkpoint`: what earlier
attempts checkpointed with their steps (`emit(checkpoint=...)`, written in the
same atomic step, so it always matches `resume_seq`).

Payloads (`omniflow.dataplane`): a chunk's payload travels inline in its edge entry when small,
else in a shared-memory segment (when the consuming session's replica is on this host) or a Redis
key (`emit.lua` stores it with the entry), the entry holding a reference. The consumer resolves
references as it reads and releases them when its session is done. A producer may have at most
`dataplane_edge_max_chunks` / `_bytes` unread on one chunk edge: past it, `emit` waits (without
blocking the loop) until the consumer's read position (`<dst>:rd:<src>` in the stages hash,
reported every quarter of the bound) moves on.

Threads: an executor may run on its stage's compute thread (`omniflow.engine.compute`).
The session belongs to the worker's event loop (`_home`); called from another
loop, `emit` encodes the step on the caller's thread and hands it over without
waiting, and `inputs`/`flush` run their Redis-facing part on the worker's loop.

Lifecycle (`SessionState`): WAITING_INPUT (claimed, no input yet) or RUNNING -> CLOSED (`close`
called: emits refused); FENCED (a write was refused: a newer attempt owns the stage, or the
workflow ended) and ABORTED (the workflow was aborted) end it from any state and stay.

The package: `core` (what every part shares: fields, thread hops, the lifecycle), `outputs` (emit,
close, flush), `inputs` (the input stream), `session` (the `Session` dataclass).
"""
from __future__ import annotations

from omniflow.executor import Chunk
from omniflow.engine.session.session import Session
from omniflow.models import SessionState

__all__ = ["Chunk", "Session", "SessionState"]
