"""The lean transport: RESP2 over asyncio Protocols, for a standalone server's hot path.

redis-py's asyncio client spends about half of a round trip's client CPU on its own layers (the
pool's get/release, the retry wrapper, the pipeline object, a read per reply through a
StreamReader). `Transport` sends the same commands over its own connections: a command list is
packed by hiredis into one write, its replies are parsed by a `hiredis.Reader` in `data_received`
and handed back in one future per round trip (client CPU per round trip on this 2-vCPU VM, both
ways alternated in one process, medians: FCALL 63 -> 49 µs, 3 commands 75 -> 49 µs, a blocking
XREAD of one entry 37 -> 27 µs; 25 -> 14 and 36 -> 16 µs while the VM ran faster: bench/transport.py).
It is used by `omniflow.storage.runner` (every script call and pipelined command list),
`RedisClient.xread` / `xreadgroup` and `RedisClient.pipeline()` (without MULTI); every other
command, and every cluster or sentinel client, stays on redis-py.

Replies are exactly redis-py's (`decode_responses=False`, RESP2): errors are built by redis-py's
parser (`parse_error`: OOM, READONLY, NOSCRIPT, LOADING... as its exception classes), a reply is
passed through the client's own `response_callbacks` with the options redis-py would pass, a
`ResponseError` stays in place in a command list, and a reply redis-py raises at once (a
`ConnectionError` such as LOADING) fails the round trip. Errors are redis-py's and are translated
by `omniflow.storage.client`, the boundary, like those of redis-py's own calls.

Connections (one `Transport` per `RedisClient`, made from the same redis-py connection settings):

- the *shared* one carries every non-blocking round trip, pipelined in FIFO order by concurrent
  callers; a caller cancelled while waiting only drops its replies (they are still read);
- *exclusive* ones, one per blocking read (XREAD/XREADGROUP with BLOCK) or replicated round trip
  (WAIT blocks the connection), taken from a small idle list; one whose caller was cancelled is
  closed (its reply would come later), as redis-py does.

Each connects lazily; a lost one (EOF, reset) fails every round trip waiting on it with redis-py's
`ConnectionError`, and the next command connects again.
"""
from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.commands.core import StreamCommands
from redis.exceptions import AuthenticationError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from redis._parsers import _AsyncHiredisParser
from redis.utils import format_error_message

from omniflow.storage.topology import FastConnection, pack_one

#: how many exclusive connections wait idle for the next blocking read (more are closed)
MAX_IDLE_EXCLUSIVE = 4
#: options redis-py's `parse_response` takes for itself, never passed to a callback (replies are
#: never decoded here: NEVER_DECODE has nothing to do)
_OWN_OPTIONS = ("keys", NEVER_DECODE, EMPTY_RESPONSE)
_NO_OPTIONS: Mapping[str, Any] = {}
_MORE = object()                                    # the reader's "no whole reply yet"

Command = tuple[Any, ...]
Options = Mapping[str, Any]


class _Round:
    """One round trip in flight: its future and the replies read so far."""

    __slots__ = ("count", "future", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], count: int) -> None:
        self.future = future
        self.count = count
        self.replies: list[Any] = []


class _Conn(asyncio.Protocol):
    """One connection: round trips written in order, replies handed back in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, where: str) -> None:
        self.loop = loop
        self.where = where
        self.closed = False
        self.lost: asyncio.Future[None] = loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(protocolError=InvalidResponse, replyError=_AsyncHiredisParser.parse_error,
                                      notEnoughData=_MORE)
        self._rounds: deque[_Round] = deque()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)      # a stream transport (TCP or TLS)

    def data_received(self, data: bytes) -> None:
        reader, rounds = self._reader, self._rounds
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not _MORE:
                head = rounds[0]
                head.replies.append(reply)
                if len(head.replies) == head.count:
                    rounds.popleft()
                    if not head.future.done():      # else its caller was cancelled: replies dropped
                        head.future.set_result(head.replies)
        except (InvalidResponse, IndexError) as exc:   # garbage, or a reply nobody asked for
            self.close(RedisConnectionError(f"Protocol error from {self.where}: {exc!r}"))

    def eof_received(self) -> bool:
        self.closed = True
        return False                    # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._fail(RedisConnectionError("Connection closed by server."))
        else:
            self._fail(RedisConnectionError(f"Error while reading from {self.where} : {exc.args}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def send(self, packed: bytes, count: int) -> asyncio.Future[list[Any]]:
        """Write one round trip of `count` commands; the future resolves to their replies."""
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise RedisConnectionError("Connection closed by server.")
        future: asyncio.Future[list[Any]] = self.loop.create_future()
        self._rounds.append(_Round(future, count))
        transport.write(packed)
        return future

    def socket(self) -> Any:
        """The socket under the transport (None before it connected)."""
        return None if self._transport is None else self._transport.get_extra_info("socket")

    def close(self, error: BaseException | None = None) -> None:
        """Close now (idempotent): every round trip still waiting fails with `error`."""
        self.closed = True
        if self.loop.is_closed():           # a loop that ended under it: nothing left to tell
            self._rounds.clear()
            return
        self._fail(error or RedisConnectionError("Connection closed by client."))
        if self._transport is not None:
            self._transport.close()
        elif not self.lost.done():
            self.lost.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self.closed = True
        rounds, self._rounds = self._rounds, deque()
        for round_ in rounds:
            if not round_.future.done():
                round_.future.set_exception(error)


class _Recorder:
    """Stands in for a redis-py client to build a command with redis-py's own code: its arguments
    and the options its reply's callback takes."""

    @staticmethod
    def execute_command(*args: Any, **options: Any) -> tuple[Command, dict[str, Any]]:
        return args, options


_RECORDER: Any = _Recorder()


def xread_command(streams: Mapping[Any, Any], count: int | None, block: int | None) -> tuple[Command, dict[str, Any]]:
    """XREAD as redis-py's `xread` builds it (its checks raise redis-py's DataError)."""
    return cast("tuple[Command, dict[str, Any]]", StreamCommands.xread(_RECORDER, cast(Any, streams), count=count, block=block))


def xreadgroup_command(group: str, consumer: str, streams: Mapping[Any, Any], count: int | None, block: int | None,
                       **kwargs: Any) -> tuple[Command, dict[str, Any]]:
    """XREADGROUP as redis-py's `xreadgroup` builds it (`noack=`)."""
    return cast("tuple[Command, dict[str, Any]]", StreamCommands.xreadgroup(
        _RECORDER, group, consumer, cast(Any, streams), count=count, block=block, **kwargs))


class Transport:
    """The lean connections of one `RedisClient` to a standalone server (see the module docstring).

    Every method raises redis-py's errors (the caller translates them); a reply that is an error
    comes back as redis-py's exception instance, in place."""

    def __init__(self, template: Connection, callbacks: Mapping[Any, Callable[..., Any]]) -> None:
        self._template = template            # redis-py's settings for a connection, never connected
        self._where = f"{template.host}:{template.port}"
        self._callbacks = callbacks
        self._found: dict[Any, Callable[..., Any] | None] = {}
        self._handshake = self._hello()
        self._shared: _Conn | None = None
        self._opening: asyncio.Task[_Conn] | None = None
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()

    @classmethod
    def for_client(cls, raw: Any) -> Transport | None:
        """The transport for redis-py client `raw`, or None where it must stay on redis-py: a
        cluster or sentinel client, a Unix socket, RESP3, a credential provider, read timeouts, a
        retry policy or health checks (redis-py's own behaviour there is not reproduced)."""
        if type(raw) is not Redis:
            return None
        pool = raw.connection_pool
        if pool.connection_class not in (FastConnection, SSLConnection):
            return None
        template = pool.connection_class(**pool.connection_kwargs)
        if (template.protocol not in (2, "2") or template.credential_provider is not None
                or template.socket_timeout is not None or template.retry_on_error or template.health_check_interval):
            return None
        return cls(template, raw.response_callbacks)

    # ------------------------------------------------------------ commands
    async def send(self, commands: Sequence[Command], *, exclusive: bool = False) -> list[Any]:
        """One round trip: every command's reply in place (an error reply as redis-py's exception)."""
        if not commands:
            return []
        packed = pack_one(commands[0]) if len(commands) == 1 else b"".join([pack_one(c) for c in commands])
        replies = await self._round_trip(packed, len(commands), exclusive)
        return [self._parse(cmd[0], reply, _NO_OPTIONS) for cmd, reply in zip(commands, replies)]

    async def send_stack(self, stack: Sequence[tuple[Command, Options]], *, exclusive: bool = False) -> list[Any]:
        """A redis-py pipeline's queued commands (each with its options) in one round trip (on a
        connection of its own with `exclusive`: one that blocks)."""
        if not stack:
            return []
        packed = b"".join([pack_one(args) for args, _ in stack])
        replies = await self._round_trip(packed, len(stack), exclusive)
        return [self._parse(args[0], reply, options) for (args, options), reply in zip(stack, replies)]

    async def request(self, args: Command, options: Options, *, exclusive: bool = False) -> Any:
        """One command with redis-py's options; its reply, or its error raised (as redis-py does)."""
        (reply,) = await self._round_trip(pack_one(args), 1, exclusive)
        reply = self._parse(args[0], reply, options)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def execute_pipeline(self, pipe: Any, raise_on_error: bool, *, exclusive: bool = False) -> list[Any]:
        """redis-py's `Pipeline.execute` (without MULTI) for redis-py pipeline `pipe`, its queued
        commands sent here: each reply through its callback, an error reply in place or, with
        `raise_on_error`, the first one raised as redis-py words it. `exclusive`: on a connection of
        its own (a pipeline that holds a blocking read)."""
        if pipe.scripts or pipe.watching:          # never queued by omniflow: redis-py's own way
            return cast("list[Any]", await pipe.execute(raise_on_error=raise_on_error))
        stack = pipe.command_stack
        await pipe.reset()
        results = await self.send_stack(stack, exclusive=exclusive)
        if raise_on_error:
            pipe.raise_first_error(stack, results)
        return results

    def _parse(self, name: Any, reply: Any, options: Options) -> Any:
        """What redis-py's `parse_response` makes of one reply (its callback, its options)."""
        if isinstance(reply, ResponseError):
            return options.get(EMPTY_RESPONSE, reply)
        found = self._callback(name)
        if found is None:
            return reply
        kwargs = {k: v for k, v in options.items() if k not in _OWN_OPTIONS}
        return found(reply, **kwargs)

    def _callback(self, name: Any) -> Callable[..., Any] | None:
        if name not in self._found:       # looked up as redis-py does (a case-insensitive dict), once per name
            self._found[name] = self._callbacks[name] if name in self._callbacks else None
        return self._found[name]

    async def _round_trip(self, packed: bytes, count: int, exclusive: bool) -> list[Any]:
        if exclusive:
            return _checked(await self._exclusive(packed, count))
        conn = self._shared
        if conn is None or conn.closed or conn.loop is not asyncio.get_running_loop():
            conn = await self._open_shared()
        return _checked(await conn.send(packed, count))

    # ------------------------------------------------------------ connections
    async def _open_shared(self) -> _Conn:
        """The shared connection, opened once for every caller waiting on it (a cancelled caller
        does not cancel it for the others)."""
        loop = asyncio.get_running_loop()
        opening = self._opening
        if opening is None or opening.get_loop() is not loop:
            opening = self._opening = loop.create_task(self._open())
            opening.add_done_callback(self._opened)
        return await asyncio.shield(opening)

    def _opened(self, task: asyncio.Task[_Conn]) -> None:
        current = self._opening is task         # else `aclose` came first: not kept
        if current:
            self._opening = None
        if task.cancelled() or task.exception() is not None:
            return
        if not current:
            task.result().close()
            return
        old, self._shared = self._shared, task.result()
        if old is not None:
            old.close()

    async def _exclusive(self, packed: bytes, count: int) -> list[Any]:
        loop = asyncio.get_running_loop()
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            if conn.closed or conn.loop is not loop:
                conn.close()
                conn = None
        if conn is None:
            conn = await self._open()
        self._busy.add(conn)
        try:
            replies = await conn.send(packed, count)
        except BaseException:
            conn.close()        # cancelled (its reply comes later) or lost: never used again
            raise
        finally:
            self._busy.discard(conn)
        if len(self._idle) < MAX_IDLE_EXCLUSIVE and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
        return replies

    async def _open(self) -> _Conn:
        """Connect and say hello as redis-py's `Connection.connect` / `on_connect` do (AUTH, CLIENT
        SETNAME, CLIENT SETINFO, SELECT), its errors raised as redis-py raises them."""
        template, loop = self._template, asyncio.get_running_loop()
        ssl = template.ssl_context.get() if isinstance(template, SSLConnection) else None
        try:
            connecting = loop.create_connection(lambda: _Conn(loop, self._where), template.host, template.port, ssl=ssl)
            _, conn = await asyncio.wait_for(connecting, template.socket_connect_timeout)
        except TimeoutError:
            raise RedisTimeoutError("Timeout connecting to server") from None
        except OSError as exc:
            raise RedisConnectionError(format_error_message(self._where, exc)) from exc
        try:
            self._keepalive(conn)
            packed, checks = self._handshake
            if checks:
                _hello_checked(checks, await conn.send(packed, len(checks)))
        except BaseException:
            conn.close()
            raise
        return conn

    def _keepalive(self, conn: _Conn) -> None:
        sock = conn.socket()
        if sock is None:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._template.socket_keepalive:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in self._template.socket_keepalive_options.items():
                sock.setsockopt(socket.SOL_TCP, option, value)

    def _hello(self) -> tuple[bytes, list[BaseException | None]]:
        """redis-py's handshake, packed once, with what each reply other than OK raises (None: an
        error is ignored). Pipelined where redis-py awaits AUTH's reply first: a refused AUTH fails
        the connection either way. (Redis 7 or later: AUTH takes a username.)"""
        t = self._template
        commands: list[tuple[Command, BaseException | None]] = []
        if t.username or t.password:
            auth = ("AUTH", t.username, t.password) if t.username else ("AUTH", t.password)
            commands.append((auth, AuthenticationError("Invalid Username or Password")))
        if t.client_name:
            commands.append((("CLIENT", "SETNAME", t.client_name), RedisConnectionError("Error setting client name")))
        if t.lib_name:
            commands.append((("CLIENT", "SETINFO", "LIB-NAME", t.lib_name), None))
        if t.lib_version:
            commands.append((("CLIENT", "SETINFO", "LIB-VER", t.lib_version), None))
        if t.db:
            commands.append((("SELECT", t.db), RedisConnectionError("Invalid Database")))
        return b"".join(pack_one(c) for c, _ in commands), [check for _, check in commands]

    async def aclose(self) -> None:
        """Close every connection (idempotent; the next command connects again)."""
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
        conns = [c for c in (self._shared, *self._idle, *self._busy) if c is not None]
        self._shared, self._idle = None, []
        for conn in conns:
            conn.close()
        loop = asyncio.get_running_loop()
        lost = [c.lost for c in conns if c.loop is loop]
        if lost:
            await asyncio.wait(lost, timeout=1.0)


def _hello_checked(checks: list[BaseException | None], replies: list[Any]) -> None:
    """Raise what redis-py's `on_connect` raises for these handshake replies."""
    for check, reply in zip(checks, replies):
        if isinstance(reply, RedisConnectionError) or (isinstance(reply, ResponseError) and check is not None):
            raise reply
        if check is not None and reply != b"OK":
            raise type(check)(*check.args)


def _raised(reply: Any) -> bool:
    """Does redis-py raise this reply at once (failing the round trip) instead of returning it?"""
    return isinstance(reply, RedisConnectionError) or (type(reply) is list and bool(reply)
                                                  and isinstance(reply[0], RedisConnectionError))


def _checked(replies: list[Any]) -> list[Any]:
    """`replies`, unless one of them is an error redis-py raises for the whole round trip."""
    for reply in replies:
        if _raised(reply):
            raise reply[0] if type(reply) is list else reply
    return replies
