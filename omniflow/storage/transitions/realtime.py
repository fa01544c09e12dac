"""Realtime sessions: `realtime_save.lua` (a session's state, fenced by the connection that owns it)."""
from __future__ import annotations

from enum import Enum
from typing import Any

from omniflow.storage.keys import Keys
from omniflow.storage.schema import s
from omniflow.storage.transitions._base import Call, code_of, returns, script_call


@returns("realtime_save")
class SaveResult(str, Enum):
    """What `realtime_save.lua` answered."""

    OK = "ok"
    GONE = "gone"          # no such session (expired, never made, or another tenant's)
    TAKEN = "taken"        # another connection owns the session now
    EXISTS = "exists"      # create: the id is in use


def realtime_save(keys: Keys, session_id: str, *, mode: str, owner: str, state: str, ttl_s: int, tenant: str) -> Call:
    """`mode`: 'create' | 'claim' | 'save' (see the script's header)."""
    return script_call("realtime_save", [keys.realtime(session_id)], [mode, owner, state, ttl_s, tenant])


def save_result(reply: Any) -> tuple[SaveResult, str]:
    """(code, the stored state JSON or '')."""
    return code_of(SaveResult, reply, "realtime_save"), (s(reply[1]) if len(reply) > 1 else "")
