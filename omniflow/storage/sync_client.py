"""The synchronous twin of `RedisClient` (the synchronous client's submits): a few commands, errors
translated as `omniflow.storage.client` translates them. redis-py stays behind `client` and `topology`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from omniflow.errors import ConfigError
from omniflow.storage.client import CLIENT_ERRORS, KeyT, translate
from omniflow.storage.topology import open_sync_client

if TYPE_CHECKING:
    from omniflow.storage.topology import SyncConnection as SyncRedis


def connect_sync(url: str, **kwargs: Any) -> SyncRedisClient:
    """The synchronous twin of `connect` (the synchronous client's submits)."""
    try:
        return SyncRedisClient(open_sync_client(url, **kwargs))
    except ValueError as exc:
        raise ConfigError(f"OMNIFLOW_REDIS_URL: {url!r} is not a Redis URL ({exc})") from exc


class SyncRedisClient:
    """The synchronous twin of `RedisClient`, for the synchronous client's submits."""

    def __init__(self, raw: SyncRedis) -> None:
        self._raw = raw

    @property
    def raw(self) -> SyncRedis:
        return self._raw

    def _do(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._raw, name)(*args)
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    def execute_command(self, *args: Any) -> Any:
        return self._do("execute_command", *args)

    def exists(self, *keys: KeyT) -> int:
        return int(self._do("exists", *keys))

    def hget(self, key: KeyT, field: KeyT) -> bytes | None:
        return cast("bytes | None", self._do("hget", key, field))

    def close(self) -> None:
        self._raw.close()

