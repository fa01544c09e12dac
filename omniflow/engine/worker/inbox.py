"""A worker's inbox: the inputs its producers forward (one stream per cell), handed to each entry's
session; consumed entries are trimmed in bulk."""
from __future__ import annotations

import logging

from omniflow.engine.worker.chunks import CHUNK_DECODE_ERRORS, decode_chunks
from omniflow.engine.worker.context import WorkerContext
from omniflow.errors import MalformedEntry, RedisError
from omniflow.runtime import Backoff
from omniflow.storage import redisio
from omniflow.storage.entries import inbox as inbox_entry
from omniflow.storage.schema import s

logger = logging.getLogger(__name__)

INBOX_TRIM_EVERY = 128      # inbox entries read between two trims


class Inbox:
    """Reads the worker's inbox streams and feeds its sessions' input queues."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def run(self, cells: tuple[int, ...]) -> None:
        """Read this worker's inboxes of `cells` (inputs forwarded by producers) and hand each entry to
        its session: one XREAD for every cell on a single server, one per cell on a cluster."""
        ctx = self.ctx
        last: dict[str, bytes | str] = {ctx.inbox_keys[cell]: "0-0" for cell in cells}
        cell_of_key = {ctx.inbox_keys[cell]: cell for cell in cells}
        untrimmed = dict.fromkeys(last, 0)
        only = next(iter(ctx.pools.values())).stage if len(ctx.pools) == 1 else None
        backoff = Backoff()
        while True:
            try:
                with redisio.boundary():
                    reply = await ctx.inbox_redis.xread(dict(last), count=1024, block=ctx.settings.block_ms)
                backoff.reset()
            except RedisError as exc:
                await backoff.wait(logger, f"worker {ctx.id}: inbox read failed", exc)
                continue
            for raw_key, entries in reply or []:
                key = s(raw_key)
                for entry_id, fields in entries:
                    last[key] = entry_id
                    try:
                        entry = inbox_entry(fields)
                        chunks = decode_chunks(entry.packed)
                    except (MalformedEntry, *CHUNK_DECODE_ERRORS) as exc:
                        ctx.dead_letter("inbox", cell_of_key[key], key, "", s(entry_id), fields,
                                        f"malformed inbox entry: {exc}")
                        continue
                    queue = ctx.inputs.get((entry.wf_id, entry.stage or only or "", entry.attempt))
                    if queue is not None:       # else: a session that ended (its inputs are durable anyway)
                        for chunk in chunks:
                            queue.put_nowait((entry.src, chunk))
                untrimmed[key] += len(entries)
                if entries and untrimmed[key] >= INBOX_TRIM_EVERY:
                    # consumed entries are trimmed in bulk: the inbox stays about as small as what is in flight
                    ctx.batcher.send("XTRIM", key, "MINID", "~", s(entries[-1][0]))
                    untrimmed[key] = 0
