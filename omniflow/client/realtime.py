"""Realtime sessions' state in Redis (`/v1/realtime`): one hash per session — the connection that
owns it, its state as JSON, its tenant — kept `realtime_session_ttl_s` after its last write.

A session outlives its WebSocket: a client that reconnects with the session id gets the state
back (`claim`), and from then on its new connection is the only one whose writes land (`save` is
fenced by `realtime_save.lua`), so a half-open old connection cannot overwrite newer state.
What the state holds is the API's business (`omniflow.api.realtime.state`); here it is a JSON
document.
"""
from __future__ import annotations

import json
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.storage import redisio
from omniflow.storage.keys import Keys
from omniflow.storage.redisio import translated
from omniflow.storage.transitions.realtime import SaveResult, realtime_save, save_result

__all__ = ["RealtimeSessions", "SaveResult"]


class RealtimeSessions:
    """Create, claim and save realtime sessions' state."""

    def __init__(self, redis: RedisClient, keys: Keys, *, ttl_s: int) -> None:
        self._redis, self._keys, self.ttl_s = redis, keys, ttl_s

    async def _call(self, mode: str, session_id: str, owner: str, state: str, tenant: str) -> tuple[SaveResult, str]:
        return save_result(await redisio.call(self._redis, *realtime_save(
            self._keys, session_id, mode=mode, owner=owner, state=state, ttl_s=self.ttl_s, tenant=tenant)))

    @translated
    async def create(self, session_id: str, *, owner: str, tenant: str, state: dict[str, Any]) -> bool:
        """Store a new session owned by connection `owner`; False if the id is taken."""
        result, _ = await self._call("create", session_id, owner, json.dumps(state), tenant)
        return result is SaveResult.OK

    @translated
    async def claim(self, session_id: str, *, owner: str, tenant: str) -> dict[str, Any] | None:
        """Make connection `owner` the session's owner; its state, or None when there is no such
        session for this tenant."""
        result, raw = await self._call("claim", session_id, owner, "", tenant)
        return json.loads(raw) if result is SaveResult.OK else None

    @translated
    async def save(self, session_id: str, *, owner: str, tenant: str, state: dict[str, Any]) -> SaveResult:
        """Write the state as connection `owner`: `OK`, or `TAKEN` when another connection claimed
        the session since (nothing written), `GONE` when it expired."""
        result, _ = await self._call("save", session_id, owner, json.dumps(state), tenant)
        return result
