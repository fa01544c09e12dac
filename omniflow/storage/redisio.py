"""The Redis boundary under its former name: everything here is `omniflow.storage.client`'s, `.sync_client`'s and `.runner`'s
(kept so that code written against `redisio` keeps working; new code imports the client)."""
from __future__ import annotations

from omniflow.storage.client import (
    CLIENT_ERRORS,
    REDIS_ERRORS,
    REFUSALS,
    RedisClient,
    boundary,
    connect,
    is_nogroup,
    is_refused,
    translate,
    translated,
)
from omniflow.storage.sync_client import SyncRedisClient, connect_sync
from omniflow.storage.queued import Pipeline
from omniflow.storage.runner import (
    READ_ONLY, call, call_sync, ensure_group, execute, load_scripts, require_replicas, script,
)

__all__ = ["CLIENT_ERRORS", "READ_ONLY", "REDIS_ERRORS", "REFUSALS", "Pipeline", "RedisClient", "SyncRedisClient",
           "boundary", "call", "call_sync", "connect", "connect_sync", "ensure_group", "execute", "is_nogroup",
           "is_refused", "load_scripts", "require_replicas", "script", "translate", "translated"]
