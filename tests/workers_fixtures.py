"""Executors used only by tests."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniflow.workers.base import Session
from omniflow.workers.toy import ToyThinker, hidden_state


class AttemptThinker(ToyThinker):
    """Non-deterministic across attempts (its words carry the attempt number), so it cannot resume."""

    resumable = False

    async def run(self, session: Session) -> Mapping[str, Any]:
        words = [f"a{session.attempt}w{i}" for i in range(int(self._param(session, "max_words", 8)))]
        for i, word in enumerate(words):
            await self._step(session, i + 1)
            await session.emit(text=word if i == 0 else " " + word, data={"hidden": hidden_state(word, i), "word": word})
        return {"completion_tokens": len(words)}
