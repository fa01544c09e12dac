"""The book of which replicas consume which stage (pure): what a producer's emits declare; a
session's input queue."""
from __future__ import annotations

import asyncio

import pytest

from omniflow.engine.session.consumers import Consumers, InputQueue
from omniflow.storage.keys import Keys
from omniflow.storage.transitions.emit import emit_keys


def test_a_replica_learned_is_declared_per_stage_and_cell_and_the_book_stays_bounded() -> None:
    book = Consumers(per_stage=2)
    assert book.of(("talker",), 0) == {"talker": ()}
    book.learn("talker", 0, "w1")
    seen = book.version
    book.learn("talker", 0, "w1")             # known already: nothing changes, no session rebuilds its KEYS
    assert book.version == seen
    book.learn("talker", 1, "w9")
    book.learn("talker", 0, "w2")
    book.learn("talker", 0, "w3")             # the oldest of cell 0 goes
    assert book.of(("talker", "code2wav"), 0) == {"talker": ("w2", "w3"), "code2wav": ()}
    assert book.of(("talker",), 1) == {"talker": ("w9",)}


def test_an_emit_declares_the_inboxes_of_the_known_consumers_once() -> None:
    keys = Keys("t", 1)
    declared = emit_keys(keys, "0abc", "thinker", ("talker", "code2wav"),
                         {"talker": ("w1", "w2"), "code2wav": ("w1",)})
    assert declared[-2:] == [keys.inbox("w1", 0), keys.inbox("w2", 0)]
    assert emit_keys(keys, "0abc", "thinker", ("talker",)) == declared[:7]


def test_an_input_queue_keeps_order_wakes_its_reader_and_loses_nothing_to_a_cancelled_read() -> None:
    async def main() -> None:
        queue = InputQueue()
        assert queue.empty() and queue.qsize() == 0
        with pytest.raises(asyncio.QueueEmpty):
            queue.get_nowait()
        reader = asyncio.create_task(queue.get())
        await asyncio.sleep(0)                    # the reader waits
        assert not reader.done()
        queue.put_nowait(("thinker", 1))
        queue.put_nowait(("thinker", 2))
        assert await asyncio.wait_for(reader, 1) == ("thinker", 1)
        assert queue.qsize() == 1 and queue.get_nowait() == ("thinker", 2)
        waiting = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        waiting.cancel()                          # a read cancelled while it waits (the input watchdog)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        queue.put_nowait(("talker", 3))           # put after the cancel: kept for the next read
        assert not queue.empty()
        assert await asyncio.wait_for(queue.get(), 1) == ("talker", 3)

    asyncio.run(main())
