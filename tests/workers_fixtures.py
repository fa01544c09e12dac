"""Executors used only by tests."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any

from omniflow.executor import BatchedExecutor, Session, StepOutput
from omniflow.workers.toy import ToyTalker, ToyThinker, hidden_state


class AttemptThinker(ToyThinker):
    """Non-deterministic across attempts (its words carry the attempt number), so it cannot resume."""

    resumable = False

    async def run(self, session: Session) -> Mapping[str, Any]:
        words = [f"a{session.attempt}w{i}" for i in range(int(self._param(session, "max_words", 8)))]
        for i, word in enumerate(words):
            await self._step(session, i + 1)
            await session.emit(text=word if i == 0 else " " + word, data={"hidden": hidden_state(word, i), "word": word})
        return {"completion_tokens": len(words)}


class BlockingThinker(ToyThinker):
    """A thinker whose first step is one blocking call (as a long forward pass is): `block_s` of
    `time.sleep`, holding its thread. Runs where `runs_on` says (param-free: see the subclasses)."""

    runs_on = "thread"
    blocked = threading.Event()       # set while the blocking call is in progress
    cancelled_after_block = threading.Event()

    async def run(self, session: Session) -> Mapping[str, Any]:
        type(self).blocked.set()
        time.sleep(float(self._param(session, "block_s", 3.0)))     # the long forward pass (simulated)
        type(self).blocked.clear()
        try:
            await asyncio.sleep(0)      # the first point where a cancellation can land
        except asyncio.CancelledError:
            type(self).cancelled_after_block.set()
            raise
        return await super().run(session)


class BlockingThinkerOnLoop(BlockingThinker):
    """The same blocking call on the worker's own event loop: what `runs_on = "thread"` prevents."""

    runs_on = "loop"


class HeldThinker(ToyThinker):
    """Every session waits, on the worker's loop, until the test sets `release` (a fresh
    `asyncio.Event` per test: `HeldThinker.release = asyncio.Event()`)."""

    runs_on = "loop"
    release: asyncio.Event | None = None

    async def run(self, session: Session) -> Mapping[str, Any]:
        assert type(self).release is not None, "set HeldThinker.release first"
        await type(self).release.wait()
        return await super().run(session)


class SlowLoadingThinker(ToyThinker):
    """A thinker whose `setup` (its model loading) blocks its compute thread until the test sets
    `release` (60 s at most, so a failed test cannot hang the session)."""

    runs_on = "thread"
    loading = threading.Event()       # set once setup has started
    release = threading.Event()

    async def setup(self) -> None:
        type(self).loading.set()
        type(self).release.wait(timeout=60)


class CountingLM(BatchedExecutor):
    """A deterministic 'language model' with continuous batching: session i of prompt P emits the
    words P-0, P-1, ... one per step, checkpointing each word, so resume and batching are checkable.
    `fail_at_step` makes the step that would emit that word raise once per attempt <= fail_attempts."""

    steps_seen: list[int] = []

    def join(self, session: Session) -> dict[str, Any]:
        done_words = [w for w in session.checkpoint.split(" ") if w]
        if len(done_words) != session.resume_seq:
            raise AssertionError(f"checkpoint {session.checkpoint!r} does not match resume_seq {session.resume_seq}")
        session.fast_forward()
        n = int(session.params.get("max_words", self.params.get("max_words", 6)))
        return {"session": session, "prompt": session.text.split()[0] if session.text.split() else "x",
                "i": len(done_words), "n": n}

    def step(self, states: list[Any]) -> list[StepOutput]:
        type(self).steps_seen.append(len(states))
        time.sleep(float(self.params.get("step_s", 0.0)))      # a forward pass (blocking, on the compute thread)
        outs = []
        for st in states:
            session = st["session"]
            fail_at = int(session.params.get("fail_at_step", 0))
            if fail_at and st["i"] + 1 == fail_at and session.attempt <= int(session.params.get("fail_attempts", 1)):
                raise RuntimeError(f"injected step failure at word {fail_at}")
            word = f"{st['prompt']}-{st['i']}"
            st["i"] += 1
            done = st["i"] >= st["n"]
            outs.append(StepOutput(text=word if st["i"] == 1 else " " + word,
                                   data={"word": word, "hidden": hidden_state(word, st["i"])},
                                   checkpoint=word + " ", done=done,
                                   usage={"words": st["n"]} if done else None))
        return outs


class MeteredLM(CountingLM):
    """`CountingLM` reporting its usage as a language model does: prompt and completion tokens."""

    def step(self, states: list[Any]) -> list[StepOutput]:
        return [dataclasses.replace(out, usage={"prompt_tokens": len(st["session"].text.split()),
                                                "completion_tokens": st["n"]}) if out.done else out
                for st, out in zip(states, super().step(states))]


class TensorThinker(ToyThinker):
    """Emits one torch tensor of each dtype (values from the word) on its edge."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        import torch

        dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64]
        for i, dtype in enumerate(dtypes):
            hidden = torch.full((2, 5), float(i + 1)).to(dtype)
            await session.emit(text=f"t{i} ", data={"hidden": hidden, "word": f"t{i}", "check": float(i + 1)})
        return {"chunks": len(dtypes)}


class TensorCheckingTalker(ToyTalker):
    """Checks each tensor's values and reports the dtypes and shapes it received."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        import numpy as np
        import torch

        seen = []
        async for chunk in session.inputs():
            hidden = chunk.data["hidden"]
            assert isinstance(hidden, torch.Tensor)
            assert torch.all(hidden.float() == chunk.data["check"])
            seen.append([str(hidden.dtype).removeprefix("torch."), list(hidden.shape)])
            await session.emit(data={"codes": np.arange(4, dtype=np.int32), "word": chunk.data["word"]})
        return {"seen": seen}


class ModelServerDownTalker(ToyTalker):
    """Its model server refuses the connection on the first attempt (an executor's own OSError)."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        if session.attempt == 1:
            raise ConnectionRefusedError(111, "model server refused the connection")
        return await super().run(session)


class RecordingTalker(ToyTalker):
    """A toy talker that records which executor instance ran each workflow (`ran`: wf id -> id(self)),
    so a test can see one executor serve the stage of two pipelines."""

    ran: dict[str, int] = {}

    async def run(self, session: Session) -> Mapping[str, Any]:
        type(self).ran[session.wf_id] = id(self)
        return await super().run(session)


class WhereThinker(ToyThinker):
    """The toy thinker with the default `runs_on` ("auto"): records the thread each session ran on."""

    runs_on = "auto"
    threads: list[str] = []

    async def run(self, session: Session) -> Mapping[str, Any]:
        type(self).threads.append(threading.current_thread().name)
        return await super().run(session)
