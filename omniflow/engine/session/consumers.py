"""Which replicas consume which stage: what a producer declares so its emits may forward chunks to
the consuming sessions' inboxes (every key a script touches is in its KEYS, the inbox included).

A worker keeps one book for all its sessions. It learns a replica when an `emit.lua` call is
refused because the stage it forwards to is bound to a replica whose inbox the call did not
declare (the call wrote nothing and is sent again, declaring it); from then on every session of
the worker declares that inbox for that stage and cell, so in steady state no call is refused. The
book keeps the last few replicas per stage and cell: declaring a gone replica's inbox costs a few
bytes, nothing else (a key is written only when the stage is bound to it).

A consumer bound to the producer's own worker gets no inbox copy: the producer hands it the chunks
in memory (`LocalInputs`).
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_PER_STAGE = 8


class Consumers:
    """(stage, cell) -> the replicas seen consuming it, most recent last."""

    def __init__(self, *, per_stage: int = DEFAULT_PER_STAGE) -> None:
        self._seen: dict[tuple[str, int], list[str]] = {}
        self._per_stage = per_stage
        self.version = 0            # bumped on every change: sessions rebuild their KEYS

    def learn(self, stage: str, cell: int, replica: str) -> None:
        seen = self._seen.setdefault((stage, cell), [])
        if replica in seen:
            return
        seen.append(replica)
        del seen[:-self._per_stage]
        self.version += 1

    def of(self, stages: Sequence[str], cell: int) -> dict[str, tuple[str, ...]]:
        """The replicas known to consume each of `stages` in `cell`."""
        return {st: tuple(self._seen.get((st, cell), ())) for st in stages}


InputKey = tuple[str, str, int]         # (workflow id, stage, attempt)


class InputQueue:
    """A session's input queue: `asyncio.Queue`'s `put_nowait`, `get_nowait`, `get`, `empty` and
    `qsize` for one consumer (the session) and producers on the same loop (the inbox reader, the
    producers of its worker handing their chunks over, the watchdog's resync). Unbounded, as the
    queue it replaces; a deque and one waiter: ~3 Python calls per chunk where `asyncio.Queue`'s
    put and get made ~10 (bench/notes.md, round 20). `empty()` may be read from another thread
    (a compute thread's hint, as before). A cancelled `get` leaves what it waited for queued."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class LocalInputs:
    """The input queues of a worker's sessions, and the chunks its own producers hand them.

    A session's queue is registered before its claim is sent and removed when it ends; the worker's
    inbox reader feeds it what producers of other workers forward. A producer of this worker names
    the worker in its `emit.lua` calls (`replica`): for a consumer bound to this worker the script
    writes no inbox copy, and once the call has written its steps the producer hands their chunks to
    the consuming session here (`deliver`), one blocking read and one inbox entry fewer per hop
    between two stages of one process. What is handed over is in the edge log already: a session
    that misses it (its queue registered after the call, a reply lost with the connection) reads it
    from there (the claim's catch-up, the watchdog's resync), and the reader skips what it has.
    """

    def __init__(self, replica: str = "") -> None:
        self.replica = replica
        self._queues: dict[InputKey, InputQueue] = {}

    def register(self, key: InputKey, queue: InputQueue) -> None:
        self._queues[key] = queue

    def get(self, key: InputKey) -> InputQueue | None:
        return self._queues.get(key)

    def pop(self, key: InputKey) -> InputQueue | None:
        return self._queues.pop(key, None)

    def deliver(self, key: InputKey, src: str, chunks: Iterable[dict[bytes, Any]]) -> bool:
        """Queue `chunks` of `src` for this worker's session `key`, if it still has it (False when not)."""
        queue = self._queues.get(key)
        if queue is None:
            return False
        for chunk in chunks:
            queue.put_nowait((src, chunk))
        return True
