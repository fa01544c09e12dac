"""What every part of a session shares: its fields, its thread hops, its lifecycle."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from omniflow.engine.compute import handoff, run_on
from omniflow.models import Priority, SessionState

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from omniflow.engine.worker.slots import Slots
    from omniflow.dataplane.backpressure import EdgeWindow, WaitStats
    from omniflow.dataplane.base import Ref
    from omniflow.dataplane.plane import DataPlane
    from omniflow.engine.session.consumers import Consumers, InputQueue, LocalInputs
    from omniflow.storage.batcher import Batcher
    from omniflow.storage.keys import Keys

T = TypeVar("T")

#: the states in which a session still writes (emits, status changes)
ACTIVE = frozenset({SessionState.WAITING_INPUT, SessionState.RUNNING})


class SessionCore:
    """The fields of a session (declared here, given defaults by `Session`) and what every part uses."""

    wf_id: str
    stage: str
    attempt: int
    input: dict[str, Any]
    params: dict[str, Any]
    finals: tuple[str, ...]
    downstream: tuple[str, ...]
    resume_seq: int
    _batcher: Batcher
    _keys: Keys
    upstream: tuple[str, ...]
    required: tuple[str, ...]  # every stage this workflow runs
    _queue: InputQueue
    _catchup: list[tuple[str, dict[bytes, bytes]]]
    _catchup_pos: int
    _taken: deque[tuple[str, dict[bytes, bytes]]]  # raw chunks taken from the queue in a batch, not yet read
    _input_timeout_s: float
    seq: int
    state: SessionState  # WAITING_INPUT when it has upstream stages
    _inflight: set[asyncio.Future[Any]]
    waiting_since: float  # monotonic time this session started waiting for input (0: not waiting)
    input_timed_out: bool
    input_wait_s: float  # time spent waiting for upstream chunks (not compute: see `SessionRunner`)
    backpressure_wait_s: float  # time spent waiting for a downstream consumer to make room
    compute_s: float  # the executor's time on it, less those waits (set by the worker when `run` returns)
    reported_usage: Mapping[str, Any] | None  # what `run` returned (set by the worker)
    _steps: list[list[Any]]
    _status: str
    _finish: tuple[list[str], bytes] | None
    _done: bool  # its finish closes it as done (its consumers' end of stream rides on it)
    _emit_keys: list[str] | None
    _consumers: Consumers  # which replicas consume which stage (the inboxes its emits declare)
    _consumers_seen: int  # the `Consumers.version` its `_emit_keys` were built with
    _local: LocalInputs | None  # the worker's input queues: its written chunks go to local consumers in memory
    _open: asyncio.Future[Any] | None  # the queued write that is not built yet (takes more steps)
    _last_in: dict[str, int]
    _write_error: BaseException | None
    queue: str  # the task queue it was claimed from ('': the stage's name)
    checkpoint: str  # what earlier attempts checkpointed (resume), see emit(checkpoint=)
    _home: asyncio.AbstractEventLoop | None  # the worker's loop (None: always called from it)
    _waiter: asyncio.Task[Any] | None  # the task waiting for input (the watchdog interrupts it)
    # data plane (None: every payload inline, no backpressure)
    _plane: DataPlane | None
    _domain_of: Callable[[str, str], Coroutine[Any, Any, str]] | None  # (wf, dst) -> its replica's shm domain
    _chunk_dsts: frozenset[str]  # downstream stages fed by `chunk` edges (bounded)
    _bp: WaitStats | None
    held: list[Ref]  # payload references read: released when done
    _domains: dict[str, tuple[str, float]]  # dst -> (domain, looked up at)
    _windows: dict[str, EdgeWindow]
    _unreported: dict[str, tuple[int, int]]  # src -> chunks, bytes read unreported
    trace: tuple[str, str]  # the workflow's W3C (traceparent, tracestate)
    _span: Span | None  # this session's span while tracing is on (omniflow.tracing)
    priority: Priority
    tenant: str
    tasks_key: str  # the task stream it was read from ('': its class's)
    _slots: Slots | None  # the stage's slots, to give way at a chunk (higher class, fairer turn; None: never)
    _completion: tuple[tuple[str, ...], str, int] | None  # finalize's keys, inflight set, result ttl (see close)
    _legacy: bool  # its workflow is of the storage layout before: its emits declare `<wf>:stages`
    completed: bool  # its finish completed the workflow
    resynced_at: float  # when the watchdog last read its edge logs again


    @property
    def text(self) -> str:
        return str(self.input.get("text") or "")

    @property
    def is_final(self) -> bool:
        return self.stage in self.finals

    @property
    def fenced(self) -> bool:
        """A write was refused: a newer attempt owns the stage, or the workflow ended."""
        return self.state is SessionState.FENCED

    @property
    def aborted(self) -> bool:
        """The workflow was aborted while this session ran."""
        return self.state is SessionState.ABORTED

    @property
    def waiting_input(self) -> bool:
        """Claimed, and no input has arrived yet (its stage status is `waiting_input`)."""
        return self.state is SessionState.WAITING_INPUT

    def fence(self) -> None:
        """This attempt no longer owns its stage: every later write is refused (an abort stays an abort)."""
        if self.state is not SessionState.ABORTED:
            self.state = SessionState.FENCED

    def abort(self) -> None:
        """The workflow was aborted: the session's task is being cancelled."""
        self.state = SessionState.ABORTED

    # ------------------------------------------------------------ threads
    def _remote(self) -> bool:
        """True when called from a loop other than the worker's (the stage's compute thread)."""
        return self._home is not None and asyncio.get_running_loop() is not self._home

    async def _on_home(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the worker's loop and await it from wherever we are."""
        if not self._remote():
            return await coro
        assert self._home is not None
        return await run_on(self._home, coro)

    def _call_home(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run `fn(*args)` on the worker's loop without waiting: at once when called there, else
        handed off (batched with the other calls queued for that loop, in order). Returns whether it
        was handed off: whether the caller runs on another loop (its compute thread)."""
        if self._remote():
            assert self._home is not None
            handoff(self._home).call(fn, *args)
            return True
        fn(*args)
        return False

