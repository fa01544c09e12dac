"""Fan-out of workflow event logs to many waiters over one blocking XREAD.

Long-polls, SSE streams and OpenAI streams all wait on a workflow's event log
(`<prefix>:wf:{id}:log`; an entry holds the events of one script call: `schema.log_events`).
Each would otherwise hold a Redis connection in its own XREAD BLOCK; instead they
subscribe here: one `StreamMux` watches every log that has at least one subscriber
and copies each entry to every subscriber's queue. A subscriber replays the history
after its cursor with XRANGE first and drops live duplicates by event id, so it never
misses an event that arrived between its subscription and its replay (`Store.read_log`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

from omniflow.storage.mux import Entry, StreamMux
from omniflow.client.store import LOG_ENTRY_LIMIT, Store
from omniflow.storage.schema import event_position, log_events, s
from omniflow.storage.topology import read_groups

Event = tuple[str, dict[str, str]]
IDLE: Event = ("", {})


def stream_id(value: str) -> tuple[int, int, int]:
    """An event id -> where it is in the log: '1700000000000-3' -> (1700000000000, 3, 0), its entry's
    third event '1700000000000-3.2' -> (1700000000000, 3, 2); a bare ms time counts as seq 0."""
    return event_position(value)


def is_stream_id(value: str) -> bool:
    try:
        stream_id(value)
    except ValueError:
        return False
    return True


class LogHub:
    """Subscribe to workflow event logs without one connection per waiter."""

    def __init__(self, store: Store, *, block_ms: int = 5_000) -> None:
        self._store = store
        self._keys = store.keys
        # one blocking read over every cell on a single server; one per cell on a cluster
        groups = read_groups(store.client, store.keys.cells)
        self._muxes = [StreamMux(store.client, store.keys, block_ms=block_ms, cell=group[0]) for group in groups]
        self._mux_of = {cell: mux for group, mux in zip(groups, self._muxes) for cell in group}
        self._subs: dict[str, set[asyncio.Queue[Entry]]] = {}
        self._pumps: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        for mux in self._muxes:
            mux.start()

    async def close(self) -> None:
        for task in self._pumps.values():
            task.cancel()
        await asyncio.gather(*self._pumps.values(), return_exceptions=True)
        self._pumps.clear()
        for mux in self._muxes:
            await mux.close()

    @property
    def watched(self) -> int:
        return len(self._subs)

    async def _pump(self, key: str, source: asyncio.Queue[Entry]) -> None:
        while True:
            entry = await source.get()
            for queue in self._subs.get(key, ()):
                queue.put_nowait(entry)

    async def _subscribe(self, key: str, after: str, cell: int) -> asyncio.Queue[Entry]:
        queue: asyncio.Queue[Entry] = asyncio.Queue()
        subs = self._subs.setdefault(key, set())
        subs.add(queue)
        if key not in self._pumps:
            mux = self._mux_of[cell]
            source = mux.watch(key, after.partition(".")[0])      # (the entry of an event id)
            self._pumps[key] = asyncio.create_task(self._pump(key, source), name=f"hub:{key}")
            await mux.poke()
        return queue

    def _unsubscribe(self, key: str, queue: asyncio.Queue[Entry], cell: int) -> None:
        subs = self._subs.get(key)
        if subs is None:
            return
        subs.discard(queue)
        if not subs:
            del self._subs[key]
            self._mux_of[cell].unwatch(key)
            pump = self._pumps.pop(key, None)
            if pump is not None:
                pump.cancel()

    @asynccontextmanager
    async def follow(self, wf_id: str, *, after: str = "0-0", timeout_s: float | None = None,
                     idle_s: float | None = None) -> AsyncIterator[AsyncIterator[Event]]:
        """Entries of the workflow's log after `after`: history first, then live ones.

        The iterator ends after the terminal entry, or when `timeout_s` passes; with
        `idle_s` it yields `IDLE` after that long without an entry (SSE keep-alives).
        """
        key, cell = self._keys.log(wf_id), self._keys.cell_of(wf_id)
        if cell not in self._mux_of:
            cell = 0            # an id of no cell of ours: its log does not exist, the history says so
        queue = await self._subscribe(key, after, cell)
        events = self._iterate(wf_id, queue, after, timeout_s, idle_s)
        try:
            yield events
        finally:
            await events.aclose()
            self._unsubscribe(key, queue, cell)

    async def _iterate(self, wf_id: str, queue: asyncio.Queue[Entry], after: str,
                       timeout_s: float | None, idle_s: float | None) -> AsyncGenerator[Event, None]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        cursor = stream_id(after)
        while True:         # the history, page by page
            page = await self._store.read_log(wf_id, after=after)
            for eid, event in page:
                cursor = stream_id(eid)
                yield eid, event
                if event.get("t") == "terminal":
                    return
            if len(page) < LOG_ENTRY_LIMIT:
                break
            after = page[-1][0]
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            wait = idle_s if left is None else (left if idle_s is None else min(left, idle_s))
            try:
                raw_id, fields = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                yield IDLE
                continue
            for eid, event in log_events(s(raw_id), fields):
                if stream_id(eid) <= cursor:
                    continue
                cursor = stream_id(eid)
                yield eid, event
                if event.get("t") == "terminal":
                    return
